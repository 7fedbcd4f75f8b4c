"""The per-process rollout state: what is armed, with which settings, who is the policy.

The optimizer wrappers and the framework hooks read :data:`STATE`; :func:`reset` puts it
back to a fresh process's state (for tests). What ``install()`` patched is ``install``'s own.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Protocol, TypeVar

from .config import EssLrConfig
from .errors import EssPatchError, EssPatchValueError
from .result import EssLrResult, check_scale

__all__ = [
    "ROLES",
    "STATE",
    "StepCountError",
    "arm",
    "armed",
    "disarm",
    "exclude",
    "is_scaled",
    "note_applier",
    "register_cache",
    "reset",
    "set_role",
]

logger = logging.getLogger(__name__)

#: "policy": optimizers in this process are scaled when a result is armed (default).
#: "critic": never scaled, even if something arms a result.
ROLES = ("policy", "critic")


class _Part:
    """One owner's share of :data:`STATE`: the fields it declares, and how :func:`reset` puts
    them back. Each part names its owner module; ``keep`` lists what outlives ``reset()``
    (what ``install()`` set up, undone by ``uninstall()`` only)."""

    keep: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def reset_part(cls, state: Any) -> None:
        """Set this part's fields of ``state`` back to their defaults, but for ``keep``."""
        for f in fields(cls):
            if f.name in cls.keep:
                continue
            value = f.default_factory() if f.default_factory is not MISSING else f.default
            setattr(state, f.name, value)


@dataclass
class _Arming(_Part):
    """state.py (``arm``/``disarm``, ``set_role``, ``exclude``, ``note_applier``) and
    collapse_warning.publish (shadow mode's copy)."""

    armed: EssLrResult | None = None
    # shadow mode's last result: logged, never read by the optimizer wrappers
    shadow: EssLrResult | None = None
    role: str = "policy"
    excluded: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    # something besides install() applies an armed scale: an attach()ed optimizer, or an
    # optimizer step decorated by a vendored (patches/) tree
    applied_elsewhere: bool = False


@dataclass
class _Installed(_Part):
    """install.py: what ``install()`` was given and wrapped; ``reset()`` keeps it all."""

    keep: ClassVar[tuple[str, ...]] = ("config", "step_wrappers")
    # the settings install() was given, for hosts whose args lack the --ess-lr-* flags
    config: EssLrConfig | None = None
    # installed integrations that wrap optimizer steps (guard.py reads it)
    step_wrappers: set = field(default_factory=set)


@dataclass
class _Guarding(_Part):
    """guard.py: the fail-closed checks around every optimizer step."""

    # torch's global step-hook handle: registered once per process, kept by reset()
    keep: ClassVar[tuple[str, ...]] = ("step_guard",)
    step_guard: Any = None
    # arm() with nothing to apply it: warned once (reset() re-arms the warning)
    warned_no_effect: bool = False
    # the scale the last optimizer step applied since the current result was armed, read back
    # from its param groups (guard.note_applied); None: no step yet. The metrics report it.
    applied: float | None = None
    # a failed request (the auto-install's error: every step raises it) and the opt-out
    # refusals already logged
    request_error: BaseException | None = None
    opt_outs_logged: set = field(default_factory=set)
    # per-thread flags of the step in progress (lr.py's scaling, loss_ledger's calls)
    local: threading.local = field(default_factory=threading.local)


@dataclass
class _Caches(_Part):
    """The integrations' memory of the host (shapes chosen, signatures): each cache lives
    with its integration and registers here (:func:`register_cache`); ``reset()`` clears
    every one and keeps the registrations."""

    caches: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    @classmethod
    def reset_part(cls, state: Any) -> None:
        for cache in list(state.caches):
            cache.clear()


@dataclass
class _Ledger(_Part):
    """ledger.py: measured inside the policy loss."""

    # the rollout so measured (a LedgerRun), this optimizer step's per-trajectory partial sums
    # ([B, 3] tables, one per loss call) and the first error met while adding to them (raised
    # at the step, on every rank alike)
    ledger_run: Any = None
    ledger: list = field(default_factory=list)
    ledger_error: BaseException | None = None


@dataclass
class _Calibration(_Part):
    """calibration.py (``calibrate_rollouts``) and collapse_warning.py (the early warning)."""

    # (results counted so far, sum of their rho), the same on every rank that computes, and
    # the fingerprint of the config it was counted under (another config starts a new one)
    calibration: tuple[float, float] = (0.0, 0.0)
    calibration_key: tuple[float, ...] | None = None
    # a stale rollout met while calibrating: warned once per calibration
    calibration_warned: bool = False
    # the early-warning rule fed with this process's results; a new rule (another threshold
    # or patience) starts it over
    early_warning: Any = None


@dataclass
class _PolicyVersion(_Part):
    """policy_version.py's "current", as the integrations see publishes (rl_hooks.py)."""

    # the version the trainer's weights were last published to the rollout engines as
    # (miles' weight_updater.weight_version; None: no publish seen in this process), and
    # whether it trained since (then no sample is on-policy)
    trainer_version: str | None = None
    trained_since_publish: bool = False


@dataclass
class _Baseline(_Part):
    """VCPO's baseline (integrations/baseline_hook.py and its framework callers)."""

    # the model a train actor lends to the advantage hook for the duration of train_actor,
    # and the last rollout's record
    baseline_model: Any = None
    baseline: dict | None = None


_PARTS: tuple[type[_Part], ...] = (
    _Arming,
    _Installed,
    _Guarding,
    _Caches,
    _Ledger,
    _Calibration,
    _PolicyVersion,
    _Baseline,
)


@dataclass
class _EssState(
    _Baseline, _PolicyVersion, _Calibration, _Ledger, _Caches, _Guarding, _Installed, _Arming
):
    """Every part's fields, on one object (flat: ``STATE.armed``, ``STATE.ledger``...)."""


STATE = _EssState()


class Cache(Protocol):
    """Something an integration remembers about the host, forgotten by :func:`reset`."""

    def clear(self) -> None: ...


C = TypeVar("C", bound=Cache)


def register_cache(cache: C) -> C:
    """Have :func:`reset` clear ``cache`` (held weakly: it lives with its owner); returns it.

    ``cache`` must hash by identity (a plain object, not a dict)."""
    STATE.caches.add(cache)
    return cache


def reset() -> None:
    """Forget everything armed or marked (does not unwrap patches: use ``uninstall``).

    Each owner's part resets itself (:class:`_Part`)."""
    for part in _PARTS:
        part.reset_part(STATE)


def arm(result_or_scale: EssLrResult | float) -> EssLrResult:
    """Set a rollout's result (or a bare scale in (0, 1]) for the coming optimizer steps.

    It stays armed until the next ``arm`` or ``disarm``: every step of the rollout uses it.
    This is the bare setter: ``ess_patch.arm`` (:func:`ess_patch.guard.arm`) first checks
    that something applies the scale, and framework hooks arm through it.

    Raises:
        ValueError: a scale outside (0, 1]; nothing is armed then.
    """
    if isinstance(result_or_scale, EssLrResult):
        check_scale(result_or_scale.scale)
        result = result_or_scale
    else:
        result = EssLrResult.from_scale(result_or_scale)
    STATE.armed = result
    STATE.applied = None  # no step has applied this result yet
    logger.debug(
        "armed ESS-LR scale %.6g (rho %.6g, status %s)", result.scale, result.rho, result.status
    )
    return result


def note_applier() -> None:
    """Record that something besides ``install()`` applies armed scales (``attach``, a
    vendored optimizer step), for the guard's check (:func:`ess_patch.guard.check_applier`)."""
    STATE.applied_elsewhere = True


def armed() -> EssLrResult | None:
    """What the next optimizer step will use, or None (no-op)."""
    return STATE.armed


def disarm() -> None:
    """Reset to the no-op: the coming optimizer steps use the scheduled LR unchanged."""
    STATE.armed = None
    STATE.applied = None


class StepCountError(EssPatchError, RuntimeError):
    """A rollout measured inside the loss ran more optimizer steps than its granularity
    allows (one ESS per rollout does not exist before the first of several steps)."""


def set_role(role: str) -> None:
    """Declare this process's role; a ``"critic"`` process is never scaled."""
    if role not in ROLES:
        raise EssPatchValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    STATE.role = role


def exclude(optimizer: Any) -> None:
    """Never scale this optimizer instance (e.g. a critic's optimizer in a shared process)."""
    STATE.excluded.add(optimizer)


def is_scaled(optimizer: Any) -> bool:
    """Whether ``optimizer`` is ever scaled in this process (policy role, not excluded)."""
    if STATE.role != "policy":
        return False
    try:
        return optimizer not in STATE.excluded
    except TypeError:  # not weak-referenceable: cannot have been excluded
        return True


def scale_for(optimizer: Any) -> float | None:
    """The scale to apply to ``optimizer``'s step now, or None to leave it untouched."""
    result = STATE.armed
    if result is None or not is_scaled(optimizer):
        return None
    return result.scale
