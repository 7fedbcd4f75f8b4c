"""Instance-level variant: scale one optimizer object, whatever its class.

For optimizers built before ``install()``, classes outside the patched ones, and plain
``torch.optim.Optimizer`` objects (e.g. miles' FSDP backend).
"""

from __future__ import annotations

import logging
from typing import Any

import wrapt

from .lr import scaled_lr, step_wrapper
from .patching import is_ours
from .state import STATE, begin_step, note_applier

__all__ = ["attach", "detach"]

logger = logging.getLogger(__name__)


def attach(optimizer: Any) -> Any:
    """Make ``optimizer.step()`` use the armed scale (LRs restored after each step).

    Idempotent; returns the optimizer. Works with anything that has ``step`` and
    ``param_groups``. A ``torch.optim.Optimizer`` gets torch's own step pre/post hooks, so
    LR schedulers that re-wrap ``step`` (created before or after) keep working and
    :func:`detach` removes only ours; other objects (Megatron's optimizers) get ``step``
    wrapped on the instance.

    Raises:
        TypeError: the object has no callable ``step`` or no ``param_groups``.
    """
    if not callable(getattr(optimizer, "step", None)) or not hasattr(optimizer, "param_groups"):
        raise TypeError(
            f"ess_patch.attach needs an optimizer with step() and param_groups; got "
            f"{type(optimizer).__name__}"
        )
    if _HOOKS in vars(optimizer) or is_ours(vars(optimizer).get("step")):
        return optimizer
    if _is_torch_optimizer(optimizer):
        handles = (
            optimizer.register_step_pre_hook(_pre_step),
            optimizer.register_step_post_hook(_post_step),
        )
        setattr(optimizer, _HOOKS, handles)
        note_applier()
        return optimizer

    def bound_wrapper(wrapped: Any, _instance: Any, args: tuple, kwargs: dict) -> Any:
        return step_wrapper(wrapped, optimizer, args, kwargs)

    wrapper = wrapt.FunctionWrapper(optimizer.step, bound_wrapper)
    wrapper._self_ess_patch_target = f"{type(optimizer).__name__} instance"
    optimizer.step = wrapper
    note_applier()
    return optimizer


def detach(optimizer: Any) -> None:
    """Undo :func:`attach` (a no-op if it was not attached)."""
    handles = vars(optimizer).pop(_HOOKS, None)
    if handles is not None:
        _restore_pending(optimizer)
        for handle in handles:
            handle.remove()
        return
    current = vars(optimizer).get("step")
    if is_ours(current):
        del optimizer.step
    elif current is not None:
        logger.warning(
            "ess_patch.detach: %s.step was re-wrapped by someone else after attach; leaving it",
            type(optimizer).__name__,
        )


# Instance attributes (not module state): the hook handles, and the scaled-LR block a step
# is inside of between its pre- and post-hook.
_HOOKS = "_ess_patch_step_hooks"
_PENDING = "_ess_patch_scaled_lr"


def _is_torch_optimizer(optimizer: Any) -> bool:
    try:
        import torch.optim
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(optimizer, torch.optim.Optimizer)


def _restore_pending(optimizer: Any) -> None:
    pending = vars(optimizer).pop(_PENDING, None)
    if pending is not None:
        pending.__exit__(None, None, None)


def _pre_step(optimizer: Any, _args: tuple, _kwargs: dict) -> None:
    # A step that raised skipped its post-hook: put its LRs back before anything else.
    _restore_pending(optimizer)
    if STATE.armed is None:
        return
    scale = begin_step(optimizer)
    if scale is None or scale == 1.0:
        return
    block = scaled_lr(optimizer, scale)
    block.__enter__()
    setattr(optimizer, _PENDING, block)


def _post_step(optimizer: Any, _args: tuple, _kwargs: dict) -> None:
    _restore_pending(optimizer)
