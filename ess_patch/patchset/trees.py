"""Reading a target tree: running git on it (``git apply`` on a plain folder, and questions to
the work tree holding one); which component, where its root is, which version; and copying a
tree's files to a scratch folder.

Every git call runs without the caller's ``GIT_*`` variables and in the C locale (its messages
are parsed); a missing git raises :class:`~.series.PatchsetError`.

One detector per component of the registry (:data:`DETECTORS`). megatron-core reads its version from
``megatron/core/package_info.py`` (parsed, not imported) or from package metadata. miles and
slime (series keyed by upstream commit) are told by the checkout's git HEAD, or, for a
snapshot without git, by :func:`fingerprint`: the git blob ids of the files a series touches
against the ones it records (the ``index <before>..<after>`` lines of
``git format-patch --full-index``).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path

from ..integrations.registry import COMPONENTS, RELEASE, Component
from ..integrations.registry import component as component_row
from .series import DIFF_HEADER, PatchsetError, Series, UnknownTreeError, discover, matches

__all__ = [
    "DETECTORS",
    "Tree",
    "blob_id",
    "committed",
    "detect",
    "dirty_files",
    "fingerprint",
    "git",
    "git_apply",
    "head_commit",
    "scratch_copy",
]

# Running git.


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["LC_ALL"] = "C"
    return env


def _run(
    cmd: list[str], env: dict[str, str], *, cwd: Path | None = None, text: bool = True
) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=text, env=env, check=False)
    except FileNotFoundError as err:
        raise PatchsetError("git is not installed (needed to apply patches)") from err


def git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``git -C cwd ARGS``: git finds the work tree holding ``cwd``, however far up."""
    return _run(["git", "-C", str(cwd), *args], _env())


def git_apply(
    root: Path, patch: Path, *, reverse: bool = False, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """``git apply`` (``--reverse``, ``--check``) of ``patch`` in the folder ``root``."""
    cmd = ["git", "apply", "--whitespace=nowarn"]
    if reverse:
        cmd.append("--reverse")
    if check:
        cmd.append("--check")
    cmd.append(str(Path(patch).resolve()))
    env = _env()
    # Never let git find a repository *above* the tree: inside one, `git apply` takes paths
    # relative to that repository's top and skips the ones outside the current folder.
    env["GIT_CEILING_DIRECTORIES"] = str(Path(root).resolve().parent)
    return _run(cmd, env, cwd=root)


def head_commit(root: Path) -> str | None:
    """HEAD's commit when ``root`` is the top of a git work tree (else None)."""
    top = git(root, "rev-parse", "--show-toplevel")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root.resolve():
        return None
    head = git(root, "rev-parse", "HEAD")
    return head.stdout.strip() if head.returncode == 0 else None


def committed(root: Path, rel: str) -> bytes | None:
    """The bytes of ``rel`` (relative to ``root``) in HEAD; None if HEAD has no such file."""
    out = _run(["git", "-C", str(root), "show", f"HEAD:./{rel}"], _env(), text=False)
    return out.stdout if out.returncode == 0 else None


def dirty_files(root: Path, files: Iterable[str]) -> list[str]:
    """Of ``files`` (relative to ``root``), those with uncommitted changes in the git work
    tree holding ``root`` (none when ``root`` is not in one; untracked files do not count).
    """
    files = list(files)
    if git(root, "rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
        return []
    prefix = git(root, "rev-parse", "--show-prefix").stdout.strip()
    status = git(root, "status", "--porcelain=v1", "-z", "--untracked-files=no", "--", *files)
    dirty = []
    for entry in filter(None, status.stdout.split("\0")):
        path = entry[3:]
        dirty.append(path[len(prefix) :] if prefix and path.startswith(prefix) else path)
    return [f for f in files if f in dirty]


# Recognising a tree.

_INDEX = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)", re.MULTILINE)


def _blob_chains(series: Series) -> dict[str, list[str]]:
    """Per touched file, its git blob ids through the series: upstream first, then after each
    patch that touches it (from the ``index`` lines; full ids with ``--full-index``)."""
    chains: dict[str, list[str]] = {}
    for patch in series.patches:
        text = patch.read_text(encoding="utf-8")
        heads = list(DIFF_HEADER.finditer(text))
        for i, head in enumerate(heads):
            end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
            index = _INDEX.search(text, head.end(), end)
            if index is None:
                continue
            chain = chains.setdefault(head.group(2), [index.group(1)])
            chain.append(index.group(2))
    return chains


def blob_id(data: bytes) -> str:
    """The id git gives a file's bytes (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def fingerprint(series: Series, root: Path) -> str | None:
    """Whether the files ``series`` touches under ``root`` are exactly its upstream's.

    Returns ``"pristine"`` (every file as upstream), ``"patched"`` (as after the series),
    ``"partly patched"`` (each file at some point of the series), or None (a file missing, or
    any other bytes: another version, or a hand edit).
    """
    chains = _blob_chains(series)
    if not chains:
        return None
    ends: list[tuple[bool, bool]] = []  # per file: (as upstream, as after the series)
    for rel, chain in chains.items():
        path = Path(root) / rel
        if not path.is_file():
            return None
        mine = blob_id(path.read_bytes())
        if not any(mine.startswith(blob) for blob in chain):
            return None
        ends.append((mine.startswith(chain[0]), mine.startswith(chain[-1])))
    if all(first for first, _ in ends):
        return "pristine"
    if all(last for _, last in ends):
        return "patched"
    return "partly patched"


def scratch_copy(root: Path, files: Iterable[str], dest: Path) -> None:
    """Copy ``files`` (relative to ``root``; the missing ones skipped) to the same paths
    under ``dest``."""
    for rel in files:
        src = root / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


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


def _release_tree(row: Component) -> Callable[[Path], Tree | None]:
    """Detector for megatron-core (a release-keyed component): its version from
    ``<package>/package_info.py`` (parsed, not imported), else from package metadata."""
    package = row.tree_package  # megatron/core
    parent, leaf = package.rsplit("/", 1)
    folder = row.folder or row.name
    dist = row.integration.distribution or folder

    def detect(target: Path) -> Tree | None:
        root = target
        if target.name == leaf and target.parent.name == parent:
            root = target.parent.parent  # pointed at megatron/core itself
        if not (root / package / "__init__.py").is_file():
            return None
        info = root / package / "package_info.py"
        if info.is_file():
            v = _literal_assignments(info, ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"))
            if all(k in v for k in ("MAJOR", "MINOR", "PATCH")):
                version = f"{v['MAJOR']}.{v['MINOR']}.{v['PATCH']}{v.get('PRE_RELEASE') or ''}"
                return Tree(root, folder, version, f"{package}/package_info.py")
        wheel = dist.replace("-", "_")
        for meta in [root / "PKG-INFO", *sorted(root.glob(f"{wheel}-*.dist-info/METADATA"))]:
            if meta.is_file() and (version := _metadata_version(meta, {dist})):
                return Tree(root, folder, version, str(meta.relative_to(root)))
        return Tree(root, folder, None, f"{package}/__init__.py")

    return detect


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


def _detector(row: Component) -> Callable[[Path], Tree | None]:
    if row.series == RELEASE:  # megatron-core: told by its version, not by a commit
        return _release_tree(row)
    return _package_checkout(row.folder, row.tree_package)  # type: ignore[arg-type]


#: component (``patches/`` folder) -> detector, from the component registry. Megatron-LM's own
#: RL loop (megatron_rl) sits in a checkout that also holds megatron/core, so detection asks
#: which of the two is meant.
DETECTORS: dict[str, Callable[[Path], Tree | None]] = {
    row.folder: _detector(row) for row in COMPONENTS if row.folder is not None
}

_EVIDENCE = {
    row.folder: f"{row.tree_package}/__init__.py" for row in COMPONENTS if row.folder is not None
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
    names = {t.component for t in trees}
    core_folder = component_row("megatron").folder
    rl_folder = component_row("megatron_rl").folder
    if names == {core_folder, rl_folder}:
        # A Megatron-LM checkout: its optimizers (megatron-core) are what every Megatron user
        # vendors, as before megatron_rl had a series; Megatron-RL is the opt-in second one.
        core = next(t for t in trees if t.component == core_folder)
        note = f"; it also holds megatron/rl: --component {rl_folder} patches Megatron-RL"
        return dataclasses.replace(core, evidence=core.evidence + note)
    if len(trees) > 1:
        raise UnknownTreeError(
            f"{target} holds several components ({', '.join(t.component for t in trees)}); "
            "choose one with --component"
        )
    return trees[0]
