"""Which trajectory weights suit a run: one rule, shared by ``ess-patch analyze`` (a user's
dumps) and ``ess-patch demo --scenario weights`` (the measurement behind it).

The rule (docs/which-weights.md has the numbers it comes from). With per-token train/rollout
differences ``d_t`` of variance ``v`` and responses of L tokens, product weights
``exp(sum d_t)`` are log-normal with variance ``L v``, so even with no policy lag
``rho ~ max(1/B, exp(-L v))``: the engines' numerics alone brake the LR. Geometric weights
``exp(mean d_t)`` have variance ``v / L``: their rho stays near 1 unless the policy moved a lot
per token. So:

- product's on-policy scale (sqrt rule) at least :data:`BRAKE_SCALE`, or product weights'
  mean scale on the run's own rollouts at least that (mismatch and lag together do not
  brake them: tokens that are not independent can sum to less than ``L v``): product weights,
  as VCPO ships them, brake on lag only;
- below it, but ``L v`` at most :data:`CALIBRATION_MAX_LV` (on-policy rho >= exp(-3) = 0.05):
  product with ``--ess-lr-calibrate-rollouts K`` (rho divided by the on-policy rho it
  measures);
- on-policy rho below that: the mismatch alone takes the ESS to a few trajectories, where it
  swings from rollout to rollout and lag has little room left to lower it (measured at B = 64:
  at ``L v = 3.4`` calibrated product weights still cut the LR by 20% at lag 0 and told lag 8
  from lag 0 barely; at ``L v >= 7`` not at all): geometric weights;
- and geometric weights "never act" on a run whose every rollout keeps a geometric scale of at
  least :data:`NEVER_ACTS_SCALE`.

No I/O; torch only in :func:`token_stats`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BRAKE_SCALE",
    "CALIBRATE_ROLLOUTS",
    "CALIBRATION_MAX_LV",
    "NEVER_ACTS_SCALE",
    "Advice",
    "Evidence",
    "TokenStats",
    "advise",
    "evidence",
    "on_policy_product_rho",
    "sqrt_scale",
    "token_stats",
]

#: A scale below this (a cut of more than 10% of the LR) counts as braking.
BRAKE_SCALE = 0.9
#: Above this ``L v`` (on-policy product rho below exp(-3)) calibration cannot separate lag
#: from the mismatch.
CALIBRATION_MAX_LV = 3.0
#: A weight mode whose every rollout keeps at least this scale (a cut under 1%) never acts.
NEVER_ACTS_SCALE = 0.99
#: The calibration length suggested (``--ess-lr-calibrate-rollouts``).
CALIBRATE_ROLLOUTS = 4
_FLOOR = 0.1  # the default floor, for the predicted scale


def sqrt_scale(rho: float, floor: float = _FLOOR) -> float:
    """The default rule: ``clamp(sqrt(rho), floor, 1)``."""
    return min(1.0, max(floor, math.sqrt(rho)))


def on_policy_product_rho(length: float, token_variance: float, trajectories: float) -> float:
    """Product weights' rho from the mismatch alone: ``max(1/B, exp(-L v))`` (log-normal
    weights of variance ``L v``; the ESS of B samples never falls below 1)."""
    floor = 1.0 / trajectories if trajectories >= 1 else 1.0
    return max(floor, math.exp(-length * token_variance))


@dataclass(frozen=True)
class Evidence:
    """What a run shows about its weights.

    Attributes:
        response_length: mean masked tokens per trajectory.
        mismatch: mean ``|train - rollout|`` log-prob per masked token (nats).
        token_variance: variance of ``train - rollout`` over the masked tokens.
        trajectories: trajectories per rollout (B, mean).
        geometric_scales / product_scales: per rollout, the scale of the default rule (sqrt,
            floor 0.1) with geometric / product weights.
        lag0: the log-probs are the rollout policy's own (no lag): the spread is the
            engines' mismatch alone. Else it may hold the lag too (a user's dumps).
    """

    response_length: float
    mismatch: float
    token_variance: float
    trajectories: float
    geometric_scales: Sequence[float] = ()
    product_scales: Sequence[float] = ()
    lag0: bool = False


@dataclass(frozen=True)
class Advice:
    """The recommendation and why (``lines``, for a reader)."""

    weights: str  # "product", "product+calibration", "geometric", or "none" (nothing measured)
    product_on_policy_rho: float
    product_on_policy_scale: float
    product_brakes_on_policy: bool
    product_saturated: bool
    geometric_never_acts: bool
    lines: tuple[str, ...]

    def text(self) -> str:
        return "\n".join(self.lines)

    def as_dict(self) -> dict:
        return {
            "weights": self.weights,
            "product_on_policy_rho": self.product_on_policy_rho,
            "product_on_policy_scale": self.product_on_policy_scale,
            "product_brakes_on_policy": self.product_brakes_on_policy,
            "product_saturated": self.product_saturated,
            "geometric_never_acts": self.geometric_never_acts,
            "text": list(self.lines),
        }


def advise(evidence: Evidence) -> Advice:
    """The weights for this run, by the rule of the module docstring; ``"none"`` when the
    evidence holds no measured trajectory (no advice can be read from nothing)."""
    e = evidence
    if e.trajectories < 1 or e.response_length <= 0:
        return _nothing_measured()
    rho = on_policy_product_rho(e.response_length, e.token_variance, e.trajectories)
    scale = sqrt_scale(rho)
    observed_quiet = bool(e.product_scales) and _mean(e.product_scales) >= BRAKE_SCALE
    brakes = scale < BRAKE_SCALE and not observed_quiet
    saturated = e.response_length * e.token_variance > CALIBRATION_MAX_LV
    geometric_quiet = bool(e.geometric_scales) and min(e.geometric_scales) >= NEVER_ACTS_SCALE
    source = (
        "the engines' mismatch alone (lag 0)"
        if e.lag0
        else "the spread of train - rollout in these log-probs (mismatch, and any lag)"
    )
    lines = [
        f"responses of {e.response_length:.0f} tokens, mean |train - rollout| "
        f"{e.mismatch:.3g} nats/token (variance {e.token_variance:.3g}), "
        f"{e.trajectories:.0f} trajectories per rollout",
        f"product weights from {source}: rho ~ exp(-L v) = {rho:.3g}, "
        f"LR x {scale:.3g} (sqrt rule, floor 0.1)",
    ]
    if e.product_scales:
        lines.append(
            f"product weights on these rollouts: mean LR scale {_mean(e.product_scales):.3g}, "
            f"min {min(e.product_scales):.3g}"
        )
    if e.geometric_scales:
        lines.append(
            f"geometric weights on these rollouts: mean LR scale "
            f"{_mean(e.geometric_scales):.3g}, min {min(e.geometric_scales):.3g}"
            + (" -> they never act here (every cut < 1%)" if geometric_quiet else "")
        )
    if not brakes:
        weights = "product"
        why = (
            "on these rollouts they cut the LR by under"
            if scale < BRAKE_SCALE
            else "the mismatch costs under"
        )
        lines.append(
            f"-> product weights (--ess-lr-weight-mode product): {why} "
            f"{100 * (1 - BRAKE_SCALE):.0f}% of the LR at this length, so they brake on lag"
        )
    elif not saturated:
        weights = "product+calibration"
        lines.append(
            f"-> product weights brake even without lag here (LR x {scale:.2g}): use "
            f"--ess-lr-weight-mode product --ess-lr-calibrate-rollouts {CALIBRATE_ROLLOUTS} "
            "(rho divided by the on-policy rho of the first rollouts), or geometric weights"
        )
    else:
        weights = "geometric"
        lines.append(
            f"-> geometric weights (the default): the mismatch alone takes product weights to "
            f"rho {rho:.2g} (L v = {e.response_length * e.token_variance:.2g} > 3), where "
            "their ESS swings from rollout to rollout and no lag signal is left to calibrate"
            + (
                "; geometric weights do not act on this run either: ESS-LR has little to go "
                "on at this mismatch (lower it first: e.g. routing replay for MoE)"
                if geometric_quiet
                else ""
            )
        )
    return Advice(weights, rho, scale, brakes, saturated, geometric_quiet, tuple(lines))


def _nothing_measured() -> Advice:
    """No masked token with finite log-probs anywhere: say so rather than advise."""
    lines = (
        "nothing was measured: no trajectory with a masked response token and finite "
        "train and rollout log-probs in these rollouts",
        "-> no advice on the weights: check that the dumps hold log_probs, "
        "rollout_log_probs and loss_masks of the policy's responses",
    )
    return Advice("none", math.nan, math.nan, False, False, False, lines)


@dataclass(frozen=True)
class TokenStats:
    """One rollout's masked train - rollout differences: how many, and their moments."""

    tokens: int
    trajectories: int
    abs_sum: float
    sum: float
    square_sum: float

    @property
    def variance(self) -> float:
        if self.tokens == 0:
            return 0.0
        mean = self.sum / self.tokens
        return max(0.0, self.square_sum / self.tokens - mean * mean)


def token_stats(
    log_probs: Sequence, rollout_log_probs: Sequence, loss_masks: Sequence
) -> TokenStats:
    """The masked, finite ``train - rollout`` differences of one rollout's trajectories
    (1-D tensors, as ``compute_ess_lr`` takes them), in float64."""
    import torch

    tokens = trajectories = 0
    abs_sum = total = square_sum = 0.0
    for lp, rlp, mask in zip(log_probs, rollout_log_probs, loss_masks, strict=True):
        d = lp.double() - rlp.double()
        d = d[(mask != 0) & torch.isfinite(d)]
        if d.numel() == 0:
            continue
        tokens += d.numel()
        trajectories += 1
        abs_sum += float(d.abs().sum())
        total += float(d.sum())
        square_sum += float((d * d).sum())
    return TokenStats(tokens, trajectories, abs_sum, total, square_sum)


def evidence(
    stats: Sequence[TokenStats],
    geometric_scales: Sequence[float] = (),
    product_scales: Sequence[float] = (),
    *,
    lag0: bool = False,
) -> Evidence:
    """A run's :class:`Evidence` from its rollouts' :class:`TokenStats` (the variance is each
    rollout's own, averaged: a drift between rollouts is not per-token noise)."""
    measured = [s for s in stats if s.tokens]
    tokens = sum(s.tokens for s in measured)
    trajectories = sum(s.trajectories for s in measured)
    if not measured:
        return Evidence(0.0, 0.0, 0.0, 0.0, tuple(geometric_scales), tuple(product_scales), lag0)
    return Evidence(
        response_length=tokens / trajectories,
        mismatch=math.fsum(s.abs_sum for s in measured) / tokens,
        token_variance=math.fsum(s.variance for s in measured) / len(measured),
        trajectories=trajectories / len(measured),
        geometric_scales=tuple(geometric_scales),
        product_scales=tuple(product_scales),
        lag0=lag0,
    )


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)
