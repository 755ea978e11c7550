"""``resolve_policy`` on verl's own ``FSDPEngineConfig`` gives the answer verl's FSDP engine
acts on (marked ``verl``: run by ``.ci/verl``; deselected by default)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlwire.grad_sync import GradSyncPolicy, resolve_policy

pytestmark = pytest.mark.verl


class _Module:
    """Records what verl's engine asks of an FSDP2 module."""

    def __init__(self) -> None:
        self.calls: list[bool] = []

    def set_requires_gradient_sync(self, value: bool) -> None:
        self.calls.append(value)


def _verl_defers(config) -> bool:
    """Whether verl's own ``FSDPEngine._gradient_sync_context`` skips the gradient sync of
    a micro-batch that is not the last (FSDP2 path)."""
    impl = pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")
    module = _Module()
    engine = SimpleNamespace(engine_config=config, module=module)
    original = impl.fsdp_version
    impl.fsdp_version = lambda _module: 2
    try:
        with impl.FSDPEngine._gradient_sync_context(engine, is_last_micro_batch=False):
            during = list(module.calls)  # the sync state while the micro-batch runs
    finally:
        impl.fsdp_version = original
    deferred = during == [False] and module.calls == [False, True]  # off, then back on
    assert deferred or module.calls == []  # else verl left the sync alone entirely
    return deferred


@pytest.mark.parametrize("flag", [None, True, False])
def test_resolve_policy_reads_verls_fsdp_engine_config_as_verl_does(flag):
    config_module = pytest.importorskip("verl.workers.config")
    settings = {} if flag is None else {"use_no_sync_for_gradient_accumulation": flag}
    config = config_module.FSDPEngineConfig(**settings)
    expected = GradSyncPolicy.DEFER if _verl_defers(config) else GradSyncPolicy.EVERY
    assert resolve_policy(config) is expected
    assert expected is (GradSyncPolicy.EVERY if flag is False else GradSyncPolicy.DEFER)
