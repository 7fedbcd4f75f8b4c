"""Instance-level variant: scale one optimizer object, whatever its class.

For optimizers built before ``install()``, classes outside the patched ones, and plain
``torch.optim.Optimizer`` objects (e.g. miles' FSDP backend).
"""

from __future__ import annotations

import logging
from typing import Any

import wrapt

from .integrations.optimizer_step import step_wrapper
from .patching import is_ours

__all__ = ["attach", "detach"]

logger = logging.getLogger(__name__)


def attach(optimizer: Any) -> Any:
    """Make ``optimizer.step()`` use the armed scale (LRs restored after each step).

    Idempotent; returns the optimizer. Works with anything that has ``step`` and
    ``param_groups``.

    Raises:
        TypeError: the object has no callable ``step`` or no ``param_groups``.
    """
    if not callable(getattr(optimizer, "step", None)) or not hasattr(optimizer, "param_groups"):
        raise TypeError(
            f"ess_patch.attach needs an optimizer with step() and param_groups; got "
            f"{type(optimizer).__name__}"
        )
    if is_ours(vars(optimizer).get("step")):
        return optimizer

    def bound_wrapper(wrapped: Any, _instance: Any, args: tuple, kwargs: dict) -> Any:
        return step_wrapper(wrapped, optimizer, args, kwargs)

    wrapper = wrapt.FunctionWrapper(optimizer.step, bound_wrapper)
    wrapper._self_ess_patch_target = f"{type(optimizer).__name__} instance"
    optimizer.step = wrapper
    return optimizer


def detach(optimizer: Any) -> None:
    """Undo :func:`attach` (a no-op if it was not attached)."""
    current = vars(optimizer).get("step")
    if is_ours(current):
        del optimizer.step
    elif current is not None:
        logger.warning(
            "ess_patch.detach: %s.step was re-wrapped by someone else after attach; leaving it",
            type(optimizer).__name__,
        )
