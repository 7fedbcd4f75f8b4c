"""Integrations: which attributes of which host library get wrapped, and with what."""

from __future__ import annotations

from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ..patching import Target

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

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.module for t in self.targets))

    def supports(self, version: str) -> bool:
        """Whether ``version`` of :attr:`distribution` is in :attr:`supported`."""
        try:
            return Version(version) in SpecifierSet(self.supported, prereleases=True)
        except InvalidVersion:
            return False
