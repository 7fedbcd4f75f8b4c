"""The errors ess-patch raises on purpose: one base, each also the built-in it always was.

``except EssPatchError`` catches whatever ess-patch raises on purpose (a bad argument, a bad
rollout, a missing host symbol, a refused step); ``except ValueError`` (or the class's other
built-in base) keeps catching what it caught before. :class:`EssLrNotAppliedError` (alias
:data:`FailClosedError`) is the one fail-closed type: ESS-LR (or a setting that needs it) was
requested and would not be applied, so the run stops on every rank instead of training at the
scheduled LR.

Nothing here imports torch or another ess-patch module: every layer may raise these.
"""

from __future__ import annotations

__all__ = [
    "EssLrNotAppliedError",
    "EssPatchError",
    "EssPatchKeyError",
    "EssPatchRuntimeError",
    "EssPatchTypeError",
    "EssPatchValueError",
    "FailClosedError",
    "FailClosedNotImplementedError",
]


class EssPatchError(Exception):
    """Base of every error ess-patch raises on purpose."""


class EssPatchValueError(EssPatchError, ValueError):
    """A value ess-patch was given is out of range or inconsistent (the message names it)."""


class EssPatchTypeError(EssPatchError, TypeError):
    """An argument of the wrong kind (the message names it and what is expected)."""


class EssPatchRuntimeError(EssPatchError, RuntimeError):
    """A state ess-patch cannot go on from (the message says what to do)."""


class EssPatchKeyError(EssPatchError, KeyError):
    """A name ess-patch does not know (the message lists the known ones)."""


class EssLrNotAppliedError(EssPatchError, RuntimeError):
    """ESS-LR was requested and would not be applied: the run stops here (on every rank),
    naming what is missing. ``ESS_PATCH_ALLOW_UNSCALED=1`` is the explicit opt-out. The one
    fail-closed type (also :data:`FailClosedError`)."""


#: The one fail-closed type, by what it is.
FailClosedError = EssLrNotAppliedError


class FailClosedNotImplementedError(FailClosedError, NotImplementedError):
    """The fail-closed refusal of a backend or an API ess-patch does not scale (verl's FSDP
    actor, its Tinker worker): also a ``NotImplementedError``, as it was before."""
