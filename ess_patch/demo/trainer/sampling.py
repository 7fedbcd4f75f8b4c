"""A step's rollout: each rollout worker's staleness and the tokens it samples (or replays)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .. import task as task_mod
from ..policy import RolloutEngine
from ..staleness import VARYING, step_lag
from ..tape import RolloutTape
from .config import DemoConfig
from .model import Layout

__all__ = ["Rollout", "rollout_lags", "sample", "worker_lags"]


def rollout_lags(cfg: DemoConfig, step: int, lag: int) -> list[int]:
    """Each rollout worker's staleness at ``step`` under ``cfg.staleness`` (max ``lag``)."""
    if cfg.staleness == "fixed":
        return [min(step, lag)] * cfg.rollout_workers
    if cfg.staleness in VARYING:
        return [step_lag(cfg.staleness, step, lag, cfg.seed)] * cfg.rollout_workers
    return worker_lags(step, cfg.rollout_workers, lag)


def worker_lags(step: int, workers: int, max_lag: int) -> list[int]:
    """How many updates behind the trainer each rollout worker's weights are at ``step``.

    Worker ``w`` pulls the newest weights every ``1 + round(w * max_lag / (workers - 1))``
    steps (worker 0 every step; one worker: every ``max_lag + 1``), starting at step 0, with
    phase ``w`` so that the workers do not all pull at once; never more than ``step``.
    """
    out = []
    for w in range(workers):
        period = 1 + (round(w * max_lag / (workers - 1)) if workers > 1 else max_lag)
        out.append(min(step, (step + w) % period))
    return out


@dataclass
class Rollout:
    prompts: torch.Tensor  # [N, P]
    tokens: torch.Tensor  # [N, T]
    logp: torch.Tensor  # [N, T] bf16 engine's log-probs (float32 values)
    lags: torch.Tensor  # [N]
    rewards: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]


def sample(
    cfg: DemoConfig,
    engine: RolloutEngine,
    versions: deque,
    step: int,
    lay: Layout,
    lag: int,
    tape: RolloutTape | None = None,
) -> Rollout:
    """This DP rank's rollout: each worker samples its prompts' groups from its weights
    (or, replaying a tape, scores the recorded tokens with them)."""
    device = cfg.device
    gen = torch.Generator(device=device).manual_seed(
        (cfg.seed * 1_000_003 + step) * 1009 + lay.dp_rank
    )
    n = cfg.response_len
    prompt_gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 1013 + lay.dp_rank)
    prompts = task_mod.make_prompts(cfg.task, n, cfg.prompts_per_rank, prompt_gen).to(device)
    lags_by_worker = rollout_lags(cfg, step, lag)
    owner = torch.arange(cfg.prompts_per_rank) % cfg.rollout_workers
    rows = cfg.rollouts_per_rank
    tokens = torch.empty(rows, n, dtype=torch.long, device=device)
    logp = torch.empty(rows, n, dtype=torch.float32, device=device)
    lags = torch.empty(rows, dtype=torch.long)
    expanded = prompts.repeat_interleave(cfg.group_size, dim=0)
    available = len(versions) - 1
    replay = tape.tokens(step, (rows, n)).to(device) if tape and tape.replaying else None
    # workers whose weights are equally old hold the same weights: one engine pass for them
    for lag in sorted(set(lags_by_worker)):
        workers = [w for w, x in enumerate(lags_by_worker) if x == lag]
        mine = torch.isin(owner, torch.tensor(workers)).nonzero().flatten()
        if not mine.numel():
            continue
        idx = (mine[:, None] * cfg.group_size + torch.arange(cfg.group_size)).flatten()
        engine.load(versions[-1 - min(lag, available)])
        if replay is None:
            out = engine.sample(expanded[idx.to(device)], n, gen)
        else:
            out = engine.score(expanded[idx.to(device)], replay[idx.to(device)])
        tokens[idx.to(device)] = out.tokens
        logp[idx.to(device)] = out.logp
        lags[idx] = min(lag, available)
    if tape is not None:
        tape.record(step, tokens)
    r = task_mod.rewards(tokens, task_mod.targets(cfg.task, expanded, n))
    grouped = r.view(-1, cfg.group_size)
    adv = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
    return Rollout(expanded, tokens, logp, lags, r, adv)
