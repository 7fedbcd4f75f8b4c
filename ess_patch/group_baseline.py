"""VCPO's baseline over a data-parallel group: every prompt group's ``b*``, wherever its rows are.

Frameworks split a rollout over DP ranks by their own schedule (slime's and miles'
``build_dp_schedule`` balances lengths, so a prompt's ``n`` samples land on several ranks).
:func:`dp_min_variance_baseline` all-gathers each rank's ``(group id, reward, squared norm,
log-weight)`` rows (a few floats per trajectory: a rollout's worth is kilobytes), computes
:func:`ess_patch.baseline.min_variance_baseline` on the whole rollout, identically on every
rank, and returns this rank's rows. A group split over ranks so gets the one ``b*`` of all its
rows, as on one process; a test checks DP2 against the single-process result.

Faults are every rank's: a rank whose inputs are malformed still joins the first gather with
an error flag, so that every rank raises (it, its own error, the others
:class:`~ess_patch.estimator.InvalidInputsElsewhereError` naming it) instead of waiting in the
second. Non-finite values travel and make ``min_variance_baseline`` raise on every rank alike.

What the frameworks substitute (``R_i - b*`` for ``R_i - mean``) and the metrics they log
(``train/ess_baseline_shift``, ``train/ess_baseline_fallback_groups``) come from the returned
:class:`GroupBaseline`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .baseline import min_variance_baseline
from .errors import EssPatchValueError
from .estimator import InvalidInputsElsewhereError
from .reduction import all_gather_rows, group_size

__all__ = ["GroupBaseline", "dp_min_variance_baseline"]

_F64 = torch.float64
#: Group ids travel as float64: exact below 2**53.
_MAX_ID = 2**53


@dataclass(frozen=True)
class GroupBaseline:
    """This rank's rows of the rollout's baseline, and the rollout's totals (every rank alike)."""

    #: ``[n]`` float64, this rank's ``R_i - b*_{g(i)}``, in its input order.
    advantages: torch.Tensor
    #: ``[n]`` float64, ``b*_{g(i)}`` of this rank's rows.
    baselines: torch.Tensor
    #: Mean over the rollout's groups of ``b* - (the group's mean reward)``.
    shift: float
    #: Mean over the rollout's groups of ``|b* - mean|``.
    abs_shift: float
    #: Groups in the rollout, and those whose norms were all zero (baseline = their mean).
    groups: int
    fallback_groups: int
    #: Groups whose rows sit on more than one DP rank (reduced over DP, not refused).
    split_groups: int


def _rows(
    rewards: Any, group_ids: Any, sq_grad_norms: Any, log_weights: Any
) -> tuple[torch.Tensor | None, str | None]:
    """``[n, 4]`` float64 (id, reward, sq norm, log-weight), or the reason it cannot be built."""
    try:
        r = torch.as_tensor(rewards).to(_F64).flatten()
        ids = torch.as_tensor(group_ids)
        sq = torch.as_tensor(sq_grad_norms).to(_F64).flatten()
    except (TypeError, ValueError, RuntimeError) as exc:
        return None, f"the inputs are not numeric tensors ({exc})"
    if ids.is_floating_point() or ids.is_complex() or ids.dim() != 1:
        return None, f"group_ids must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}"
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= _MAX_ID):
        return None, "group_ids must lie in [0, 2**53)"
    lw = (
        torch.zeros_like(r)
        if log_weights is None
        else torch.as_tensor(log_weights).to(_F64).flatten()
    )
    sizes = {"rewards": r.numel(), "group_ids": ids.numel(), "sq_grad_norms": sq.numel()}
    if log_weights is not None:
        sizes["log_weights"] = lw.numel()
    if len(set(sizes.values())) != 1:
        return None, f"the inputs' lengths differ ({sizes}); give one value per trajectory"
    return torch.stack([ids.to(_F64), r, sq, lw], dim=1), None


def dp_min_variance_baseline(
    rewards: Any,
    group_ids: Any,
    sq_grad_norms: Any,
    *,
    log_weights: Any = None,
    dp_group: Any = None,
) -> GroupBaseline:
    """Every group's minimum-variance baseline over the DP group; this rank's advantages.

    Args:
        rewards: ``[n]`` this rank's rewards (the framework's, before its group baseline).
        group_ids: ``[n]`` integer prompt-group ids, the same id for a group on every rank.
        sq_grad_norms: ``[n]`` squared gradient norms (``norm_pass`` or the in-step hooks).
        log_weights: ``[n]`` ``log w_i``, or ``None`` when the norms already carry ``w_i^2``.
        dp_group: the data-parallel group (``None``: this process holds the whole rollout).

    Raises:
        ValueError: this rank's inputs are malformed (every other rank:
            ``InvalidInputsElsewhereError`` naming it).
        NonFiniteBaselineInputError: a NaN/inf anywhere in the rollout (on every rank).
    """
    rows, problem = _rows(rewards, group_ids, sq_grad_norms, log_weights)
    size = group_size(dp_group, "DP")
    if size > 1:
        n = 0 if rows is None else rows.shape[0]
        flags = [float(problem is not None), n, float(log_weights is not None)]
        head = all_gather_rows(torch.tensor(flags, dtype=_F64), dp_group, "DP")
        bad = [k for k in range(size) if head[k, 0] > 0]
        if problem is not None:
            raise EssPatchValueError(f"dp_min_variance_baseline: {problem}")
        if bad:
            raise InvalidInputsElsewhereError(
                f"dp_min_variance_baseline: the baseline's inputs on DP rank(s) {bad} are "
                "malformed (that rank raised the detailed error); every rank stops here rather "
                "than waiting in a collective"
            )
        if len(set(head[:, 2].tolist())) > 1:
            with_weights = [k for k in range(size) if head[k, 2] > 0]
            raise EssPatchValueError(
                f"dp_min_variance_baseline: DP rank(s) {with_weights} passed log_weights and "
                "the others did not; pass them on every rank or on none"
            )
        counts = [int(c) for c in head[:, 1].tolist()]
        width = max(counts)
        padded = torch.zeros(width, 4, dtype=_F64)
        padded[: rows.shape[0]] = rows
        gathered = all_gather_rows(padded.flatten(), dp_group, "DP").reshape(size, width, 4)
        everything = torch.cat([gathered[k, : counts[k]] for k in range(size)])
        owner = torch.cat([torch.full((c,), k) for k, c in enumerate(counts)])
        mine = owner == dist.get_rank(dp_group)
    else:
        if problem is not None:
            raise EssPatchValueError(f"dp_min_variance_baseline: {problem}")
        everything, owner = rows, torch.zeros(rows.shape[0], dtype=torch.long)
        mine = torch.ones(rows.shape[0], dtype=torch.bool)
    ids = everything[:, 0].long()
    res = min_variance_baseline(
        None if log_weights is None else everything[:, 3],
        everything[:, 1],
        everything[:, 2],
        ids,
    )
    count = torch.zeros(res.group_ids.numel(), dtype=_F64).index_add(
        0, torch.searchsorted(res.group_ids, ids), torch.ones_like(everything[:, 1])
    )
    total = torch.zeros_like(count).index_add(
        0, torch.searchsorted(res.group_ids, ids), everything[:, 1]
    )
    shift = res.baselines - total / count
    where = torch.searchsorted(res.group_ids, ids)
    ranks_per_group = torch.zeros(res.group_ids.numel(), size, dtype=torch.bool)
    ranks_per_group[where, owner] = True
    return GroupBaseline(
        advantages=res.advantages[mine],
        baselines=res.per_trajectory[mine],
        shift=float(shift.mean()) if shift.numel() else 0.0,
        abs_shift=float(shift.abs().mean()) if shift.numel() else 0.0,
        groups=int(res.group_ids.numel()),
        fallback_groups=res.fallback_groups,
        split_groups=int((ranks_per_group.sum(1) > 1).sum()),
    )
