"""The demo's training loop: :func:`run_rank` trains every arm on this rank; an arm's loop is
``_train_arm``, its steps in the helpers beside it."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from typing import Any

import torch

from ... import EssLrConfig, arm, calibration, compute_ess_lr, disarm
from ..policy import RolloutEngine
from ..tape import RolloutTape
from .config import BASELINE_ARMS, DemoConfig
from .loss import forward_backward, micro_batches
from .model import Layout, build, digest, is_writer, publish
from .record import baseline_fields, ess_fields, lr_fields, step_stats, time_fields
from .sampling import Rollout, sample

__all__ = ["run_rank"]

logger = logging.getLogger(__name__)


def run_rank(cfg: DemoConfig, progress: Any = None) -> list[dict[str, Any]] | None:
    """Train every arm on this rank; the writer rank returns the per-step records.

    ``progress``: an object with ``put((arm, step))`` (a multiprocessing queue), fed by the
    writer rank after every step.
    """
    installed = False
    if cfg.install_ess:
        import ess_patch

        ess_patch.install(["megatron"], config=cfg.ess_config())
        installed = True
    try:
        records: list[dict[str, Any]] = []
        mean_scale: dict[str, float] = {}
        writer = False
        for arm_name in cfg.arms:
            # the "constant" arm's scale (the other arms do not read it)
            constant = (
                mean_scale.get(cfg.control_of, 1.0)
                if cfg.constant_scale is None
                else cfg.constant_scale
            )
            arm_records, scales, writer = _train_arm(cfg, arm_name, progress, constant)
            records += arm_records
            # every rank holds the same scales (compute_ess_lr's result is global)
            mean_scale[arm_name] = sum(scales) / len(scales)
    finally:
        if installed:
            import ess_patch

            disarm()
            ess_patch.uninstall()
    return records if writer else None


def _shim(cfg: DemoConfig) -> Any:
    """What megatron's calls run in: the CPU shim on a CPU, nothing on a GPU."""
    if cfg.device == "cpu":
        from ..cpu import megatron_on_cpu

        return megatron_on_cpu
    return contextlib.nullcontext


def _seed(cfg: DemoConfig) -> None:
    """Seed torch (and, on a GPU, megatron's model-parallel RNG) with the run's seed."""
    torch.manual_seed(cfg.seed)
    if cfg.device == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(cfg.seed)


def _train_arm(
    cfg: DemoConfig, arm_name: str, progress: Any, constant: float
) -> tuple[list[dict[str, Any]], list[float], bool]:
    """One arm's run; returns the writer's records, the scale of each step, is-writer."""
    from megatron.core import parallel_state as ps

    _seed(cfg)
    # megatron's code runs inside the CPU shim (demo only); ess-patch's own calls outside it,
    # as they run in production
    shim = _shim(cfg)
    with shim():
        model, ddp, optimizer, scheduler = build(cfg)
        engine = RolloutEngine(cfg.spec, tp=cfg.tp, device=cfg.device)
    lay = Layout.current(model.config)
    last = ps.is_pipeline_last_stage()
    glue = _baseline_glue(arm_name, model, ddp, lay)
    group_ids = torch.arange(cfg.prompts_per_rank).repeat_interleave(cfg.group_size)
    writer = is_writer(cfg, lay)
    tape = _tape(cfg, arm_name, lay)

    applied, hooks = _lr_recorder(optimizer)
    ess_config = cfg.ess_config(arm_name)
    lag = 0 if arm_name == "sync" else cfg.lag
    calibration.restart()  # each arm is a run of its own (calibrate_rollouts)
    scales: list[float] = []
    versions: deque[dict[str, Any]] = deque([publish(model, lay, cfg)], maxlen=lag + 1)
    mb = cfg.rollouts_per_rank // cfg.microbatches
    masks = [torch.ones(cfg.response_len, device=cfg.device) for _ in range(cfg.rollouts_per_rank)]
    records = []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        with shim():
            roll = sample(cfg, engine, versions, step, lay, lag, tape)
        t1, c1 = time.perf_counter(), time.thread_time()

        micro = micro_batches(cfg, arm_name, roll, mb, ones=glue is not None)
        stash: list[torch.Tensor] = []  # the last stage's log-probs, per micro-batch
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        if glue is not None:
            glue.begin(roll.rewards, group_ids)
        with shim():
            losses = forward_backward(cfg, ddp, micro, stash)
        t2, c2 = time.perf_counter(), time.thread_time()

        # ESS over the step's trajectories: every rank, the last stage's log-probs
        logp = torch.cat(stash) if last else None
        scale, rho, ess = _arm_step(cfg, arm_name, ess_config, logp, roll, masks, lay, constant)
        scales.append(scale)
        t3, c3 = time.perf_counter(), time.thread_time()

        with shim():
            scheduled, ok, grad_norm = _optimizer_step(optimizer, scheduler, applied)
        t4, c4 = time.perf_counter(), time.thread_time()

        versions.append(publish(model, lay, cfg))
        t5 = time.perf_counter()

        stats = step_stats(cfg, logp, roll, losses, lay) if last else None
        if writer:
            assert stats is not None
            rec = {
                "arm": arm_name,
                "step": step,
                **stats,
                **ess_fields(cfg, rho, ess, lag, scale),
                **lr_fields(scheduled, applied, grad_norm, ok),
                **time_fields((t0, t1, t2, t3, t4, t5), (c1, c2, c3, c4)),
            }
            rec.update(baseline_fields(arm_name, glue, losses))
            if step == cfg.steps - 1:
                rec["weights_sha256"] = digest(versions[-1])
            records.append(rec)
            if progress is not None:
                progress.put((arm_name, step))
    _teardown(cfg, hooks, glue)
    return records, scales, writer


def _teardown(cfg: DemoConfig, hooks: list[Any], glue: Any) -> None:
    """Leave nothing of the arm behind: the LR hooks, the glue's hooks, the armed scale."""
    for hook in hooks:
        hook.remove()
    if glue is not None:
        glue.remove()
    if cfg.install_ess:
        disarm()


def _optimizer_step(optimizer: Any, scheduler: Any, applied: list[float]) -> tuple:
    """megatron's optimizer step and the scheduler's: (the scheduled LRs, ok, grad norm);
    ``applied`` gets the LRs the step applied."""
    scheduled = [group["lr"] for group in optimizer.param_groups]
    applied.clear()
    ok, grad_norm, _ = optimizer.step()
    scheduler.step(increment=1)
    return scheduled, ok, grad_norm


def _lr_recorder(optimizer: Any) -> tuple[list[float], list[Any]]:
    """A list that each leaf optimizer's ``step`` fills with the LRs it applies, and the hooks
    (to remove)."""
    applied: list[float] = []

    def record_lr(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        applied.extend(group["lr"] for group in opt.param_groups)

    hooks = [
        leaf.optimizer.register_step_pre_hook(record_lr)
        for leaf in getattr(optimizer, "chained_optimizers", [optimizer])
    ]
    return applied, hooks


def _baseline_glue(arm_name: str, model: Any, ddp: Any, lay: Layout) -> Any:
    """The baseline arms' glue (b* and the rewrite in finalize), None for the other arms."""
    if arm_name not in BASELINE_ARMS:
        return None
    from megatron.core import parallel_state as ps

    from ..opob import BaselineGlue

    return BaselineGlue(
        model,
        ddp,
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=lay.pp_group,
        dp_group=lay.dp_group,
    )


def _tape(cfg: DemoConfig, arm_name: str, lay: Layout) -> RolloutTape | None:
    """The rollout tape this rank records or replays, if the config names one."""
    if not cfg.rollout_tape:
        return None
    return RolloutTape(
        cfg.rollout_tape,
        cfg.tape_mode,
        arm_name,
        lay.dp_rank,
        writes=lay.tp_rank == 0 and lay.pp_rank == 0,
    )


def _arm_step(
    cfg: DemoConfig,
    arm_name: str,
    ess_config: EssLrConfig,
    logp: torch.Tensor | None,
    roll: Rollout,
    masks: list[torch.Tensor],
    lay: Layout,
    constant: float,
) -> tuple[float, float, float]:
    """ESS over the step's trajectories (every rank; the last stage's log-probs), then the
    arm's scale armed for the coming optimizer step: (scale, rho, ess)."""
    if not cfg.install_ess:
        return 1.0, math.nan, math.nan
    last = logp is not None
    result = compute_ess_lr(
        list(logp) if last else None,
        list(roll.logp) if last else None,
        masks,
        config=ess_config,
        dp_group=lay.dp_group,
        pp_group=lay.pp_group,
    )
    if arm_name in ("off", "sync", "baseline", "proxy"):
        disarm()
        scale = 1.0
    elif arm_name == "constant":
        scale = arm(constant).scale
    else:
        scale = arm(result).scale
    return scale, result.rho, result.ess
