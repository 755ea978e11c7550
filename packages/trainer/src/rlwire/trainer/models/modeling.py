"""Loading and saving the Hugging Face policy: shared by actor and rollout engines."""

from __future__ import annotations

import glob
import os
import secrets
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "load_hf_model",
    "preload_hf",
    "fsync_path",
    "replace_directory",
    "remove_staging",
    "save_hf_model",
    "set_gradient_checkpointing",
    "staging_folder",
]


def preload_hf() -> None:
    """Import what loading a Hugging Face model needs (about 2 s on this machine's CPUs):
    a worker process does it as it starts, while the driver still prepares the model."""
    import transformers.modeling_utils  # noqa: F401


def load_hf_model(path: str, dtype: str, device: torch.device) -> PreTrainedModel:
    """A Hugging Face causal LM from ``path`` in ``dtype`` (``"float32"``, ...) on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device)  # type: ignore[arg-type]  # typeshed: @wraps(Module.to) loses self


def set_gradient_checkpointing(model: PreTrainedModel, enable: bool) -> None:
    """Activation checkpointing of ``model``'s decoder layers on or off
    (``model.enable_gradient_checkpointing``). Non-reentrant: it needs no input that
    requires a gradient (a LoRA model's frozen embeddings) and runs under FSDP."""
    # transformers 5.24 renamed them activation_checkpointing_* (the old names warn)
    if hasattr(model, "activation_checkpointing_enable"):
        renamed: Any = model  # (the names transformers before 5.24 lacks, for mypy)
        if enable:
            renamed.activation_checkpointing_enable({"use_reentrant": False})
        else:
            renamed.activation_checkpointing_disable()
    elif enable:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def save_hf_model(
    weights: Iterable[tuple[str, torch.Tensor]],
    source: str,
    target: Path,
    dtype: str,
    *,
    extra: Mapping[str, str] | None = None,
    sole_writer: bool = False,
) -> None:
    """Write a Hugging Face directory at ``target``: ``source``'s architecture and tokenizer
    with ``weights`` (``(Hugging Face name, full tensor)`` pairs) in ``dtype``, loadable by
    ``from_pretrained`` and vLLM as is. The model is built on the meta device, so nothing
    but the given weights is allocated. Written in a folder of its own beside ``target``
    (:func:`staging_folder`), then swapped in whole (:func:`replace_directory`): whatever
    ``target`` held is replaced, so a caller that must not replace a folder checks first.

    Args:
        extra: files (name: text) written into the folder before it is swapped in, so that
            it appears with them (an export's marker).
        sole_writer: the caller is the only process that writes ``target`` (a run, under its
            lock): the staging folders of an earlier write of it that was cut off are removed
            first. Without it they stay (another process may be writing one)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kind = getattr(torch, dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=kind)
    state = {name: value.detach().to("cpu", kind) for name, value in weights}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # a tied output layer comes back as the embedding
    held = model.state_dict()
    missing = [name for name in missing if held[name].is_meta]  # tying filled the others
    if missing or unexpected:
        raise ValueError(
            f"the weights do not match {source}'s architecture: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    # written beside, then swapped in: a process killed while writing leaves the previous
    # export (or none), never a directory that loads half of the weights

    def write(staging: Path) -> None:
        model.save_pretrained(staging)
        AutoTokenizer.from_pretrained(source).save_pretrained(staging)

    write_swapped(target, write, extra=extra, sole_writer=sole_writer)


def write_swapped(
    target: Path,
    write: Callable[[Path], None],
    *,
    extra: Mapping[str, str] | None = None,
    sole_writer: bool = False,
) -> None:
    """``write`` a folder's files into a staging folder of this caller's own
    (:func:`staging_folder`), add ``extra`` (name: text), then swap it in for ``target``
    whole (:func:`replace_directory`); on any failure the staging folder goes and ``target``
    is as it was. ``sole_writer``: as :func:`save_hf_model`'s."""
    if sole_writer:
        remove_staging(target)
    staging = staging_folder(target)
    try:
        write(staging)
        for name, text in (extra or {}).items():
            (staging / name).write_text(text)
        replace_directory(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # (after a swap: the old contents)
        raise


def staging_folder(target: Path) -> Path:
    """A new, empty folder beside ``target`` (``<name>.tmp-<random>``, created here and so
    this caller's alone) to write ``target``'s replacement in: two writers of one target
    (two exports of one step) never write into, or remove, each other's. Made as
    ``tempfile.mkdtemp`` makes one, but with the mode the umask gives (mkdtemp's 0700 would
    become the finished folder's, unreadable to a server run by another user)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        staging = target.with_name(f"{target.name}.tmp-{secrets.token_hex(4)}")
        try:
            staging.mkdir()
        except FileExistsError:
            continue
        return staging


def remove_staging(target: Path) -> None:
    """Remove what cut-off writes of ``target`` left beside it: its staging folders
    (:func:`staging_folder`), and ``<name>.tmp``, the one staging folder every writer shared
    before them. Only for the sole writer of ``target``: another's may be in use."""
    for path in target.parent.glob(f"{glob.escape(target.name)}.tmp*"):
        if path.name == f"{target.name}.tmp" or path.name.startswith(f"{target.name}.tmp-"):
            shutil.rmtree(path, ignore_errors=True)


def replace_directory(staging: Path, target: Path) -> None:
    """``staging`` (complete) put in place of ``target``, durably: every file and directory
    of it flushed to disk first; then the two swapped in one step where the kernel can
    (``renameat2`` with ``RENAME_EXCHANGE``: ``target`` exists at every moment, the old
    one or the new one), else the old one renamed aside first; the old one removed after and
    the rename flushed."""
    for path in sorted(staging.rglob("*"), reverse=True):  # files, then their directories
        fsync_path(path)
    fsync_path(staging)
    old = staging.with_name(staging.name + ".old")  # as private as staging is
    shutil.rmtree(old, ignore_errors=True)
    if target.exists() and _exchange(staging, target):
        shutil.rmtree(staging, ignore_errors=True)  # (now the old contents)
    else:
        if target.exists():
            target.rename(old)
        staging.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    fsync_path(target.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux's ``renameat2(..., RENAME_EXCHANGE)``); False
    where the kernel, libc or filesystem cannot."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
