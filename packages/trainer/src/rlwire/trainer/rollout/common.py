"""What rollout engines hand back, and the log-probabilities the actor recomputes.

Shapes: ``B = prompts x n`` sequences (the ``n`` samples of a prompt are
consecutive), ``P`` prompt tokens (left-padded), ``T`` response tokens.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = [
    "Example",
    "Rollout",
    "Sampling",
    "response_lengths",
    "sequence_logprobs",
    "split_evenly",
]


def response_lengths(mask: torch.Tensor) -> torch.Tensor:
    """``(B,)``: one past each row's last 1 in ``mask`` ``(B, T)`` (0 for none): a response's
    length, the environment's tokens between the model's turns included."""
    steps = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.bool() * steps).amax(dim=1) if mask.shape[1] else mask.new_zeros(mask.shape[0])


def _padded(t: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    missing = width - t.shape[1]
    if missing == 0:
        return t
    return torch.nn.functional.pad(t, (missing, 0) if left else (0, missing), value=value)


@dataclasses.dataclass(frozen=True, slots=True)
class Sampling:
    """How a call samples when it is not training's ``rollout`` settings (validation: verl's
    ``val_kwargs``): ``n`` samples per prompt at ``temperature``, or the most likely token
    at every step when ``greedy`` (the log-probs are then those of the model's own
    distribution, temperature 1)."""

    n: int
    temperature: float
    greedy: bool
    top_p: float = 1.0
    top_k: int = 0
    """Training's ``rollout.top_p`` and ``top_k`` (0: off); validation samples whole
    distributions."""


@dataclasses.dataclass(frozen=True, slots=True)
class Example:
    """One dataset row as the trainer uses it (verl's row: ``prompt``, ``data_source``,
    ``reward_model.ground_truth``, ``extra_info``)."""

    prompt: str
    """The prompt text given to the rollout engine (chat messages already rendered)."""
    answer: str
    """The ground truth handed to the reward."""
    data_source: str = ""
    """Which dataset the row comes from (verl's rewards dispatch on it)."""
    extra_info: dict | None = None
    """Anything else the row carries for the reward."""
    messages: list[dict] | None = None
    """The prompt as chat messages, when the row gave them (multi-turn rollouts render
    them with the tools' schemas: :mod:`rlwire.trainer.agent`)."""
    columns: dict | None = None
    """The row's other fields by name (everything but the prompt), for a reward function
    with TRL's signature, which takes every dataset column; None for a built-in task."""


@dataclasses.dataclass(slots=True)
class Rollout:
    """The one batch type between processes: rollout workers -> driver -> actor ranks.

    ``B`` samples; the ``n`` samples of a prompt are consecutive (a *group*). Rollout
    engines fill the token fields; the rollout worker stamps ``versions``; the driver
    adds ``examples`` (or the fully-async worker does, per group), then
    ``rewards`` and ``advantages`` before sharding it over the actor ranks.
    """

    prompt_ids: torch.Tensor
    """``(B, P)`` int64, left-padded."""
    prompt_mask: torch.Tensor
    """``(B, P)`` int64, 1 for real prompt tokens."""
    response_ids: torch.Tensor
    """``(B, T)`` int64 sampled tokens (padding after an end-of-sequence token)."""
    response_mask: torch.Tensor
    """``(B, T)`` int64: the loss mask (verl's ``response_mask``). 1 for the sampled tokens,
    up to and including the first end-of-sequence token; in a multi-turn trajectory 1 for
    the model's tokens only and 0 for the environment's and the chat template's, which
    stay real tokens of the sequence (a response runs to the last token of its last turn:
    everything after is padding)."""
    logprobs: torch.Tensor
    """``(B, T)`` float32 log-probability of each sampled token under the sampling
    distribution (temperature applied), as the rollout engine saw it: the behaviour policy."""
    texts: list[str]
    """Decoded responses (special tokens skipped), ``B`` of them."""
    pad_id: int = 0
    """The token the id tensors are padded with."""
    versions: torch.Tensor | None = None
    """``(B, T)`` int64: the weight version that generated each response token (with
    partial rollouts one sample can carry several); meaningless where the mask is 0."""
    examples: list[Example] = dataclasses.field(default_factory=list)
    """The dataset row of each sample (``B``; the ``n`` samples of a prompt share one), for
    the reward."""
    rewards: torch.Tensor | None = None
    """``(B,)`` float32, once scored."""
    advantages: torch.Tensor | None = None
    """``(B,)`` float32, once scored (group-normalised rewards)."""
    trajectories: list | None = None
    """Multi-turn rollouts: each sample's :class:`rlwire.trainer.agent.Trajectory` (its turns,
    tool calls, environment rewards and why it stopped); None for single-turn samples."""
    generate_s: torch.Tensor | None = None
    """``(B,)`` float64: each sample's share of the engine's wall seconds on the calls that
    generated it (a call's time divided evenly over its rows; fully async: the wall time
    while groups were in flight, split evenly over the groups in flight,
    :class:`~rlwire.trainer.runtime.rollout_serve.ShareClock`; the rollout worker stamps
    it), so that a batch's sum is the generation time behind it wherever its parts came
    from."""

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def __reduce__(self):
        # Between processes the tensors travel as numpy arrays, which Ray sends out of band
        # as raw buffers; torch tensors are pickled one by one (measured here: a Ray call
        # passing and returning six small tensors took 2.5 ms as torch tensors, 0.9 ms as
        # numpy arrays).
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return (_rebuild_rollout, ({k: _to_array(v) for k, v in values.items()},))

    def answered(self) -> torch.Tensor:
        """``(B,)`` bool: the samples holding a response token (a failed agent session's
        has none: it has no version, and counts in no version, span or lag)."""
        return self.response_mask.bool().any(dim=1)

    @property
    def version(self) -> int | None:
        """The oldest weight version among the samples' tokens; None when no sample holds
        a token (every agent session failed)."""
        versions = self.sample_versions()
        return int(versions.min()) if len(versions) else None

    def sample_versions(self) -> torch.Tensor:
        """``(R,)`` int64: the version of each sample that holds a response token (its
        oldest token's), in order; ``R`` is :meth:`answered`'s count, 0 when every agent
        session failed."""
        return self._oldest_newest()[0]

    def version_spans(self) -> torch.Tensor:
        """``(B,)`` int64: newest minus oldest token version of each sample (0 unless the
        sample was continued across a weight sync; 0 for a sample of no token)."""
        spans = torch.zeros(len(self), dtype=torch.int64, device=self.response_mask.device)
        oldest, newest = self._oldest_newest()
        spans[self.answered()] = newest - oldest
        return spans

    def _oldest_newest(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(R,)`` each: the oldest and newest token version of the samples that hold a
        response token (taken over their tokens only: padding's versions are meaningless)."""
        versions = self._versions()
        real = self.response_mask.bool()
        answered = real.any(dim=1)
        real, versions = real[answered], versions[answered]
        if len(real) == 0:  # none (a zero-width batch's reduction over dim 1 would raise)
            empty = torch.zeros(0, dtype=torch.int64, device=versions.device)
            return empty, empty
        int64 = torch.iinfo(torch.int64)
        oldest = torch.where(real, versions, int64.max).min(dim=1).values
        newest = torch.where(real, versions, int64.min).max(dim=1).values
        return oldest, newest

    def _versions(self) -> torch.Tensor:
        assert self.versions is not None, "Rollout.versions: not stamped (the rollout worker does)"
        return self.versions

    @classmethod
    def concat(cls, parts: list[Rollout]) -> Rollout:
        """One batch of ``parts`` in order: prompts left-padded and responses right-padded
        to the widest part (padding masked out, log-probs 0); optional fields are kept
        when every part has them."""
        pad = parts[0].pad_id
        width_p = max(p.prompt_ids.shape[1] for p in parts)
        width_r = max(p.response_ids.shape[1] for p in parts)

        def joined(field: str, width: int | None = None) -> torch.Tensor | None:
            values = [getattr(p, field) for p in parts]
            if any(v is None for v in values):
                return None
            if width is not None:  # per-token values, padded (and masked) like the responses
                values = [_padded(v, width, 0, False) for v in values]
            return torch.cat(values)

        return cls(
            torch.cat([_padded(p.prompt_ids, width_p, pad, True) for p in parts]),
            torch.cat([_padded(p.prompt_mask, width_p, 0, True) for p in parts]),
            torch.cat([_padded(p.response_ids, width_r, pad, False) for p in parts]),
            torch.cat([_padded(p.response_mask, width_r, 0, False) for p in parts]),
            torch.cat([_padded(p.logprobs, width_r, 0.0, False) for p in parts]),
            [t for p in parts for t in p.texts],
            pad_id=pad,
            versions=joined("versions", width_r),
            examples=[x for p in parts for x in p.examples],
            trajectories=(
                None
                if any(p.trajectories is None for p in parts)
                else [t for p in parts for t in p.trajectories or ()]
            ),
            rewards=joined("rewards"),
            advantages=joined("advantages"),
            generate_s=joined("generate_s"),
        )

    def select(self, rows: slice | torch.Tensor) -> Rollout:
        """The rows ``rows`` (a slice, or a 1-D tensor of row indices) as a batch of their own."""

        def cut(value):
            return None if value is None else value[rows]

        def pick(items: list) -> list:
            if isinstance(rows, slice):
                return items[rows]
            return [items[i] for i in rows.tolist()] if items else []

        return Rollout(
            self.prompt_ids[rows],
            self.prompt_mask[rows],
            self.response_ids[rows],
            self.response_mask[rows],
            self.logprobs[rows],
            pick(self.texts),
            pad_id=self.pad_id,
            versions=cut(self.versions),
            examples=pick(self.examples),
            trajectories=None if self.trajectories is None else pick(self.trajectories),
            rewards=cut(self.rewards),
            advantages=cut(self.advantages),
            generate_s=cut(self.generate_s),
        )

    def groups(self, n: int) -> list[Rollout]:
        """The consecutive groups of ``n`` samples (one prompt each)."""
        if len(self) % n:
            raise ValueError(f"{len(self)} samples do not split into groups of {n}")
        return [self.select(slice(i, i + n)) for i in range(0, len(self), n)]

    def shard(self, rank: int, world_size: int) -> Rollout:
        """Actor rank ``rank``'s contiguous, equal share of the batch."""
        share = len(self) // world_size
        return self.select(slice(rank * share, (rank + 1) * share))

    def to(self, device: torch.device | str) -> Rollout:
        """The same batch with every tensor on ``device``."""

        def moved(value):
            return None if value is None else value.to(device)

        return dataclasses.replace(
            self,
            prompt_ids=self.prompt_ids.to(device),
            prompt_mask=self.prompt_mask.to(device),
            response_ids=self.response_ids.to(device),
            response_mask=self.response_mask.to(device),
            logprobs=self.logprobs.to(device),
            versions=moved(self.versions),
            rewards=moved(self.rewards),
            advantages=moved(self.advantages),
        )


def _to_array(value):
    """A host tensor of a numpy dtype as its numpy array (same memory); anything else as is."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        try:
            return value.detach().numpy()
        except TypeError:  # a dtype numpy lacks (bfloat16): pickled as a tensor
            return value
    return value


def _rebuild_rollout(values: dict) -> Rollout:
    import numpy

    def tensor(value):
        if not isinstance(value, numpy.ndarray):
            return value
        # Ray hands out-of-band buffers back read-only: own a copy to stay writable.
        return torch.from_numpy(value if value.flags.writeable else value.copy())

    return Rollout(**{k: tensor(v) for k, v in values.items()})


def sequence_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool = False,
):
    """``(B, T)`` log-probabilities of ``response_ids`` under ``model`` (one forward pass).

    Positions follow the attention mask, so left padding does not shift them.
    With ``with_entropy`` also returns the ``(B, T)`` entropy of each token's distribution.
    """
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention = torch.cat([prompt_mask, torch.ones_like(response_ids)], dim=1)
    positions = (torch.cumsum(attention, dim=1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions).logits
    steps = response_ids.shape[1]
    logits = logits[:, -steps - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return token_logp
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


def split_evenly(items: list, parts: int) -> list[list]:
    """``items`` in ``parts`` consecutive shares of ``ceil(len / parts)`` (the last ones
    shorter, or empty): the prompts of a call, over the rollout engines."""
    share = -(-len(items) // parts)
    return [items[i * share : (i + 1) * share] for i in range(parts)]
