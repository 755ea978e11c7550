"""The weights digest (:class:`rlwire.trainer.rollout.WeightsDigest`): fingerprints reduced on
the tensors' own device, equal for equal values whatever their dtype, order or chunking, and
different when any one element differs; the actor's ``named_sync_weights(dtype=...)``."""

from __future__ import annotations

import warnings

import pytest
import torch

from rlwire.trainer.rollout import WeightsDigest, weights_digest
from rlwire.trainer.rollout.digest import _column_weights, _row_weights

ROW = 4096
MOD = 1 << 64


def _fingerprint(tensor: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    digest = WeightsDigest(chunk=chunk)
    digest.add("t", tensor)
    return digest.fingerprints()["t"]


def _reference(tensor: torch.Tensor) -> list[int]:
    """The documented sums in Python integers, mod 2**64: what every device must give."""
    bits = tensor.reshape(-1).to(torch.float32).view(torch.int32).tolist()
    columns = _column_weights(torch.device("cpu")).tolist()
    rows = _row_weights(-(-len(bits) // ROW), torch.device("cpu")).tolist()
    lanes = []
    for lane in range(2):
        total = sum(v * columns[lane][i % ROW] * rows[i // ROW][lane] for i, v in enumerate(bits))
        lanes.append(total % MOD)
    return lanes


def _unsigned(fingerprint: torch.Tensor) -> list[int]:
    return [v % MOD for v in fingerprint.tolist()]


def test_torch_int64_multiply_and_sum_wrap_on_the_host():
    big = torch.tensor([(1 << 62) + 12345, -(1 << 62) - 7, (1 << 63) - 1], dtype=torch.int64)
    signed = [((v * 0x5DEECE66D) + (1 << 63)) % MOD - (1 << 63) for v in big.tolist()]
    assert (big * 0x5DEECE66D).tolist() == signed
    many = torch.full((1 << 20,), (1 << 62) + 3, dtype=torch.int64)
    assert int(many.sum()) == (((1 << 20) * ((1 << 62) + 3)) + (1 << 63)) % MOD - (1 << 63)


@pytest.mark.parametrize("numel", [1, 100, ROW, ROW + 1, 3 * ROW - 5])
def test_fingerprint_is_the_documented_sum_mod_2_64(numel):
    torch.manual_seed(numel)
    tensor = torch.randn(numel) * 1e30  # large exponents: products near 2**62
    assert _unsigned(_fingerprint(tensor)) == _reference(tensor)


def test_weights_are_odd_and_columns_distinct():
    columns = _column_weights(torch.device("cpu"))
    assert columns.shape == (2, ROW)
    assert bool((columns % 2 == 1).all()) and int(columns.max()) < 1 << 31
    assert all(len(set(lane.tolist())) == ROW for lane in columns)
    assert bool((_row_weights(1000, torch.device("cpu")) % 2 != 0).all())


@pytest.mark.parametrize("numel", [0, 7, ROW, 5 * ROW + 123, (1 << 17) + 9])
def test_fingerprint_does_not_depend_on_the_chunking(numel):
    torch.manual_seed(1)
    tensor = torch.randn(numel)
    fingerprints = [_fingerprint(tensor, chunk) for chunk in (ROW, 3 * ROW, 16 * ROW, None)]
    for other in fingerprints[1:]:
        torch.testing.assert_close(other, fingerprints[0], atol=0, rtol=0)


def test_fingerprint_follows_the_row_major_order_of_any_layout():
    torch.manual_seed(2)
    tensor = torch.randn(64, 96)
    transposed_copy = tensor.t().contiguous().t()  # same values, column-major storage
    assert not transposed_copy.is_contiguous()
    torch.testing.assert_close(_fingerprint(transposed_copy), _fingerprint(tensor), atol=0, rtol=0)


def test_digest_does_not_depend_on_the_order_of_adding():
    torch.manual_seed(3)
    items = [(f"layer.{i}.weight", torch.randn(100 + 37 * i, 3)) for i in range(12)]
    first = weights_digest(items)
    assert weights_digest(reversed(items)) == first
    digest = WeightsDigest(chunk=ROW)
    for name, value in items[5:] + items[:5]:
        digest.add(name, value)
    assert digest.hexdigest() == first


@pytest.mark.parametrize("held", [torch.bfloat16, torch.float16])
def test_equal_values_held_in_another_dtype_agree(held):
    """A bf16 (fp16) engine and an fp32 copy of the same values: the same digest."""
    torch.manual_seed(4)
    values = {f"w{i}": torch.randn(ROW + 3 * i, dtype=torch.float32).to(held) for i in range(4)}
    as_fp32 = {name: value.float() for name, value in values.items()}
    assert weights_digest(values.items()) == weights_digest(as_fp32.items())
    for name, value in values.items():
        torch.testing.assert_close(_fingerprint(value), _fingerprint(as_fp32[name]), atol=0, rtol=0)


def test_every_single_element_change_changes_the_fingerprint():
    torch.manual_seed(5)
    tensor = torch.randn(ROW + 50)  # a whole row and a partial one
    base = _fingerprint(tensor)
    up = torch.nextafter(tensor, torch.tensor(float("inf")))  # the smallest change: one ulp
    for i in range(tensor.numel()):
        changed = tensor.clone()
        changed[i] = up[i]
        assert not bool((_fingerprint(changed) == base).any()), f"element {i}: both lanes"


def test_swaps_and_the_sign_of_zero_change_the_fingerprint():
    torch.manual_seed(6)
    tensor = torch.randn(2 * ROW + 77)
    base = _fingerprint(tensor)
    n = tensor.numel()
    pairs = [(i, i + 1) for i in range(0, n - 1, 3)]  # neighbours, in a row and across rows
    pairs += [tuple(torch.randint(0, n, (2,)).tolist()) for _ in range(500)]
    pairs += [(0, ROW), (ROW - 1, ROW), (5, 2 * ROW + 5)]  # same column, other rows
    for i, j in pairs:
        if i == j:
            continue
        swapped = tensor.clone()
        swapped[i], swapped[j] = tensor[j], tensor[i]
        assert not bool((_fingerprint(swapped) == base).any()), f"swap {i} <-> {j}"
    zeros = torch.zeros(ROW + 1)
    for i in (0, ROW - 1, ROW):
        negative = zeros.clone()
        negative[i] = -0.0
        assert not bool((_fingerprint(negative) == _fingerprint(zeros)).any())
    # exchanging values whose bit patterns differ only in the exponent (1.0 and 2.0)
    ones = torch.ones(3 * ROW)
    ones[10] = 2.0
    base = _fingerprint(ones)
    for j in range(0, 3 * ROW, 7):
        if j != 10:
            moved = torch.ones(3 * ROW)
            moved[j] = 2.0
            assert not bool((_fingerprint(moved) == base).any()), f"2.0 moved to {j}"


def test_names_and_shapes_count():
    values = torch.arange(12, dtype=torch.float32)
    digest = weights_digest([("a", values)])
    assert weights_digest([("b", values)]) != digest
    assert weights_digest([("a", values.view(3, 4))]) != digest
    assert weights_digest([("a", torch.zeros(3))]) != weights_digest([("a", torch.zeros(4))])


def test_add_reads_nothing_back():
    """On the meta device every read of a value fails: add() must only queue work, and
    keep each fingerprint on the tensor's own device."""
    digest = WeightsDigest()
    for numel in (5, ROW, 3 * ROW + 1):
        digest.add(f"w{numel}", torch.empty(numel, device="meta", dtype=torch.bfloat16))
    for fingerprint in digest.fingerprints().values():
        assert fingerprint.device.type == "meta"
        assert fingerprint.shape == (2,) and fingerprint.dtype == torch.int64


def test_chunk_must_be_a_multiple_of_a_row():
    with pytest.raises(ValueError, match=r"^chunk: 100 is not allowed; use a positive multiple"):
        WeightsDigest(chunk=100)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fingerprints_equal_the_hosts_and_only_hexdigest_waits():
    torch.manual_seed(7)
    items = [(f"w{i}", torch.randn(ROW * 300 + 11 * i)) for i in range(6)]
    items.append(("bf16", torch.randn(ROW * 2 + 1).bfloat16()))
    host = WeightsDigest()
    for name, value in items:
        host.add(name, value)
    device = WeightsDigest()
    on_device = [(name, value.cuda()) for name, value in items]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for name, value in on_device:
            device.add(name, value)  # any host synchronisation raises here
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name, fingerprint in device.fingerprints().items():
        assert fingerprint.device.type == "cuda"
        torch.testing.assert_close(fingerprint.cpu(), host.fingerprints()[name], atol=0, rtol=0)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert device.hexdigest() == host.hexdigest()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    synchronising = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(synchronising) == 1, [str(w.message) for w in synchronising]


# --- the actor's sync in the engine's dtype ------------------------------------------------
def test_cast_for_sync_casts_only_what_is_held_in_the_parameter_dtype():
    from rlwire.trainer.actor.base import cast_for_sync

    items = [
        ("w", torch.randn(5)),
        ("ids", torch.arange(3)),
        ("half", torch.randn(2).half()),
    ]
    sent = dict(cast_for_sync(iter(items), torch.float32, torch.bfloat16))
    assert [sent[n].dtype for n in ("w", "ids", "half")] == [
        torch.bfloat16,
        torch.int64,
        torch.float16,
    ]
    torch.testing.assert_close(sent["w"], items[0][1].bfloat16(), atol=0, rtol=0)
    same = iter(items)
    assert cast_for_sync(same, torch.float32, None) is same
    assert cast_for_sync(same, torch.float32, torch.float32) is same


@pytest.mark.parametrize("mixed_precision", [True, False])  # DTensor shards / a plain module
def test_fsdp2_sends_in_the_engines_dtype_and_the_engine_digests_alike(
    one_rank, tmp_path, mixed_precision
):
    from rlwire.trainer.actor.fsdp import FSDP2Engine
    from rlwire.trainer.config.root import load_config
    from rlwire.trainer.models.modeling import load_hf_model
    from rlwire.trainer.models.tiny import build_tiny_model

    path = str(build_tiny_model(tmp_path / "tiny", hidden=32, layers=1))
    config = load_config(
        overrides=[
            f"model.path={path}",
            "actor.strategy=fsdp2",
            "actor.world_size=1",
            f"actor.mixed_precision={str(mixed_precision).lower()}",
        ]
    )
    actor = FSDP2Engine(config, path, torch.device("cpu"))
    assert hasattr(next(iter(actor.model.state_dict().values())), "full_tensor") is (
        mixed_precision
    )
    held = dict(actor.named_sync_weights())
    sent = dict(actor.named_sync_weights(dtype=torch.bfloat16))
    assert list(sent) == list(held)
    for name, value in held.items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(sent[name], value.bfloat16(), atol=0, rtol=0)
    # a bf16 engine holding what was sent digests as the actor did while sending
    engine = load_hf_model(path, "bfloat16", torch.device("cpu"))
    engine.load_state_dict(sent)
    assert weights_digest(engine.state_dict().items()) == weights_digest(sent.items())
    assert weights_digest(sent.items()) != weights_digest(held.items())  # fp32 values differ


def test_the_parts_name_the_first_tensor_that_differs():
    from rlwire.trainer.rollout.digest import digest_of_parts, first_difference

    weights = {"b": torch.arange(6.0).view(2, 3), "a": torch.ones(5), "c": torch.zeros(4)}
    parts = WeightsDigest()
    for name, tensor in weights.items():
        parts.add(name, tensor)
    ours = parts.parts()
    assert sorted(ours) == ["a", "b", "c"] and ours["b"].startswith("[2, 3]:")
    assert digest_of_parts(ours) == parts.hexdigest() == weights_digest(weights.items())
    changed = dict(weights, c=torch.tensor([0.0, 0.0, 1e-7, 0.0]), b=weights["b"] + 1)
    theirs = WeightsDigest()
    for name, tensor in changed.items():
        theirs.add(name, tensor)
    assert first_difference(ours, theirs.parts()) == "b"  # the first, sorted, of b and c
    assert first_difference(ours, ours) is None
    assert first_difference(ours, {k: v for k, v in ours.items() if k != "a"}) == "a"


def test_the_weight_check_stops_at_an_engine_that_differs_and_says_once_of_one_without(
    caplog,
):
    from rlwire.trainer.errors import RunError
    from rlwire.trainer.runtime.weight_check import WeightCheck

    sent = {"a": "[1]:00", "b": "[1]:01"}
    digest = "d" * 64
    check = WeightCheck()
    agree = {"digest": digest, "digest_parts": sent, "pulls": [{"worker": 0, "digest": digest}]}
    check(agree, 3)  # equal: nothing
    check({"digest": None, "pulls": [{"worker": 0, "digest": None}]}, 3)  # digests off
    blind = {"digest": digest, "digest_parts": sent, "pulls": [{"worker": 1, "digest": None}]}
    with caplog.at_level("WARNING"):
        check(blind, 3)
        check(blind, 4)
    said = [r.getMessage() for r in caplog.records if "gives no digest" in r.getMessage()]
    assert said == [
        "ckpt_engine.digest: rollout worker 1's engine gives no digest of its weights; its "
        "updates are not compared"
    ]
    held = {"worker": 2, "digest": "e" * 64, "digest_parts": {"a": "[1]:00", "b": "[1]:02"}}
    with pytest.raises(RunError) as err:
        check({"digest": digest, "digest_parts": sent, "pulls": [agree["pulls"][0], held]}, 5)
    assert str(err.value) == (
        "ckpt_engine.digest: after the sync of weight version 5, rollout worker 2's engine "
        "holds other weights than the actor sent (digest eeeeeeeeeeee against dddddddddddd; "
        "first differing tensor: b)"
    )
    with pytest.raises(RunError, match="the engine gives no per-tensor digests to name a"):
        check({"digest": digest, "pulls": [{"worker": 0, "digest": "e" * 64}]}, 6)
