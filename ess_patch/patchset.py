"""The ``patches/`` series: find them, recognise a target tree, check, apply and revert them.

Layout (shipped inside the wheel as ``ess_patch/patches``)::

    patches/<component>/<version or commit>/NNNN-<subject>.patch   (git format-patch files)

Everything goes through ``git apply`` (``--check`` to tell "applicable", ``--reverse --check``
to tell "already applied"), which works on plain directories too: an unpacked sdist or wheel,
a site-packages folder, a Megatron-LM checkout. A series is applied whole or not at all: it is
first checked patch by patch on a scratch copy of the files it touches, and a failure while
writing the real tree undoes what was written.

Components are recognised by :data:`DETECTORS` (one function per component, returning a
:class:`Tree` or None). megatron-core reads its version from ``megatron/core/package_info.py``
(parsed, not imported) or from package metadata. miles and slime (series keyed by upstream
commit) are told by the checkout's git HEAD, or, for a snapshot without git, by fingerprint:
the git blob ids of the files a series touches, which the series itself records (the
``index <before>..<after>`` lines of ``git format-patch --full-index``), match that commit's
upstream files (pristine) or the patched ones. A tree matching neither gets ``version=None``:
the series is then chosen by ``git apply --check`` alone.
"""

from __future__ import annotations

import ast
import contextlib
import enum
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path

from packaging.version import InvalidVersion, Version

from .integrations.megatron import MEGATRON
from .vendored import CALL_SITES

__all__ = [
    "DETECTORS",
    "ConflictError",
    "DirtyTreeError",
    "PatchStatus",
    "PatchsetError",
    "Series",
    "State",
    "Tree",
    "UnknownTreeError",
    "apply_series",
    "blob_id",
    "call_site_gaps",
    "check_series",
    "decorated_methods",
    "defined_methods",
    "detect",
    "discover",
    "fingerprint",
    "patches_dir",
    "revert_series",
    "select_series",
    "series_gaps",
]

#: Overrides where the series are read from (default: the copy shipped in the package).
ENV_PATCHES_DIR = "ESS_PATCH_PATCHES_DIR"


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


# --------------------------------------------------------------------------------------
# Series
# --------------------------------------------------------------------------------------


def patches_dir() -> Path:
    """The directory holding ``<component>/<version>/*.patch``.

    ``$ESS_PATCH_PATCHES_DIR`` if set; else the copy installed with the package
    (``ess_patch/patches``); else, in a source checkout, the repository's ``patches/``.
    """
    env = os.environ.get(ENV_PATCHES_DIR)
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
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


_DIFF_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


def patch_files(patch: Path) -> list[str]:
    """Paths a git patch file touches (both sides of a rename)."""
    found: dict[str, None] = {}
    for a, b in _DIFF_HEADER.findall(patch.read_text(encoding="utf-8")):
        found.setdefault(a, None)
        found.setdefault(b, None)
    return list(found)


_COMMIT = re.compile(r"[0-9a-f]{7,40}")


_INDEX = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)", re.MULTILINE)


def _blob_chains(series: Series) -> dict[str, list[str]]:
    """Per touched file, its git blob ids through the series: upstream first, then after each
    patch that touches it (from the ``index`` lines; full ids with ``--full-index``)."""
    chains: dict[str, list[str]] = {}
    for patch in series.patches:
        text = patch.read_text(encoding="utf-8")
        heads = list(_DIFF_HEADER.finditer(text))
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


def _version_key(text: str) -> tuple[int, Version | str]:
    if _COMMIT.fullmatch(text):  # a commit (miles, slime), even one that reads as a number
        return (1, text)
    try:
        return (0, Version(text))
    except InvalidVersion:
        return (1, text)


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
            (p for p in comp_dir.iterdir() if p.is_dir()), key=lambda p: _version_key(p.name)
        )
        for ver_dir in versions:
            patches = tuple(sorted(ver_dir.glob("*.patch")))
            if patches:
                found.append(Series(comp_dir.name, ver_dir.name, ver_dir, patches))
    return found


# --------------------------------------------------------------------------------------
# Trees
# --------------------------------------------------------------------------------------


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


def _git_head(root: Path) -> str | None:
    """HEAD's commit when ``root`` is the top of a git work tree (else None)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root.resolve():
        return None
    head = _git(root, "rev-parse", "HEAD")
    return head.stdout.strip() if head.returncode == 0 else None


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
        head = _git_head(target)
        try:
            available = discover(component)
        except (PatchsetError, FileNotFoundError):
            available = []
        if head and any(_matches(s.version, head) for s in available):
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


# --------------------------------------------------------------------------------------
# git apply
# --------------------------------------------------------------------------------------


def _git_env(cwd: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    # Never let git find a repository *above* the tree: inside one, `git apply` takes paths
    # relative to that repository's top and skips the ones outside the current folder.
    env["GIT_CEILING_DIRECTORIES"] = str(Path(cwd).resolve().parent)
    env["LC_ALL"] = "C"
    return env


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["LC_ALL"] = "C"
    try:
        return subprocess.run(
            ["git", "-C", str(cwd), *args], capture_output=True, text=True, env=env, check=False
        )
    except FileNotFoundError as err:
        raise PatchsetError("git is not installed (needed to apply patches)") from err


def _git_apply(
    root: Path, patch: Path, *, reverse: bool = False, check: bool = False
) -> subprocess.CompletedProcess[str]:
    cmd = ["git", "apply", "--whitespace=nowarn"]
    if reverse:
        cmd.append("--reverse")
    if check:
        cmd.append("--check")
    cmd.append(str(Path(patch).resolve()))
    try:
        return subprocess.run(
            cmd, cwd=root, capture_output=True, text=True, env=_git_env(root), check=False
        )
    except FileNotFoundError as err:
        raise PatchsetError("git is not installed (needed to apply patches)") from err


_ERROR_FILE = re.compile(
    r"^error: (?:patch failed: (?P<a>.+?):\d+|(?P<b>.+?): (?:patch does not apply|No such file"
    r" or directory|already exists in working directory|does not exist in index|"
    r"does not match index|wrong type))$",
    re.MULTILINE,
)


def _failed_files(stderr: str) -> list[str]:
    found: dict[str, None] = {}
    for m in _ERROR_FILE.finditer(stderr):
        found.setdefault(m.group("a") or m.group("b"), None)
    return list(found)


# --------------------------------------------------------------------------------------
# Status, apply, revert
# --------------------------------------------------------------------------------------


class State(str, enum.Enum):
    APPLICABLE = "applicable"
    APPLIED = "already applied"
    CONFLICTING = "conflicting"


@dataclass(frozen=True)
class PatchStatus:
    """One patch of a series on one tree. ``files``: the conflicting files (else empty)."""

    patch: Path
    state: State
    files: tuple[str, ...] = ()
    detail: str = ""

    def describe(self) -> str:
        text = self.state.value
        if self.files:
            text += f": {', '.join(self.files)} (hand edit, or another upstream version)"
        return text


def _scratch_copy(root: Path, files: Iterable[str], dest: Path) -> None:
    for rel in files:
        src = root / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _simulate(series: Series, root: Path, *, reverse: bool) -> list[PatchStatus]:
    """Status of each patch, in series order, checked in order on a scratch copy.

    Forward: a patch that applies is applied to the copy before the next one is checked.
    Reverse (for revert): walked from the last patch, reverting what is applied.
    """
    statuses: dict[Path, PatchStatus] = {}
    with tempfile.TemporaryDirectory(prefix="ess-patch-check-") as tmp:
        scratch = Path(tmp) / "tree"
        scratch.mkdir()
        _scratch_copy(root, series.files(), scratch)
        order = reversed(series.patches) if reverse else series.patches
        for patch in order:
            # the direction we are going first: a patch that reads both ways counts as "to do"
            go = _git_apply(scratch, patch, reverse=reverse, check=True)
            if go.returncode == 0:
                _git_apply(scratch, patch, reverse=reverse)
                state = State.APPLIED if reverse else State.APPLICABLE
                statuses[patch] = PatchStatus(patch, state)
                continue
            back = _git_apply(scratch, patch, reverse=not reverse, check=True)
            if back.returncode == 0:
                state = State.APPLICABLE if reverse else State.APPLIED
                statuses[patch] = PatchStatus(patch, state)
                continue
            files = _failed_files(go.stderr) or patch_files(patch)
            statuses[patch] = PatchStatus(patch, State.CONFLICTING, tuple(files), go.stderr.strip())
    return [statuses[p] for p in series.patches]


def check_series(series: Series, root: Path) -> list[PatchStatus]:
    """Per patch: applicable, already applied, or conflicting (naming the files). No writes."""
    return _simulate(series, Path(root), reverse=False)


def _raise_conflicts(series: Series, root: Path, statuses: list[PatchStatus], verb: str) -> None:
    bad = [s for s in statuses if s.state is State.CONFLICTING]
    if bad:
        files = list(dict.fromkeys(f for s in bad for f in s.files))
        lines = "; ".join(f"{s.patch.name}: {', '.join(s.files)}" for s in bad)
        raise ConflictError(
            f"cannot {verb} {series.name} on {root}: conflicting {', '.join(files)} "
            f"({lines}). Nothing was changed",
            files,
        )


def dirty_files(root: Path, files: Iterable[str]) -> list[str]:
    """Of ``files`` (relative to ``root``), those with uncommitted changes in the git work
    tree holding ``root`` (none when ``root`` is not in one; untracked files do not count).
    """
    files = list(files)
    if _git(root, "rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
        return []
    prefix = _git(root, "rev-parse", "--show-prefix").stdout.strip()
    status = _git(root, "status", "--porcelain=v1", "-z", "--untracked-files=no", "--", *files)
    dirty = []
    for entry in filter(None, status.stdout.split("\0")):
        path = entry[3:]
        dirty.append(path[len(prefix) :] if prefix and path.startswith(prefix) else path)
    return [f for f in files if f in dirty]


def _committed(root: Path, rel: str) -> bytes | None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    out = subprocess.run(
        ["git", "-C", str(root), "show", f"HEAD:./{rel}"], capture_output=True, env=env, check=False
    )
    return out.stdout if out.returncode == 0 else None


def _refuse_dirty(series: Series, root: Path, verb: str, *, ours_ok: bool) -> None:
    dirty = dirty_files(root, series.files())
    if dirty and ours_ok:
        # Reverting right after `apply`: the uncommitted changes may be exactly the series.
        with tempfile.TemporaryDirectory(prefix="ess-patch-revert-") as tmp:
            scratch = Path(tmp)
            _scratch_copy(root, series.files(), scratch)
            for patch in reversed(series.patches):
                _git_apply(scratch, patch, reverse=True)
            dirty = [
                f
                for f in dirty
                if not (scratch / f).is_file() or (scratch / f).read_bytes() != _committed(root, f)
            ]
    if dirty:
        raise DirtyTreeError(
            f"refusing to {verb} {series.name}: {root} has uncommitted changes in "
            f"{', '.join(dirty)} (commit or stash them first, or pass --allow-dirty)"
        )


def apply_series(series: Series, root: Path, *, allow_dirty: bool = False) -> list[PatchStatus]:
    """Apply every patch of ``series`` that is not applied yet, or none.

    Returns the statuses found before applying (all "already applied": nothing was done).

    Raises:
        ConflictError: a patch conflicts (names the files); the tree is unchanged.
        DirtyTreeError: uncommitted changes in a touched file (git work trees only).
        PatchsetError: git failed while writing; what was written has been undone.
    """
    root = Path(root)
    statuses = check_series(series, root)
    _raise_conflicts(series, root, statuses, "apply")
    todo = [s.patch for s in statuses if s.state is State.APPLICABLE]
    if not todo:
        return statuses
    if not allow_dirty:
        _refuse_dirty(series, root, "apply", ours_ok=False)
    _write(series, root, todo, reverse=False)
    return statuses


def revert_series(series: Series, root: Path, *, allow_dirty: bool = False) -> list[PatchStatus]:
    """Revert every applied patch of ``series`` (last first), or none. Returns the statuses
    found before reverting (all "applicable": nothing was applied, nothing done).

    Uncommitted changes that are exactly this series (``apply`` then ``revert``) are fine;
    anything else in a touched file raises :class:`DirtyTreeError`.
    """
    root = Path(root)
    statuses = _simulate(series, root, reverse=True)
    _raise_conflicts(series, root, statuses, "revert")
    todo = [s.patch for s in reversed(statuses) if s.state is State.APPLIED]
    if not todo:
        return statuses
    if not allow_dirty:
        _refuse_dirty(series, root, "revert", ours_ok=True)
    _write(series, root, todo, reverse=True)
    return statuses


def _write(series: Series, root: Path, patches: list[Path], *, reverse: bool) -> None:
    done: list[Path] = []
    for patch in patches:
        result = _git_apply(root, patch, reverse=reverse)
        if result.returncode != 0:
            for undo in reversed(done):
                _git_apply(root, undo, reverse=not reverse)
            raise PatchsetError(
                f"git apply{' --reverse' if reverse else ''} {patch.name} failed on {root} "
                f"after its check passed; undid the {len(done)} patch(es) already written: "
                f"{result.stderr.strip()}"
            )
        done.append(patch)


# --------------------------------------------------------------------------------------
# Choosing a series
# --------------------------------------------------------------------------------------


def _matches(series_version: str, tree_version: str) -> bool:
    if series_version == tree_version:
        return True
    # commit-keyed series (miles, slime): a hash prefix of 7+ digits names the commit
    if not (_COMMIT.fullmatch(series_version) and _COMMIT.fullmatch(tree_version.lower())):
        return False
    short, full = sorted((series_version, tree_version.lower()), key=len)
    return full.startswith(short)


def _closeness(series_version: Version, mine: Version) -> tuple[int, ...]:
    a = (*series_version.release, 0, 0, 0)[:3]
    b = (*mine.release, 0, 0, 0)[:3]
    # distance in major, then minor, then patch; on a tie the older release first
    return (*(abs(x - y) for x, y in zip(a, b)), 0 if series_version <= mine else 1)


def _candidates(tree: Tree, series: list[Series]) -> list[Series]:
    """Series to try on ``tree``: its own version's, then by closeness of version."""
    exact = [s for s in series if tree.version and _matches(s.version, tree.version)]
    rest = [s for s in series if s not in exact]
    try:
        mine = Version(tree.version) if tree.version else None
    except InvalidVersion:
        mine = None
    versioned = [(s, k[1]) for s in rest if (k := _version_key(s.version))[0] == 0]
    other = [s for s in rest if _version_key(s.version)[0] != 0]
    if mine is None:  # unknown version: newest first
        ordered = sorted(versioned, key=lambda sv: sv[1], reverse=True)
    else:
        ordered = sorted(versioned, key=lambda sv: _closeness(sv[1], mine))
    return exact + [s for s, _ in ordered] + other


def select_series(
    tree: Tree, version: str | None = None, *, root: Path | None = None
) -> tuple[Series, list[PatchStatus]]:
    """The series to use on ``tree`` and its per-patch status there.

    ``version`` names a series folder (``patches/<component>/<version>``). Without it: the
    series made for the tree's version if there is one (a conflict there is a hand edit: no
    fallback). Else the others by closeness of version (older first on a tie): the first
    that applies (or is applied, per ``git apply --check``) and leaves no gap with
    ``install()`` (:func:`series_gaps`) wins; else the first that applies (callers should
    check its gaps); else the closest one, with its conflicts.

    Raises:
        UnknownTreeError: no series for the component, or no folder named ``version``.
    """
    available = discover(tree.component, root)
    if not available:
        where = (root or patches_dir()) / tree.component
        raise UnknownTreeError(f"no patch series for {tree.component} (nothing in {where})")
    if version is not None:
        chosen = [s for s in available if _matches(s.version, version)]
        if not chosen:
            raise UnknownTreeError(
                f"no {tree.component} series {version!r}; available: "
                f"{', '.join(s.version for s in available)}"
            )
        return chosen[0], check_series(chosen[0], tree.root)
    own = [s for s in available if tree.version and _matches(s.version, tree.version)]
    if own:  # made for this very version: its conflicts are real (hand edits), no fallback
        return own[0], check_series(own[0], tree.root)
    first: tuple[Series, list[PatchStatus]] | None = None
    clean: tuple[Series, list[PatchStatus]] | None = None
    for candidate in _candidates(tree, available):
        statuses = check_series(candidate, tree.root)
        first = first or (candidate, statuses)
        if any(s.state is State.CONFLICTING for s in statuses):
            continue
        if not series_gaps(candidate, tree.root):
            return candidate, statuses
        clean = clean or (candidate, statuses)
    result = clean or first
    assert result is not None
    return result


# --------------------------------------------------------------------------------------
# Static symbol checks (no import)
# --------------------------------------------------------------------------------------


def _module_file(root: Path, module: str) -> Path:
    return Path(root, *module.split(".")).with_suffix(".py")


def _class_node(root: Path, module: str, owner: str) -> ast.ClassDef | None:
    path = _module_file(root, module)
    if not path.is_file():
        return None
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name == owner:
            return node
    return None


def defined_methods(root: Path, module: str, owner: str) -> set[str] | None:
    """Names of the functions defined in class ``owner``'s own body in ``module`` (parsed
    from the file under ``root``, never imported); None if the file or class is missing."""
    node = _class_node(Path(root), module, owner)
    if node is None:
        return None
    return {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def decorated_methods(root: Path, module: str, owner: str, decorator: str) -> set[str]:
    """Methods of ``owner`` whose decorators include the plain name ``decorator``."""
    node = _class_node(Path(root), module, owner)
    if node is None:
        return set()
    return {
        n.name
        for n in node.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and any(isinstance(d, ast.Name) and d.id == decorator for d in n.decorator_list)
    }


#: The name the series give their call-site decorator (see tools/megatron_core_series.py).
VENDORED_DECORATOR = "_ess_optimizer_step"


def megatron_core_gaps(root: Path) -> list[str]:
    """Where a (patched) megatron-core tree and ``install()`` disagree: a method that
    ``install()`` would wrap (the class body defines it) without the series' decorator, or a
    decorated one that it would not wrap. Empty: the diff is the exact twin of the monkeypatch.
    """
    gaps = []
    for t in MEGATRON.targets:
        wraps = t.attribute in (defined_methods(root, t.module, t.owner) or set())
        decorated = t.attribute in decorated_methods(root, t.module, t.owner, VENDORED_DECORATOR)
        if wraps and not decorated:
            gaps.append(f"{t.owner}.{t.attribute}: install() wraps it, the series does not")
        elif decorated and not wraps:
            gaps.append(f"{t.owner}.{t.attribute}: decorated, but install() does not wrap it")
    return gaps


def _module_path(module: str) -> str:
    return "/".join(module.split(".")) + ".py"


def _definition(
    root: Path, module: str, owner: str, name: str, depth: int = 0
) -> tuple[str, str, ast.FunctionDef | ast.AsyncFunctionDef] | None:
    """Where ``module.owner.name`` is defined under ``root``: (file, owner, node), following
    module-level ``from X import name`` re-imports (absolute or relative); None if not found."""
    rel = _module_path(module)
    path = Path(root, rel)
    if not path.is_file() or depth > 8:
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body: list[ast.stmt] = tree.body
    if owner:
        cls = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == owner), None)
        if cls is None:
            return None
        body = cls.body
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return rel, owner, node
    if owner:
        return None
    for node in body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    base = module.split(".")[: -node.level] if node.level else []
                    source = ".".join([*base, *filter(None, [node.module])])
                    return _definition(root, source, "", alias.name, depth + 1)
    return None


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {d.id for d in node.decorator_list if isinstance(d, ast.Name)}


def _vendored_imports(root: Path, rel: str) -> dict[str, str]:
    """``{local name: name}`` of what ``rel`` imports from ``ess_patch.vendored``."""
    path = Path(root, rel)
    if not path.is_file():
        return {}
    found = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "ess_patch.vendored":
            for alias in node.names:
                found[alias.asname or alias.name] = alias.name
    return found


def call_site_gaps(component: str) -> Callable[[Path], list[str]]:
    """Gaps function for a framework series (miles, slime): where a patched tree and
    ``install(component)`` disagree. A call site of ``ess_patch.vendored.CALL_SITES`` without
    its decorator or its import; an ``install()`` target whose definition (re-imports
    followed) is not a call site; or a function decorated with ``_ess_*`` that is not one.
    """
    from .install import INTEGRATIONS

    def gaps(root: Path) -> list[str]:
        sites = {(c.path, c.owner, c.function): c for c in CALL_SITES[component]}
        out = []
        for (rel, owner, name), site in sites.items():
            found = _definition(root, rel[: -len(".py")].replace("/", "."), owner, name)
            if found is None:
                out.append(f"{site.label}: not defined in {rel}")
            elif site.alias not in _decorator_names(found[2]):
                out.append(f"{rel} {site.label}: install() wraps it, the series does not")
            elif _vendored_imports(root, rel).get(site.alias) != site.decorator:
                out.append(
                    f"{rel} {site.label}: decorated with {site.alias}, which is not "
                    f"ess_patch.vendored.{site.decorator}"
                )
        for t in INTEGRATIONS[component].targets:
            found = _definition(root, t.module, t.owner, t.attribute)
            if found is None:
                out.append(f"{t.path}: install() wraps it, but it is not in the tree")
            elif found[:2] + (found[2].name,) not in sites:
                out.append(
                    f"{t.path}: install() wraps it (defined in {found[0]}), the series does not"
                )
        files = {*(c.path for c in sites.values())}
        files |= {_module_path(t.module) for t in INTEGRATIONS[component].targets}
        for rel in sorted(files):
            path = Path(root, rel)
            if not path.is_file():
                continue
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                members = [(node, "")]
                if isinstance(node, ast.ClassDef):
                    members = [(n, node.name) for n in node.body]
                for fn, owner in members:
                    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        continue
                    ours = {d for d in _decorator_names(fn) if d.startswith("_ess_")}
                    if ours and (rel, owner, fn.name) not in sites:
                        label = ".".join(p for p in (owner, fn.name) if p)
                        out.append(f"{rel} {label}: decorated, but install() does not wrap it")
        return out

    return gaps


def _twin_files(component: str) -> tuple[str, ...]:
    from .install import INTEGRATIONS

    files = [c.path for c in CALL_SITES[component]]
    files += [_module_path(m) for m in INTEGRATIONS[component].modules]
    return tuple(dict.fromkeys(files))


@dataclass(frozen=True)
class Twin:
    """How to compare a component's series with its runtime integration: the files holding
    the integration's targets, and a function listing the gaps on a patched tree."""

    files: tuple[str, ...]
    gaps: Callable[[Path], list[str]]


TWINS: dict[str, Twin] = {
    "megatron-core": Twin(
        files=tuple("/".join(m.split(".")) + ".py" for m in MEGATRON.modules),
        gaps=megatron_core_gaps,
    ),
    **{c: Twin(files=_twin_files(c), gaps=call_site_gaps(c)) for c in CALL_SITES},
}


def series_gaps(series: Series, root: Path) -> list[str]:
    """The gaps (see :func:`megatron_core_gaps`, :func:`call_site_gaps`) that ``root`` would
    have once ``series`` is applied (computed on a scratch copy; patches that do not apply are
    left out). Empty for a component without a registered twin."""
    twin = TWINS.get(series.component)
    if twin is None:
        return []
    with tempfile.TemporaryDirectory(prefix="ess-patch-gaps-") as tmp:
        scratch = Path(tmp)
        _scratch_copy(Path(root), [*series.files(), *twin.files], scratch)
        for patch in series.patches:
            if _git_apply(scratch, patch, check=True).returncode == 0:
                _git_apply(scratch, patch)
        return twin.gaps(scratch)
