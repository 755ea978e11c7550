"""Policy parsing, config validation and the micro-batch context, without process groups."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import rlwire.grad_sync as gs
from rlwire.grad_sync import (
    GradSyncConfig,
    GradSyncPolicy,
    decide_policy,
    micro_batch_sync,
    predict_retained_grad_bytes,
    resolve_policy,
    retained_grad_bytes,
    run_micro_batches,
)


def test_public_surface():
    assert sorted(gs.__all__) == [
        "GradSyncConfig",
        "GradSyncPolicy",
        "decide_policy",
        "micro_batch_sync",
        "predict_retained_grad_bytes",
        "resolve_policy",
        "retained_grad_bytes",
        "run_micro_batches",
    ]
    assert GradSyncPolicy.DEFER == "defer" and isinstance(GradSyncPolicy.AUTO, str)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (None, GradSyncPolicy.DEFER),
        ({}, GradSyncPolicy.DEFER),
        (SimpleNamespace(), GradSyncPolicy.DEFER),
        ({"policy": "every"}, GradSyncPolicy.EVERY),
        ({"grad_sync_policy": "AUTO"}, GradSyncPolicy.AUTO),
        ({"grad_sync_policy": "every", "policy": "defer"}, GradSyncPolicy.EVERY),
        ({"policy": None, "use_no_sync_for_gradient_accumulation": False}, GradSyncPolicy.EVERY),
        ({"use_no_sync_for_gradient_accumulation": True}, GradSyncPolicy.DEFER),
        ({"use_no_sync_for_gradient_accumulation": False}, GradSyncPolicy.EVERY),
        ({"policy": "defer", "use_no_sync_for_gradient_accumulation": False}, GradSyncPolicy.DEFER),
        (SimpleNamespace(use_no_sync_for_gradient_accumulation=False), GradSyncPolicy.EVERY),
        (SimpleNamespace(grad_sync_policy=GradSyncPolicy.EVERY), GradSyncPolicy.EVERY),
        (GradSyncConfig(policy="every"), GradSyncPolicy.EVERY),
        (GradSyncConfig(), GradSyncPolicy.DEFER),
        ("auto", GradSyncPolicy.AUTO),
        (GradSyncPolicy.EVERY, GradSyncPolicy.EVERY),
    ],
)
def test_resolve_policy(config, expected):
    assert resolve_policy(config) is expected


def test_bad_policy_string_names_field_and_allowed_values():
    with pytest.raises(ValueError) as err:
        resolve_policy({"policy": "sometimes"})
    assert str(err.value) == (
        "policy: 'sometimes' is not a gradient-sync policy; allowed: 'defer', 'every', 'auto'"
    )
    with pytest.raises(ValueError, match=r"^grad_sync_policy: 'never' is not"):
        resolve_policy(SimpleNamespace(grad_sync_policy="never"))
    with pytest.raises(ValueError, match=r"^GradSyncConfig.policy: 3 is not a gradient-sync"):
        GradSyncConfig(policy=3)


def test_legacy_field_must_be_bool():
    with pytest.raises(ValueError, match="use_no_sync_for_gradient_accumulation: 'yes' is not"):
        resolve_policy({"use_no_sync_for_gradient_accumulation": "yes"})


@pytest.mark.parametrize("budget", [-1, 1.5, "1GiB", True])
def test_bad_budget(budget):
    with pytest.raises(ValueError, match=r"^GradSyncConfig.memory_budget_bytes: "):
        GradSyncConfig(policy="auto", memory_budget_bytes=budget)


def test_config_is_frozen_and_coerces_strings():
    config = GradSyncConfig(policy="Every", memory_budget_bytes=0)
    assert config.policy is GradSyncPolicy.EVERY
    with pytest.raises(AttributeError):
        config.policy = GradSyncPolicy.DEFER  # type: ignore[misc]


class NoSyncRecorder(nn.Linear):
    """A module with a ``no_sync()`` context, like DDP and Megatron-Core's DDP."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.syncing = True
        self.log: list[bool] = []

    @contextlib.contextmanager
    def no_sync(self):
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("defer", [False, False, False, True]), ("every", [True] * 4)],
)
def test_run_micro_batches_disables_sync_on_all_but_last(policy, expected):
    model = NoSyncRecorder()

    def step(x):
        model.log.append(model.syncing)
        return x * 2

    batches = (i for i in range(4))  # a generator: the last item is found by lookahead
    assert run_micro_batches(model, batches, step, policy=policy) == [0, 2, 4, 6]
    assert model.log == expected
    assert model.syncing


def test_forward_only_never_disables_sync():
    model = NoSyncRecorder()
    run_micro_batches(model, range(3), lambda _: model.log.append(model.syncing), forward_only=True)
    assert model.log == [True, True, True]


def test_context_restores_after_exception():
    model = NoSyncRecorder()
    with pytest.raises(RuntimeError, match="boom"), micro_batch_sync(model, is_last=False):
        assert not model.syncing
        raise RuntimeError("boom")
    assert model.syncing


def test_empty_micro_batches_is_an_error():
    with pytest.raises(ValueError, match="micro_batches is empty"):
        run_micro_batches(nn.Linear(2, 2), [], lambda b: b)


def test_plain_module_retains_nothing_and_auto_on_cpu_defers(caplog):
    model = nn.Linear(8, 8)
    with micro_batch_sync(model, is_last=False):
        model(torch.randn(2, 8)).sum().backward()
    assert retained_grad_bytes(model) == 0
    assert predict_retained_grad_bytes(model) == 0
    with caplog.at_level(logging.INFO, logger="rlwire.grad_sync"):
        assert decide_policy(model, "auto") is GradSyncPolicy.DEFER
        assert decide_policy(model, "auto") is GradSyncPolicy.DEFER  # decided once
    assert [r.getMessage() for r in caplog.records] == [
        "grad_sync auto -> defer for Linear: CPU model and no memory budget"
    ]


class _VerlStyleConfig(Mapping):
    """Behaves like verl 0.9.1's engine configs: a dataclass that is also a ``Mapping``
    whose item lookup (and so ``in``) raises ``AttributeError`` for a missing key."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def __getitem__(self, key):
        return getattr(self, key)  # AttributeError, not KeyError, when missing

    def __iter__(self):
        return iter(self.__dict__)

    def __len__(self):
        return len(self.__dict__)


class _AttributeStyleMapping(dict):
    """An attribute-style dict (like ``addict``/``EasyDict``): ``.missing`` raises KeyError."""

    def __getattr__(self, key):
        if key.startswith("__"):  # Python's own protocol lookups stay attribute errors
            raise AttributeError(key)
        return self[key]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (_VerlStyleConfig(use_no_sync_for_gradient_accumulation=False), GradSyncPolicy.EVERY),
        (_VerlStyleConfig(use_no_sync_for_gradient_accumulation=True), GradSyncPolicy.DEFER),
        (_VerlStyleConfig(strategy="fsdp2"), GradSyncPolicy.DEFER),
        (_VerlStyleConfig(grad_sync_policy="auto", memory_budget_bytes=7), GradSyncPolicy.AUTO),
        (_AttributeStyleMapping(use_no_sync_for_gradient_accumulation=False), GradSyncPolicy.EVERY),
        (_AttributeStyleMapping(), GradSyncPolicy.DEFER),
    ],
)
def test_configs_whose_missing_keys_raise_attribute_or_key_errors(config, expected):
    assert resolve_policy(config) is expected


def test_budget_is_read_from_a_verl_style_config():
    from rlwire.grad_sync._policy import resolve_config

    cfg = resolve_config(_VerlStyleConfig(grad_sync_policy="auto", memory_budget_bytes=7))
    assert cfg == GradSyncConfig(policy="auto", memory_budget_bytes=7)
