"""Wrap and unwrap attributes by dotted path with wrapt, keeping a record of each patch.

One :class:`Target` names one attribute (``module``, ``owner`` class path, ``attribute``)
and the wrapper to put around it. :func:`apply` wraps it once (never twice) and returns a
:class:`Patch` that :func:`revert` uses to put the exact original object back.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import wrapt

from . import errors
from .errors import EssPatchError

__all__ = [
    "MISSING",
    "UNWRAPPED",
    "VENDORED",
    "VENDORED_MARK",
    "WRAPPED",
    "FailClosedError",
    "MissingTargetError",
    "Patch",
    "Target",
    "apply",
    "is_ours",
    "is_vendored",
    "revert",
    "target_status",
]

logger = logging.getLogger(__name__)

_MARK = "_self_ess_patch_target"
#: Set by ess_patch.vendored's decorators on the functions a patches/ diff decorated.
VENDORED_MARK = "__ess_patch_vendored__"


class MissingTargetError(EssPatchError, ImportError):
    """A symbol ess-patch must wrap does not exist in the installed version."""


class FailClosedError(errors.FailClosedError, MissingTargetError):
    """A host imported after ``install()`` fits no shape while ESS-LR is requested in this
    process: the host's import fails with it (the run stops) instead of the integration being
    rolled back and the policy training at the scheduled LR."""


@dataclass(frozen=True)
class Target:
    """One attribute to wrap: ``module.owner.attribute`` (owner "" = a module-level name).

    ``required`` targets must exist and be defined by the owner itself; optional ones
    (present only in some versions, or inherited) are skipped. ``decorator``: the
    ``ess_patch.vendored`` decorator a ``patches/`` diff puts on this definition (None: no
    series decorates it, or the target is another module's re-import of a decorated one).
    ``vendored`` False: install() only; no ``patches/`` series carries it (a vendored tree gets
    it from ``install()``, which still wraps it there), and the twin check leaves it out.
    """

    module: str
    owner: str
    attribute: str
    wrapper: Callable[..., Any]
    required: bool = True
    decorator: str | None = None
    vendored: bool = True

    @property
    def path(self) -> str:
        return ".".join(p for p in (self.module, self.owner, self.attribute) if p)


@dataclass(frozen=True)
class Patch:
    target: Target
    holder: Any  # the class or module whose attribute was replaced
    original: Any  # exactly what holder.__dict__[attribute] was


def _holder(target: Target) -> Any:
    """The imported module or class that should define ``target``, or None."""
    holder: Any = sys.modules.get(target.module)
    for part in filter(None, target.owner.split(".")):
        holder = getattr(holder, part, None)
    return holder


def is_ours(obj: Any) -> bool:
    """Whether ``obj`` is a wrapper that ess-patch put in place."""
    return isinstance(obj, wrapt.FunctionWrapper) and getattr(obj, _MARK, None) is not None


def is_vendored(obj: Any) -> bool:
    """Whether ``obj`` already carries an ess-patch call site from a vendored diff."""
    return bool(getattr(obj, VENDORED_MARK, False))


#: What :func:`target_status` reports.
MISSING, VENDORED, WRAPPED, UNWRAPPED = "missing", "vendored", "wrapped", "unwrapped"


def target_status(target: Target) -> str:
    """What is at ``target`` now: :data:`MISSING` (its owner does not define it, or its module
    is not imported), :data:`VENDORED` (a ``patches/`` diff's call site), :data:`WRAPPED` (by
    ``install()`` in this process) or :data:`UNWRAPPED` (``install()`` would wrap it)."""
    holder = _holder(target)
    value = vars(holder).get(target.attribute) if holder is not None else None
    if value is None:
        return MISSING
    if is_vendored(value):
        return VENDORED
    return WRAPPED if is_ours(value) else UNWRAPPED


def apply(target: Target, supported: str) -> Patch | None:
    """Wrap ``target`` (its module must be imported). Returns None when skipped.

    Raises:
        MissingTargetError: a required target is missing, naming its path and ``supported``.
    """
    holder = _holder(target)
    own = vars(holder) if holder is not None else {}
    if target.attribute not in own:
        if target.required:
            raise MissingTargetError(
                f"ess-patch cannot find {target.path} (it must be defined there, not inherited). "
                f"Supported versions: {supported}. Install a supported version, or use "
                "ess_patch.attach(optimizer) on your optimizer instance instead"
            )
        logger.debug("ess-patch: optional target %s not present; skipped", target.path)
        return None
    original = own[target.attribute]
    if is_vendored(original):
        logger.info(
            "ess-patch: %s already calls ess-patch (vendored diff from patches/); not wrapping it",
            target.path,
        )
        return None
    if is_ours(original):
        if getattr(original, _MARK) == target.path:
            logger.debug("ess-patch: %s is already wrapped; not wrapping twice", target.path)
            return None
        # Our wrapper of another site, imported here by name (``from .log_utils import
        # log_train_step`` after log_utils was wrapped): not wrapped twice, but recorded, so
        # that revert() puts the plain function back here too.
        logger.debug("ess-patch: %s holds the wrapper of %s", target.path, getattr(original, _MARK))
        return Patch(target=target, holder=holder, original=original.__wrapped__)
    # Ownership was checked above: wrap_function_wrapper alone would also "wrap" an
    # inherited method by shadowing it on the subclass, and then scale twice.
    name = ".".join(p for p in (target.owner, target.attribute) if p)
    wrapper = wrapt.wrap_function_wrapper(target.module, name, target.wrapper)
    setattr(wrapper, _MARK, target.path)
    logger.debug("ess-patch: wrapped %s", target.path)
    return Patch(target=target, holder=holder, original=original)


def unwrap_copy(target: Target) -> bool:
    """Put the plain function back at ``target`` if it holds one of our wrappers that no
    :class:`Patch` records: a module that copied a wrapper by name (``from .loss import f``)
    while it was still being imported, when its integration was rolled back before that
    module finished. Returns whether something was put back."""
    holder = _holder(target)
    current = vars(holder).get(target.attribute) if holder is not None else None
    if not is_ours(current):
        return False
    setattr(holder, target.attribute, current.__wrapped__)
    return True


def revert(patch: Patch) -> None:
    """Put the original back, if our wrapper is still the one in place."""
    current = vars(patch.holder).get(patch.target.attribute)
    if not is_ours(current):
        logger.warning(
            "ess-patch: %s was replaced by someone else after ess-patch wrapped it; "
            "leaving it as it is",
            patch.target.path,
        )
        return
    setattr(patch.holder, patch.target.attribute, patch.original)
