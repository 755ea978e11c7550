"""The resolution rule, on mappings, objects and real megatron-core dataclasses."""

from __future__ import annotations

import copy
import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from rlwire.megatron_ddp import (
    build_ddp_config,
    effective_optimizer_settings,
    is_muon_layer_wise,
    resolve_ddp_overrides,
)

FOUR_CASES = [
    # (use_precision_aware_optimizer, main_grads_dtype, expected grad_reduce_in_fp32)
    (False, "fp32", True),
    (False, "bf16", True),
    (True, "fp32", True),
    (True, "bf16", False),
]


@pytest.mark.parametrize(("aware", "dtype", "expected"), FOUR_CASES)
@pytest.mark.parametrize("kind", ["mapping", "object"])
def test_four_cases(kind, aware, dtype, expected):
    fields = {"use_precision_aware_optimizer": aware, "main_grads_dtype": dtype}
    config = fields if kind == "mapping" else SimpleNamespace(**fields)
    assert resolve_ddp_overrides(config) == {"grad_reduce_in_fp32": expected}


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, "bfloat16", "BF16", torch.float16, "fp16", "float16"]
)
def test_any_sub_fp32_main_grads_dtype_spelling_resolves_low_precision(dtype):
    config = {"use_precision_aware_optimizer": True, "main_grads_dtype": dtype}
    assert resolve_ddp_overrides(config)["grad_reduce_in_fp32"] is False


def test_real_optimizer_config_defaults_to_fp32():
    from megatron.core.optimizer import OptimizerConfig

    config = OptimizerConfig(bf16=True, use_distributed_optimizer=True)
    assert resolve_ddp_overrides(config) == {"grad_reduce_in_fp32": True}


def test_missing_fields_take_megatron_defaults():
    assert resolve_ddp_overrides({}) == {"grad_reduce_in_fp32": True}
    assert resolve_ddp_overrides(SimpleNamespace(lr=1e-5)) == {"grad_reduce_in_fp32": True}


@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize(("aware", "dtype", "_"), FOUR_CASES)
def test_explicit_override_wins_both_ways(explicit, aware, dtype, _):
    config = {"use_precision_aware_optimizer": aware, "main_grads_dtype": dtype}
    overrides = {"grad_reduce_in_fp32": explicit, "overlap_grad_reduce": True}
    assert resolve_ddp_overrides(config, overrides) == overrides


def test_no_optimizer_injects_nothing_and_copies():
    overrides = {"overlap_grad_reduce": True}
    resolved = resolve_ddp_overrides(None, overrides)
    assert resolved == {"overlap_grad_reduce": True}
    assert resolved is not overrides
    assert resolve_ddp_overrides(None) == {}
    # Even overrides that would resolve to bf16 do not matter without an optimizer.
    assert (
        resolve_ddp_overrides(
            None,
            optimizer_overrides={"use_precision_aware_optimizer": True, "main_grads_dtype": "bf16"},
        )
        == {}
    )


def test_precision_aware_enabled_only_through_optimizer_overrides():
    base = {"use_precision_aware_optimizer": False, "main_grads_dtype": "fp32"}
    overrides = {"use_precision_aware_optimizer": True, "main_grads_dtype": "bf16"}
    resolved = resolve_ddp_overrides(base, optimizer_overrides=overrides)
    assert resolved == {"grad_reduce_in_fp32": False}
    # ... on a real OptimizerConfig base too (its dataclass fields are validated).
    from megatron.core.optimizer import OptimizerConfig

    real = OptimizerConfig(bf16=True)
    assert resolve_ddp_overrides(real, optimizer_overrides=overrides) == {
        "grad_reduce_in_fp32": False
    }
    assert real.use_precision_aware_optimizer is False  # base untouched


def test_inputs_are_never_mutated():
    base = {
        "use_precision_aware_optimizer": True,
        "main_grads_dtype": "bf16",
        "optimizer": "dist_muon",
    }
    ddp = {"overlap_grad_reduce": True}
    opt_over = {"main_grads_dtype": "fp16"}
    snapshot = copy.deepcopy((base, ddp, opt_over))
    resolved = resolve_ddp_overrides(base, ddp, optimizer_overrides=opt_over)
    assert resolved == {
        "overlap_grad_reduce": True,
        "grad_reduce_in_fp32": False,
        "use_layer_wise_param_layout": True,
    }
    assert (base, ddp, opt_over) == snapshot


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"optimizer": "dist_muon"}, True),
        ({"optimizer": "Dist_Muon"}, True),
        ({"optimizer": "muon", "use_distributed_optimizer": True}, True),
        ({"optimizer": "muon", "layer_wise_distributed_optimizer": True}, True),
        ({"optimizer": "muon", "use_layer_wise_distributed_optimizer": True}, True),  # verl
        ({"optimizer": "muon"}, False),
        ({"optimizer": "adam", "use_distributed_optimizer": True}, False),
    ],
)
def test_muon_layer_wise_recognition(settings, expected):
    assert is_muon_layer_wise(effective_optimizer_settings(settings)) is expected
    resolved = resolve_ddp_overrides(settings)
    assert ("use_layer_wise_param_layout" in resolved) is expected


def test_muon_layout_is_only_a_default():
    resolved = resolve_ddp_overrides(
        {"optimizer": "dist_muon"}, {"use_layer_wise_param_layout": False}
    )
    assert resolved["use_layer_wise_param_layout"] is False


@pytest.mark.parametrize("bad", ["float64", "half", 64, True, torch.float64])
def test_bad_dtype_names_field_and_accepted_values(bad):
    aware = {"use_precision_aware_optimizer": True}
    with pytest.raises(ValueError) as err:
        resolve_ddp_overrides({**aware, "main_grads_dtype": bad})
    assert str(err.value) == (
        f"main_grads_dtype: {bad!r} is not an accepted dtype; accepted: "
        "torch.float32/bfloat16/float16/uint8 or 'fp32', 'float32', '32', 32, 'bf16', "
        "'bfloat16', 'fp16', 'float16', '16', 16, 'fp8'"
    )
    with pytest.raises(ValueError, match=r"^exp_avg_dtype: 'half' is not an accepted"):
        resolve_ddp_overrides(aware, optimizer_overrides={"exp_avg_dtype": "half"})


# Spellings Megatron-LM's arguments and verl's precision parsing accept, on a
# precision-aware optimizer (where the dtypes matter), and what they resolve to:
# (field, value, effective dtype, grad_reduce_in_fp32).
SPELLINGS = [
    ("main_grads_dtype", "32", torch.float32, True),
    ("main_grads_dtype", 32, torch.float32, True),
    ("main_grads_dtype", "float32", torch.float32, True),
    ("main_grads_dtype", "16", torch.float16, False),
    ("main_grads_dtype", 16, torch.float16, False),
    ("main_grads_dtype", "bf16", torch.bfloat16, False),
    ("exp_avg_dtype", "fp8", torch.uint8, True),
    ("exp_avg_dtype", torch.uint8, torch.uint8, True),
    ("exp_avg_sq_dtype", "FP8", torch.uint8, True),
    ("exp_avg_sq_dtype", 16, torch.float16, True),
    ("main_params_dtype", "16", torch.float16, True),
]


@pytest.mark.parametrize(("field", "value", "dtype", "reduce_in_fp32"), SPELLINGS)
def test_every_megatron_and_verl_dtype_spelling(field, value, dtype, reduce_in_fp32):
    config = {"use_precision_aware_optimizer": True, field: value}
    assert effective_optimizer_settings(config)[field] == dtype
    assert resolve_ddp_overrides(config)["grad_reduce_in_fp32"] is reduce_in_fp32


@pytest.mark.parametrize("value", ["fp8", "anything", 7, torch.float64])
def test_optimizer_state_dtypes_are_not_read_without_the_precision_aware_optimizer(value):
    # As verl does: only a precision-aware optimizer uses them; Megatron's are fp32 then.
    config = {field: value for field in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")}
    settings = effective_optimizer_settings(config)
    assert settings["main_grads_dtype"] == settings["exp_avg_dtype"] == torch.float32
    assert resolve_ddp_overrides(config) == {"grad_reduce_in_fp32": True}


def test_unknown_optimizer_override_on_a_dataclass_lists_fields():
    from megatron.core.optimizer import OptimizerConfig

    with pytest.raises(ValueError, match=r"unknown field\(s\) \['main_grad_dtype'\].*valid: \["):
        resolve_ddp_overrides(OptimizerConfig(), optimizer_overrides={"main_grad_dtype": "bf16"})


def test_build_ddp_config_is_the_real_dataclass():
    from megatron.core.distributed import DistributedDataParallelConfig

    config = build_ddp_config(
        {"use_precision_aware_optimizer": True, "main_grads_dtype": "bf16"},
        {"overlap_grad_reduce": True},
        use_distributed_optimizer=True,
        bucket_size=1 << 20,
    )
    assert type(config) is DistributedDataParallelConfig
    assert config.grad_reduce_in_fp32 is False
    assert config.overlap_grad_reduce is True
    assert config.use_distributed_optimizer is True
    assert config.bucket_size == 1 << 20
    assert build_ddp_config({}).grad_reduce_in_fp32 is True
    # The user's override beats the caller's base value.
    assert build_ddp_config({}, {"bucket_size": 7}, bucket_size=9).bucket_size == 7


def test_build_ddp_config_unknown_user_key_lists_valid_fields():
    with pytest.raises(ValueError) as err:
        build_ddp_config({}, {"grad_reduce_in_fp33": True})
    message = str(err.value)
    assert message.startswith(
        "override_ddp_config: unknown DistributedDataParallelConfig field(s) "
        "['grad_reduce_in_fp33']; valid: ["
    )
    assert "'grad_reduce_in_fp32'" in message and "'overlap_grad_reduce'" in message


def test_build_ddp_config_drops_a_derived_key_megatron_lacks_with_one_warning(caplog):
    from megatron.core.distributed import DistributedDataParallelConfig

    known = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    with caplog.at_level(logging.WARNING, logger="rlwire.megatron_ddp"):
        config = build_ddp_config({"optimizer": "dist_muon"})
    if "use_layer_wise_param_layout" in known:  # newer megatron-core
        assert config.use_layer_wise_param_layout is True
        assert caplog.records == []
    else:  # megatron-core 0.16: the field does not exist yet
        assert [r.getMessage() for r in caplog.records] == [
            f"megatron-core {_mcore_version()} has no "
            "DistributedDataParallelConfig.use_layer_wise_param_layout; dropping the "
            "derived value True"
        ]
    assert config.grad_reduce_in_fp32 is True


def _mcore_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")
