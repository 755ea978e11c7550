"""Tools around the trainer: the benchmarks, the comparison with TRL, the device check and
the fault campaign; each runs as ``python -m rlwire.trainer.tools.<name>``.

May import anything in the trainer; nothing in the trainer imports them."""
