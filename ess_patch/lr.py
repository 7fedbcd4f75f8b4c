"""Scale every param group's LR for the duration of one block, and always restore it; the
optimizer-step wrapper that applies the armed scale that way, exactly once per update."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .errors import EssPatchKeyError
from .guard import note_applied
from .ledger import begin_step
from .result import check_scale
from .state import STATE

__all__ = ["applied_step", "scaled_lr", "step_wrapper"]


@contextmanager
def scaled_lr(optimizer: Any, scale: float) -> Iterator[None]:
    """Multiply every param group's ``lr`` by ``scale`` inside the block.

    Works for anything with ``param_groups`` (torch optimizers, Megatron optimizers
    including ``ChainedOptimizer``, whose property builds a new list of the shared dicts
    on each access). Each group's original ``lr`` object is put back on exit, also when
    the block raises, so the scheduler and checkpoints never see a scaled LR. A group
    reached twice is scaled once. ``scale == 1`` writes nothing.

    Raises:
        ValueError: ``scale`` is outside (0, 1].
        KeyError: a param group has no ``lr`` (nothing is changed).
    """
    value = check_scale(scale)
    if value == 1.0:
        yield
        return
    saved: list[tuple[dict, Any]] = []
    seen: set[int] = set()
    for index, group in enumerate(optimizer.param_groups):
        if id(group) in seen:
            continue
        seen.add(id(group))
        if "lr" not in group:
            raise EssPatchKeyError(
                f"param_groups[{index}] of {type(optimizer).__name__} has no 'lr'"
            )
        saved.append((group, group["lr"]))
    try:
        for group, lr in saved:
            group["lr"] = lr * value
        yield
    finally:
        for group, lr in saved:
            group["lr"] = lr


@contextmanager
def applied_step(optimizer: Any, scale: float) -> Iterator[None]:
    """:func:`scaled_lr` for one optimizer step that also records what the step applied: each
    group's LR read before the block and inside it (``guard.note_applied``), kept once the
    step returned. The metrics report that, never the armed result."""
    groups = list(optimizer.param_groups)
    scheduled = [group.get("lr", 0.0) for group in groups]
    with scaled_lr(optimizer, scale):
        applied = [group.get("lr", 0.0) for group in groups]
        yield
    note_applied(scheduled, applied, scale)


def step_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper: run one optimizer step with the armed LR scale, LRs always restored.

    Shared by every optimizer integration (Megatron, ``attach``, the vendored diffs).
    Whichever wrapped entry point runs first (``ChainedOptimizer.step``, a child's
    ``step_with_ready_grads``, ``DistributedOptimizer.step_with_ready_grads`` calling its
    parent's...) scales that optimizer's param groups once; nested wrapped calls on the same
    thread pass through, so each real update is scaled exactly once whatever the nesting.
    """
    if STATE.armed is None and STATE.ledger_run is None:  # default: nothing armed or measured
        return wrapped(*args, **kwargs)
    local = STATE.local
    if getattr(local, "in_step", False):
        return wrapped(*args, **kwargs)
    # The outermost wrapped call decides for the whole step, also when it decides "no":
    # an excluded ChainedOptimizer's children must not scale themselves either.
    local.in_step = True
    try:
        # once per real step (a rollout measured inside the loss: reduces the step's ledger)
        scale = begin_step(instance)
        if scale is None:  # not the policy's optimizer (a critic, excluded)
            return wrapped(*args, **kwargs)
        with applied_step(instance, scale):
            return wrapped(*args, **kwargs)
    finally:
        local.in_step = False
