"""Series folder names: a release version (megatron-core) or a commit hash (miles, slime).

How they sort (:func:`version_key`) and whether one names a tree's version (:func:`matches`).
"""

from __future__ import annotations

import re

from packaging.version import InvalidVersion, Version

__all__ = ["COMMIT", "matches", "version_key"]

#: A commit hash, or a prefix of one long enough to name it.
COMMIT = re.compile(r"[0-9a-f]{7,40}")


def version_key(text: str) -> tuple[int, Version | str]:
    """Sort key: release versions (in version order) before commits and other names."""
    if COMMIT.fullmatch(text):  # a commit (miles, slime), even one that reads as a number
        return (1, text)
    try:
        return (0, Version(text))
    except InvalidVersion:
        return (1, text)


def matches(series_version: str, tree_version: str) -> bool:
    """Whether a series folder name names ``tree_version`` (equal, or the same commit)."""
    if series_version == tree_version:
        return True
    # commit-keyed series (miles, slime): a hash prefix of 7+ digits names the commit
    if not (COMMIT.fullmatch(series_version) and COMMIT.fullmatch(tree_version.lower())):
        return False
    short, full = sorted((series_version, tree_version.lower()), key=len)
    return full.startswith(short)
