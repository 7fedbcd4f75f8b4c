"""Telling a snapshot without git by its files: their git blob ids against the ones a series
records (the ``index <before>..<after>`` lines of ``git format-patch --full-index``)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from .series import DIFF_HEADER, Series

__all__ = ["blob_id", "fingerprint"]

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
