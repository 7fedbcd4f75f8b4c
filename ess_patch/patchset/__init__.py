"""The ``patches/`` series: find them, recognise a target tree, check, apply and revert them.

Layout (shipped inside the wheel as ``ess_patch/patches``)::

    patches/<component>/<version or commit>/NNNN-<subject>.patch   (git format-patch files)

Everything goes through ``git apply`` (``--check`` to tell "applicable", ``--reverse --check``
to tell "already applied"), which works on plain directories too: an unpacked sdist or wheel,
a site-packages folder, a Megatron-LM checkout. A series is applied whole or not at all: it is
first checked patch by patch on a scratch copy of the files it touches, and a failure while
writing the real tree undoes what was written.

A tree is recognised by one detector per component (its version from the sources, git HEAD,
or the blob-id fingerprint the series itself records: see ``trees``); a tree matching no
known version gets ``version=None``, and the series is then chosen by ``git apply --check``.

Modules (each imports only those above it):

- ``series``: the errors; series folder names (release or commit); :class:`Series`,
  :func:`discover`, :func:`patches_dir`.
- ``trees``: running git (``git apply`` on a folder; HEAD, committed bytes, dirty files);
  :class:`Tree`, :data:`~.trees.DETECTORS`, :func:`detect`; blob-id fingerprints; scratch
  copies.
- ``apply``: :class:`State`, :class:`~.apply.PatchStatus`; check, apply, revert a series.
- ``twin``: whether a patched tree is the exact twin of ``install()`` (symbols parsed with
  ``ast``, :func:`~.twin.gaps`, :func:`series_gaps`) and :func:`select_series`.
- ``cli``: ``ess-patch patches``, with the megatron-core release table behind
  ``ess-patch patches compat`` (it downloads wheels).

This package exports what the tests, ``tools/`` and the README use.
"""

from __future__ import annotations

from .apply import State, apply_series, check_series, revert_series
from .series import (
    ENV_PATCHES_DIR,
    ConflictError,
    DirtyTreeError,
    Series,
    UnknownTreeError,
    discover,
    patches_dir,
)
from .trees import Tree, detect
from .twin import class_defines, definition, module_path, select_series, series_gaps

__all__ = [
    "ENV_PATCHES_DIR",
    "ConflictError",
    "DirtyTreeError",
    "Series",
    "State",
    "Tree",
    "UnknownTreeError",
    "apply_series",
    "check_series",
    "class_defines",
    "definition",
    "detect",
    "discover",
    "module_path",
    "patches_dir",
    "revert_series",
    "select_series",
    "series_gaps",
]
