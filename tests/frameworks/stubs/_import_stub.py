"""Helpers for the import-time stubs in this folder (see README.md).

Every stub name exists only so that an upstream ``import`` succeeds on a CPU machine without
sglang / mooncake. Using it (calling, instantiating, reading an attribute) raises
:class:`StubUsedError`, so a test can never silently run stub code in place of the real thing.
"""

from __future__ import annotations

import types
from typing import Any, NoReturn

__all__ = ["StubUsedError", "stub_class", "stub_function", "stub_module", "stub_object"]


class StubUsedError(RuntimeError):
    """An import-time stub of a GPU-only dependency was used at run time."""


def _fail(what: str) -> NoReturn:
    raise StubUsedError(
        f"{what} is an import-time stub (tests/frameworks/stubs): the real package is not "
        "installed on this machine, and this code path needs it"
    )


class _StubMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        _fail(f"{cls.__module__}.{cls.__qualname__}.{name}")


def stub_class(module: str, name: str, **allowed: Any) -> type:
    """A class that raises when instantiated or when any attribute not in ``allowed`` is read."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _fail(f"{module}.{name}()")

    return _StubMeta(name, (), {"__module__": module, "__init__": __init__, **allowed})


def stub_function(module: str, name: str) -> Any:
    def stub(*args: Any, **kwargs: Any) -> NoReturn:
        _fail(f"{module}.{name}()")

    stub.__module__, stub.__name__, stub.__qualname__ = module, name, name
    return stub


class _StubObject:
    def __init__(self, qualname: str) -> None:
        object.__setattr__(self, "_qualname", qualname)

    def __getattr__(self, name: str) -> NoReturn:
        _fail(f"{object.__getattribute__(self, '_qualname')}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        _fail(f"{object.__getattribute__(self, '_qualname')}()")

    def __repr__(self) -> str:
        return f"<import-time stub {object.__getattribute__(self, '_qualname')}>"


def stub_object(module: str, name: str) -> Any:
    """An instance (e.g. a module-level singleton) whose every attribute raises."""
    return _StubObject(f"{module}.{name}")


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):
            raise AttributeError(name)
        _fail(f"{self.__name__}.{name}")


def stub_module(name: str) -> types.ModuleType:
    """A module object (for ``from pkg import submodule``) whose every attribute raises."""
    return _StubModule(name)
