"""verl's and TRL's names for the step metrics they share with ours, added beside ours to
every line of ``metrics.jsonl`` and so to every logger, so that a dashboard built on either
one's runs shows ours. Only a metric that means the same is named: ours keep their own
definitions (``docs/reference/metric-names.md`` lists each mapping)."""

from __future__ import annotations

from typing import Any

__all__ = ["ALIASES", "with_aliases"]

ALIASES: dict[str, tuple[str, ...]] = {
    # ours: (verl's, TRL's), each only where that library logs the same quantity
    "reward_mean": ("critic/score/mean", "reward"),
    "response_length": ("response_length/mean", "completions/mean_length"),
    "response_length_max": ("response_length/max", "completions/max_length"),
    "response_length_min": ("response_length/min", "completions/min_length"),
    "policy_loss": ("actor/pg_loss",),
    "clip_fraction": ("actor/pg_clipfrac", "clip_ratio/region_mean"),
    "entropy": ("actor/entropy",),
    "kl_ref": ("actor/kl_loss", "kl"),
    "grad_norm": ("actor/grad_norm",),
}
"""Our name -> the other names the same value is logged under. TRL's ``reward_std``,
``entropy`` and ``grad_norm`` are the same names as ours. Timings keep our names only
(``time_*_s``: they time our phases, which are not verl's ``timing_s/*``)."""

_EXTRA = "reward_extra/"


def with_aliases(line: dict[str, Any]) -> dict[str, Any]:
    """``line`` (a step's metrics) with each value it has also under the names above, and
    each reward function's mean (``reward_extra/<name>``) also as TRL's
    ``rewards/<name>/mean``. A name already in ``line`` is never overwritten."""
    out = dict(line)
    for ours, theirs in ALIASES.items():
        if ours in line:
            for name in theirs:
                out.setdefault(name, line[ours])
    for key, value in line.items():
        if key.startswith(_EXTRA):
            out.setdefault(f"rewards/{key.removeprefix(_EXTRA)}/mean", value)
    return out
