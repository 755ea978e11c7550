"""The gradient-synchronisation policy, its config, and resolution from foreign configs."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["GradSyncConfig", "GradSyncPolicy", "resolve_policy"]

# Field names read by `resolve_policy`, in order of precedence.
_POLICY_KEYS = ("grad_sync_policy", "policy")
# verl's boolean: True defers the sync to the last micro-batch (`no_sync()`).
_LEGACY_KEY = "use_no_sync_for_gradient_accumulation"


class GradSyncPolicy(enum.StrEnum):
    """When data-parallel gradients are synchronised during micro-batch accumulation.

    With ``M`` micro-batches per optimizer step:

    - ``DEFER``: synchronise only on the final micro-batch. One reduction per
      step instead of ``M``, but every rank keeps an *unsharded* gradient of the
      whole model alive between micro-batches (for FSDP2 with an fp32
      ``reduce_dtype`` that is 4 bytes per parameter, whatever the world size).
    - ``EVERY``: synchronise on every micro-batch. ``M`` reductions per step;
      only the sharded gradient is retained between micro-batches.
    - ``AUTO``: ``DEFER`` when the predicted retained bytes fit the memory
      budget, else ``EVERY``; decided once per model and logged.
    """

    DEFER = "defer"
    EVERY = "every"
    AUTO = "auto"

    @classmethod
    def parse(cls, value: Any, *, field: str = "policy") -> GradSyncPolicy:
        """Return the policy named by ``value`` (a member or its string, any case).

        Raises:
            ValueError: ``value`` names no policy; the message names ``field``
                and the allowed values.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.strip().lower() in cls._value2member_map_:
            return cls(value.strip().lower())
        allowed = ", ".join(repr(p.value) for p in cls)
        raise ValueError(f"{field}: {value!r} is not a gradient-sync policy; allowed: {allowed}")


@dataclass(kw_only=True, slots=True, frozen=True)
class GradSyncConfig:
    """How gradients are synchronised across micro-batches of one optimizer step."""

    policy: GradSyncPolicy = GradSyncPolicy.DEFER
    """``defer`` (one reduction per step, unsharded gradients retained between
    micro-batches), ``every`` (a reduction per micro-batch, nothing extra
    retained) or ``auto`` (``defer`` if the retained bytes fit
    ``memory_budget_bytes``). Strings are accepted and converted."""

    memory_budget_bytes: int | None = None
    """Bytes the deferred gradients may occupy, used by ``auto`` only. ``None``
    derives a budget from free accelerator memory (see
    :func:`rlwire.grad_sync.decide_policy`); on a CPU-only model ``auto`` with no
    budget resolves to ``defer``, since host memory is not the scarce resource."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "policy", GradSyncPolicy.parse(self.policy, field="GradSyncConfig.policy")
        )
        budget = self.memory_budget_bytes
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget < 0
        ):
            raise ValueError(
                f"GradSyncConfig.memory_budget_bytes: {budget!r} is not allowed; "
                "use a non-negative int (bytes) or None (derive from free device memory)"
            )


def _field(config: Any, name: str) -> Any:
    """``config[name]`` or ``config.name``; ``None`` when it has neither.

    A missing key may raise ``KeyError`` or ``AttributeError``: verl's engine configs
    are dataclasses that are also ``Mapping``s whose item lookup (and so ``in``)
    raises ``AttributeError``.
    """
    if isinstance(config, Mapping):
        with contextlib.suppress(KeyError, AttributeError):
            return config[name]
    try:
        return getattr(config, name)
    except (AttributeError, KeyError):  # attribute-style mappings raise KeyError
        return None


def _fields(config: Any) -> dict[str, Any]:
    """The subset of ``config``'s fields that `resolve_policy` reads, as a dict."""
    names = (*_POLICY_KEYS, _LEGACY_KEY, "memory_budget_bytes")
    values = {name: _field(config, name) for name in names}
    return {name: value for name, value in values.items() if value is not None}


def resolve_policy(config: Any) -> GradSyncPolicy:
    """Read the gradient-sync policy from any kind of config.

    Args:
        config: a :class:`GradSyncConfig`, a :class:`GradSyncPolicy` or its
            string, a mapping, any object with attributes, or ``None``.

    Returns:
        ``grad_sync_policy`` or ``policy`` if present; otherwise the legacy
        boolean ``use_no_sync_for_gradient_accumulation`` (``True`` → ``DEFER``,
        ``False`` → ``EVERY``); otherwise ``DEFER``, so configs written before
        the policy existed keep their deferred behaviour. ``AUTO`` is returned
        as is: it is decided per model by :func:`decide_policy`.

    Raises:
        ValueError: the policy string is unknown, or the legacy field is not a bool.
    """
    if config is None:
        return GradSyncPolicy.DEFER
    if isinstance(config, GradSyncConfig):
        return config.policy
    if isinstance(config, (GradSyncPolicy, str)):
        return GradSyncPolicy.parse(config)
    fields = _fields(config)
    for key in _POLICY_KEYS:
        if key in fields:
            return GradSyncPolicy.parse(fields[key], field=key)
    if _LEGACY_KEY in fields:
        legacy = fields[_LEGACY_KEY]
        if not isinstance(legacy, bool):
            raise ValueError(
                f"{_LEGACY_KEY}: {legacy!r} is not allowed; use True (defer) or False (every)"
            )
        return GradSyncPolicy.DEFER if legacy else GradSyncPolicy.EVERY
    return GradSyncPolicy.DEFER


def resolve_config(config: Any) -> GradSyncConfig:
    """Like :func:`resolve_policy`, but keeps ``memory_budget_bytes`` too."""
    if isinstance(config, GradSyncConfig):
        return config
    budget = None
    if config is not None and not isinstance(config, (GradSyncPolicy, str)):
        budget = _fields(config).get("memory_budget_bytes")
    return GradSyncConfig(policy=resolve_policy(config), memory_budget_bytes=budget)
