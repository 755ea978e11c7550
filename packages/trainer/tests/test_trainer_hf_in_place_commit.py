"""``ckpt_engine.in_place``: the hf rollout engine's commit of weights used in place keeps
what it holds (``held``) and what it tells the sender (``released``) true to the arenas
its parameters read, whatever fails in it (issue 64, item 9). No Ray: the commit of
:meth:`HFEngine._stage_in_place` on a small module, with a stand-in for the shm engine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from rlwire.trainer.rollout.hf import HFEngine


class Stubborn(torch.nn.Parameter):
    """A parameter whose storage cannot be swapped (the commit's swap fails on it)."""

    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)  # type: ignore[attr-defined]

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        raise RuntimeError("this storage cannot be swapped")


class Sender:
    """The shm engine's receiving side, as the commit sees it."""

    def __init__(self, got: dict[str, torch.Tensor], version: int, fail: bool = False) -> None:
        self.got, self.version, self.fail = got, version, fail
        self.told: list[int] = []  # the versions released

    async def receive_in_place(self) -> tuple[dict[str, torch.Tensor], int]:
        return self.got, self.version

    def released(self, version: int) -> None:
        self.told.append(version)
        if self.fail:
            raise ConnectionError("the store is gone")


def _engine(model: torch.nn.Module, held: int) -> HFEngine:
    engine = HFEngine.__new__(HFEngine)  # the commit's state alone: no model to load
    engine.model = model
    engine.index = 0
    engine.held = held
    engine.config = SimpleNamespace(rollout=SimpleNamespace(kv_on_update="recompute"))
    engine.batch = SimpleNamespace(forgotten=0)
    engine.batch.forget = lambda: setattr(engine.batch, "forgotten", engine.batch.forgotten + 1)
    return engine


def _commit(engine: HFEngine, sender: Sender):
    return asyncio.run(engine._stage_in_place(sender))


def test_a_swap_that_fails_puts_every_parameter_back_and_releases_nothing():
    """The second parameter's swap fails: the first is put back (the model reads the held
    version's arena alone, as ``held`` says), and the sender is told nothing (it may not
    write that arena). Before: the first parameter read the new version, ``held`` the old."""
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    model.b = Stubborn(torch.zeros(2), requires_grad=False)
    old_a = model.a.data
    sender = Sender({"a": torch.ones(4), "b": torch.ones(2)}, version=8)
    engine = _engine(model, held=7)
    commit = _commit(engine, sender)
    with pytest.raises(RuntimeError, match="this storage cannot be swapped"):
        commit()
    assert model.a.data.data_ptr() == old_a.data_ptr()
    assert torch.equal(model.a, torch.zeros(4))
    assert engine.held == 7 and sender.told == [] and engine.batch.forgotten == 0


def test_a_release_that_fails_after_the_swap_leaves_held_naming_the_new_version():
    """The swap went through, then telling the sender fails: the model reads the new
    version, and ``held`` says so (before: it still named the version left)."""
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    new = torch.arange(4.0)
    sender = Sender({"a": new}, version=8, fail=True)
    engine = _engine(model, held=7)
    commit = _commit(engine, sender)
    with pytest.raises(ConnectionError, match="the store is gone"):
        commit()
    assert model.a.data.data_ptr() == new.data_ptr()
    assert engine.held == 8 and sender.told == [8] and engine.batch.forgotten == 1


def test_a_commit_swaps_every_parameter_then_releases_the_version():
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    model.b = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    got = {"a": torch.ones(4), "b": torch.full((2,), 2.0)}
    sender = Sender(got, version=3)
    engine = _engine(model, held=2)
    assert _commit(engine, sender)() == 3
    assert all(p.data_ptr() == got[n].data_ptr() for n, p in model.named_parameters())
    assert engine.held == 3 and sender.told == [3] and engine.batch.forgotten == 1
