"""Checking, applying and reverting a series with ``git apply``, whole or not at all.

A series is first checked patch by patch on a scratch copy of the files it touches
(:func:`check_series`: applicable, already applied, or conflicting), and a failure while
writing the real tree undoes what was written. Uncommitted changes in a touched file of a git
work tree are refused (:class:`~.series.DirtyTreeError`).
"""

from __future__ import annotations

import enum
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .series import ConflictError, DirtyTreeError, PatchsetError, Series, patch_files
from .trees import committed, dirty_files, git_apply, scratch_copy

__all__ = [
    "PatchStatus",
    "State",
    "apply_series",
    "check_series",
    "conflicting_files",
    "revert_series",
]


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


def conflicting_files(statuses: Iterable[PatchStatus]) -> list[str]:
    """The files the statuses name as conflicting, each once, in order."""
    return list(dict.fromkeys(f for s in statuses for f in s.files))


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


def _simulate(series: Series, root: Path, *, reverse: bool) -> list[PatchStatus]:
    """Status of each patch, in series order, checked in order on a scratch copy.

    Forward: a patch that applies is applied to the copy before the next one is checked.
    Reverse (for revert): walked from the last patch, reverting what is applied.
    """
    statuses: dict[Path, PatchStatus] = {}
    with tempfile.TemporaryDirectory(prefix="ess-patch-check-") as tmp:
        scratch = Path(tmp) / "tree"
        scratch.mkdir()
        scratch_copy(root, series.files(), scratch)
        order = reversed(series.patches) if reverse else series.patches
        for patch in order:
            # the direction we are going first: a patch that reads both ways counts as "to do"
            go = git_apply(scratch, patch, reverse=reverse, check=True)
            if go.returncode == 0:
                git_apply(scratch, patch, reverse=reverse)
                state = State.APPLIED if reverse else State.APPLICABLE
                statuses[patch] = PatchStatus(patch, state)
                continue
            back = git_apply(scratch, patch, reverse=not reverse, check=True)
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
    _carry_out(series, root, statuses, reverse=False, allow_dirty=allow_dirty)
    return statuses


def revert_series(series: Series, root: Path, *, allow_dirty: bool = False) -> list[PatchStatus]:
    """Revert every applied patch of ``series`` (last first), or none. Returns the statuses
    found before reverting (all "applicable": nothing was applied, nothing done).

    Uncommitted changes that are exactly this series (``apply`` then ``revert``) are fine;
    anything else in a touched file raises :class:`DirtyTreeError`.
    """
    root = Path(root)
    statuses = _simulate(series, root, reverse=True)
    _carry_out(series, root, statuses, reverse=True, allow_dirty=allow_dirty)
    return statuses


def _carry_out(
    series: Series, root: Path, statuses: list[PatchStatus], *, reverse: bool, allow_dirty: bool
) -> None:
    """Write the patches that ``statuses`` leave to do (apply, or revert last first), or raise
    without writing: a conflict, or (unless ``allow_dirty``) uncommitted changes."""
    verb = "revert" if reverse else "apply"
    bad = [s for s in statuses if s.state is State.CONFLICTING]
    if bad:
        files = conflicting_files(bad)
        lines = "; ".join(f"{s.patch.name}: {', '.join(s.files)}" for s in bad)
        raise ConflictError(
            f"cannot {verb} {series.name} on {root}: conflicting {', '.join(files)} "
            f"({lines}). Nothing was changed",
            files,
        )
    to_do = State.APPLIED if reverse else State.APPLICABLE
    todo = [s.patch for s in (reversed(statuses) if reverse else statuses) if s.state is to_do]
    if not todo:
        return
    if not allow_dirty:
        _refuse_dirty(series, root, verb, ours_ok=reverse)
    _write(series, root, todo, reverse=reverse)


def _refuse_dirty(series: Series, root: Path, verb: str, *, ours_ok: bool) -> None:
    dirty = dirty_files(root, series.files())
    if dirty and ours_ok:
        # Reverting right after `apply`: the uncommitted changes may be exactly the series.
        with tempfile.TemporaryDirectory(prefix="ess-patch-revert-") as tmp:
            scratch = Path(tmp)
            scratch_copy(root, series.files(), scratch)
            for patch in reversed(series.patches):
                git_apply(scratch, patch, reverse=True)
            dirty = [
                f
                for f in dirty
                if not (scratch / f).is_file() or (scratch / f).read_bytes() != committed(root, f)
            ]
    if dirty:
        raise DirtyTreeError(
            f"refusing to {verb} {series.name}: {root} has uncommitted changes in "
            f"{', '.join(dirty)} (commit or stash them first, or pass --allow-dirty)"
        )


def _write(series: Series, root: Path, patches: list[Path], *, reverse: bool) -> None:
    done: list[Path] = []
    for patch in patches:
        result = git_apply(root, patch, reverse=reverse)
        if result.returncode != 0:
            for undo in reversed(done):
                git_apply(root, undo, reverse=not reverse)
            raise PatchsetError(
                f"git apply{' --reverse' if reverse else ''} {patch.name} failed on {root} "
                f"after its check passed; undid the {len(done)} patch(es) already written: "
                f"{result.stderr.strip()}"
            )
        done.append(patch)
