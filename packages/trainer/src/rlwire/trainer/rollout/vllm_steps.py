"""``vllm``'s requests on vLLM's own continuous batching: each step of the
:class:`~rlwire.trainer.rollout.requests.EngineCore` is one ``LLMEngine.step()`` of the
in-process engine (vLLM's scheduler takes the requests added since the last step beside
those running, and decodes every running one by a token).

Requests go into vLLM as they are admitted (token ids, their own seed, deltas out); a weight
commit runs between two ``step()`` calls, so each token's version is the one the core held
when the step that sampled it ran. What a commit does to the requests in flight
(``rollout.kv_on_update``): ``keep`` leaves them running on their KV cache (vLLM's
``pause_generation(mode="keep")``); ``recompute`` and every LoRA update (the old adapter is
removed from the engine) end them in vLLM and add each again on its context so far (prompt
and sampled tokens), with the rest of its budget: prefilled with the new weights.
"""

from __future__ import annotations

import itertools
from typing import TypedDict

from .requests import Live, Request, continuation_seed

__all__ = ["VLLMStepper", "sampled_logprobs", "vllm_sampling"]


class VLLMSampling(TypedDict):
    temperature: float
    top_p: float
    top_k: int


def vllm_sampling(request: Request) -> VLLMSampling:
    """The temperature, ``top_p`` and ``top_k`` vLLM is given for ``request``: temperature 0
    for a greedy one (vLLM's greedy), with no cut."""
    if request.greedy:
        return {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
    return {"temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k}


class VLLMStepper:
    """The :class:`~rlwire.trainer.rollout.requests.Stepper` of a ``VLLMEngine``
    (``engine``: its ``llm``, ``lora_request``, ``tokenizer`` and sampling parameters)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.eos = engine.tokenizer.eos_token_id
        self._in_vllm: dict[str, Live] = {}  # vLLM's request id -> the request
        self._again: list[Live] = []  # to add again at the next step (forget)
        self._ids = itertools.count()

    def _add(self, live: Live) -> None:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        request = live.request
        times = 0 if live.state is None else live.state[1]  # (vLLM's id, times added)
        params = self.engine.sampling_params(
            max_tokens=request.max_new_tokens - len(live.token_ids),
            seed=continuation_seed(request.seed, times),
            **vllm_sampling(request),
        )
        params.output_kind = RequestOutputKind.DELTA  # each step: the new tokens only
        key = f"rlwire-{next(self._ids)}"
        live.state = (key, times + 1)
        self.engine.llm.llm_engine.add_request(
            key,
            TokensPrompt(prompt_token_ids=list(request.prompt_ids) + live.token_ids),
            params,
            lora_request=self.engine.lora_request,
        )
        self._in_vllm[key] = live

    def step(self, admitted: list[Live], running: list[Live], version: int) -> None:
        again, self._again = self._again, []
        for live in again + admitted:
            self._add(live)
        for out in self.engine.llm.llm_engine.step():
            followed = self._in_vllm.get(out.request_id)
            if followed is None:
                continue  # one this stepper no longer follows (ended, forgotten)
            live, sample = followed, out.outputs[0]
            tokens, logprobs = list(sample.token_ids), sampled_logprobs(sample)
            for token, logprob in zip(tokens, logprobs, strict=True):
                live.append(int(token), float(logprob), version, self.eos)
                if live.finish_reason is not None:
                    break
            if out.finished:
                del self._in_vllm[out.request_id]
                if live.finish_reason is None:  # vLLM's own end (its length limit)
                    live.finish_reason = "stop" if sample.finish_reason == "stop" else "length"

    def forget(self) -> None:
        """End every request in vLLM (between two steps); each is added again at the next
        step on its context so far, prefilled with the weights held then."""
        if self._in_vllm:
            self.engine.llm.llm_engine.abort_request(list(self._in_vllm))
        self._again.extend(self._in_vllm.values())
        self._in_vllm.clear()

    def release(self, ended: list[Live]) -> None:
        gone = {id(live) for live in ended}
        left = [key for key, live in self._in_vllm.items() if id(live) in gone]
        if left:  # ended here (an end-of-sequence token, a failed step) before vLLM said so
            self.engine.llm.llm_engine.abort_request(left)
            for key in left:
                del self._in_vllm[key]
        self._again = [live for live in self._again if id(live) not in gone]


def sampled_logprobs(sample) -> list[float]:
    """The log-prob of each token of a vLLM ``CompletionOutput`` (``logprobs=0``)."""
    return [step[t].logprob for t, step in zip(sample.token_ids, sample.logprobs, strict=True)]
