"""GSM8K in verl's row format, for ``rlwire-train`` (and verl itself):

    uv run --extra datasets python -m examples.gsm8k.prepare --out ~/data/gsm8k

writes ``train.parquet`` (7,473 rows) and ``test.parquet`` (1,319) from the Hub's
``openai/gsm8k`` (``main``). Each row: ``data_source`` ``openai/gsm8k`` (which chooses the
gsm8k scorer when ``reward.function`` is unset), ``prompt`` as chat messages (the question
and an instruction to end with ``#### <answer>``), ``ability``, ``reward_model`` with the
number after the solution's ``####`` as ``ground_truth``, and ``extra_info``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def verl_row(row: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    """One ``openai/gsm8k`` row (``question``, ``answer`` ending ``#### <number>``) as verl's
    GSM8K row."""
    solution = row["answer"]
    if "####" not in solution:
        raise ValueError(
            f"{split} row {index}: the answer has no '#### <number>': {solution!r:.80}"
        )
    truth = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "question": row["question"]},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("~/data/gsm8k").expanduser())
    parser.add_argument("--source", default="openai/gsm8k", help="a Hub id or a local copy")
    args = parser.parse_args(argv)

    import datasets

    args.out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = datasets.load_dataset(args.source, "main", split=split)
        converted = [verl_row(row, split, i) for i, row in enumerate(rows)]
        datasets.Dataset.from_list(converted).to_parquet(str(args.out / f"{split}.parquet"))
        print(f"{args.out / f'{split}.parquet'}: {len(converted)} rows")


if __name__ == "__main__":
    main()
