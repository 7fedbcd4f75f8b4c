"""The early warning, live: every measured result of the run goes to the rule
(``ess_patch.early_warning``), and one WARNING says so when it fires.

The integrations call :func:`observe` once per result they compute (once per rollout, or per
optimizer step with granularity "step"), on every rank alike, in shadow mode and with ESS-LR
on; the rule's state lives in ``state.STATE`` and only global rank 0 (or a process without
torch.distributed) logs, so a run says it once, not once per rank. Logging only: nothing here
changes an LR or a result.

``publish()`` is the one path every framework takes with a result it computed: the warning
first, then the result kept for shadow mode's logs (``STATE.shadow``) or armed for the coming
optimizer steps (or handed back for the caller to apply: the ledger's step wrapper, verl's
per-mini-batch arming).
"""

from __future__ import annotations

import logging
import math
import sys

from .config import EssLrConfig
from .early_warning import MEANING, EarlyWarning
from .guard import arm
from .result import UNMEASURED, EssLrResult
from .state import STATE

__all__ = ["observe", "publish", "restart"]

logger = logging.getLogger(__name__)


def restart() -> None:
    """Start the rule over (a new run in the same process), keeping the rest of the state."""
    STATE.early_warning = None


def _rule(config: EssLrConfig) -> EarlyWarning:
    rule = STATE.early_warning
    if rule is None or (rule.threshold, rule.patience) != (
        config.warn_threshold,
        config.warn_patience,
    ):
        rule = STATE.early_warning = EarlyWarning(config.warn_threshold, config.warn_patience)
    return rule


def observe(result: EssLrResult, config: EssLrConfig, *, applied: bool, framework: str) -> bool:
    """Feed one result's rho to the early-warning rule; returns whether it fired (on every
    rank alike). ``applied``: ESS-LR scales this run's LR (False: shadow mode).

    Unmeasured results, a non-finite rho and a critic process are left out; a
    ``warn_threshold`` of 0 turns the rule off."""
    if (
        config.warn_threshold <= 0.0
        or STATE.role != "policy"
        # attributes, not result.measured: no call back into result.py on the hook's path
        or result.status in (*UNMEASURED, "manual")
        or not math.isfinite(result.rho)
    ):
        return False
    rule = _rule(config)
    if not rule.update(result.rho):
        return False
    if _logs_here():
        logger.warning(message(rule, config, result, applied=applied, framework=framework))
    return True


def publish(
    result: EssLrResult,
    config: EssLrConfig,
    *,
    framework: str,
    shadow: bool,
    arm_now: bool = True,
) -> EssLrResult:
    """Publish one computed result, on every rank alike: :func:`observe` it, then in shadow
    mode keep it for the logs (never applied), else arm it (``arm_now``; False: the caller
    applies it) with the fail-closed ``ess_patch.guard.arm``. Returns ``result``."""
    observe(result, config, applied=not shadow, framework=framework)
    if shadow:
        STATE.shadow = result
    elif arm_now:
        arm(result)
    return result


def message(
    rule: EarlyWarning, config: EssLrConfig, result: EssLrResult, *, applied: bool, framework: str
) -> str:
    """The warning for a rule that has just fired on ``result``."""
    unit = "optimizer step" if config.granularity == "step" else "rollout"
    (first, _), (last, rho) = rule.last_firing[0], rule.last_firing[-1]
    values = ", ".join(f"{r:.3g}" for _, r in rule.last_firing)
    if applied:
        state = (
            f"ESS-LR is on and scales this {unit}'s LR by {result.scale:.3g}; if rho stays "
            "this low, lower the staleness (fewer optimizer steps behind the rollout policy)"
        )
    else:
        state = (
            "ESS-LR is in shadow mode: no LR is scaled. Turn it on (--use-ess-lr in place of "
            "--ess-lr-shadow; verl: ESS_LR_ENABLE=1 in place of ESS_LR_SHADOW=1) or lower "
            "the staleness (fewer optimizer steps behind the rollout policy)"
        )
    return (
        f"ess-patch ({framework}): ESS early warning at {unit} {last} (counted from 0 in this "
        f"process): rho {values} over {unit}s {first}-{last}, below {rule.threshold:g} for "
        f"{rule.patience} in a row (now {rho:.3g}, {config.weight_mode} weights). {MEANING}. "
        f"{state}. Said once; again only after {rule.patience} {unit}s at or above "
        f"{rule.threshold:g} (--ess-lr-warn-threshold / ESS_LR_WARN_THRESHOLD, 0: off; "
        "--ess-lr-warn-patience)."
    )


def _logs_here() -> bool:
    """Global rank 0, or a process without an initialised torch.distributed."""
    # read from sys.modules: the auto-install path must not import torch
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return True
    return dist.get_rank() == 0
