"""One rank of the demo: off-policy policy-gradient training with megatron-core's optimizer.

Every rank runs :func:`run_rank` after the launcher has set up gloo and megatron's
``parallel_state``. For each arm ("off": ESS-LR never armed; "on": armed every step) it
builds the policy (same seed), wraps this pipeline stage in megatron-core's
``DistributedDataParallel``, builds the real optimizer with ``get_megatron_optimizer``
(Adam, fp32, grad clipping) and ``OptimizerParamScheduler``, and trains. ``ess_patch.install()``
patches the optimizer classes once per process; the "off" arm shows it changes nothing
until a result is armed.

Per step (= one rollout, one optimizer step):

1. Rollout: every trajectory is sampled from a stale copy of the policy, ``lag`` updates
   old with ``lag`` uniform in ``[0, min(max_lag, step)]`` (fully-async style). The rollout
   engine keeps the log-probs it sampled with.
2. Forward through the pipeline (gloo send/recv between stages); each CP rank computes the
   train log-probs of its zigzag chunk of every trajectory's response.
3. Every stage: ``compute_ess_lr`` with the CP, DP and PP groups (the last stage computes,
   every stage gets the result or the same error); in the "on" arm ``ess_patch.arm(result)``.
4. Backward of the token-level importance-weighted policy gradient
   ``-A_i * exp(logp_t - rollout_logp_t)`` (no clipping of the ratio), DDP grad reduction
   over DP x CP, ``optimizer.step()`` (the patched step applies the armed scale),
   ``scheduler.step()``.
5. The new weights go to the rollout engine (PP stages broadcast their slices).

The applied LR is read inside the step, by a pre-step hook on megatron's inner torch
optimizer; the scheduled LR is ``param_groups``' LR outside the step.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from .. import EssLrConfig, arm, compute_ess_lr, disarm
from ..cp_slicing import local_response_masks, zigzag_response_ranges
from .cpu import megatron_on_cpu
from .task import (
    HIDDEN,
    NUM_BLOCKS,
    NUM_TASKS,
    PROMPT_LEN,
    RESPONSE_LEN,
    START,
    PolicyNet,
    Stage,
    make_targets,
    sample_rollouts,
    stage_bounds,
)

__all__ = ["ARMS", "DemoConfig", "DemoConfigError", "run_rank"]

logger = logging.getLogger(__name__)

#: "off": never armed; "on": ESS-LR with ``ess``; "geometric" / "product": ESS-LR with
#: that weight mode; "constant": armed every step with one fixed scale, the mean scale of the
#: ``control_of`` arm in the same run (a smaller LR that does not look at staleness).
ARMS = ("off", "on", "geometric", "product", "constant")
DEFAULT_ARMS = ("off", "on")
#: How the policy-gradient loss weights a trajectory's tokens: "token": each token by its own
#: ratio ``exp(logp_t - rollout_logp_t)``; "sequence": every token by the trajectory's ratio
#: ``exp(sum_t (logp_t - rollout_logp_t))`` (sequence-level IS, untruncated).
IS_LEVELS = ("token", "sequence")
#: Log-ratios are clamped to +-this before exp() only so that float32 stays finite; the
#: number of clamped tokens is recorded per step (``clamped_tokens``).
MAX_LOG_RATIO = 20.0


class DemoConfigError(ValueError):
    """A :class:`DemoConfig` field is out of range; ``field`` names it (the CLI: a flag)."""

    def __init__(self, field: str, value: Any, problem: str) -> None:
        self.field, self.value, self.problem = field, value, problem
        super().__init__(f"DemoConfig.{field}={value!r}: {problem}")


@dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run depends on (the same on every rank)."""

    steps: int = 400
    lag: int = 8
    seed: int = 0
    dp: int = 2
    cp: int = 2
    pp: int = 1
    #: The ESS-LR settings (the "geometric" / "product" arms override ``weight_mode``).
    ess: EssLrConfig = field(default_factory=EssLrConfig)
    lr: float = 1e-2
    warmup: int = 10
    clip_grad: float = 1.0
    prompts_per_rank: int = 8
    group_size: int = 4
    arms: tuple[str, ...] = DEFAULT_ARMS
    is_level: str = "token"
    control_of: str = "product"

    def __post_init__(self) -> None:
        object.__setattr__(self, "arms", tuple(self.arms))
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or not self.arms:
            raise DemoConfigError("arms", self.arms, f"give one or more of {ARMS}")
        for name in ("steps", "dp", "cp", "pp", "prompts_per_rank", "group_size"):
            if getattr(self, name) < 1:
                raise DemoConfigError(name, getattr(self, name), "must be >= 1")
        if self.pp > NUM_BLOCKS + 2:
            raise DemoConfigError(
                "pp",
                self.pp,
                f"must be at most {NUM_BLOCKS + 2}, the number of parts of the demo policy",
            )
        if (
            "constant" in self.arms
            and self.control_of not in self.arms[: self.arms.index("constant")]
        ):
            raise ValueError(
                f"DemoConfig.arms={self.arms!r}: the 'constant' arm copies the mean scale of "
                f"control_of={self.control_of!r}, which must come before it"
            )
        if self.control_of not in ("on", "geometric", "product"):
            raise ValueError(
                f"DemoConfig.control_of={self.control_of!r}: give 'on', 'geometric' or 'product'"
            )
        if self.is_level not in IS_LEVELS:
            raise ValueError(f"DemoConfig.is_level={self.is_level!r}: give one of {IS_LEVELS}")
        if self.lag < 0:
            raise DemoConfigError("lag", self.lag, "must be >= 0")
        if not isinstance(self.ess, EssLrConfig):
            raise DemoConfigError("ess", self.ess, "must be an ess_patch.EssLrConfig")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.pp

    def ess_config(self, arm_name: str | None = None) -> EssLrConfig:
        """The ESS-LR config of an arm: its own weight mode for "geometric" / "product"."""
        if arm_name in ("geometric", "product"):
            return replace(self.ess, weight_mode=arm_name)
        return self.ess

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Layout:
    dp_rank: int
    cp_rank: int
    pp_rank: int
    dp_group: Any  # DP without CP: whose ranks hold other trajectories
    cp_group: Any
    pp_group: Any
    dp_cp_group: Any  # what DDP reduces gradients over

    @classmethod
    def current(cls) -> _Layout:
        from megatron.core import parallel_state as ps

        return cls(
            dp_rank=ps.get_data_parallel_rank(with_context_parallel=False),
            cp_rank=ps.get_context_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_group=ps.get_data_parallel_group(with_context_parallel=False),
            cp_group=ps.get_context_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        )

    def pp_peer(self, stage: int) -> int:
        return dist.get_global_rank(self.pp_group, stage)


def is_writer(cfg: DemoConfig, lay: _Layout) -> bool:
    """The rank that records the steps: last pipeline stage, first DP and CP rank."""
    return lay.pp_rank == cfg.pp - 1 and lay.dp_rank == 0 and lay.cp_rank == 0


def run_rank(cfg: DemoConfig, progress: Any = None) -> list[dict[str, Any]] | None:
    """Train both arms on this rank; the writer rank returns the per-step records.

    ``progress``: an object with ``put((arm, step))`` (a multiprocessing queue), fed by the
    writer rank after every step.
    """
    import ess_patch

    lay = _Layout.current()
    ess_patch.install(["megatron"], config=cfg.ess_config())
    try:
        records: list[dict[str, Any]] = []
        mean_scale: dict[str, float] = {}
        for arm_name in cfg.arms:
            constant = mean_scale.get(cfg.control_of, 1.0)
            arm_records, scales = _train_arm(cfg, arm_name, lay, progress, constant)
            records += arm_records
            # Every rank holds the same scales (broadcast over PP, reduced over DP and CP).
            mean_scale[arm_name] = sum(scales) / len(scales)
    finally:
        disarm()
        ess_patch.uninstall()
    return records if is_writer(cfg, lay) else None


def _build(cfg: DemoConfig, stage: torch.nn.Module):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.lr,
        weight_decay=0.0,
        clip_grad=cfg.clip_grad,
        bf16=False,
        params_dtype=torch.float32,
    )
    ddp = DistributedDataParallel(
        TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1),
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
        stage,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=False)
    warmup = min(cfg.warmup, max(cfg.steps - 1, 0))
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=cfg.lr / 10,
        max_lr=cfg.lr,
        min_lr=cfg.lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(cfg.steps, warmup + 1),
        lr_decay_style="constant",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=max(cfg.steps, 1),
        wd_incr_style="constant",
    )
    return ddp, optimizer, scheduler


def _snapshot(net: PolicyNet) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _sync_weights(net: PolicyNet, bounds: list[tuple[int, int]], lay: _Layout) -> None:
    """Give every rank the whole current policy: each PP stage broadcasts the parts it owns."""
    if len(bounds) == 1:
        return
    with torch.no_grad():
        for owner, (lo, hi) in enumerate(bounds):
            params = [p for part in net.parts[lo:hi] for p in part.parameters()]
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.broadcast(flat, src=lay.pp_peer(owner), group=lay.pp_group)
            if owner != lay.pp_rank:
                offset = 0
                for p in params:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()


def _local_index(lay: _Layout, cp: int) -> torch.Tensor:
    """Response-token indices this CP rank holds (zigzag), the same for every trajectory."""
    (a0, a1), (b0, b1) = zigzag_response_ranges(
        PROMPT_LEN + RESPONSE_LEN, RESPONSE_LEN, lay.cp_rank, cp
    )
    return torch.cat([torch.arange(a0, a1), torch.arange(b0, b1)])


def _train_arm(
    cfg: DemoConfig, arm_name: str, lay: _Layout, progress: Any, constant: float
) -> tuple[list[dict[str, Any]], list[float]]:
    """One arm's run; returns the writer's records and the LR scale applied at each step."""
    torch.manual_seed(cfg.seed)
    net = PolicyNet()
    bounds = stage_bounds(len(net.parts), cfg.pp)
    first, last = lay.pp_rank == 0, lay.pp_rank == cfg.pp - 1
    stage = Stage(net, *bounds[lay.pp_rank])
    with megatron_on_cpu():
        ddp, optimizer, scheduler = _build(cfg, stage)

    applied: list[float] = []

    def record_lr(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        applied.extend(group["lr"] for group in opt.param_groups)

    hooks = [
        leaf.optimizer.register_step_pre_hook(record_lr)
        for leaf in getattr(optimizer, "chained_optimizers", [optimizer])
    ]
    ess_config = cfg.ess_config(arm_name)
    scales: list[float] = []
    targets = make_targets(cfg.seed)
    versions: deque[dict[str, torch.Tensor]] = deque([_snapshot(net)], maxlen=cfg.lag + 1)
    idx = _local_index(lay, cfg.cp)
    n_traj = cfg.prompts_per_rank * cfg.group_size
    full_masks = [torch.ones(RESPONSE_LEN) for _ in range(n_traj)]
    local_masks = local_response_masks(
        full_masks,
        [PROMPT_LEN + RESPONSE_LEN] * n_traj,
        [RESPONSE_LEN] * n_traj,
        lay.cp_rank,
        cfg.cp,
    )
    mask = torch.stack(local_masks) if idx.numel() else torch.zeros(n_traj, 0)
    writer = is_writer(cfg, lay)
    records = []
    for step in range(cfg.steps):
        # 1. rollout from stale policies (identical on the CP and PP peers of a DP rank)
        gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 1009 + lay.dp_rank)
        lags = torch.randint(0, len(versions), (n_traj,), generator=gen)
        tasks = torch.randint(0, NUM_TASKS, (cfg.prompts_per_rank,), generator=gen)
        tasks = tasks.repeat_interleave(cfg.group_size)
        batch = sample_rollouts(list(versions), lags, tasks, targets, cfg.group_size, gen)
        tokens = batch.tokens[:, idx]
        rollout_logp = batch.rollout_logp[:, idx]

        # 2. forward through the pipeline, this CP rank's tokens only
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        if first:
            prev = torch.where(idx > 0, batch.tokens[:, (idx - 1).clamp(min=0)], START)
            x = torch.stack([tasks[:, None].expand_as(prev), idx.expand_as(prev), prev], dim=-1)
            x = x.reshape(-1, 3)
        else:
            x = torch.empty(n_traj * idx.numel(), HIDDEN)
            dist.recv(x, src=lay.pp_peer(lay.pp_rank - 1))
            x.requires_grad_(True)
        out = ddp(x)
        if not last:
            dist.send(out.detach(), dst=lay.pp_peer(lay.pp_rank + 1))

        # 3. ESS: one call on every stage (the last computes over CP and DP, every stage
        # gets its result or its error); arm
        stats = None
        detached = None
        if last:
            logp = torch.log_softmax(out.float(), dim=-1)
            logp = logp.gather(1, tokens.reshape(-1, 1)).view(n_traj, idx.numel())
            detached = logp.detach()
            stats = _step_stats(detached, rollout_logp, mask, batch, lay)
        result = compute_ess_lr(
            list(detached) if last else None,
            list(rollout_logp) if last else None,
            local_masks if last else None,
            config=ess_config,
            cp_group=lay.cp_group,
            dp_group=lay.dp_group,
            pp_group=lay.pp_group,
        )
        if arm_name in ("on", "geometric", "product"):
            scales.append(arm(result).scale)
        elif arm_name == "constant":
            scales.append(arm(constant).scale)
        else:
            disarm()
            scales.append(1.0)

        # 4. backward, DDP reduction, the (patched) megatron step, the scheduler
        if last:
            if cfg.is_level == "sequence":
                # grad of exp(S_i) is exp(S_i) * grad S_i: weight each token's logp by the
                # trajectory's ratio, summed over all CP chunks of it.
                seq = ((logp.detach() - rollout_logp) * mask).sum(dim=1)
                if cfg.cp > 1:
                    dist.all_reduce(seq, group=lay.cp_group)
                weight = torch.exp(seq.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
                per_token = -batch.advantages[:, None] * weight[:, None] * logp * mask
            else:
                log_ratio = (logp - rollout_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
                per_token = -batch.advantages[:, None] * torch.exp(log_ratio) * mask
            # DDP averages over DP x CP; each CP rank holds a part of the per-DP-rank sum
            loss = per_token.sum() * cfg.cp / (n_traj * RESPONSE_LEN)
            loss.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=lay.pp_peer(lay.pp_rank + 1))
            out.backward(grad)
        if not first:
            dist.send(x.grad, dst=lay.pp_peer(lay.pp_rank - 1))
        ddp.finish_grad_sync()
        scheduled = [group["lr"] for group in optimizer.param_groups]
        applied.clear()
        with megatron_on_cpu():
            ok, grad_norm, _ = optimizer.step()
        scheduler.step(increment=1)

        # 5. weight update to the rollout engine
        _sync_weights(net, bounds, lay)
        versions.append(_snapshot(net))

        if writer:
            assert stats is not None
            records.append(
                {
                    "arm": arm_name,
                    "step": step,
                    **stats,
                    "rho": result.rho,
                    "ess": result.ess,
                    "num_trajectories": result.num_trajectories,
                    "lr_scale": scales[-1],
                    "scheduled_lr": scheduled[0],
                    "applied_lr": applied[0] if applied else math.nan,
                    "scheduled_lrs": scheduled,
                    "applied_lrs": list(applied),
                    "grad_norm": math.nan if grad_norm is None else float(grad_norm),
                    "update_successful": bool(ok),
                }
            )
            if progress is not None:
                progress.put((arm_name, step))
    for hook in hooks:
        hook.remove()
    disarm()
    return records, scales


def _step_stats(
    logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, batch: Any, lay: _Layout
) -> dict[str, float]:
    """Reward, mean lag and train/rollout mismatch over the whole global batch (DP x CP)."""
    diff = (logp - rollout_logp) * mask
    own = 1.0 if lay.cp_rank == 0 else 0.0  # trajectory-level sums: counted once per DP rank
    sums = torch.tensor(
        [
            diff.abs().sum().item(),
            mask.sum().item(),
            (diff.abs() > MAX_LOG_RATIO).sum().item(),
            own * batch.rewards.sum().item(),
            own * batch.lags.float().sum().item(),
            own * batch.rewards.numel(),
        ],
        dtype=torch.float64,
    )
    if dist.get_world_size(lay.dp_cp_group) > 1:
        dist.all_reduce(sums, group=lay.dp_cp_group)
    abs_sum, count, clamped, reward_sum, lag_sum, n = sums.tolist()
    return {
        "reward": reward_sum / n,
        "mean_lag": lag_sum / n,
        "mismatch": abs_sum / max(count, 1.0),
        "clamped_tokens": int(clamped),
    }
