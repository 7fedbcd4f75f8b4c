"""Public names removed since 0.1.0, each with what replaces it (CHANGELOG.md, "Removed").

A removed name says what to do instead however it is reached:

- ``ess_patch.X`` raises :class:`RemovedNameError`, an ``AttributeError``, so ``hasattr`` and
  ``getattr(ess_patch, X, default)`` still answer "absent";
- ``from ess_patch import X`` raises :class:`RemovedImportError`, an ``ImportError``: Python's
  ``from``-import replaces any ``AttributeError`` by a bare "cannot import name" and drops its
  message, so the module's ``__getattr__`` raises this one when the caller is a ``from``-import;
- a removed keyword argument raises :class:`RemovedKeywordError`, a ``TypeError``.

None of them is a drop-in, so none is a deprecation shim: each was replaced by a different
call (one granularity path in 0.2.0: a rollout is one optimizer step holding every trajectory).
"""

from __future__ import annotations

import dis
import sys
from collections.abc import Mapping

from .errors import EssPatchError, EssPatchTypeError

__all__ = [
    "REMOVED_KEYWORDS",
    "REMOVED_NAMES",
    "RemovedImportError",
    "RemovedKeywordError",
    "RemovedNameError",
    "removed_keyword",
    "removed_name",
]

_PER_STEP = (
    "call ess_patch.compute_ess_lr once per optimizer step, over the samples that step trains "
    "on, and ess_patch.arm(result) before that step"
)

#: name -> (release that removed it, what to use instead)
REMOVED_NAMES: dict[str, tuple[str, str]] = {
    "compute_ess_lr_steps": ("0.2.0", _PER_STEP),
    "arm_steps": ("0.2.0", _PER_STEP),
    "armed_steps": ("0.2.0", "ess_patch.armed() is the result the coming optimizer step uses"),
    "broadcast_steps_from_last_stage": (
        "0.2.0",
        "pass pp_group to ess_patch.compute_ess_lr, once per optimizer step, on every stage",
    ),
}

#: (function, keyword) -> (release that removed it, what to do instead)
REMOVED_KEYWORDS: dict[tuple[str, str], tuple[str, str]] = {
    ("compute_ess_lr", "prepare_masks"): (
        "0.2.0",
        "prepare the inputs first (e.g. slice the masks to this CP rank's tokens) and pass "
        "them; if preparing fails on a rank, still call compute_ess_lr(..., error=exc) there, "
        "so that every peer raises too instead of waiting in a collective",
    ),
}

_SEE = "(CHANGELOG.md, 'Removed')"


class RemovedNameError(EssPatchError, AttributeError):
    """``ess_patch.<name>`` for a name removed since 0.1.0; the message names its replacement."""


class RemovedImportError(EssPatchError, ImportError):
    """``from ess_patch import <name>`` for a name removed since 0.1.0; the message names its
    replacement."""


class RemovedKeywordError(EssPatchError, TypeError):
    """A keyword argument removed since 0.1.0; the message names what to do instead."""


def _message(name: str) -> str:
    release, instead = REMOVED_NAMES[name]
    return f"ess_patch.{name} was removed in ess-patch {release}: {instead} {_SEE}"


def _in_from_import(frame: object) -> bool:
    for instruction in dis.get_instructions(frame.f_code):
        if instruction.offset == frame.f_lasti:
            return instruction.opname == "IMPORT_FROM"
    return False


def removed_name(module: object, name: str) -> AttributeError | ImportError | None:
    """The error for reaching a removed ``name`` on ``module`` (None if it was never removed).

    Called from the package's ``__getattr__``: an :class:`RemovedImportError` when the caller
    is a ``from``-import, else a :class:`RemovedNameError`.
    """
    if name not in REMOVED_NAMES:
        return None
    # the frame that asked: the caller of the module's __getattr__ (the C code between them
    # adds no Python frame)
    if _in_from_import(sys._getframe(2)):
        return RemovedImportError(_message(name), name=name)
    return RemovedNameError(_message(name), name=name, obj=module)


def removed_keyword(function: str, keywords: Mapping[str, object]) -> TypeError:
    """The error for ``function`` called with keywords it does not take: a
    :class:`RemovedKeywordError` naming the replacement when one was removed, else the
    ``TypeError`` Python itself would raise."""
    for keyword in keywords:
        if (function, keyword) in REMOVED_KEYWORDS:
            release, instead = REMOVED_KEYWORDS[function, keyword]
            return RemovedKeywordError(
                f"{function}() no longer takes {keyword}= (removed in ess-patch {release}): "
                f"{instead} {_SEE}"
            )
    first = next(iter(keywords))
    return EssPatchTypeError(f"{function}() got an unexpected keyword argument {first!r}")
