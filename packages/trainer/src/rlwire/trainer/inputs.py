"""The run's inputs, validated before anything starts: model, data, reward, checkpoints."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from .config import TrainerConfig
from .errors import RunError

__all__ = ["latest_checkpoint", "load_data", "load_reward", "resolve_model", "score"]


def resolve_model(config: TrainerConfig, run_dir: Path) -> Path:
    """The model directory: the built-in tiny model (built once) or the user's."""
    if config.model.path == "tiny":
        from .tiny import build_tiny_model

        return build_tiny_model(run_dir / "tiny-model", seed=config.trainer.seed)
    path = Path(config.model.path).resolve()
    if not (path / "config.json").is_file():
        raise RunError(
            f"model.path: {path} is not a Hugging Face model directory "
            "(no config.json there); give a local directory or 'tiny'"
        )
    return path


def load_data(config: TrainerConfig) -> Callable[[int], list[tuple[str, str]]]:
    """A function ``step -> [(prompt, answer)] * train_batch_size`` (deterministic in step)."""
    size, seed = config.data.train_batch_size, config.trainer.seed
    source = config.data.source
    if source == "builtin:repeat":
        from .tiny import repeat_prompts

        return lambda step: repeat_prompts(size, seed=seed * 1_000_003 + step)
    path = Path(source)
    if not path.is_file():
        raise RunError(f"data.source: {source!r} is neither 'builtin:repeat' nor a file")
    rows: list[tuple[str, str]] = []
    keys = (config.data.prompt_key, config.data.answer_key)
    if path.suffix == ".jsonl":
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                rows.append((str(record[keys[0]]), str(record[keys[1]])))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise RunError(
                    f"data.source: {path} line {number} is not a JSON object with "
                    f"{keys[0]!r} and {keys[1]!r}: {err}"
                ) from None
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise RunError(
                "data.source: reading Parquet needs pyarrow: pip install 'rlwire-trainer[parquet]'"
            ) from None
        table = pq.read_table(path).to_pylist()
        for number, record in enumerate(table, 1):
            if keys[0] not in record or keys[1] not in record:
                raise RunError(f"data.source: {path} row {number} lacks {keys[0]!r} or {keys[1]!r}")
            rows.append((str(record[keys[0]]), str(record[keys[1]])))
    else:
        raise RunError(f"data.source: {path} must be .jsonl or .parquet")
    if not rows:
        raise RunError(f"data.source: {path} holds no rows")
    order = list(range(len(rows)))

    def batch(step: int) -> list[tuple[str, str]]:
        start = step * size
        return [rows[order[(start + i) % len(rows)]] for i in range(size)]

    return batch


def load_reward(config: TrainerConfig) -> Callable[[list[str], list[str], list[str]], list]:
    spec = config.reward.function
    if spec == "builtin":
        from .tiny import repeat_reward

        return repeat_reward
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise RunError(
            f"reward.function: {spec!r} is not 'builtin', 'module.path:function' or "
            "'file.py:function'"
        )
    try:
        if target.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location("rlwire_user_reward", target)
            if module_spec is None or not Path(target).is_file():
                raise ImportError(f"no file {target}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(target)
        fn = getattr(module, name)
    except (ImportError, AttributeError, SyntaxError) as err:
        raise RunError(f"reward.function: cannot import {spec!r}: {err}") from None
    if not callable(fn):
        raise RunError(f"reward.function: {spec!r} is not callable")
    return fn


def score(fn, prompts: list[str], texts: list[str], answers: list[str]) -> torch.Tensor:
    try:
        values = fn(prompts, texts, answers)
        rewards = torch.as_tensor([float(v) for v in values], dtype=torch.float32)
    except Exception as err:  # a user function: report it as a run error
        raise RunError(f"reward.function raised {type(err).__name__}: {err}") from None
    if rewards.shape != (len(texts),):
        raise RunError(
            f"reward.function returned {tuple(rewards.shape)} values for "
            f"{len(texts)} responses; it must return one float per response"
        )
    return rewards


_STEP_DIR = re.compile(r"^step_(\d+)$")


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = run_dir / "checkpoints"
    found = []
    if root.is_dir():
        for child in root.iterdir():
            if (m := _STEP_DIR.match(child.name)) and (child / "COMPLETE").exists():
                found.append((int(m[1]), child))
    return max(found)[1] if found else None
