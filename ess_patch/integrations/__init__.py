"""Integrations: which attributes of which host library get wrapped, and with what."""

from __future__ import annotations

from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ..patching import Target
from .shapes import History

__all__ = ["Integration"]


@dataclass(frozen=True)
class Integration:
    """One host library: its distribution, the versions we support and the targets.

    ``supported`` is the single source of truth for the version check at install time
    (read from package metadata, without importing the library).
    """

    name: str
    distribution: str | None  # None: not pip-installed as a versioned distribution
    supported: str
    targets: tuple[Target, ...]
    #: a framework with a history: its known shapes, one chosen per aspect at import time
    history: History | None = None
    #: the upstream commit its newest ``patches/`` series and the framework tests are cut
    #: from (None: series keyed by release)
    snapshot: str | None = None

    @property
    def modules(self) -> tuple[str, ...]:
        """Every module whose import matters: the targets' and those that decide a shape."""
        shaped = self.history.modules if self.history is not None else ()
        return tuple(dict.fromkeys((*(t.module for t in self.targets), *shaped)))

    def supports(self, version: str) -> bool:
        """Whether ``version`` of :attr:`distribution` is in :attr:`supported`."""
        try:
            return Version(version) in SpecifierSet(self.supported, prereleases=True)
        except InvalidVersion:
            return False
