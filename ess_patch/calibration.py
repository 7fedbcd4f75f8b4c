"""A base ratio calibrated from the run's own first rollouts (``calibrate_rollouts = K``).

Why: the rollout engine's log-probs differ from the trainer's even on-policy (bf16 inference
kernels, MoE routing), by a per-token noise ``d_t`` of variance ``s^2``. Product weights sum it
over the response, so on-policy ``rho ~ exp(-L s^2)`` at response length L: a 256-token
response at ``s^2 = 0.03`` (mean ``|d|`` 0.139, MoE with routing replay) cut the LR to x 0.26
in the demo's measurement (docs/which-weights.md) before the policy moved at all. Dividing
rho by the on-policy rho measured on the first K results leaves what staleness adds
(``exp(-L s_stale^2)`` when the two are independent): the brake acts on the policy's lag,
not on the engines' numerics.

What happens: the first K measured results (status "ok") apply scale 1 (status
"calibrating"); from the next one on, rho is divided by ``base_ratio x`` their mean rho
(``EssLrResult.calibrated_ratio``, logged as ``ess_lr_base_ratio``). Unmeasured rollouts and
non-finite ones (the floor) are not counted.

Every rank that computes a result agrees: each holds ``(count, sum of rho)`` in
``state.STATE``, the pair travels in the envelopes of the CP and DP collectives, and every
rank continues from the most advanced one (:func:`~ess_patch.reduction.agreed_calibration`),
so a rank that restarted catches up instead of diverging. With ``compute_ess_lr(pp_group=)``
pipeline stages receive the last stage's result, calibration included; an integration that
computes on every stage over its own groups (Megatron-RL, verl's TP/CP ranks) calibrates each
stage alike from the same inputs. The pair is tied to the config it was counted under: a
different config (another weight mode, another K) starts a new calibration, and so do
:func:`restart`, ``state.reset()`` and a restart of the whole job. To keep a ratio, pass the
logged value as ``base_ratio``.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from .config import EssLrConfig
from .estimator import scale_of
from .result import EssLrResult
from .state import STATE

__all__ = ["apply", "held", "restart"]

logger = logging.getLogger(__name__)


def _key(config: EssLrConfig) -> tuple[float, ...]:
    return tuple(config.fingerprint())


def held(config: EssLrConfig) -> tuple[float, float]:
    """The ``(count, sum of rho)`` this rank holds for ``config`` (``(0, 0)``: none yet, or it
    was counted under another config)."""
    if STATE.calibration_key != _key(config):
        return (0.0, 0.0)
    return STATE.calibration


def restart() -> None:
    """Start a new calibration (e.g. a new run in the same process) without forgetting the
    rest of the state, as ``state.reset()`` would."""
    STATE.calibration = (0.0, 0.0)
    STATE.calibration_key = None


def _hold(config: EssLrConfig, pair: tuple[float, float]) -> None:
    STATE.calibration = pair
    STATE.calibration_key = _key(config)


def apply(result: EssLrResult, config: EssLrConfig, agreed: tuple[float, float]) -> EssLrResult:
    """``result`` under calibration, from the ``(count, sum of rho)`` the ranks agreed on
    (:func:`~ess_patch.reduction.agreed_calibration`); records the new pair in the state.

    Identical on every rank given identical inputs (a pure function of them and the config).
    """
    k = config.calibrate_rollouts
    count, total = agreed
    if count >= k:
        _hold(config, agreed)
        ratio = config.base_ratio * total / count
        if result.status == "ok":
            return replace(
                result, scale=scale_of(result.rho, config, ratio), calibrated_ratio=ratio
            )
        return replace(result, calibrated_ratio=ratio) if result.measured else result
    if result.status != "ok":
        _hold(config, agreed)
        return result
    count, total = count + 1, total + result.rho
    _hold(config, (count, total))
    if count == 1:
        logger.info(
            "ESS-LR calibrating the base ratio over the first %d measured rollouts: the LR is "
            "not scaled meanwhile",
            k,
        )
    if count == k:
        logger.info(
            "ESS-LR base ratio calibrated: %.6g = base_ratio %.6g x mean rho %.6g of the first "
            "%d rollouts (%s weights); from the next rollout on, scale = %s(rho / %.6g). To keep "
            "it after a restart, set ESS_LR_BASE_RATIO=%.6g (--ess-lr-base-ratio) and "
            "ESS_LR_CALIBRATE_ROLLOUTS=0 (--ess-lr-calibrate-rollouts)",
            config.base_ratio * total / count,
            config.base_ratio,
            total / count,
            k,
            config.weight_mode,
            config.rule,
            config.base_ratio * total / count,
            config.base_ratio * total / count,
        )
    return replace(result, scale=1.0, status="calibrating")
