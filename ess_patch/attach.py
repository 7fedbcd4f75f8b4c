"""Instance-level variant: scale one optimizer object, whatever its class.

For optimizers built before ``install()``, classes outside the patched ones, and plain
``torch.optim.Optimizer`` objects (e.g. miles' FSDP backend).
"""

from __future__ import annotations

import logging
from typing import Any

import wrapt

from .errors import EssPatchTypeError
from .guard import ATTACHED, note_applied
from .ledger import begin_step
from .lr import scaled_lr, step_wrapper
from .patching import is_ours
from .state import STATE, note_applier

__all__ = ["attach", "detach"]

logger = logging.getLogger(__name__)


def attach(optimizer: Any) -> Any:
    """Make ``optimizer.step()`` use the armed scale (LRs restored after each step).

    Idempotent; returns the optimizer. Works with anything that has ``step`` and
    ``param_groups``. A ``torch.optim.Optimizer`` gets torch's own step pre/post hooks, so
    LR schedulers that re-wrap ``step`` (created before or after) keep working and
    :func:`detach` removes only ours; other objects (Megatron's optimizers) get ``step``
    wrapped on the instance. When ``step(closure)`` raises in the closure, the LRs are back
    before the error leaves ``step`` (torch runs no post-step hook then); a raise elsewhere
    in a torch optimizer's step is undone by the next ``step()`` or ``state_dict()``.

    Raises:
        TypeError: the object has no callable ``step`` or no ``param_groups``.
    """
    if not callable(getattr(optimizer, "step", None)) or not hasattr(optimizer, "param_groups"):
        raise EssPatchTypeError(
            f"ess_patch.attach needs an optimizer with step() and param_groups; got "
            f"{type(optimizer).__name__}"
        )
    if _HOOKS in vars(optimizer) or is_ours(vars(optimizer).get("step")):
        return optimizer
    if _is_torch_optimizer(optimizer):
        handles = (
            optimizer.register_step_pre_hook(_pre_step),
            optimizer.register_step_post_hook(_post_step),
            # a step that raised outside its closure skipped the post-hook: a checkpoint
            # taken before the next step must not save the scaled LR
            optimizer.register_state_dict_pre_hook(_restore_pending),
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
_HOOKS = ATTACHED  # the step guard (guard.py) lets an attached optimizer's step through
_PENDING = "_ess_patch_scaled_lr"


def _is_torch_optimizer(optimizer: Any) -> bool:
    try:
        import torch.optim
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(optimizer, torch.optim.Optimizer)


def _restore_pending(optimizer: Any) -> tuple | None:
    """Put the LRs of a step in flight back; returns its ``(scheduled, applied, scale)``."""
    pending = vars(optimizer).pop(_PENDING, None)
    if pending is None:
        return None
    block, *record = pending
    block.__exit__(None, None, None)
    return tuple(record)


def _pre_step(optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    # A step that raised skipped its post-hook: put its LRs back before anything else.
    _restore_pending(optimizer)
    if STATE.armed is None and STATE.ledger_run is None:
        return None
    scale = begin_step(optimizer)
    if scale is None:
        return None
    scheduled = [group.get("lr", 0.0) for group in optimizer.param_groups]
    block = scaled_lr(optimizer, scale)
    block.__enter__()
    applied = [group.get("lr", 0.0) for group in optimizer.param_groups]
    setattr(optimizer, _PENDING, (block, scheduled, applied, scale))
    return _guard_closure(optimizer, args, kwargs)


def _guard_closure(optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The step's arguments with its closure (if any) wrapped so that a raise in it restores
    the LRs at once: torch skips the post-step hooks when ``step`` raises, and a scheduler,
    ``state_dict()`` or checkpoint taken then would keep the scaled LR for good.

    ``args`` starts with the optimizer itself (torch's hook wrapper passes it so).
    """
    if "closure" in kwargs and callable(kwargs["closure"]):
        return args, {**kwargs, "closure": _guarded(optimizer, kwargs["closure"])}
    if len(args) > 1 and callable(args[1]):
        return (args[0], _guarded(optimizer, args[1]), *args[2:]), kwargs
    return None


def _guarded(optimizer: Any, closure: Any) -> Any:
    def closure_restoring_lr_on_error(*a: Any, **k: Any) -> Any:
        try:
            return closure(*a, **k)
        except BaseException:
            _restore_pending(optimizer)
            raise

    return closure_restoring_lr_on_error


def _post_step(optimizer: Any, _args: tuple, _kwargs: dict) -> None:
    record = _restore_pending(optimizer)
    if record is not None:  # the step returned: what it applied is what the metrics report
        note_applied(*record)
