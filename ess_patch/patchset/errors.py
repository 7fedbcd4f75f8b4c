"""The errors the series tools raise: each message says why and names the file."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ConflictError", "DirtyTreeError", "PatchsetError", "UnknownTreeError"]


class PatchsetError(Exception):
    """A series cannot be used on this tree; the message says why and names the file."""


class UnknownTreeError(PatchsetError):
    """The target is not a tree that any series is for (or its series is not shipped)."""


class DirtyTreeError(PatchsetError):
    """The target is a git work tree with uncommitted changes in files the series touches."""


class ConflictError(PatchsetError):
    """A patch of the series neither applies nor is already applied (hand edits, other version)."""

    def __init__(self, message: str, files: Sequence[str]):
        super().__init__(message)
        self.files = tuple(files)
