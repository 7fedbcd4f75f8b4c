"""The fields of a step's record: reward, lag, loss and mismatch over the global batch, ESS,
the scheduled and applied LRs, the timings and the baseline's metrics."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from .config import MAX_LOG_RATIO, PROXY_ARMS, DemoConfig
from .model import Layout
from .sampling import Rollout

__all__ = ["baseline_fields", "ess_fields", "lr_fields", "step_stats", "time_fields"]


def step_stats(
    cfg: DemoConfig, logp: torch.Tensor, roll: Rollout, losses: Any, lay: Layout
) -> dict[str, float]:
    """Reward, lag, loss and train/rollout mismatch over the global batch (all DP ranks)."""
    log_ratio = (logp - roll.logp).double()  # log(policy / rollout) per token
    diff = log_ratio.abs()
    # KL(rollout || policy) per token from the rollout's own samples: k1 = E[-log r] and
    # the nonnegative k3 = E[r - 1 - log r], r = policy / rollout
    r = log_ratio.clamp(max=MAX_LOG_RATIO)
    fresh = (roll.lags == 0).to(diff.device)
    clamped = sum(float(x["clamped"]) for x in losses)
    sums = torch.tensor(
        [
            diff.sum().item(),
            float(diff.numel()),
            diff[fresh].sum().item(),
            float(fresh.sum().item() * cfg.response_len),
            roll.rewards.double().sum().item(),
            roll.lags.double().sum().item(),
            float(roll.rewards.numel()),
            sum(float(x["loss"]) for x in losses),
            clamped,
            sum(float(x["entropy"]) for x in losses),
            (-log_ratio).sum().item(),
            (r.exp() - 1 - r).sum().item(),
        ],
        dtype=torch.float64,
        device=diff.device,
    )
    if cfg.dp > 1:
        dist.all_reduce(sums, group=lay.dp_group)
    (abs_sum, count, fresh_sum, fresh_count, reward, lag, rows, loss, clamped, ent, k1, k3) = (
        sums.tolist()
    )
    return {
        "reward": reward / rows,
        "mean_lag": lag / rows,
        "mismatch": abs_sum / count,
        "mismatch_lag0": fresh_sum / fresh_count if fresh_count else math.nan,
        "loss": loss / (cfg.dp * cfg.microbatches),
        "clamped": int(clamped),
        "entropy": ent / count,
        "kl_k1": k1 / count,
        "kl": k3 / count,
    }


def ess_fields(cfg: DemoConfig, rho: float, ess: float, lag: int, scale: float) -> dict:
    """A record's ESS fields: rho, ESS, the batch, the lag and the scale armed."""
    return {
        "rho": rho,
        "ess": ess,
        "num_trajectories": cfg.rollouts_per_rank * cfg.dp,
        "lag_max": lag,
        "lr_scale": scale,
    }


def lr_fields(scheduled: list[float], applied: list[float], grad_norm: Any, ok: Any) -> dict:
    """A record's LR and update fields: the scheduled LRs and those the optimizer applied."""
    return {
        "scheduled_lr": scheduled[0],
        "applied_lr": applied[0] if applied else math.nan,
        "scheduled_lrs": scheduled,
        "applied_lrs": list(applied),
        "grad_norm": math.nan if grad_norm is None else float(grad_norm),
        "update_successful": bool(ok),
    }


def time_fields(wall: tuple[float, ...], cpu: tuple[float, ...]) -> dict[str, float]:
    """A record's timings from the step's wall-clock marks t0..t5 and CPU marks c1..c4."""
    t0, t1, t2, t3, t4, t5 = wall
    c1, c2, c3, c4 = cpu
    return {
        "time_sample_s": t1 - t0,
        "time_train_s": (t2 - t1) + (t4 - t3),
        "time_ess_s": t3 - t2,
        "time_publish_s": t5 - t4,
        # this thread's CPU time: the work itself, without waiting for peers
        "cpu_train_s": (c2 - c1) + (c4 - c3),
        "cpu_ess_s": c3 - c2,
    }


def baseline_fields(arm_name: str, glue: Any, losses: Any) -> dict[str, Any]:
    """A record's baseline fields: the glue's metrics (averaged over DP in finalize: reading
    them is local) and, for the proxy arms, the mean |b* - group mean| over this rank's
    micro-batches (the demo's groups stay local)."""
    out = {f"opob_{k}": v for k, v in (glue.metrics() if glue is not None else {}).items()}
    if arm_name in PROXY_ARMS:
        shifts = [float(x["proxy_abs_shift"]) for x in losses]
        out["opob_proxy_abs_shift"] = sum(shifts) / len(shifts)
    return out
