"""The step wrapper shared by every optimizer integration (Megatron, plain torch).

Whichever wrapped entry point runs first (``ChainedOptimizer.step``, a child's
``step_with_ready_grads``, ``DistributedOptimizer.step_with_ready_grads`` calling its
parent's...) scales that optimizer's param groups once; nested wrapped calls on the same
thread pass through, so each real update is scaled exactly once whatever the nesting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..lr import scaled_lr
from ..state import STATE, begin_step

__all__ = ["step_wrapper"]


def step_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper: run one optimizer step with the armed LR scale, LRs always restored."""
    if STATE.armed is None:  # the default: nothing armed, nothing touched
        return wrapped(*args, **kwargs)
    local = STATE.local
    if getattr(local, "in_step", False):
        return wrapped(*args, **kwargs)
    # The outermost wrapped call decides for the whole step, also when it decides "no":
    # an excluded ChainedOptimizer's children must not scale themselves either.
    local.in_step = True
    try:
        scale = begin_step(instance)  # once per real step (moves per-step results on)
        if scale is None or scale == 1.0:
            return wrapped(*args, **kwargs)
        with scaled_lr(instance, scale):
            return wrapped(*args, **kwargs)
    finally:
        local.in_step = False
