"""Call sites for source trees patched with the diffs in ``patches/`` (no monkeypatching).

The diffs only add an import and a decorator; the behaviour lives here, shared with the
wrapt wrappers that ``install()`` applies. Functions decorated here carry a mark, so that
``install()`` sees a vendored tree and does not wrap it a second time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from .integrations.optimizer_step import step_wrapper

__all__ = ["VENDORED_MARK", "is_vendored", "optimizer_step"]

VENDORED_MARK = "__ess_patch_vendored__"

F = TypeVar("F", bound=Callable[..., Any])


def optimizer_step(method: F) -> F:
    """Decorate an optimizer's ``step`` / ``step_with_ready_grads`` (the megatron-core diff)."""

    @functools.wraps(method)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        return step_wrapper(functools.partial(method, self), self, args, kwargs)

    setattr(step, VENDORED_MARK, True)
    return step  # type: ignore[return-value]


def is_vendored(obj: Any) -> bool:
    """Whether ``obj`` already carries an ess-patch call site from a vendored diff."""
    return bool(getattr(obj, VENDORED_MARK, False))
