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

Modules (each imports only those above it):

- ``errors``: the exceptions.
- ``git``: running git (``git apply`` on a folder; HEAD, committed bytes, dirty files).
- ``versions``: series folder names (release or commit): sorting and matching.
- ``series``: where the series are, :class:`Series`, :func:`discover`.
- ``blobs``: git blob ids of a tree's files against a series' ``index`` lines.
- ``trees``: :class:`Tree`, :data:`DETECTORS`, :func:`detect`.
- ``apply``: :class:`State`, :class:`PatchStatus`; check, apply, revert a series.
- ``symbols``: classes, methods and decorators of a source tree, parsed with ``ast``.
- ``gaps``: whether a patched tree is the exact twin of ``install()`` (:data:`TWINS`).
- ``selection``: :func:`select_series`.
"""

from __future__ import annotations

from .apply import (
    PatchStatus,
    State,
    apply_series,
    check_series,
    conflicting_files,
    revert_series,
)
from .blobs import blob_id, fingerprint
from .errors import ConflictError, DirtyTreeError, PatchsetError, UnknownTreeError
from .gaps import (
    TWINS,
    VENDORED_DECORATOR,
    Twin,
    call_site_gaps,
    megatron_core_gaps,
    series_gaps,
)
from .git import dirty_files
from .selection import select_series
from .series import ENV_PATCHES_DIR, Series, discover, patch_files, patches_dir
from .symbols import class_defines, decorated_methods, defined_methods
from .trees import DETECTORS, Tree, detect

__all__ = [
    "DETECTORS",
    "ENV_PATCHES_DIR",
    "TWINS",
    "VENDORED_DECORATOR",
    "ConflictError",
    "DirtyTreeError",
    "PatchStatus",
    "PatchsetError",
    "Series",
    "State",
    "Tree",
    "Twin",
    "UnknownTreeError",
    "apply_series",
    "blob_id",
    "call_site_gaps",
    "check_series",
    "class_defines",
    "conflicting_files",
    "decorated_methods",
    "defined_methods",
    "detect",
    "dirty_files",
    "discover",
    "fingerprint",
    "megatron_core_gaps",
    "patch_files",
    "patches_dir",
    "revert_series",
    "select_series",
    "series_gaps",
]
