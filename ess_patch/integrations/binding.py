"""Bind a wrapped host function's arguments by parameter NAME, never by position.

The frameworks reorder and insert parameters across their history (miles'
``compute_advantages_and_returns(args, parallel_state, rollout_data)`` became
``(args, rollout_data)``), so every wrapper reads and rewrites arguments through
:func:`bind`, from the wrapped function's own ``inspect.signature`` (cached per function).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

from ..state import register_cache

__all__ = ["bind", "bind_method", "call_method", "call_with", "parameters", "undecorated"]


class _Signatures:
    """``inspect.Signature`` per wrapped host function, held weakly (cleared by reset())."""

    def __init__(self) -> None:
        self._by_function: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, function: Any) -> inspect.Signature | None:
        return self._by_function.get(function)

    def __setitem__(self, function: Any, signature: inspect.Signature) -> None:
        self._by_function[function] = signature

    def clear(self) -> None:
        self._by_function.clear()


_SIGNATURES = register_cache(_Signatures())


def _signature(function: Callable[..., Any]) -> inspect.Signature | None:
    key = getattr(function, "__func__", function)
    try:
        cached = _SIGNATURES.get(key)
    except TypeError:  # not weak-referenceable (a functools.partial of a method...)
        cached, key = None, None
    if cached is not None:
        return cached
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    if key is not None:
        _SIGNATURES[key] = signature
    return signature


def parameters(function: Callable[..., Any]) -> tuple[str, ...]:
    """The parameter names of ``function`` (empty when it has no inspectable signature)."""
    signature = _signature(function)
    return () if signature is None else tuple(signature.parameters)


def bind(function: Callable[..., Any], args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    """``args``/``kwargs`` bound to ``function``'s parameters, defaults applied.

    None when the signature cannot be read or the call does not fit it: the caller then
    calls through unchanged and the host raises its own ``TypeError``.
    """
    signature = _signature(function)
    if signature is None:
        return None
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound


def call_with(function: Callable[..., Any], bound: inspect.BoundArguments, **changes: Any) -> Any:
    """Call ``function`` with ``bound``'s arguments, ``changes`` replacing some by name
    (extra ``**kwargs`` the caller passed are kept)."""
    bound.arguments.update(changes)
    return function(*bound.args, **bound.kwargs)


def undecorated(function: Any) -> Any:
    """The function under a host's decorators: ``__wrapped__`` where set, and a closure over
    ``decorated_function`` (verl's ``GPUMemoryLogger`` wraps its function in
    ``f(*args, **kwargs)`` without ``functools.wraps``)."""
    for _ in range(8):  # a few layers at most; never loop on a self-referencing wrapper
        inner = getattr(function, "__wrapped__", None)
        code = getattr(function, "__code__", None)
        cells = getattr(function, "__closure__", None)
        if (
            inner is None
            and code is not None
            and cells
            and "decorated_function" in code.co_freevars
        ):
            inner = cells[code.co_freevars.index("decorated_function")].cell_contents
        if inner is None:
            return function
        function = inner
    return function


def bind_method(
    wrapped: Any, instance: Any, args: tuple, kwargs: dict
) -> inspect.BoundArguments | None:
    """A wrapped method call's arguments by name (``self`` included), read from the
    undecorated function: wrapt hands over the bound method, a vendored tree's decorator a
    ``functools.partial(method, self)``. Call it back with ``call_with(wrapped, bound)``
    minus ``self``: see :func:`call_method`."""
    import functools

    function = wrapped.func if isinstance(wrapped, functools.partial) else wrapped
    return bind(undecorated(getattr(function, "__func__", function)), (instance, *args), kwargs)


def call_method(wrapped: Any, bound: inspect.BoundArguments, **changes: Any) -> Any:
    """Call a bound ``wrapped`` method with :func:`bind_method`'s arguments, ``changes``
    replacing some by name."""
    bound.arguments.update(changes)
    return wrapped(*bound.args[1:], **bound.kwargs)
