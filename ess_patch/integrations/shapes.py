"""A host framework's known shapes across its history, and the one this process runs.

miles and slime move things between commits: where the process groups live, the advantage
hook's parameters, which module holds the train-step log. A framework lists, per
:class:`Aspect`, the :class:`Shape` s it has had (newest first), each with the
:class:`Feature` s (module, symbol, parameter names) that identify it; the probes beside it
are :class:`ModuleFound` (found without importing it), :class:`ModuleGone` (a module removed)
and :class:`MethodTakes` (parameters read through the host's decorators). The first shape whose
features are all present is chosen -- by feature, never by commit id -- when a module that
needs the answer is imported (``Aspect.when``), or when ``--use-ess-lr`` is parsed, and is
recorded on the :class:`History` (forgotten by ``uninstall()`` and ``state.reset()``) for
``ess-patch doctor`` and ``install.installed_shapes()``.
No shape fits: :class:`~ess_patch.patching.MissingTargetError` naming the framework, what is
missing and the supported range.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.machinery import PathFinder
from importlib.util import find_spec
from typing import Any

from ..errors import EssPatchKeyError
from ..patching import MissingTargetError
from ..state import register_cache
from .binding import undecorated

__all__ = [
    "Aspect",
    "Feature",
    "History",
    "MethodTakes",
    "ModuleFound",
    "ModuleGone",
    "Shape",
    "module_exists",
]

_ABSENT = object()


def _member(holder: Any, name: str) -> Any:
    """``holder.name``; a dataclass field without a default is not a class attribute, so it
    counts as present through ``__dataclass_fields__`` (returned as the class itself)."""
    value = getattr(holder, name, _ABSENT)
    if (
        value is _ABSENT
        and isinstance(holder, type)
        and name in getattr(holder, "__dataclass_fields__", {})
    ):
        return holder
    return value


@dataclass(frozen=True)
class Feature:
    """``module.symbol`` exists (and, as a function, takes ``parameters`` by these names)."""

    module: str
    symbol: str
    parameters: tuple[str, ...] = ()

    def __str__(self) -> str:
        text = f"{self.module}.{self.symbol}"
        return f"{text}({', '.join(self.parameters)})" if self.parameters else text

    def missing(self) -> str | None:
        """None when present, else what is missing, for an error message.

        Imports ``module``; a module that does not exist is a missing feature, an import
        failing inside an existing module is the host's own error and propagates.
        """
        try:
            holder: Any = importlib.import_module(self.module)
        except ModuleNotFoundError as exc:
            if exc.name and (self.module + ".").startswith(exc.name + "."):
                return f"module {self.module} does not exist"
            raise
        for part in self.symbol.split("."):
            holder = _member(holder, part)
            if holder is _ABSENT:
                return f"{self.module}.{self.symbol} does not exist"
        if self.parameters:
            try:
                names = inspect.signature(holder).parameters
            except (TypeError, ValueError):
                return f"{self.module}.{self.symbol} has no readable signature"
            return self.lacking(names)
        return None

    def lacking(self, names: Any) -> str | None:
        """None when every one of ``parameters`` is in ``names``, else what is missing."""
        lacking = [p for p in self.parameters if p not in names]
        if lacking:
            return f"{self.module}.{self.symbol} has no parameter {', '.join(lacking)}"
        return None


def module_exists(name: str) -> bool:
    """Whether module ``name`` exists, found without importing it or any package above it.

    ``importlib.util.find_spec("a.b.c")`` imports ``a.b``, and a package's ``__init__`` may
    import the very module whose import asked (verl v0.7.x: ``core_algos`` imports
    ``verl.workers.config``, whose hook checks ``verl.workers.actor.megatron_actor``, whose
    package imports ``dp_actor``, which imports ``core_algos``: a circular import). So each
    level is looked up in the search path of the one above (``sys.modules`` where imported).
    """
    parts = name.split(".")
    locations: list[str] | None = None
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        module = sys.modules.get(prefix)
        if module is not None:
            locations = getattr(module, "__path__", None)
        else:
            try:
                spec = (
                    find_spec(prefix)  # a top-level name: imports nothing
                    if depth == 1
                    else PathFinder.find_spec(prefix, list(locations or ()))
                )
            except (ImportError, ValueError):
                return False
            if spec is None:
                return False
            locations = spec.submodule_search_locations
        if depth < len(parts) and locations is None:  # a module, not a package
            return False
    return True


@dataclass(frozen=True)
class ModuleFound(Feature):
    """A module that exists, found without importing it (``find_spec``): a check must not
    pull a heavy module into every process that imports its parent (verl's engine path
    imports datasets, ray... and is checked when ``verl.workers`` is imported)."""

    symbol: str = ""

    def missing(self) -> str | None:
        return None if module_exists(self.module) else f"module {self.module} does not exist"

    def __str__(self) -> str:
        return self.module


class MethodTakes(Feature):
    """A method that takes ``parameters`` by name once the host's decorators are looked
    through (``binding.undecorated``: verl's ``GPUMemoryLogger`` on ``update_policy`` has no
    ``functools.wraps``)."""

    def missing(self) -> str | None:
        gone = ModuleFound(self.module).missing()
        if gone is not None:
            return gone
        holder: Any = importlib.import_module(self.module)
        for part in self.symbol.split("."):
            holder = getattr(holder, part, None)
            if holder is None:
                return f"{self.module}.{self.symbol} does not exist"
        return self.lacking(inspect.signature(undecorated(holder)).parameters)


@dataclass(frozen=True)
class ModuleGone(ModuleFound):
    """A module that does NOT exist (verl's legacy actor, removed in v0.8.0)."""

    def missing(self) -> str | None:
        return None if super().missing() is not None else f"module {self.module} exists"


@dataclass(frozen=True)
class Shape:
    """One answer to an aspect, valid over a span of the framework's history."""

    label: str  # what doctor shows, e.g. "get_parallel_state().intra_dp"
    span: str  # e.g. "2026-04-03 to 2026-07-09"
    requires: tuple[Feature, ...] = ()
    #: what the integration does in this shape (e.g. builds the Groups); compared by label
    adapter: Callable[..., Any] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Aspect:
    """One question with alternative answers over time ("groups", "hook", "metrics")."""

    name: str
    shapes: tuple[Shape, ...]
    #: modules whose import decides this aspect (they need the answer, or must not run
    #: silently without it, like the module that logs the train step)
    when: tuple[str, ...] = ()
    #: how doctor phrases the choice: "{label}" filled in
    phrase: str = "{label}"


@dataclass(frozen=True, eq=False)  # compared by identity: each one registers its choices
class History:
    """The shapes one framework has had; picks and records the one this process runs."""

    framework: str
    supported: str
    aspects: tuple[Aspect, ...]
    # aspect name -> the shape chosen in this process; forgotten by uninstall() and
    # state.reset(), since tests change the host modules between installs
    _chosen: dict[str, Shape] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        register_cache(self)

    def clear(self) -> None:
        """Forget the shapes chosen (they are detected again when next needed)."""
        self._chosen.clear()

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules whose import triggers a choice (for install's post-import hooks)."""
        return tuple(dict.fromkeys(m for a in self.aspects for m in a.when))

    def aspect(self, name: str) -> Aspect:
        for aspect in self.aspects:
            if aspect.name == name:
                return aspect
        raise EssPatchKeyError(f"{self.framework} has no aspect {name!r}")

    def choose(self, name: str) -> Shape:
        """The shape of aspect ``name`` in this process (detected once, then recorded).

        Raises:
            MissingTargetError: no known shape fits, naming what each one misses.
        """
        chosen = self._chosen
        if name in chosen:
            return chosen[name]
        aspect = self.aspect(name)
        misses = []
        for shape in aspect.shapes:
            miss = next(filter(None, (f.missing() for f in shape.requires)), None)
            if miss is None:
                chosen[name] = shape
                return shape
            misses.append(f"{shape.label} [{shape.span}]: {miss}")
        raise MissingTargetError(
            f"ess-patch ({self.framework}): this {self.framework} fits no known shape for "
            f"{name!r}; " + "; ".join(misses) + f". Supported: {self.supported}. Use a "
            f"supported version, or apply the patches/ series for your {self.framework} release"
        )

    def choose_all(self) -> dict[str, Shape]:
        """Every aspect decided now (at parse time, or for doctor)."""
        return {a.name: self.choose(a.name) for a in self.aspects}

    def on_import(self, module: str) -> None:
        """Decide the aspects that ``module``'s import needs (see ``Aspect.when``)."""
        for aspect in self.aspects:
            if module in aspect.when:
                self.choose(aspect.name)

    def describe(self) -> str:
        """The recorded choices in words, e.g. "miles: groups from ...; metrics via ..."."""
        chosen = self._chosen
        parts = [
            a.phrase.format(label=chosen[a.name].label) for a in self.aspects if a.name in chosen
        ]
        return f"{self.framework}: {'; '.join(parts) if parts else 'not decided yet'}"
