"""The per-process rollout state: what is armed, with which settings, who is the policy.

The optimizer wrappers and the framework hooks read :data:`STATE`; :func:`reset` puts it
back to a fresh process's state (for tests). What ``install()`` patched is ``install``'s own.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import EssLrConfig
from .result import EssLrResult, check_scale

__all__ = [
    "ROLES",
    "STATE",
    "StepCountError",
    "arm",
    "arm_steps",
    "armed",
    "armed_steps",
    "begin_step",
    "disarm",
    "exclude",
    "ledger_add",
    "ledger_fail",
    "ledger_take",
    "note_applier",
    "reset",
    "set_role",
    "set_step_source",
]

logger = logging.getLogger(__name__)

#: "policy": optimizers in this process are scaled when a result is armed (default).
#: "critic": never scaled, even if something arms a result.
ROLES = ("policy", "critic")


@dataclass
class _EssState:
    armed: EssLrResult | None = None
    # granularity "step": this rollout's results, one per optimizer step, and the index of the
    # next step's; ``armed`` is then the current (or next) step's result
    steps: tuple[EssLrResult, ...] | None = None
    step_index: int = 0
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
    # per host framework, the shape chosen for each aspect (integrations.shapes); cleared by
    # uninstall() and reset(), since tests change the host modules between installs
    shapes: dict[str, dict[str, Any]] = field(default_factory=dict)
    # inspect.Signature per wrapped host function (integrations.binding)
    signatures: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    local: threading.local = field(default_factory=threading.local)
    # measured inside the policy loss (integrations.loss_ledger): this optimizer step's
    # per-trajectory partial sums ([B, 3] tables, one per loss call), the first error met while
    # adding to it (raised at the step, on every rank alike), and what reduces it at the step
    ledger: list = field(default_factory=list)
    ledger_error: BaseException | None = None
    step_source: Callable[[Any], EssLrResult | None] | None = None


STATE = _EssState()


def reset() -> None:
    """Forget everything armed or marked (does not unwrap patches: use ``uninstall``)."""
    STATE.armed = None
    STATE.steps = None
    STATE.step_index = 0
    STATE.shadow = None
    STATE.role = "policy"
    STATE.excluded = weakref.WeakSet()
    STATE.local = threading.local()
    STATE.warned_no_effect = False
    STATE.applied_elsewhere = False
    STATE.shapes = {}
    STATE.signatures = weakref.WeakKeyDictionary()
    set_step_source(None)


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
    _drop_steps()
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
    _drop_steps()
    STATE.armed = None


class StepCountError(RuntimeError):
    """An optimizer step ran after every per-step result armed for the rollout was used."""


def arm_steps(results: Sequence[EssLrResult | float]) -> tuple[EssLrResult, ...]:
    """Arm one result (or bare scale) per coming optimizer step: granularity ``"step"``.

    Each real optimizer update takes the next one, in order (:func:`begin_step`), whatever
    the optimizer nesting; a step that is skipped on inf/nan grads (``(False, None, None)``)
    still takes its own, since the results follow the mini-batches. ``armed()`` is the
    current step's result (before the first step: the first one), so the metrics a host
    logs after a step are that step's. An optimizer step after the last one raises
    :class:`StepCountError` before anything changes; fewer steps than results is logged
    (warning) when the next rollout arms. An empty sequence arms nothing.

    Raises:
        ValueError: a scale outside (0, 1] (nothing is armed).
    """
    items = tuple(r if isinstance(r, EssLrResult) else EssLrResult.from_scale(r) for r in results)
    for item in items:
        check_scale(item.scale)
    _drop_steps()
    STATE.steps = items or None
    STATE.step_index = 0
    STATE.armed = items[0] if items else None
    logger.debug("armed %d per-step ESS-LR results", len(items))
    return items


def armed_steps() -> tuple[EssLrResult, ...] | None:
    """The per-step results armed for this rollout (``arm_steps``), or None."""
    return STATE.steps


def begin_step(optimizer: Any) -> float | None:
    """The scale for the optimizer step of ``optimizer`` that starts now, or None.

    The step wrappers call it once per real step, on every rank. With a step source set
    (:func:`set_step_source`: ESS measured inside the loss) it first reduces this step's ledger
    through it (collectives: every rank of the world enters the step together) and arms the
    result. With per-step results armed it moves ``armed()`` to this step's result (an
    optimizer that is never scaled moves nothing).

    Raises:
        StepCountError: every per-step result of the rollout was already used.
        whatever the step source raises (a fault, on every rank alike); nothing is updated.
    """
    if not _scaled(optimizer):
        return None
    source = STATE.step_source
    if source is not None:
        result = source(optimizer)
        if result is not None:
            check_scale(result.scale)
            STATE.armed = result
    steps = STATE.steps
    if steps is not None:
        index = STATE.step_index
        if index >= len(steps):
            raise StepCountError(
                f"ESS-LR granularity 'step': optimizer step {index + 1} of this rollout has no "
                f"result; {len(steps)} were armed, one per mini-batch the rollout was split into. "
                "The train loop runs more optimizer steps per rollout than that split found "
                "(check how the integration splits the rollout, or use granularity 'rollout'). "
                "Nothing was updated"
            )
        STATE.armed = steps[index]
        STATE.step_index = index + 1
    return STATE.armed.scale if STATE.armed is not None else None


def _drop_steps() -> None:
    steps, used = STATE.steps, STATE.step_index
    if steps is not None and used < len(steps):
        logger.warning(
            "ESS-LR granularity 'step': the last rollout had %d per-step results but only %d "
            "optimizer step(s) used them (a train step that did not call optimizer.step()?); if "
            "that step was not the last, the steps after it used their predecessors' results",
            len(steps),
            used,
        )
    STATE.steps = None
    STATE.step_index = 0


def set_role(role: str) -> None:
    """Declare this process's role; a ``"critic"`` process is never scaled."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    STATE.role = role


def exclude(optimizer: Any) -> None:
    """Never scale this optimizer instance (e.g. a critic's optimizer in a shared process)."""
    STATE.excluded.add(optimizer)


def _scaled(optimizer: Any) -> bool:
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
    if result is None or not _scaled(optimizer):
        return None
    return result.scale


def set_step_source(source: Callable[[Any], EssLrResult | None] | None) -> None:
    """Decide each optimizer step's result at the step: ``source(optimizer)``, called by
    :func:`begin_step` on every rank, reduces this step's ledger (or returns None: leave the
    step alone). None stops it. Either way the ledger is emptied (a new rollout starts)."""
    STATE.step_source = source
    STATE.ledger = []
    STATE.ledger_error = None


def ledger_add(table: Any) -> None:
    """Add one loss call's per-trajectory ``[B, 3]`` partial sums to this step's ledger."""
    STATE.ledger.append(table)


def ledger_fail(error: BaseException) -> None:
    """Record an error met while adding to the ledger; the step raises it on every rank."""
    if STATE.ledger_error is None:
        STATE.ledger_error = error


def ledger_take() -> tuple[list, BaseException | None]:
    """This step's tables and error, and an empty ledger for the next step."""
    tables, error = STATE.ledger, STATE.ledger_error
    STATE.ledger = []
    STATE.ledger_error = None
    return tables, error
