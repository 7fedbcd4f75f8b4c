"""The per-step ledger: ESS measured inside the loss, decided at each optimizer step.

A rollout is one step that holds every trajectory; granularity ``"step"`` (and any run whose
pre-training log-probs are not the current policy's) measures each optimizer step over its
own mini-batch instead. The loss hooks of an integration add each call's per-trajectory
partial sums (``[B, 3]`` float64 tables, CP-local, see
:func:`~ess_patch.estimator.trajectory_stats`) with :func:`add`; at ``optimizer.step()``, which
every rank of the DP x CP x PP world enters together, the step wrappers call
:func:`begin_step`, which reduces the step's tables (CP sum per trajectory, DP gather on the
last pipeline stage, then a PP broadcast from it; faults and settings in the envelopes, as
for a rollout), arms the result for that step and empties the ledger.

This module sits between the collectives and the optimizer-step wrappers: the step calls
down into it, the loss hooks add to it; nothing here calls back up into an integration.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from . import collapse_warning
from .config import EssLrConfig
from .errors import EssPatchRuntimeError
from .result import EssLrResult, check_scale
from .state import STATE, StepCountError, is_scaled

__all__ = ["LedgerRun", "add", "begin_step", "fail", "new_rollout", "running", "start", "stop"]

logger = logging.getLogger(__name__)


@dataclass
class LedgerRun:
    """One rollout measured inside the loss: where its steps are reduced and how.

    ``reason``: why it is measured inside the loss (said in errors and logs). ``shadow``:
    keep each step's result for the logs (``STATE.shadow``), never scale. ``context``: what
    the integration's loss hook needs to build its tables (opaque here).
    """

    framework: str
    reason: str
    config: EssLrConfig
    cp_group: Any = None
    dp_group: Any = None
    pp_group: Any = None
    is_pp_last: bool = True
    shadow: bool = False
    context: Any = None
    steps: int = 0  # optimizer steps of this rollout so far


def start(run: LedgerRun | None) -> None:
    """Measure the coming optimizer steps inside the loss (None: stop). Either way the
    ledger is emptied: a new rollout starts."""
    STATE.ledger_run = run
    STATE.ledger = []
    STATE.ledger_error = None


def stop() -> None:
    """Stop measuring inside the loss (the next rollout decides again)."""
    start(None)


def running() -> LedgerRun | None:
    """The rollout measured inside the loss now, or None."""
    return STATE.ledger_run


def add(table: Any) -> None:
    """Add one loss call's per-trajectory ``[B, 3]`` partial sums to this step's ledger."""
    STATE.ledger.append(table)


def fail(error: BaseException) -> None:
    """Record an error met while adding to the ledger; the step raises it on every rank."""
    if STATE.ledger_error is None:
        STATE.ledger_error = error


def begin_step(optimizer: Any) -> float | None:
    """The scale for the optimizer step of ``optimizer`` that starts now, or None.

    The step wrappers call it once per real step, on every rank. While a rollout is measured
    inside the loss (:func:`start`) it first reduces this step's ledger (collectives: every
    rank of the world enters the step together) and arms the result; else the armed result
    holds for every step of the rollout.

    Raises:
        StepCountError: a rollout of granularity "rollout" measured inside the loss reached
            its second optimizer step (on every rank alike, before any collective).
        whatever the reduction raises (a fault, on every rank alike); nothing is updated.
    """
    if not is_scaled(optimizer):
        return None
    run = STATE.ledger_run
    if run is not None:
        result = _step_result(run)
        if result is not None:
            check_scale(result.scale)
            STATE.armed = result
            STATE.applied = None
    return STATE.armed.scale if STATE.armed is not None else None


def _step_result(run: LedgerRun) -> EssLrResult | None:
    """This step's result from the ledger (None in shadow mode: logged, never applied)."""
    run.steps += 1
    if run.steps > 1 and run.config.granularity != "step":
        if not run.shadow:
            # every rank enters its n-th step together: all raise here, before any collective
            raise StepCountError(
                f"ess-patch ({run.framework}): ESS-LR measures this run inside the policy loss "
                f"({run.reason}), one result per optimizer step, and this rollout has more "
                "than one optimizer step: one ESS over the whole rollout (granularity "
                "'rollout') does not exist before its first step. Set --ess-lr-granularity step "
                "(or ESS_LR_GRANULARITY=step). Nothing was updated in this step"
            )
        if run.steps == 2:
            # shadow mode never changes an LR: say what the logs hold instead of stopping a run
            logger.warning(
                "ess-patch (%s): shadow mode measures this run inside the policy loss (%s), "
                "and this rollout has more than one optimizer step: the logged results are per "
                "optimizer step, not one per rollout",
                run.framework,
                run.reason,
            )
    tables, error = STATE.ledger, STATE.ledger_error
    STATE.ledger, STATE.ledger_error = [], None
    if run.is_pp_last and not tables and error is None:
        # every micro-batch of the last stage runs the loss: none seen means the policy loss
        # is not hooked here; never a measured-looking no-op
        error = EssPatchRuntimeError(
            f"ess-patch ({run.framework}): no policy-loss call reached ESS-LR in this optimizer "
            f"step, which it measures inside the loss ({run.reason}); is {run.framework}'s "
            "policy loss patched (ess_patch.install())?"
        )
    # granularity 'rollout' counts its rollout once towards calibration (shadow mode's later
    # steps of the same rollout are logged, never counted: K counts rollouts, not steps)
    result = reduce_tables(
        tables, error, run, count=run.steps == 1 or run.config.granularity == "step"
    )
    # the step wrapper applies the result (arm_now=False)
    collapse_warning.publish(
        result, run.config, framework=run.framework, shadow=run.shadow, arm_now=False
    )
    return None if run.shadow else result


def reduce_tables(
    tables: list, error: BaseException | None, run: LedgerRun, *, count: bool = True
) -> EssLrResult:
    """One step's result from its tables, identical on every rank (collectives: CP sum per
    trajectory, DP gather on the last stage, then a PP broadcast from it). ``error``: this
    rank failed to build its tables; every rank raises. ``count``: whether it may count
    towards calibration."""
    import torch

    from .compute import compute_ess_lr_from_stats
    from .reduction import broadcast_from_last_stage

    out = None
    failure: BaseException | None = None
    try:
        if run.is_pp_last:
            table = (
                torch.cat(tables)
                if tables
                else torch.zeros((0, 3), dtype=torch.float64)  # no sample of this step here
            )
            out = compute_ess_lr_from_stats(
                table,
                config=run.config,
                cp_group=run.cp_group,
                dp_group=run.dp_group,
                error=error,
                count=count,
            )
    except Exception as exc:
        failure = exc  # the other pipeline stages learn of it through the broadcast
    return broadcast_from_last_stage(out, run.pp_group, config=run.config, error=failure)


def new_rollout(*, shadow: bool = False) -> None:
    """Forget the previous rollout before a new one is measured: its ledger, its shadow
    result and (unless ``shadow``: shadow mode never touches what the step applies) its
    armed scale."""
    stop()
    STATE.shadow = None
    if not shadow:
        STATE.armed = None
