"""The ``hf`` rollout engine: Hugging Face ``generate`` on a plain copy of the policy.

Shapes: ``B = prompts x n`` sequences (the ``n`` samples of a prompt are
consecutive), ``P`` prompt tokens (left-padded), ``T`` response tokens.
"""

from __future__ import annotations

import torch

from ..modeling import load_hf_model
from .base import RolloutEngine
from .common import Rollout, weights_digest

__all__ = ["HFEngine", "hf_generate"]


def _response_mask(response_ids: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    if eos_id is None:
        return torch.ones_like(response_ids)
    is_eos = (response_ids == eos_id).long()
    # tokens after the first eos: cumulative count of eos seen *before* this position > 0
    before = torch.cumsum(is_eos, dim=1) - is_eos
    return (before == 0).long()


@torch.no_grad()
def hf_generate(
    model,
    tokenizer,
    prompts: list[str],
    *,
    n: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> Rollout:
    """Sample ``n`` responses per prompt with ``model.generate`` on the model's device;
    the returned tensors are on the host (they travel to the driver)."""
    device = next(model.parameters()).device
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    prompt_ids = batch["input_ids"].repeat_interleave(n, dim=0).to(device)
    prompt_mask = batch["attention_mask"].repeat_interleave(n, dim=0).to(device)
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    response_ids = out.sequences[:, prompt_ids.shape[1] :]
    logits = torch.stack(out.logits, dim=1).float() / temperature  # (B, T, V)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, response_ids.unsqueeze(-1))
    mask = _response_mask(response_ids, tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(
        response_ids * mask + tokenizer.pad_token_id * (1 - mask), skip_special_tokens=True
    )
    tensors = (prompt_ids, prompt_mask, response_ids, mask, logprobs.squeeze(-1) * mask)
    return Rollout(*(t.cpu() for t in tensors), texts, pad_id=tokenizer.pad_token_id)


class HFEngine(RolloutEngine):
    """``rollout.backend=hf``: a plain Hugging Face copy of the policy, ``generate`` sampling."""

    name = "hf"

    def __init__(
        self, config, model_path: str, device: torch.device, *, gpu_share: float = 1.0
    ) -> None:
        from transformers import AutoTokenizer

        super().__init__(config, model_path, device, gpu_share=gpu_share)
        self.model = load_hf_model(model_path, config.model.dtype, device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)

    async def apply(self, engine) -> int:
        from rlwire.ckpt_engine import apply_to_module

        return await apply_to_module(self.model, engine)

    def digest(self) -> str | None:
        return weights_digest(self.model.state_dict().items())

    def generate(self, prompts: list[str], seed: int) -> Rollout:
        cfg = self.config.rollout
        return hf_generate(
            self.model,
            self.tokenizer,
            prompts,
            n=cfg.n,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            seed=seed,
        )
