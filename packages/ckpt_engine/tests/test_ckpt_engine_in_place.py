"""Weights used in place (``share_weights(buffers=2)``, ``receive_in_place``): what a failed
send leaves, and receivers that map the sender's arenas read-only (issue 64, item 9)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from engine_pair import joined_pair  # this folder: pytest puts it on sys.path

from rlwire.ckpt_engine import CheckpointEngineError


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(64, 8), "b": torch.randn(16)}


def _bytes(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in tensors.items()}


async def _exchange(tx, rx, weights: dict[str, torch.Tensor], version: int):
    """One update sent and received in place: the receiver's tensors (not committed)."""
    _, (got, received) = await asyncio.gather(
        tx.send_weights(list(weights.items()), version=version), rx.receive_in_place()
    )
    assert received == version
    assert _bytes(got) == _bytes(weights)
    return got


def test_a_send_refused_before_any_receiver_saw_it_records_nothing():
    """The first send fails (a tensor not in the arenas' layout): nothing is recorded, so
    the next send goes to the first arena as if the failed one never happened."""
    sent = _weights()
    tx, rx, _ = joined_pair(timeout=3)
    bad = [("w", torch.zeros(3)), ("b", sent["b"])]

    async def run() -> None:
        tx.share_weights(sent.items(), buffers=2)
        with pytest.raises(CheckpointEngineError, match=r"'w' \(\(3,\) .* not in the layout"):
            await tx.send_weights(bad, version=1)
        got = await _exchange(tx, rx, sent, 1)
        assert rx._arena_of(got["w"]) == 0
        rx.released(1)
        assert rx._arena_of((await _exchange(tx, rx, sent, 2))["w"]) == 1

    try:
        asyncio.run(run())
    finally:
        tx.finalize()
        rx.finalize()


def test_a_failed_send_after_the_wait_is_retried_into_the_same_arena_at_once():
    """Versions 1 and 2 fill both arenas; the send of 3 waits until the receiver left
    version 1's arena (it committed 2), then fails before publishing. Its retry writes the
    same arena without waiting for a release already taken (and the one after goes to the
    other arena, once the receiver committed 3)."""
    sent = _weights()
    tx, rx, _ = joined_pair(timeout=2)
    bad = [("w", sent["w"]), ("b", torch.zeros(16, dtype=torch.float64))]

    async def run() -> None:
        tx.share_weights(sent.items(), buffers=2)
        arenas = []
        for v in (1, 2):
            with torch.no_grad():
                sent["w"] += 1
            got = await _exchange(tx, rx, sent, v)
            arenas.append(rx._arena_of(got["w"]))
            rx.released(v)
        assert arenas == [0, 1]
        with pytest.raises(CheckpointEngineError, match=r"'b' .* not in the layout"):
            await tx.send_weights(bad, version=3)
        with torch.no_grad():
            sent["w"] += 1
        got = await _exchange(tx, rx, sent, 3)  # before: a timeout waiting for 2's release
        assert rx._arena_of(got["w"]) == 0
        rx.released(3)
        assert rx._arena_of((await _exchange(tx, rx, sent, 4))["w"]) == 1

    try:
        asyncio.run(run())
    finally:
        tx.finalize()
        rx.finalize()


def test_a_send_that_failed_after_receivers_could_take_it_refuses_the_next():
    """Version 2 reaches the receiver (which commits it) but its acknowledgement does not
    reach the sender in time: some receivers may read version 2's arena and others version
    1's, so no arena may be written. The next send is refused, naming why, and what the
    receiver holds is unchanged (before: version 3 was written over the version-2 arena
    the receiver's parameters are)."""
    sent = _weights()
    tx, rx, _ = joined_pair(timeout=1)

    async def no_ack(meta) -> None:
        """This receiver's acknowledgement is lost."""

    async def run() -> None:
        tx.share_weights(sent.items(), buffers=2)
        await _exchange(tx, rx, sent, 1)
        rx.released(1)
        with torch.no_grad():
            sent["w"] += 1
        rx._release = no_ack  # type: ignore[method-assign]  # the lost acknowledgement
        sent_2, got = await asyncio.gather(
            tx.send_weights(list(sent.items()), version=2),
            rx.receive_in_place(),
            return_exceptions=True,
        )
        del rx._release
        assert isinstance(sent_2, CheckpointEngineError), sent_2
        held, version = got  # type: ignore[misc]  # the receiver took it whole
        version_2 = _bytes(sent)
        assert version == 2 and _bytes(held) == version_2
        rx.released(2)  # committed: its parameters are version 2's arena
        with torch.no_grad():
            sent["w"] += 1
        with pytest.raises(CheckpointEngineError) as err:
            await tx.send_weights(list(sent.items()), version=3)
        assert _bytes(held) == version_2  # untouched
        assert str(err.value) == (
            "shm: the send of version 2 failed after receivers could take it from its arena "
            "(weights used in place): neither arena can be written while some may read it; "
            "finalize this engine and join a new group"
        )

    try:
        asyncio.run(run())
    finally:
        tx.finalize()
        rx.finalize()


def _permissions(tensor: torch.Tensor) -> str:
    """The permissions (``r--s``...) of this process's mapping holding ``tensor``."""
    ptr = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= ptr < high:
                return perms
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_receivers_map_the_arenas_read_only_and_infer_from_them():
    """The receiver's view of each arena is a read-only shared mapping (the sender's own is
    read-write); a model whose parameters are those tensors infers as with its own."""
    sent = _weights()
    tx, rx, _ = joined_pair(timeout=3)
    model = torch.nn.Linear(8, 64)
    with torch.no_grad():
        model.bias.copy_(torch.randn(64))
    expected = torch.nn.functional.linear(torch.ones(2, 8), sent["w"], model.bias)

    async def run() -> dict[str, torch.Tensor]:
        tx.share_weights(sent.items(), buffers=2)
        return await _exchange(tx, rx, sent, 1)

    try:
        got = asyncio.run(run())
        assert _permissions(got["w"]) == "r--s" and _permissions(got["b"]) == "r--s"
        assert _permissions(tx._double.views[0]["w"]) == "rw-s"  # type: ignore[attr-defined]
        model.weight.data = got["w"]
        with torch.no_grad():
            out = model(torch.ones(2, 8))
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
    finally:
        tx.finalize()
        rx.finalize()


def test_a_receivers_stray_write_into_an_arena_kills_it_instead_of_changing_the_weights():
    """A receiver that writes into a tensor it received in place faults (SIGSEGV): the
    weights every other receiver reads are not changed under them (before: the write went
    through, into the sender's arena)."""
    script = textwrap.dedent(
        """
        import asyncio, sys
        import torch
        from engine_pair import joined_pair  # this folder: PYTHONPATH

        tx, rx, _ = joined_pair(timeout=3)
        sent = {"w": torch.ones(64)}

        async def run():
            tx.share_weights(sent.items(), buffers=2)
            _, (got, _) = await asyncio.gather(
                tx.send_weights(list(sent.items()), version=1), rx.receive_in_place()
            )
            return got

        got = asyncio.run(run())
        theirs = tx._double.views[0]["w"]  # the sender's own mapping of the arena
        tx.finalize()  # the files unlinked (nothing left in /dev/shm): mappings stay
        rx.finalize()
        print("received", float(got["w"].sum()), flush=True)
        got["w"].add_(1)  # the stray write
        print("written", float(theirs.sum()), flush=True)
        """
    )
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.stdout.splitlines() == ["received 64.0"], (done.stdout, done.stderr[-2000:])
    assert done.returncode == -signal.SIGSEGV, done.stderr[-2000:]


def test_receivers_map_the_bucket_slots_read_only_and_receive_through_them():
    """A receiver's view of the master's two bucket slots is a read-only shared mapping, as
    its arenas' are (issue 70, item 6; before: read-write, so a receiver's stray write
    changed the bucket every other receiver reads); the master's own is read-write (it
    packs into them). Nothing on the receive path writes a slot (a write would fault here):
    checksummed dense updates of tensors split over buckets, as views (``copy=False``) and
    staged, then delta updates, arrive bit for bit."""
    from rlwire.ckpt_engine import apply_to_module

    torch.manual_seed(0)
    sent = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7)).bfloat16()
    held = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7)).bfloat16()
    tx, rx, _ = joined_pair(timeout=20, checksum=True, sender={"delta": "on"})

    async def run() -> list:
        staging, version, bases = {}, None, []
        for v in range(1, 4):
            with torch.no_grad():
                for p in sent.parameters():
                    p[torch.rand(p.shape) < 0.05] += 1
            stats, version = await asyncio.gather(
                tx.send_weights(list(sent.state_dict().items()), version=v),
                apply_to_module(held, rx, atomic=v > 1, staging=staging, version=version),
            )
            for (name, a), b in zip(
                sent.state_dict().items(), held.state_dict().values(), strict=True
            ):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (v, name)
            bases.append(stats.base)
        return bases

    try:
        assert [_permissions(s) for s in rx.slots] == ["r--s", "r--s"]
        assert [_permissions(s) for s in tx.slots] == ["rw-s", "rw-s"]
        assert asyncio.run(run()) == [None, 1, 2]  # a dense update, then deltas
    finally:
        tx.finalize()
        rx.finalize()
