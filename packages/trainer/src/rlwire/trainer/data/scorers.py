"""The built-in scorers (``gsm8k``, ``math``) and verl's choice of one by each row's
``data_source`` (its ``default_compute_score``): what ``reward.function`` unset scores a data
file with."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import RunError

__all__ = [
    "MATH_INSTALL_HINT",
    "SCORERS",
    "by_data_source",
    "gsm8k_score",
    "known_sources",
    "math_score",
    "scorer_for",
    "unscored_sources",
]

MATH_INSTALL_HINT = "the math scorer needs math-verify: pip install 'rlwire-trainer[math]'"

_GSM8K_ANSWER = re.compile(r"####\s*(-?[0-9.,$]+)")


def _number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip().rstrip(".")


def gsm8k_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """GSM8K's format: 1.0 when the last ``#### <number>`` of the response equals the
    ground truth (commas and dollar signs ignored), else 0.0 (verl's ``gsm8k`` scorer with
    its default ``format_score`` of 0)."""
    found = _GSM8K_ANSWER.findall(solution_str)
    return float(bool(found) and _number(found[-1]) == _number(str(ground_truth)))


def math_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the response's final (boxed) answer is mathematically equal to the ground
    truth, checked with ``math-verify``, else 0.0."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise RunError(MATH_INSTALL_HINT) from None
    gold = parse(f"${ground_truth}$")
    return float(bool(gold) and verify(gold, parse(solution_str)))


SCORERS: dict[str, Callable[..., float]] = {"gsm8k": gsm8k_score, "math": math_score}
"""``reward.function`` names of the built-in scorers (verl's per-sample signature)."""

_BY_SOURCE: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math": "math",
    "math_dapo": "math",
}
"""verl's ``data_source`` names -> the scorer (``aime*`` too: math). verl scores its
``math_dapo`` sources with their own 1/-1 scorer; here they get ``math``'s 1/0."""


def scorer_for(source: str) -> str | None:
    """The scorer ``reward.function`` unset uses for rows of ``source``, or None."""
    if source.startswith("aime"):
        return "math"
    return _BY_SOURCE.get(source)


def unscored_sources(sources: Iterable[str]) -> list[str]:
    """The ``data_source`` values no built-in scorer takes, sorted."""
    return sorted({s for s in sources if scorer_for(s) is None})


def by_data_source(data_source, solution_str, ground_truth, extra_info=None) -> Any:
    """The row's scorer, chosen by its ``data_source`` (verl's ``default_compute_score``);
    the sources are checked before the run starts (:func:`unscored_sources`)."""
    name = scorer_for(data_source)
    assert name is not None, f"data_source {data_source!r}: no scorer (checked at start)"
    return SCORERS[name](data_source, solution_str, ground_truth, extra_info)


def known_sources() -> str:
    """The ``data_source`` names with a scorer, for error messages."""
    return ", ".join([*_BY_SOURCE, "aime*"])
