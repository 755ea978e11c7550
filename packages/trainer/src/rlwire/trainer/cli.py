"""``rlwire-train``: the command line.

rlwire-train [--preset NAME] [--config FILE.yaml] [--print-config] [--help-config]
             [dotted.key=value ...]   (options and overrides in any order)
rlwire-train plot RUN_DIR
rlwire-train export RUN_DIR [--step N] [--out DIR] [--adapter]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from .errors import RunError

__all__ = ["command", "export_run", "main"]


def importable_from_here() -> None:
    """The user's modules that dotted paths name (``reward.function``, ``agent.tools``,
    ``agent.environment``, ``agent.function``) found in the working directory, as
    ``python -m`` finds them: added to ``sys.path`` (after what is installed, so nothing
    installed is shadowed) and to ``PYTHONPATH``, which the workers of the cluster the run
    starts inherit (a cluster joined with ``ray.address`` needs them installed there)."""
    here = os.getcwd()
    if here not in sys.path:
        sys.path.append(here)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, here])


def _fail(message: str) -> int:
    print(f"rlwire-train: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["export"]:  # a checkpoint as a Hugging Face folder, offline
        return _export(argv[1:])
    if argv[:1] == ["plot"]:
        if len(argv) != 2:
            return _fail("usage: rlwire-train plot RUN_DIR")
        from .outputs.plot import plot_run

        try:
            print(plot_run(argv[1]))
        except FileNotFoundError as err:
            return _fail(str(err))
        return 0
    from .config import PRESETS, ConfigError, describe_config, load_config, to_dict

    presets = "; ".join(f"{name}: {' '.join(items)}" for name, items in PRESETS.items())
    parser = argparse.ArgumentParser(
        prog="rlwire-train",
        description="GRPO training with the rlwire packages (Ray orchestrated). With no "
        "arguments: the embedded job (tiny local model, built-in task) on this machine.",
        epilog="Options and key=value overrides may come in any order; later overrides win. "
        "Every key with its type, default and meaning: rlwire-train --help-config (the "
        "docs' configuration reference, docs/reference/configuration.md); verl's key names "
        "are accepted (docs/integrations/verl.md).",
    )
    parser.add_argument("--config", help="a YAML file merged over the defaults")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help=f"a named job applied before --config and the overrides ({presets})",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved configuration and exit"
    )
    parser.add_argument(
        "--help-config",
        action="store_true",
        help="print the configuration reference (every key) and exit",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. actor.world_size=2",
    )
    # intermixed: "trainer.steps=10 --preset realistic trainer.seed=1" is one command
    args = parser.parse_intermixed_args(argv)
    if args.help_config:
        print(describe_config(), end="")
        return 0

    # what the config says as it loads (verl keys that change nothing here): on the terminal
    notes = logging.StreamHandler(sys.stderr)
    notes.setLevel(logging.WARNING)
    notes.setFormatter(logging.Formatter("rlwire-train: note: %(message)s"))
    logging.getLogger("rlwire.trainer").addHandler(notes)
    try:
        importable_from_here()
        config = load_config(args.config, args.overrides, preset=args.preset)
    except ConfigError as err:
        return _fail(str(err))
    finally:
        logging.getLogger("rlwire.trainer").removeHandler(notes)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
        return 0
    from .driver import AlreadyFinished, run

    started = time.perf_counter()
    try:
        result = run(config, progress=not args.no_progress)
    except AlreadyFinished as note:
        print(f"rlwire-train: {note}")
        return 0
    except RunError as err:
        return _fail(str(err))
    except SystemError as err:
        # the SIGTERM handler's RunError, raised while Ray's Cython checked signals inside
        # a wait: Ray hands it on as the cause of a SystemError (a campaign trial's find)
        stop = err.__cause__ or err.__context__
        if not isinstance(stop, RunError):
            raise
        return _fail(str(stop))
    summary = result.summary
    if not summary["steps"]:  # the run had trained to the end: its export was still to do
        print(f"exported hf_model/ of step {result.start_step} (training had finished)")
        print(f"run directory: {result.run_dir}")
        return 0
    print(
        f"trained {summary['steps']} steps in {time.perf_counter() - started:.1f} s "
        f"(training loop {summary['loop_s']:.1f} s, {summary['samples_per_s']:.0f} samples/s); "
        f"reward {summary['reward_final']:.3f} (mean of the last 10% of steps)"
    )
    outputs = "metrics.jsonl, plot.png, train.log, checkpoints/, hf_model/"
    print(f"run directory: {result.run_dir}  ({outputs})")
    return 0


def command() -> None:
    """The ``rlwire-train`` executable: :func:`main`, then the process ends at once.

    Everything the run writes is written and closed when :func:`main` returns, and Ray is
    stopped; what is left is the interpreter's own teardown of torch's modules, which takes
    0.6-0.8 s on this machine (measured: a script that only imports torch exits in 0.68 s,
    with ``os._exit`` in 0.04 s). An exception from :func:`main` leaves the normal way."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    command()


def export_run(
    run_dir: Path, *, step: int | None = None, out: Path | None = None, adapter: bool = False
) -> Path:
    """``rlwire-train export``'s work: the run at ``run_dir`` read with its own
    ``config.yaml``, then :func:`.outputs.hf_export.export_checkpoint`; returns the folder
    written. Raises RunError (one line) for anything that cannot be exported."""
    from .config import ConfigError, load_config
    from .outputs.hf_export import export_checkpoint

    run_dir = run_dir.resolve()
    if not (run_dir / "config.yaml").is_file():
        raise RunError(f"export: {run_dir} is not a run directory (no config.yaml there)")
    try:
        config = load_config(run_dir / "config.yaml")
    except ConfigError as err:
        raise RunError(f"export: {run_dir / 'config.yaml'}: {err}") from None
    return export_checkpoint(run_dir, config, step=step, out=out, adapter=adapter)


def _export(argv: list[str]) -> int:
    """``rlwire-train export``: the command's arguments; 0, or 2 with one line."""
    parser = argparse.ArgumentParser(
        prog="rlwire-train export",
        description="Write a checkpoint of a run as a Hugging Face model folder.",
    )
    parser.add_argument("run_dir", type=Path, help="the run directory (trainer.output_dir)")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the last)")
    parser.add_argument(
        "--out",
        type=Path,
        help="where: a new or empty folder, or an earlier export, replaced "
        "(default: RUN_DIR/hf_models/step_N)",
    )
    parser.add_argument(
        "--adapter", action="store_true", help="with LoRA: the adapter alone, not merged"
    )
    args = parser.parse_args(argv)
    try:
        folder = export_run(args.run_dir, step=args.step, out=args.out, adapter=args.adapter)
    except RunError as err:
        return _fail(str(err))
    print(folder)
    return 0
