"""The per-process rollout state: what is armed, with which settings, who is the policy.

The optimizer wrappers and the framework hooks read :data:`STATE`; :func:`reset` puts it
back to a fresh process's state (for tests). What ``install()`` patched is ``install``'s own.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from .config import EssLrConfig
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
    # a stale rollout met while calibrating: warned once per calibration
    calibration_warned: bool = False
    # the policy version the trainer's weights were last published to the rollout engines as
    # (miles' weight_updater.weight_version; None: no publish seen in this process), and
    # whether it trained since (then no sample is on-policy): policy_version.py's "current"
    trainer_version: str | None = None
    trained_since_publish: bool = False


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
    for cache in list(STATE.caches):
        cache.clear()
    STATE.ledger_run = None
    STATE.ledger = []
    STATE.ledger_error = None
    STATE.calibration = (0.0, 0.0)
    STATE.calibration_key = None
    STATE.calibration_warned = False
    STATE.trainer_version = None
    STATE.trained_since_publish = False


def arm(result_or_scale: EssLrResult | float) -> EssLrResult:
    """Arm a rollout's result (or a bare scale in (0, 1]) for the coming optimizer steps.

    It stays armed until the next ``arm`` or ``disarm``: every step of the rollout uses it.

    Raises:
        ValueError: a scale outside (0, 1]; or the auto-install (``ESS_PATCH_AUTO_INSTALL``)
            failed on a bad setting in this process and nothing else applies the scale (the
            message names the variable). RuntimeError: it failed for another reason.
            Nothing is armed then.
    """
    if isinstance(result_or_scale, EssLrResult):
        check_scale(result_or_scale.scale)
        result = result_or_scale
    else:
        result = EssLrResult.from_scale(result_or_scale)
    check_something_applies()
    STATE.armed = result
    logger.debug(
        "armed ESS-LR scale %.6g (rho %.6g, status %s)", result.scale, result.rho, result.status
    )
    return result


def note_applier() -> None:
    """Record that something besides ``install()`` applies armed scales (``attach``, a
    vendored optimizer step), for :func:`arm`'s warning."""
    STATE.applied_elsewhere = True


def check_something_applies() -> None:
    """Warn once (or raise, after a failed auto-install) when nothing in this process would
    apply an armed scale: :func:`arm`, and a rollout measured inside the loss, call it."""
    # Nothing reads STATE.armed unless install() wrapped something, an optimizer was
    # attached, or a vendored tree decorated its optimizer steps: say so, once.
    # install() sets config and uninstall() clears it: config is set while install() is in effect
    if STATE.config is not None or STATE.applied_elsewhere:
        return
    failure = _autoinstall_failure()
    if failure is not None:
        raise failure
    if STATE.warned_no_effect:
        return
    STATE.warned_no_effect = True
    logger.warning(
        "ess_patch.arm(): nothing in this process applies the armed scale (install() was not "
        "called, no optimizer is attach()ed, no vendored optimizer step): optimizer steps use "
        "the scheduled LR unchanged. Call ess_patch.install() or ess_patch.attach(optimizer) "
        "first. (Said once per process.)"
    )


def _autoinstall_failure() -> Exception | None:
    """The error for an ``arm()`` in a process whose auto-install failed, or None."""
    # install.py imports this module, so its record is read where it lives, not imported
    installation = getattr(sys.modules.get(f"{__package__}.install"), "INSTALLATION", None)
    error = getattr(installation, "autoinstall_error", None)
    if error is None:
        return None
    kind = ValueError if isinstance(error, ValueError) else RuntimeError
    return kind(
        "ess_patch.arm(): ESS-LR was requested in this process (ESS_PATCH_AUTO_INSTALL) but "
        f"its auto-install failed at start-up: {type(error).__name__}: {error}. Nothing "
        "applies the scale, so nothing was armed; fix that and restart the process (or call "
        "ess_patch.install() / ess_patch.attach(optimizer) yourself)"
    )


def armed() -> EssLrResult | None:
    """What the next optimizer step will use, or None (no-op)."""
    return STATE.armed


def disarm() -> None:
    """Reset to the no-op: the coming optimizer steps use the scheduled LR unchanged."""
    STATE.armed = None


class StepCountError(RuntimeError):
    """A rollout measured inside the loss ran more optimizer steps than its granularity
    allows (one ESS per rollout does not exist before the first of several steps)."""


def set_role(role: str) -> None:
    """Declare this process's role; a ``"critic"`` process is never scaled."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
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
