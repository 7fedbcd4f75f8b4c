"""Scale every param group's LR for the duration of one block, and always restore it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .result import check_scale

__all__ = ["check_scale", "scaled_lr"]


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
            raise KeyError(f"param_groups[{index}] of {type(optimizer).__name__} has no 'lr'")
        saved.append((group, group["lr"]))
    try:
        for group, lr in saved:
            group["lr"] = lr * value
        yield
    finally:
        for group, lr in saved:
            group["lr"] = lr
