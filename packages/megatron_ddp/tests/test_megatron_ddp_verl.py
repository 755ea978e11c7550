"""``resolve_ddp_overrides`` against verl's own Megatron engine resolution
(``MegatronEngine._resolve_override_ddp_config``) over a table of verl optimizer configs and
DDP overrides (marked ``verl``: run by ``.ci/verl``; deselected by default)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlwire.megatron_ddp import resolve_ddp_overrides

pytestmark = pytest.mark.verl

CASES = [
    # (verl McoreOptimizerConfig fields, override_ddp_config)
    ({}, {}),
    ({"use_precision_aware_optimizer": True, "main_grads_dtype": "bf16"}, {}),
    ({"use_precision_aware_optimizer": True, "main_grads_dtype": "fp32"}, {}),
    ({"use_precision_aware_optimizer": True, "main_grads_dtype": "bfloat16"}, {}),
    ({"use_precision_aware_optimizer": False, "main_grads_dtype": "bf16"}, {}),
    ({}, {"grad_reduce_in_fp32": False}),
    (
        {"use_precision_aware_optimizer": True, "main_grads_dtype": "bf16"},
        {"grad_reduce_in_fp32": True, "bucket_size": 1 << 20},
    ),
    ({"optimizer": "muon", "use_layer_wise_distributed_optimizer": True}, {}),
    (
        {"optimizer": "muon", "use_layer_wise_distributed_optimizer": True},
        {"use_layer_wise_param_layout": False},
    ),
    ({"optimizer": "muon", "use_layer_wise_distributed_optimizer": False}, {}),
    ({"optimizer": "adam", "use_layer_wise_distributed_optimizer": True}, {}),
]


@pytest.mark.parametrize(("optimizer", "overrides"), CASES)
def test_resolve_ddp_overrides_agrees_with_verls_megatron_engine(optimizer, overrides):
    impl = pytest.importorskip("verl.workers.engine.megatron.transformer_impl")
    config_module = pytest.importorskip("verl.workers.config")
    optimizer_config = config_module.McoreOptimizerConfig(lr=1e-6, **optimizer)
    engine = SimpleNamespace(
        engine_config=SimpleNamespace(override_ddp_config=dict(overrides)),
        optimizer_config=optimizer_config,
    )
    verls = impl.MegatronEngine._resolve_override_ddp_config(engine)
    ours = resolve_ddp_overrides(optimizer_config, overrides)
    assert ours == verls
    assert overrides == dict(overrides)  # never mutated


def test_a_forward_only_engine_gets_the_overrides_unchanged():
    impl = pytest.importorskip("verl.workers.engine.megatron.transformer_impl")
    overrides = {"bucket_size": 123}
    engine = SimpleNamespace(
        engine_config=SimpleNamespace(override_ddp_config=overrides), optimizer_config=None
    )
    assert resolve_ddp_overrides(
        None, overrides
    ) == impl.MegatronEngine._resolve_override_ddp_config(engine)
