"""The per-process rollout state: what is armed, with which settings, who is the policy.

The optimizer wrappers and the framework hooks read :data:`STATE`; :func:`reset` puts it
back to a fresh process's state (for tests). What ``install()`` patched is ``install``'s own.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

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


@dataclass
class _EssState:
    armed: EssLrResult | None = None
    # shadow mode's last result: logged, never read by the optimizer wrappers
    shadow: EssLrResult | None = None
    role: str = "policy"
    excluded: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    # the settings install() was given, for hosts whose args lack the --ess-lr-* flags
    config: EssLrConfig | None = None
    # something besides install() applies an armed scale: an attach()ed optimizer, or an
    # optimizer step decorated by a vendored (patches/) tree
    applied_elsewhere: bool = False
    # arm() with nothing to apply it: warned once (reset() re-arms the warning)
    warned_no_effect: bool = False
    # installed integrations that wrap optimizer steps (install.py keeps it, guard.py reads it)
    step_wrappers: set = field(default_factory=set)
    # the scale the last optimizer step applied since the current result was armed, read back
    # from its param groups (guard.note_applied); None: no step yet. The metrics report it.
    applied: float | None = None
    # guard.py: torch's global step-hook handle (registered once per process, kept by
    # reset()), a failed request (the auto-install's error: every step raises it) and the
    # opt-out refusals already logged
    step_guard: Any = None
    request_error: BaseException | None = None
    opt_outs_logged: set = field(default_factory=set)
    # what the integrations remember about the host (shapes chosen, signatures): each cache
    # lives with its integration and registers here, so that reset() clears every one
    caches: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    local: threading.local = field(default_factory=threading.local)
    # measured inside the policy loss (ledger.py): the rollout so measured (a LedgerRun), this
    # optimizer step's per-trajectory partial sums ([B, 3] tables, one per loss call) and the
    # first error met while adding to them (raised at the step, on every rank alike)
    ledger_run: Any = None
    ledger: list = field(default_factory=list)
    ledger_error: BaseException | None = None
    # calibrate_rollouts: (results counted so far, sum of their rho), the same on every rank
    # that computes (calibration.py), and the fingerprint of the config it was counted under
    # (another config starts a new calibration); reset() starts a new calibration
    calibration: tuple[float, float] = (0.0, 0.0)
    calibration_key: tuple[float, ...] | None = None
    # the early-warning rule fed with this process's results (collapse_warning.py); a new rule
    # (another threshold or patience) or reset() starts it over
    early_warning: Any = None
    # a stale rollout met while calibrating: warned once per calibration
    calibration_warned: bool = False
    # the policy version the trainer's weights were last published to the rollout engines as
    # (miles' weight_updater.weight_version; None: no publish seen in this process), and
    # whether it trained since (then no sample is on-policy): policy_version.py's "current"
    trainer_version: str | None = None
    trained_since_publish: bool = False
    # VCPO's baseline (integrations/baseline_hook.py): the model a train actor lends to the
    # advantage hook for the duration of train_actor, and the last rollout's record
    baseline_model: Any = None
    baseline: dict | None = None


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
    """Forget everything armed or marked (does not unwrap patches: use ``uninstall``)."""
    STATE.armed = None
    STATE.shadow = None
    STATE.role = "policy"
    STATE.excluded = weakref.WeakSet()
    STATE.local = threading.local()
    STATE.warned_no_effect = False
    STATE.applied_elsewhere = False
    STATE.applied = None
    STATE.request_error = None
    STATE.opt_outs_logged = set()
    for cache in list(STATE.caches):
        cache.clear()
    STATE.ledger_run = None
    STATE.ledger = []
    STATE.ledger_error = None
    STATE.calibration = (0.0, 0.0)
    STATE.calibration_key = None
    STATE.early_warning = None
    STATE.calibration_warned = False
    STATE.trainer_version = None
    STATE.trained_since_publish = False
    STATE.baseline_model = None
    STATE.baseline = None


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
