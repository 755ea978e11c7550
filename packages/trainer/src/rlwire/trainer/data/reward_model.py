"""A reward model: a sequence-classification model (``AutoModelForSequenceClassification``,
one label) that scores each prompt + completion, as TRL's ``GRPOTrainer`` scores with a
model named in ``reward_funcs`` and verl with ``reward_model.model.path``.

It is a TRL-signature reward (``f(prompts, completions, completion_ids, **kwargs)``), so it
sits beside function rewards with their weights. The texts are built as TRL builds them:
chat messages through the reward model's chat template (the prompt's messages, then the
completion's), else the prompt's text followed by the completion's; tokenized without
special tokens, padded on the right, scored in batches of ``reward.model_batch_size``; the
score is the first logit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import RunError

__all__ = ["RewardModel", "is_model_spec", "model_device"]


def is_model_spec(spec: str) -> bool:
    """Whether a reward ``spec`` names a model (a local model directory, or a Hub id
    ``org/name``) rather than a function (``module:function``) or a built-in name."""
    from .readers import is_hub_id

    if ":" in spec:
        return False
    path = Path(spec).expanduser()
    return (path / "config.json").is_file() or is_hub_id(spec)


def model_device(setting: str) -> torch.device:
    """``reward.model_device``: ``auto`` is the driver's first GPU when it has one, else
    the CPU."""
    if setting == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


class RewardModel:
    """The reward model at ``path`` (loaded now, in ``dtype``, on ``device``)."""

    def __init__(self, path: Path, *, device: torch.device, batch_size: int, dtype: str) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, dtype=getattr(torch, dtype)
            )
        except (OSError, ValueError) as err:  # no such model, or no one-label head
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise RunError(f"reward model {path}: cannot be loaded as a scorer: {first}") from None
        if self.tokenizer.pad_token is None:  # as TRL: the end of text pads
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.to(device).eval()
        self.device, self.batch_size = device, batch_size

    def texts(self, prompts: list[Any], completions: list[Any]) -> list[str]:
        """The text of each prompt + completion, as the model reads it."""
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if isinstance(prompt, list):  # chat messages: the model's own template
                text = self.tokenizer.apply_chat_template(prompt + completion, tokenize=False)
                out.append(str(text))
            else:
                out.append(prompt + completion)
        return out

    def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float]:
        texts = self.texts(prompts, completions)
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=False,
            ).to(self.device)
            with torch.inference_mode():
                logits = self.model(**batch).logits[:, 0]
            scores += logits.float().cpu().tolist()
        return scores
