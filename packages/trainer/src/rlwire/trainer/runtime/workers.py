"""The Ray actor of a training rank (with its rollout engine inside:
:mod:`rlwire.trainer.runtime.hybrid`; the rollout worker of its own:
:mod:`rlwire.trainer.runtime.rollout_worker`).

These are plain classes; the driver wraps them with ``ray.remote`` and
declared resources. Actor ranks form their own ``torch.distributed`` group
(gloo on CPU, NCCL on CUDA) of ``actor.world_size``; rank 0 also joins the
checkpoint engine as its sender and the rollout workers as its receivers.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import functools
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..actor import ActorEngine, actor_engine_class
from ..algorithms.correction import correction_weights
from ..algorithms.losses import LossScale
from ..algorithms.reward_kl import kl_estimate
from ..algorithms.step import compute_old_logprobs, grpo_update, ppo_update
from ..config.root import TrainerConfig
from ..data.inputs import build_tiny
from ..models.lora import save_adapter
from ..outputs.checkpoint import load_actor, save_actor
from ..rollout import Rollout
from .background import Background
from .weight_push import WeightPush
from .worker_process import WorkerProcess, host, is_loopback, seed_everything, set_threads

__all__ = ["ActorWorker"]

_TIMEOUT = datetime.timedelta(seconds=300)


def join_group(
    backend: str,
    *,
    rank: int,
    world_size: int,
    master: tuple[str, int],
    store: Any = None,
    timeout: datetime.timedelta = _TIMEOUT,
) -> None:
    """torch.distributed's default group of the actor ranks, over rank 0's ``store`` (a
    ``rlwire.ckpt_engine.bound_store`` at ``master``: listening on that address only); the
    other ranks connect to it. ``MASTER_ADDR``/``MASTER_PORT`` are set too, for libraries
    that read them.

    On one host (``master`` on loopback) gloo's pairs listen on loopback too
    (``GLOO_SOCKET_IFNAME=lo`` unless the user set it): gloo's default device listens on
    the address the hostname resolves to, reachable from the network, and its pairs are
    not authenticated. torch reads the variable for every gloo group of this process
    (Megatron's included), as ``init_process_group`` takes no gloo device."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master[0], str(master[1])
    if "gloo" in backend and is_loopback(master[0]) and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if store is None:
        store = dist.TCPStore(master[0], master[1], is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


class ActorWorker(WeightPush, WorkerProcess):
    """One training rank: an actor engine (``actor.strategy``: FSDP2, FSDP1, Megatron DDP or
    a third party's) behind :class:`rlwire.trainer.actor.ActorEngine`, GRPO updates, weight
    export through the checkpoint engine, and checkpoints."""

    CONCURRENCY_GROUPS = {"abort": 1}
    """The Ray actor's concurrency groups (not the hybrid engine's): every call runs in
    order on the default group but :meth:`~.weight_push.WeightPush.abort_push`, on
    ``abort``, which ends a send that the default group's thread is waiting in."""

    def __init__(self, config: TrainerConfig, model_path: str, rank: int) -> None:
        super().__init__(config)
        self.model_path = model_path
        self.rank = rank
        self._actor: ActorEngine | None = None  # setup() builds it
        self.engine = None
        self.shared: dict[str, torch.Tensor] | None = None  # zero-copy: the arena's tensors
        self._sending = Background("actor rank 0's weight send")  # fully async: the send in flight
        self._snapshot = None  # fully async, rank 0: the last push's weights (resend_push)
        self.lr_scale = 1.0  # the staleness-aware step size in effect
        # Where a sync's tensors go for an engine without a device of its own: the host
        # for a receiver in another process; the hybrid engine's in-process receiver reads
        # them on this device (HybridWorker).
        self.sync_device = torch.device("cpu")
        self._group_store: Any = None  # rank 0: the actor group's store (address())
        self._kept_for_sync = False
        """``actor.offload``: train() left the model on the device for the sync that follows
        (:meth:`_resident` sends from it, then offloads it)."""

    @property
    def actor(self) -> ActorEngine:
        """The actor engine (built by :meth:`setup`)."""
        assert self._actor is not None, f"actor rank {self.rank}: setup() has not run"
        return self._actor

    # --- setup ---------------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        """rank 0: where the group's store listens, from now on: on this node's address only
        (loopback while the cluster has one node), not on every interface as torch's own
        TCPStore server would."""
        from rlwire.ckpt_engine import bound_store

        address = host()
        self._group_store = bound_store(address, _TIMEOUT.total_seconds())
        return address, self._group_store.port

    def build_model(self) -> None:
        """Build the built-in tiny model at ``model_path`` (``model.path=tiny``) unless it is
        there: in a worker, which imports transformers anyway."""
        build_tiny(self.config, Path(self.model_path))

    def setup(self, master: tuple[str, int]) -> None:
        cfg = self.config
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        store = None
        if self.rank == 0:
            if self._group_store is None:  # address() not asked: a group of one, no Ray
                from rlwire.ckpt_engine import bound_store

                self._group_store = bound_store(master[0], _TIMEOUT.total_seconds())
            store = self._group_store
            master = (master[0], store.port)
        join_group(
            backend, rank=self.rank, world_size=cfg.actor.world_size, master=master, store=store
        )
        seed_everything(cfg.trainer.seed)
        engine_class = actor_engine_class(cfg.actor.strategy)
        self._actor = actor = engine_class(cfg, self.model_path, self.device)
        set_threads(cfg, actor.model)

    def describe(self) -> dict[str, list[str]]:
        """What the actor engine wants logged once at start (info lines and warnings)."""
        return self.actor.describe()

    # --- a training step -----------------------------------------------------------------
    def train(
        self, batch: Rollout, lag: float = 0.0, step: int = 0, sync_follows: bool = False
    ) -> dict[str, Any]:
        """Proximal log-probs (a forward pass, unless ``bypass_mode``, or the update is
        exactly on-policy and they are the training forward's own), the off-policy
        correction against the behaviour log-probs, the staleness-aware step size for a
        batch ``lag`` versions old on average (``actor.optim.stale_lr_kl``; every rank
        takes the same) times the learning-rate schedule at update ``step``
        (``actor.optim.lr_scheduler_type``), then PPO mini-batches and epochs over this rank's
        shard of the batch (with its ``advantages``). Times its phases. With
        ``actor.offload`` and ``sync_follows`` (the next call sends the weights) the model
        stays on the device, the optimizer state and the reference going to the host: the
        sync sends from it without reloading it, then offloads it."""
        began = time.perf_counter()
        cfg, actor = self.config, self.actor
        correction = cfg.algorithm.rollout_correction
        if cfg.actor.offload:
            actor.reload()
        rollout = batch.to(self.device)
        temperature = cfg.rollout.temperature
        actor.model.train()
        forward = self._logprobs_of(rollout)
        start = time.perf_counter()
        reuse = cfg.reuses_training_logprobs()
        if correction.bypass_mode:
            proximal = rollout.logprobs
        elif reuse:  # exactly on-policy: the training forward's own, recorded during it
            proximal = torch.zeros_like(rollout.logprobs)
        else:  # in eval mode, as the rollout engine samples (dropout would separate them)
            proximal = _evaluated(actor.model, forward)
        old_logprob_s = time.perf_counter() - start
        with actor.reference_policy() as reference:  # for the KL loss (not the KL in reward)
            ref = None
            if reference is not None and cfg.algorithm.kl_coef > 0:
                ref = _evaluated(reference, forward)
        ref_s = time.perf_counter() - start - old_logprob_s
        correct = functools.partial(
            correction_weights,
            behaviour=rollout.logprobs,
            mask=rollout.response_mask,
            config=correction,
            off_policy=cfg.trainer.off_policy,
        )
        weights = None if reuse else correct(proximal)
        lr_scale = 1.0
        if lag > 0 and weights is not None:  # the batch's KL per response, on every rank
            tokens = float(rollout.response_mask.sum())
            kl = weights.metrics["kl_behaviour_proximal"] * tokens / len(rollout)
            lr_scale = cfg.actor.optim.lr_scale(lag, self._mean_over_ranks(kl, len(rollout)))
        lr_scale *= cfg.actor.optim.schedule(step, cfg.trainer.steps)  # warm-up, decay
        if lr_scale != self.lr_scale:
            actor.scale_lr(lr_scale)
            self.lr_scale = lr_scale
        algorithm = cfg.algorithm
        update = functools.partial(
            grpo_update,
            actor.model,
            None,
            micro_batch_size=cfg.micro_batch_rows(),
            max_tokens=cfg.actor.update_token_budget(),
            remove_padding=cfg.actor.use_remove_padding,
            temperature=temperature,
            clip_ratio=algorithm.clip_low,
            clip_ratio_high=algorithm.clip_high,
            clip_ratio_c=algorithm.clip_ratio_c,
            loss_mode=algorithm.loss_mode,
            loss_agg=algorithm.loss_agg,
            entropy_coeff=algorithm.entropy_coeff,
            grad_sync=cfg.actor.grad_sync,
            kl_coef=algorithm.kl_coef,
            optimizer_step=actor.optimizer_step,
            record=proximal if reuse else None,
        )
        metrics = ppo_update(
            rollout,
            None if reuse else proximal,
            mini_batch_size=cfg.mini_batch_rows(),
            epochs=cfg.actor.ppo_epochs,
            update=update,
            scale_of=self._loss_scale,
            advantages=rollout.advantages,
            ref_logprobs=ref,
            weights=None if weights is None else weights.weights,
            loss_mask=None if weights is None else weights.mask,
        )
        if weights is None:  # the correction is off: its metrics, from the recorded ones
            weights = correct(proximal)
        metrics |= {"time_old_logprob_s": old_logprob_s, "time_ref_s": ref_s}
        mask = rollout.response_mask.float()
        kl_rollout = ((rollout.logprobs - proximal) * mask).sum() / mask.sum()
        if cfg.actor.offload:
            actor.offload(model=not sync_follows)
            self._kept_for_sync = sync_follows
        metrics["time_actor_s"] = time.perf_counter() - began
        return {
            **metrics,
            **weights.metrics,
            "kl_rollout": float(kl_rollout),
            # read back from the optimizer: the step size its steps took, not the one asked for
            "lr_scale": actor.lr_in_effect() / cfg.actor.optim.lr if cfg.actor.optim.lr else 1.0,
        }

    def _logprobs_of(self, rollout: Rollout):
        """``model -> (B, T)`` log-probs of ``rollout``'s responses (forward only)."""
        return functools.partial(
            compute_old_logprobs,
            rollout=rollout,
            micro_batch_size=self.config.actor.log_prob_micro_batch_size
            or self.config.micro_batch_rows(),
            max_tokens=self.config.actor.log_prob_token_budget(),
            remove_padding=self.config.actor.use_remove_padding,
            temperature=self.config.rollout.temperature,
        )

    def reward_kl(self, batch: Rollout) -> torch.Tensor:
        """``(B, 2)`` for this rank's shard: each response's summed and mean
        ``algorithm.kl_penalty`` estimate between the actor before the update and the
        reference policy (``algorithm.use_kl_in_reward``; forward passes only)."""
        cfg, actor = self.config, self.actor
        if cfg.actor.offload:
            actor.reload(optimizer=False)
        rollout = batch.to(self.device)
        forward = self._logprobs_of(rollout)
        proximal = _evaluated(actor.model, forward)
        with actor.reference_policy() as reference:
            assert reference is not None, "algorithm.use_kl_in_reward: no reference policy"
            ref = _evaluated(reference, forward)
        if cfg.actor.offload:
            actor.offload()
        mask = rollout.response_mask.float()
        kl = kl_estimate(proximal, ref, cfg.algorithm.kl_penalty) * mask
        per_response = kl.sum(dim=1)
        return torch.stack([per_response, per_response / mask.sum(dim=1).clamp(min=1)], 1).cpu()

    def _loss_scale(self, mask: torch.Tensor) -> LossScale:
        """A mini-batch's counts over every actor rank, from this rank's loss ``mask`` (a
        collective): what each micro-batch's loss is normalised by."""
        import torch.distributed as dist

        local = LossScale.of(mask)
        counts = torch.tensor(
            [local.tokens, local.sequences], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(counts)
        return LossScale(
            tokens=float(counts[0]),
            sequences=float(counts[1]),
            world=self.config.actor.world_size,
            horizon=self.config.rollout.max_new_tokens,
        )

    def _mean_over_ranks(self, value: float, weight: float) -> float:
        """The ``weight``-weighted mean of every actor rank's ``value`` (a collective)."""
        import torch.distributed as dist

        both = torch.tensor([value * weight, weight], dtype=torch.float64, device=self.device)
        dist.all_reduce(both)
        return float(both[0] / both[1].clamp(min=1))

    @contextlib.contextmanager
    def _resident(self, *, optimizer: bool) -> Iterator[None]:
        """The model (and the optimizer state) on the device for the block, when offloaded
        between phases: exporting weights and saving gather shards with device collectives."""
        if not self.config.actor.offload:
            yield
            return
        if optimizer or not self._kept_for_sync:  # else train() left the model here
            self.actor.reload(optimizer=optimizer, reference=False)
        try:
            yield
        finally:
            self._kept_for_sync = False
            self.actor.offload()

    def export_hf(self, directory: str, adapter: str | None = None) -> None:
        """Write the policy as a Hugging Face directory (merged, with LoRA) and with LoRA the
        adapter in PEFT's format at ``adapter`` (rank 0; the others join the gathers)."""
        from ..models.modeling import save_hf_model

        with self._resident(optimizer=False):
            for kind in ("model", "adapter") if adapter else ("model",):
                weights = self.actor.named_weights() if kind == "model" else self._full_weights()
                if self.rank != 0:  # a collective: every rank iterates to the end
                    collections.deque(weights, maxlen=0)
                elif kind == "model":  # (the run's folders: it holds the run directory's lock)
                    save_hf_model(
                        weights,
                        self.model_path,
                        Path(directory),
                        self.config.held_dtype(),
                        sole_writer=True,
                    )
                else:
                    assert adapter is not None  # kind "adapter" comes only with one
                    lora = self.config.actor.lora
                    save_adapter(weights, lora, self.model_path, Path(adapter), sole_writer=True)

    # --- checkpoints -----------------------------------------------------------------------
    def save(self, directory: str) -> None:
        """This rank's part of a checkpoint (:mod:`rlwire.trainer.outputs.checkpoint`)."""
        with self._resident(optimizer=True):
            save_actor(self.actor, Path(directory), self.rank)

    def load(self, directory: str, *, same_world: bool, step: int) -> None:
        """Restore a checkpoint saved after ``step`` updates (resharded to this group; the RNG
        states only at the world size they were saved with, else reseeded from the seed
        and the step). The learning rate is ``actor.optim.lr``'s again."""
        with self._resident(optimizer=True):
            reseed = self.config.trainer.seed + step
            load_actor(self.actor, Path(directory), self.rank, same_world=same_world, reseed=reseed)
        self.actor.scale_lr(1.0)  # the checkpoint holds the lr in effect then
        self.lr_scale = 1.0


def _evaluated(model: torch.nn.Module, forward) -> torch.Tensor:
    """``forward(model)`` with ``model`` in eval mode (verl computes old and reference
    log-probs so); its mode restored after."""
    training = model.training
    model.eval()
    try:
        return forward(model)
    finally:
        model.train(training)
