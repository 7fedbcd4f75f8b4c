"""``compute_ess_lr``: the estimator and the reductions, in the order every rank runs them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from . import estimator
from .config import EssLrConfig
from .reduction import all_gather_summaries, all_reduce_trajectory_stats, group_size
from .result import EssLrResult

__all__ = ["compute_ess_lr"]


@torch.no_grad()  # log-probs that require grad must not grow an autograd graph here
def compute_ess_lr(
    log_probs: Sequence[torch.Tensor] | None,
    rollout_log_probs: Sequence[torch.Tensor] | None,
    loss_masks: Sequence[torch.Tensor] | None,
    *,
    config: EssLrConfig | None = None,
    cp_group: object | None = None,
    dp_group: object | None = None,
    prepare_masks: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]] | None = None,
) -> EssLrResult:
    """ESS, rho and LR scale of one rollout, identical on every rank.

    Args:
        log_probs: per trajectory, this rank's train-side log-probs of the response
            tokens (1-D float tensors).
        rollout_log_probs: the same tokens' log-probs from the rollout (inference) engine.
        loss_masks: per trajectory, aligned with the tensors above; non-zero = counted.
        config: the rule (defaults to ``EssLrConfig()``).
        cp_group: context-parallel group whose ranks hold other chunks of the *same*
            trajectories (one all-reduce when its size > 1).
        dp_group: data-parallel group (without CP) whose ranks hold *other* trajectories
            (one all-gather when its size > 1).
        prepare_masks: applied to ``loss_masks`` first, under the same error handling as
            the validation (e.g. slicing full-length masks to this CP rank's tokens).

    A rank whose ``log_probs`` or ``rollout_log_probs`` is None has missing inputs: it
    still enters every collective and every rank returns the no-op (``status="missing"``).
    Under CP such a rank must still pass ``loss_masks`` (or the other log-probs) so that
    it knows how many trajectories its CP peers reduce.

    Raises:
        ValueError / TypeError: inputs that do not line up (names the sample index). In a
            single process before anything else; with groups, after the collectives (which
            the rank still enters with an "invalid" flag), and then every rank raises.
        estimator.NonFiniteLogProbError: a NaN/inf log-ratio with ``nonfinite="raise"``,
            raised on every rank alike, naming the data-parallel rank and the sample index.
    """
    config = EssLrConfig() if config is None else config
    if not isinstance(config, EssLrConfig):
        raise TypeError(
            f"config must be an EssLrConfig (from ess_patch import EssLrConfig), got "
            f"{type(config).__name__}; build one with EssLrConfig(**your_dict)"
        )
    distributed = group_size(cp_group) > 1 or group_size(dp_group) > 1
    missing = log_probs is None or rollout_log_probs is None
    error: Exception | None = None
    try:
        if prepare_masks is not None and loss_masks is not None:
            loss_masks = prepare_masks(loss_masks)
        if missing:
            stats = _missing_table(log_probs, rollout_log_probs, loss_masks, cp_group)
        else:
            if loss_masks is None:
                raise ValueError("loss_masks is None but log-probs were given; pass the masks too")
            stats = estimator.trajectory_stats(log_probs, rollout_log_probs, loss_masks)
    except (TypeError, ValueError) as exc:
        if not distributed:
            raise
        # Still enter every collective, so that the peers fail with us instead of hanging.
        error = exc
        stats = _missing_table(None, None, loss_masks if _is_sequence(loss_masks) else None, None)
    flags = estimator.Flags(missing=missing, invalid=error is not None)
    stats, flags = all_reduce_trajectory_stats(stats, flags, cp_group)
    # The data-parallel rank names the culprit identically on every CP peer of the batch.
    dp_rank = dist.get_rank(dp_group) if group_size(dp_group) > 1 else 0
    summary = estimator.summarize(stats, config, rank=dp_rank, flags=flags)
    summary = estimator.combine(all_gather_summaries(summary, dp_group))
    if error is not None:
        raise error
    return estimator.finalize(summary, config)


def _is_sequence(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, torch.Tensor)


def _missing_table(
    log_probs: Sequence[torch.Tensor] | None,
    rollout_log_probs: Sequence[torch.Tensor] | None,
    loss_masks: Sequence[torch.Tensor] | None,
    cp_group: object | None,
) -> torch.Tensor:
    """A zero table of the right height, so a rank with missing inputs can join the CP sum."""
    known = next((s for s in (loss_masks, log_probs, rollout_log_probs) if s is not None), None)
    if known is None:
        if group_size(cp_group) > 1:
            raise ValueError(
                "compute_ess_lr: all inputs are None on a rank of a CP group of size > 1; pass "
                "loss_masks so that this rank joins its CP peers' reduction with the right size"
            )
        return torch.zeros((0, 3), dtype=torch.float64)
    device = known[0].device if len(known) else torch.device("cpu")
    return torch.zeros((len(known), 3), dtype=torch.float64, device=device)
