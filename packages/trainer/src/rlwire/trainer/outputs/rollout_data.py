"""``trainer.rollout_data_dir`` (verl's key): every step's trained samples as JSONL, one
line a sample (a trajectory, with multi-turn rollouts), in ``<dir>/<step>.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..rollout import Rollout, response_lengths

__all__ = ["rollout_lines", "write_rollouts"]


def rollout_lines(step: int, batch: Rollout, n: int) -> list[dict[str, Any]]:
    """``batch``'s samples as records: the step, the prompt's place in the step's batch
    (``prompt_index``: samples ``n`` to a prompt), the prompt and the conversation as text
    (turn by turn with their roles for multi-turn samples), the token ids, the loss mask
    (1: a token the model sampled), each model token's behaviour log-prob and weight
    version (null elsewhere), the tool calls with their arguments, results and errors,
    the reward, the advantage and the environment's per-turn rewards."""
    lengths = response_lengths(batch.response_mask).tolist()
    lines = []
    for row in range(len(batch)):
        length = lengths[row]
        mask = batch.response_mask[row, :length].tolist()
        model = [bool(m) for m in mask]

        def per_model_token(values, kind=float, model=model) -> list:
            return [kind(v) if m else None for v, m in zip(values, model, strict=True)]

        example = batch.examples[row] if batch.examples else None
        trajectory = batch.trajectories[row] if batch.trajectories is not None else None
        line: dict[str, Any] = {
            "step": step,
            "prompt_index": row // n,
            "prompt": example.prompt if example is not None else None,
            "answer": example.answer if example is not None else None,
            "response": batch.texts[row] if batch.texts else None,
            "prompt_ids": batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist(),
            "response_ids": batch.response_ids[row, :length].tolist(),
            "loss_mask": mask,
            "logprobs": per_model_token(batch.logprobs[row, :length].tolist()),
            "versions": (
                None
                if batch.versions is None
                else per_model_token(batch.versions[row, :length].tolist(), int)
            ),
            "reward": None if batch.rewards is None else float(batch.rewards[row]),
            "advantage": None if batch.advantages is None else float(batch.advantages[row]),
        }
        if trajectory is not None:
            line.update(trajectory.to_json())
        lines.append(line)
    return lines


def write_rollouts(directory: str | Path, step: int, batch: Rollout, n: int) -> Path:
    """Write step ``step``'s samples to ``<directory>/<step>.jsonl`` (see
    :func:`rollout_lines`); the file's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{step}.jsonl"
    text = "".join(json.dumps(line) + "\n" for line in rollout_lines(step, batch, n))
    path.write_text(text)
    return path
