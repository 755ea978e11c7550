"""The ``hf`` rollout engine: Hugging Face ``generate`` on a plain copy of the policy.

Shapes: ``B = prompts x n`` sequences (the ``n`` samples of a prompt are
consecutive), ``P`` prompt tokens (left-padded), ``T`` response tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..models import lora
from ..models.modeling import load_hf_model
from .base import RequestsEngine, StagingRolloutEngine
from .common import Rollout
from .digest import digest_of_parts, weights_digest_parts
from .hf_batch import HFBatch
from .requests import EngineCore

__all__ = ["HFEngine", "hf_extend", "hf_generate", "hf_start"]


def _response_mask(response_ids: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    if eos_id is None:
        return torch.ones_like(response_ids)
    is_eos = (response_ids == eos_id).long()
    # tokens after the first eos: cumulative count of eos seen *before* this position > 0
    before = torch.cumsum(is_eos, dim=1) - is_eos
    return (before == 0).long()


def hf_start(tokenizer, prompts: list[str], n: int) -> Rollout:
    """``n`` rows per prompt (consecutive), left-padded (whatever the tokenizer's default),
    with empty responses."""
    batch = tokenizer(
        prompts,
        return_tensors="pt",
        padding=True,
        padding_side="left",
        add_special_tokens=False,
    )
    prompt_ids = batch["input_ids"].repeat_interleave(n, dim=0)
    empty = prompt_ids.new_zeros((prompt_ids.shape[0], 0))
    return Rollout(
        prompt_ids,
        batch["attention_mask"].repeat_interleave(n, dim=0),
        empty,
        empty.clone(),
        empty.float(),
        [""] * prompt_ids.shape[0],
        pad_id=tokenizer.pad_token_id,
    )


@torch.no_grad()
def hf_extend(
    model,
    tokenizer,
    batch: Rollout,
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    greedy: bool = False,
) -> tuple[Rollout, torch.Tensor]:
    """Continue every row of ``batch`` (prompt + a response without its end yet) by up to
    ``max_new_tokens`` sampled tokens with ``model.generate`` on the model's device
    (see :meth:`rlwire.trainer.rollout.PartialRolloutEngine.extend`); host tensors back.

    Tokens are sampled from ``softmax(logits / temperature)`` and nothing else, whatever
    the model's own generation config asks for: the recorded log-probs are the sampler's.
    ``greedy``: the most likely token instead (log-probs at temperature 1)."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    context = torch.cat([batch.prompt_ids, batch.response_ids], dim=1).to(device)
    attention = torch.cat([batch.prompt_mask, batch.response_mask], dim=1).to(device)
    if greedy:
        temperature = 1.0  # what the log-probs below are taken at
    plain = GenerationConfig(
        do_sample=not greedy,
        **({} if greedy else {"temperature": temperature, "top_k": 0, "top_p": 1.0}),
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    # generate() fills every field left unset in `plain` from model.generation_config (the
    # directory's generation_config.json: repetition_penalty, no_repeat_ngram_size, min_p,
    # bad_words_ids, ...), and for many of them unset is the only "off". With a blank one
    # in its place it samples from softmax(logits / temperature), the distribution the
    # log-probs below and the actor's recomputation describe.
    held = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        torch.manual_seed(seed)
        out = model.generate(input_ids=context, attention_mask=attention, generation_config=plain)
    finally:
        model.generation_config = held
    new_ids = out.sequences[:, context.shape[1] :]
    logits = torch.stack(out.logits, dim=1).float() / temperature  # (B, T, V)
    new_logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new_ids.unsqueeze(-1))
    new_mask = _response_mask(new_ids, tokenizer.eos_token_id)
    eos = tokenizer.eos_token_id
    ended = (
        (new_ids == eos).any(dim=1)
        if eos is not None
        else torch.zeros(len(batch), dtype=torch.bool)
    )
    response_ids = torch.cat([batch.response_ids, new_ids.cpu()], dim=1)
    mask = torch.cat([batch.response_mask, new_mask.cpu()], dim=1)
    logprobs = torch.cat([batch.logprobs, (new_logprobs.squeeze(-1) * new_mask).cpu()], dim=1)
    texts = tokenizer.batch_decode(
        response_ids * mask + tokenizer.pad_token_id * (1 - mask), skip_special_tokens=True
    )
    grown = Rollout(
        batch.prompt_ids,
        batch.prompt_mask,
        response_ids,
        mask,
        logprobs,
        texts,
        pad_id=batch.pad_id,
    )
    return grown, ended.cpu()


def hf_generate(
    model,
    tokenizer,
    prompts: list[str],
    *,
    n: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    greedy: bool = False,
) -> Rollout:
    """Sample ``n`` responses per prompt with ``model.generate`` on the model's device (the
    most likely tokens with ``greedy``); the returned tensors are on the host (they travel
    to the driver)."""
    rows = hf_start(tokenizer, prompts, n)
    grown, _ = hf_extend(
        model,
        tokenizer,
        rows,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        greedy=greedy,
    )
    return grown


class HFEngine(RequestsEngine, StagingRolloutEngine):
    """``rollout.backend=hf``: a plain Hugging Face copy of the policy, serving requests with
    continuous batching (:class:`~rlwire.trainer.rollout.hf_batch.HFBatch` on an
    :class:`~rlwire.trainer.rollout.requests.EngineCore`); ``generate`` and ``extend`` are
    layers over requests. A weight update is written in between two decoding steps, the
    requests in flight carrying on (``rollout.kv_on_update``)."""

    name = "hf"
    hybrid = True
    takes_deltas = True
    takes_lora = True

    def __init__(
        self,
        config,
        model_path: str,
        device: torch.device,
        *,
        gpu_share: float = 1.0,
        index: int = 0,
    ) -> None:
        from transformers import AutoTokenizer

        super().__init__(config, model_path, device, gpu_share=gpu_share, index=index)
        model: torch.nn.Module = load_hf_model(model_path, config.model.dtype, device)
        # With LoRA the same PEFT adapters as the actor's; syncs carry them alone, by name.
        self.adapter: dict[str, torch.nn.Parameter] | None = None
        if config.actor.lora.enabled:
            model = lora.wrap(model, config.actor.lora)
            self.adapter = lora.adapter_targets(model)
        self.model = model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.staging: dict[str, torch.Tensor] = {}  # reused by every update (atomic apply)
        self.held: int | None = None  # the version the model holds: deltas apply onto it
        self.batch = HFBatch(
            self.model,
            eos_id=self.tokenizer.eos_token_id,
            pad_id=self.tokenizer.pad_token_id,
            pace_s=self.step_seconds(),
        )
        self.core = EngineCore(
            self.batch, max_num_seqs=config.rollout.max_num_seqs, name=f"rlwire-{self.name}-{index}"
        )

    def step_seconds(self) -> float:
        """Wall seconds a decoding step takes at least (0: as fast as it goes)."""
        return 0.0

    async def stage(self, engine) -> Callable[[], int]:
        from rlwire.ckpt_engine import stage_update

        if self.config.ckpt_engine.in_place and self.adapter is None:
            return await self._stage_in_place(engine)

        # Atomic (an adapter split over buckets commits whole); committed by swapping
        # storages with the staging copy (one pass over the weights, not two): nothing here
        # captures parameter storage. Deltas apply onto the version held at commit.
        targets = self.model if self.adapter is None else self.adapter
        staged = await stage_update(
            targets, engine, staging=self.staging, version=self.held, swap=True
        )

        def commit() -> int:  # between two decoding steps (between_steps runs it)
            self.held = staged.commit()
            if self.config.rollout.kv_on_update == "recompute":
                self.batch.forget()
            return self.held

        return commit

    async def _stage_in_place(self, engine) -> Callable[[], int]:
        """``ckpt_engine.in_place``: the update's tensors are the sender's arena's, which
        no one writes until this engine says it left them; at the commit they become the
        model's (a pointer swap per tensor: no copy), and the arena of the version before
        is released."""
        got, version = await engine.receive_in_place()
        targets = self.model.state_dict(keep_vars=True)
        if set(got) != set(targets):
            raise RuntimeError(
                f"rollout engine {self.index}: the update's tensors differ from the model's: "
                f"{sorted(set(got) ^ set(targets))[:8]}"
            )
        for name, tensor in got.items():
            held = targets[name]
            if held.shape != tensor.shape or held.dtype != tensor.dtype:
                raise RuntimeError(
                    f"rollout engine {self.index}: {name!r} is {tuple(tensor.shape)} "
                    f"{tensor.dtype} in the update but {tuple(held.shape)} {held.dtype} here"
                )

        def commit() -> int:  # between two decoding steps (between_steps runs it)
            # Whole or not at all: a swap that fails puts back what it had swapped, so the
            # model reads the held version's arena alone and nothing is released.
            swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
            with torch.no_grad():
                try:
                    for name, tensor in got.items():
                        before = targets[name].data
                        targets[name].data = tensor
                        swapped.append((targets[name], before))
                except BaseException:
                    for param, before in reversed(swapped):
                        param.data = before
                    raise
            self.held = version  # the model reads this version's arena alone from here
            if self.config.rollout.kv_on_update == "recompute":
                self.batch.forget()
            # last: the sender may then write the arena left (a failure here keeps it unwritten)
            engine.released(version)
            return version

        return commit

    def digest(self) -> str | None:
        return digest_of_parts(self.digest_parts())

    def digest_parts(self) -> dict[str, str]:
        if self.adapter is not None:  # what syncs carry
            return weights_digest_parts(self.adapter.items())
        return weights_digest_parts(self.model.state_dict().items())

    def start(self, prompts: list[str]) -> Rollout:
        return hf_start(self.tokenizer, prompts, self.config.rollout.n)
