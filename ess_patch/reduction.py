"""The collectives that make a rollout's ESS global: CP all-reduce, DP all-gather, PP broadcast.

Each runs only on an explicit group with more than one rank (``group=None`` would mean
WORLD in torch.distributed, so it is never passed). Every rank enters the same collectives
in the same order whatever its own inputs hold; the flags that decide the outcome
(missing inputs, non-finite values) travel inside the reduced tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .estimator import Flags
from .result import STATUSES, EssLrResult

__all__ = [
    "all_gather_summaries",
    "all_reduce_trajectory_stats",
    "broadcast_from_last_stage",
    "comm_device",
    "group_size",
]


def group_size(group: object | None) -> int:
    """World size of ``group``; 1 for None (no group given: single-process semantics)."""
    if group is None:
        return 1
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "a process group was passed to ess_patch but torch.distributed is not initialized; "
            "call torch.distributed.init_process_group first or pass no group"
        )
    return dist.get_world_size(group)


def comm_device(group: object) -> torch.device:
    """The device collectives on ``group`` need: the current CUDA device for NCCL, else CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_trajectory_stats(
    stats: torch.Tensor, flags: Flags, cp_group: object | None
) -> tuple[torch.Tensor, Flags]:
    """Sum the per-trajectory ``[sum, count, non-finite]`` table over the CP ranks.

    After this every CP rank holds the table of the full sequences, and the flags of every
    CP peer (carried in one extra row of the same all-reduce). No-op for CP size 1.
    """
    if group_size(cp_group) <= 1:
        return stats, flags
    device = comm_device(cp_group)
    flag_row = torch.zeros((1, stats.shape[1]), dtype=stats.dtype, device=device)
    flag_row[0, 0] = float(flags.missing)
    flag_row[0, 1] = float(flags.invalid)
    table = torch.cat([stats.to(device), flag_row])
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=cp_group)
    table = table.to(stats.device)
    return table[:-1], Flags(missing=table[-1, 0] > 0, invalid=table[-1, 1] > 0)


def all_gather_summaries(summary: torch.Tensor, dp_group: object | None) -> torch.Tensor:
    """Gather every DP rank's summary vector into a ``[dp, size]`` tensor (one collective).

    A gather rather than two all-reduces: the log-space shift must be global, and each
    rank can rescale the others' sums by ``exp(max_r - max)`` locally.
    """
    size = group_size(dp_group)
    if size <= 1:
        return summary
    device = comm_device(dp_group)
    local = summary.to(device).contiguous()
    gathered = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(gathered, local, group=dp_group)
    return torch.stack(gathered)


_FIELDS = 7


def broadcast_from_last_stage(result: EssLrResult | None, pp_group: object | None) -> EssLrResult:
    """Give every pipeline stage the last stage's result (one broadcast when PP > 1).

    Only the last stage has log-probs; the others pass None and receive its result.

    Raises:
        ValueError: the last stage (or a single-stage run) passed None.
    """
    size = group_size(pp_group)
    if size <= 1:
        if result is None:
            raise ValueError("broadcast_from_last_stage: the last pipeline stage passed no result")
        return result
    last = size - 1
    is_last = dist.get_rank(pp_group) == last
    if is_last and result is None:
        raise ValueError(
            f"broadcast_from_last_stage: the last pipeline stage (rank {dist.get_rank()}) passed "
            "no result; it must compute one (compute_ess_lr) before broadcasting"
        )
    buf = torch.zeros(_FIELDS, dtype=torch.float64, device=comm_device(pp_group))
    if is_last:
        buf.copy_(torch.tensor(_encode(result), dtype=torch.float64))
    dist.broadcast(buf, src=dist.get_global_rank(pp_group, last), group=pp_group)
    return result if is_last else _decode(buf.tolist())


def _encode(r: EssLrResult) -> list[float]:
    return [
        r.scale,
        r.rho,
        r.ess,
        r.num_trajectories,
        r.num_empty,
        r.num_nonfinite,
        STATUSES.index(r.status),
    ]


def _decode(v: list[float]) -> EssLrResult:
    return EssLrResult(
        scale=v[0],
        rho=v[1],
        ess=v[2],
        num_trajectories=int(v[3]),
        num_empty=int(v[4]),
        num_nonfinite=int(v[5]),
        status=STATUSES[int(v[6])],
    )
