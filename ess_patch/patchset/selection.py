"""Choosing the series for a tree: its own version's, else the closest one that applies and
leaves no gap with ``install()``."""

from __future__ import annotations

from pathlib import Path

from packaging.version import InvalidVersion, Version

from .apply import PatchStatus, State, check_series
from .errors import UnknownTreeError
from .gaps import series_gaps
from .series import Series, discover, patches_dir
from .trees import Tree
from .versions import matches, version_key

__all__ = ["select_series"]


def _closeness(series_version: Version, mine: Version) -> tuple[int, ...]:
    a = (*series_version.release, 0, 0, 0)[:3]
    b = (*mine.release, 0, 0, 0)[:3]
    # distance in major, then minor, then patch; on a tie the older release first
    return (*(abs(x - y) for x, y in zip(a, b)), 0 if series_version <= mine else 1)


def _candidates(tree: Tree, series: list[Series]) -> list[Series]:
    """Series to try on ``tree``: its own version's, then by closeness of version."""
    exact = [s for s in series if tree.version and matches(s.version, tree.version)]
    rest = [s for s in series if s not in exact]
    try:
        mine = Version(tree.version) if tree.version else None
    except InvalidVersion:
        mine = None
    versioned = [(s, k[1]) for s in rest if (k := version_key(s.version))[0] == 0]
    other = [s for s in rest if version_key(s.version)[0] != 0]
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
        chosen = [s for s in available if matches(s.version, version)]
        if not chosen:
            raise UnknownTreeError(
                f"no {tree.component} series {version!r}; available: "
                f"{', '.join(s.version for s in available)}"
            )
        return chosen[0], check_series(chosen[0], tree.root)
    own = [s for s in available if tree.version and matches(s.version, tree.version)]
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
