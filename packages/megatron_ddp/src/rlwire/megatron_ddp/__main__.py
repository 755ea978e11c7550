"""``python -m rlwire.megatron_ddp``: print the bytes-per-parameter table of the README."""

from __future__ import annotations

from ._table import memory_table

if __name__ == "__main__":
    print(memory_table())
