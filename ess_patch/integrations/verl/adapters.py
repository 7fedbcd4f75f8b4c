"""verl: what both actor paths use to hook in: a bound argument (or a refusal naming the
releases), the optimizer attached for one update and released after it, the refusal of a
non-Megatron actor."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import FailClosedNotImplementedError
from ...guard import refuse
from ...patching import MissingTargetError
from ...state import disarm
from .shapes import SUPPORTED


def argument(call: Any, wrapped: Any, name: str) -> Any:
    """Argument ``name`` of a bound call, or a refusal naming the method and the releases."""
    if call is None or name not in call.arguments:
        raise MissingTargetError(
            f"ess-patch (verl): {getattr(wrapped, '__qualname__', wrapped)} takes no {name} "
            f"parameter. Supported: {SUPPORTED}"
        )
    return call.arguments[name]


def attach_optimizer(optimizer: Any) -> bool:
    """Make the actor's optimizer apply the armed scale even without ``install("megatron")``
    (with it, the nested wrappers still scale each update once). Returns whether we did."""
    from ...attach import attach
    from ...patching import is_ours

    if optimizer is None or is_ours(vars(optimizer).get("step")):
        return False
    attach(optimizer)
    return True


def release(optimizer: Any, attached: bool, enabled: bool) -> None:
    """After the actor's update: nothing stays armed (the critic, and anything after, is never
    scaled), and the optimizer is detached if we attached it."""
    if enabled:
        disarm()
    if attached:
        from ...attach import detach

        detach(optimizer)


def strategy_of(actor_config: Any) -> Any:
    if isinstance(actor_config, Mapping):
        return actor_config.get("strategy")
    return getattr(actor_config, "strategy", None)


def refuse_other_backends(strategy: Any) -> None:
    if strategy not in (None, "megatron"):
        refuse(
            "verl",
            f"strategy {strategy!r} is not supported and would never be scaled (ESS-LR (verl) "
            "supports the Megatron actor, actor_rollout_ref.actor.strategy=megatron)",
            "Use the Megatron actor, or turn ESS-LR off (ESS_LR_ENABLE, actor.ess_scaling.enable)",
            kind=FailClosedNotImplementedError,
        )
