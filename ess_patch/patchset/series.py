"""The shipped series: the errors every room raises, series folder names (a release version or
a commit hash), where the series are (:func:`patches_dir`), what one is (:class:`Series`), and
finding them all (:func:`discover`)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from ..errors import EssPatchError

__all__ = [
    "COMMIT",
    "DIFF_HEADER",
    "ENV_PATCHES_DIR",
    "ConflictError",
    "DirtyTreeError",
    "PatchsetError",
    "Series",
    "UnknownTreeError",
    "discover",
    "matches",
    "patch_files",
    "patches_dir",
    "version_key",
]


class PatchsetError(EssPatchError):
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


# Series folder names: a release version (megatron-core) or a commit hash (miles, slime).

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


#: Overrides where the series are read from (default: the copy shipped in the package).
ENV_PATCHES_DIR = "ESS_PATCH_PATCHES_DIR"


def patches_dir() -> Path:
    """The directory holding ``<component>/<version>/*.patch``.

    ``$ESS_PATCH_PATCHES_DIR`` if set; else the copy installed with the package
    (``ess_patch/patches``); else, in a source checkout, the repository's ``patches/``.
    """
    env = os.environ.get(ENV_PATCHES_DIR)
    if env:
        return Path(env)
    here = Path(__file__).resolve().parents[1]  # the ess_patch package
    if (here / "patches").is_dir():
        return here / "patches"
    checkout = here.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "patches").is_dir():
        return checkout / "patches"
    raise PatchsetError(
        f"no patches directory: neither {here / 'patches'} (installed package) nor a source "
        f"checkout's patches/; set {ENV_PATCHES_DIR}"
    )


@dataclass(frozen=True)
class Series:
    """One numbered series of patches for one upstream version (or commit) of a component."""

    component: str
    version: str
    directory: Path
    patches: tuple[Path, ...]

    @property
    def name(self) -> str:
        return f"{self.component}/{self.version}"

    def files(self) -> list[str]:
        """Paths (relative to the tree root) that the series touches, in order of appearance."""
        seen: dict[str, None] = {}
        for patch in self.patches:
            for path in patch_files(patch):
                seen.setdefault(path, None)
        return list(seen)


#: The header of one file's diff in a git patch: ``diff --git a/<before> b/<after>``.
DIFF_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


def patch_files(patch: Path) -> list[str]:
    """Paths a git patch file touches (both sides of a rename)."""
    found: dict[str, None] = {}
    for a, b in DIFF_HEADER.findall(patch.read_text(encoding="utf-8")):
        found.setdefault(a, None)
        found.setdefault(b, None)
    return list(found)


def discover(component: str | None = None, root: Path | None = None) -> list[Series]:
    """Every series under ``root`` (default :func:`patches_dir`), sorted by component and
    version; only ``component``'s when given. A version folder without ``*.patch`` is ignored.
    """
    root = patches_dir() if root is None else Path(root)
    found = []
    for comp_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        if component is not None and comp_dir.name != component:
            continue
        versions = sorted(
            (p for p in comp_dir.iterdir() if p.is_dir()), key=lambda p: version_key(p.name)
        )
        for ver_dir in versions:
            patches = tuple(sorted(ver_dir.glob("*.patch")))
            if patches:
                found.append(Series(comp_dir.name, ver_dir.name, ver_dir, patches))
    return found
