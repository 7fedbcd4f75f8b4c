"""Recognising a target tree: which component, where its root is, which version.

One detector per component (:data:`DETECTORS`). megatron-core reads its version from
``megatron/core/package_info.py`` (parsed, not imported) or from package metadata. miles and
slime (series keyed by upstream commit) are told by the checkout's git HEAD, or, for a
snapshot without git, by :func:`~.blobs.fingerprint`.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path

from .blobs import fingerprint
from .errors import PatchsetError, UnknownTreeError
from .git import head_commit
from .series import discover
from .versions import matches

__all__ = ["DETECTORS", "Tree", "detect"]


@dataclass(frozen=True)
class Tree:
    """A recognised target: the series' paths are relative to ``root``.

    ``version`` is None when it cannot be told; ``evidence`` names the file it was read from.
    """

    root: Path
    component: str
    version: str | None
    evidence: str


def _literal_assignments(path: Path, names: Iterable[str]) -> dict[str, object]:
    wanted = set(names)
    values: dict[str, object] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in wanted:
                with contextlib.suppress(ValueError):
                    values[target.id] = ast.literal_eval(node.value)
    return values


def _metadata_version(path: Path, names: set[str]) -> str | None:
    headers = HeaderParser().parsestr(path.read_text(encoding="utf-8", errors="replace"))
    name = (headers.get("Name") or "").lower().replace("_", "-")
    return headers.get("Version") if name in names else None


def _detect_megatron_core(target: Path) -> Tree | None:
    root = target
    if target.name == "core" and target.parent.name == "megatron":
        root = target.parent.parent  # pointed at megatron/core itself
    if not (root / "megatron" / "core" / "__init__.py").is_file():
        return None
    info = root / "megatron" / "core" / "package_info.py"
    if info.is_file():
        v = _literal_assignments(info, ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"))
        if all(k in v for k in ("MAJOR", "MINOR", "PATCH")):
            version = f"{v['MAJOR']}.{v['MINOR']}.{v['PATCH']}{v.get('PRE_RELEASE') or ''}"
            return Tree(root, "megatron-core", version, "megatron/core/package_info.py")
    names = {"megatron-core"}
    for meta in [root / "PKG-INFO", *sorted(root.glob("megatron_core-*.dist-info/METADATA"))]:
        if meta.is_file() and (version := _metadata_version(meta, names)):
            return Tree(root, "megatron-core", version, str(meta.relative_to(root)))
    return Tree(root, "megatron-core", None, "megatron/core/__init__.py")


def _package_checkout(component: str, package: str) -> Callable[[Path], Tree | None]:
    """Detector for a framework checkout holding ``<package>/__init__.py`` (miles, slime).

    The version, in order: HEAD's commit when the checkout is a git repository whose HEAD a
    shipped series is for; else the series whose fingerprint (:func:`fingerprint`) the files
    match; else HEAD's commit (no series for it); else None (the series is then chosen by
    ``git apply --check``).
    """

    def detect(target: Path) -> Tree | None:
        if not (target / package / "__init__.py").is_file():
            return None
        head = head_commit(target)
        try:
            available = discover(component)
        except (PatchsetError, FileNotFoundError):
            available = []
        if head and any(matches(s.version, head) for s in available):
            return Tree(target, component, head, "git HEAD")
        for series in reversed(available):  # newest folder name last: try it first
            state = fingerprint(series, target)
            if state is not None:
                evidence = f"fingerprint of the {len(series.files())} files it patches: {state}"
                return Tree(target, component, series.version, evidence)
        if head:
            return Tree(target, component, head, "git HEAD")
        return Tree(
            target,
            component,
            None,
            f"{package}/__init__.py; no git HEAD, and the files match no series' upstream",
        )

    return detect


#: component name -> detector; a component's series live in ``patches/<component>/``.
DETECTORS: dict[str, Callable[[Path], Tree | None]] = {
    "megatron-core": _detect_megatron_core,
    "miles": _package_checkout("miles", "miles"),
    "slime": _package_checkout("slime", "slime"),
}

_EVIDENCE = {
    "megatron-core": "megatron/core/__init__.py",
    "miles": "miles/__init__.py",
    "slime": "slime/__init__.py",
}


def detect(target: Path, component: str | None = None) -> Tree:
    """Recognise ``target``: which component, where its root is, which version.

    Raises:
        UnknownTreeError: no such directory; nothing recognised (names the files looked for);
            ``component`` given but not found there; or several components and none chosen.
    """
    target = Path(target)
    if not target.is_dir():
        raise UnknownTreeError(f"{target} is not a directory")
    if component is not None:
        if component not in DETECTORS:
            raise UnknownTreeError(
                f"unknown component {component!r}; known: {', '.join(DETECTORS)}"
            )
        tree = DETECTORS[component](target)
        if tree is None:
            raise UnknownTreeError(
                f"{target} is not a {component} tree: no {_EVIDENCE.get(component, '?')} in it"
            )
        return tree
    trees = [t for t in (d(target) for d in DETECTORS.values()) if t is not None]
    if not trees:
        looked = ", ".join(f"{f} ({c})" for c, f in _EVIDENCE.items())
        raise UnknownTreeError(
            f"cannot tell what {target} is: none of {looked} is in it. "
            "Point --target at the tree root (e.g. a Megatron-LM checkout) or pass --component"
        )
    if len(trees) > 1:
        raise UnknownTreeError(
            f"{target} holds several components ({', '.join(t.component for t in trees)}); "
            "choose one with --component"
        )
    return trees[0]
