"""Call sites for source trees patched with the diffs in ``patches/`` (no monkeypatching).

The diffs only add an import and a decorator; the behaviour lives here, shared with the
wrapt wrappers that ``install()`` applies. Functions decorated here carry a mark, so that
``install()`` sees a vendored tree and does not wrap it a second time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from .integrations import miles as _miles
from .integrations import slime as _slime
from .integrations.miles import MILES_FRAMEWORK
from .integrations.optimizer_step import step_wrapper
from .integrations.rl_hooks import advantage_wrapper, parse_args_wrapper
from .integrations.slime import SLIME_FRAMEWORK

__all__ = [
    "VENDORED_MARK",
    "is_vendored",
    "miles_advantages",
    "miles_fsdp_train_core",
    "miles_log_train_step",
    "miles_parse_args",
    "optimizer_step",
    "slime_advantages",
    "slime_log",
    "slime_parse_args",
]

VENDORED_MARK = "__ess_patch_vendored__"

F = TypeVar("F", bound=Callable[..., Any])


def optimizer_step(method: F) -> F:
    """Decorate an optimizer's ``step`` / ``step_with_ready_grads`` (the megatron-core diff)."""

    @functools.wraps(method)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        return step_wrapper(functools.partial(method, self), self, args, kwargs)

    setattr(step, VENDORED_MARK, True)
    return step  # type: ignore[return-value]


def _function_hook(wrapper: Callable[..., Any]) -> Callable[[F], F]:
    """A decorator running a module-level function through one of install()'s wrappers."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            return wrapper(function, None, args, kwargs)

        setattr(call, VENDORED_MARK, True)
        return call  # type: ignore[return-value]

    return decorate


def _method_hook(wrapper: Callable[..., Any]) -> Callable[[F], F]:
    """The same for a method: the wrapper gets the instance, as wrapt gives it."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return wrapper(functools.partial(method, self), self, args, kwargs)

        setattr(call, VENDORED_MARK, True)
        return call  # type: ignore[return-value]

    return decorate


#: miles ``utils/arguments.py``: ``@miles_parse_args`` on ``parse_args``.
miles_parse_args = _function_hook(parse_args_wrapper(MILES_FRAMEWORK))
#: miles ``training_utils/loss.py``: on ``compute_advantages_and_returns``.
miles_advantages = _function_hook(advantage_wrapper(MILES_FRAMEWORK))
#: miles ``training_utils/log_utils.py``: on ``log_train_step``.
miles_log_train_step = _function_hook(_miles.log_train_step_wrapper)
#: miles ``fsdp_utils/actor.py``: on ``FSDPTrainRayActor._train_core``.
miles_fsdp_train_core = _method_hook(_miles.fsdp_train_core_wrapper)
#: slime ``utils/arguments.py``: on ``parse_args``.
slime_parse_args = _function_hook(parse_args_wrapper(SLIME_FRAMEWORK))
#: slime ``backends/megatron_utils/loss.py``: on ``compute_advantages_and_returns``.
slime_advantages = _function_hook(advantage_wrapper(SLIME_FRAMEWORK))
#: slime ``observability/logging_utils.py``: on ``log``.
slime_log = _function_hook(_slime.log_wrapper)


def is_vendored(obj: Any) -> bool:
    """Whether ``obj`` already carries an ess-patch call site from a vendored diff."""
    return bool(getattr(obj, VENDORED_MARK, False))
