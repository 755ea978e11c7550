"""The rlwire backends offered to vLLM, and their names there (``rlwire_<name>``)."""

from __future__ import annotations

__all__ = ["ANY", "BACKENDS", "PREFIX", "backend_of", "vllm_name"]

BACKENDS = ("gloo", "shm", "filesystem", "nccl", "cuda_ipc")
"""Offered where they can be built (:meth:`rlwire.ckpt_engine.registry.usable`): ``nccl``
and ``cuda_ipc`` need CUDA."""

PREFIX = "rlwire_"

ANY = "rlwire"
"""The vLLM-side name for any rlwire backend: the trainer side's init info names it."""


def vllm_name(backend: str) -> str:
    return PREFIX + backend


def backend_of(name: str) -> str:
    """The rlwire backend of a vLLM backend name; a name that is not one says what is."""
    backend = name[len(PREFIX) :] if name.startswith(PREFIX) else None
    if backend not in BACKENDS:
        allowed = ", ".join(vllm_name(b) for b in BACKENDS)
        raise ValueError(f"weight transfer backend {name!r} is not an rlwire one; use {allowed}")
    return backend
