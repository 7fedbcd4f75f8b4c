"""Call sites for source trees patched with the diffs in ``patches/`` (no monkeypatching).

The diffs only add an import and a decorator; the behaviour lives here, shared with the
wrapt wrappers that ``install()`` applies. Functions decorated here carry a mark, so that
``install()`` sees a vendored tree and does not wrap it a second time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .integrations import miles as _miles
from .integrations import slime as _slime
from .integrations.miles import MILES_FRAMEWORK
from .integrations.optimizer_step import step_wrapper
from .integrations.rl_hooks import advantage_wrapper, parse_args_wrapper
from .integrations.slime import SLIME_FRAMEWORK
from .state import STATE

__all__ = [
    "CALL_SITES",
    "VENDORED_MARK",
    "CallSite",
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
    STATE.vendored_steps = True  # arm() then has an effect without install()

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


@dataclass(frozen=True)
class CallSite:
    """Where a framework's diff (``patches/<component>/``) puts one of the decorators above.

    ``path``: the file, relative to the tree root; ``owner``: the class ("" for a module-level
    function); ``function``: what is decorated; ``decorator``: the name in this module. The
    diff imports it as ``_ess_<decorator>`` (guarded: the identity without ess_patch).
    """

    path: str
    owner: str
    function: str
    decorator: str

    @property
    def alias(self) -> str:
        return f"_ess_{self.decorator}"

    @property
    def label(self) -> str:
        return ".".join(p for p in (self.owner, self.function) if p)


#: Per framework, every definition that ``install()`` wraps: the diffs decorate exactly these
#: (re-imports by name elsewhere, e.g. ``from ...loss import compute_advantages_and_returns``
#: in ``megatron_utils/actor.py``, get the decorated function). tools/framework_series.py
#: writes the diffs from this table; ``ess_patch.patchset`` checks them against install().
CALL_SITES: dict[str, tuple[CallSite, ...]] = {
    "miles": (
        CallSite("miles/utils/arguments.py", "", "parse_args", "miles_parse_args"),
        CallSite(
            "miles/backends/training_utils/loss.py",
            "",
            "compute_advantages_and_returns",
            "miles_advantages",
        ),
        CallSite(
            "miles/backends/training_utils/log_utils.py",
            "",
            "log_train_step",
            "miles_log_train_step",
        ),
        CallSite(
            "miles/backends/fsdp_utils/actor.py",
            "FSDPTrainRayActor",
            "_train_core",
            "miles_fsdp_train_core",
        ),
    ),
    "slime": (
        CallSite("slime/utils/arguments.py", "", "parse_args", "slime_parse_args"),
        CallSite(
            "slime/backends/megatron_utils/loss.py",
            "",
            "compute_advantages_and_returns",
            "slime_advantages",
        ),
        CallSite("slime/observability/logging_utils.py", "", "log", "slime_log"),
    ),
}
