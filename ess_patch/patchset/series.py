"""The shipped series: where they are (:func:`patches_dir`), what one is (:class:`Series`),
and finding them all (:func:`discover`)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import PatchsetError
from .versions import version_key

__all__ = ["DIFF_HEADER", "ENV_PATCHES_DIR", "Series", "discover", "patch_files", "patches_dir"]

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
