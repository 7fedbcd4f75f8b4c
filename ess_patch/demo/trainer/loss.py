"""The policy-gradient loss of a micro-batch, the step's micro-batches and megatron's
forward/backward schedule over them."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from .. import task as task_mod
from ..policy import response_logprobs, train_inputs
from .config import MAX_LOG_RATIO, PROXY_ARMS, DemoConfig
from .sampling import Rollout

__all__ = ["forward_backward", "forward_step", "micro_batches", "policy_loss"]


def policy_loss(cfg: DemoConfig, batch: dict[str, torch.Tensor], stash: list, logits: torch.Tensor):
    """The policy-gradient loss of one micro-batch (last stage), per-token mean."""
    logp = response_logprobs(logits, batch["tokens"])
    stash.append(logp.detach())
    log_ratio = logp.detach() - batch["rollout_logp"]
    adv = batch["advantages"][:, None]
    if cfg.loss == "sequence":
        seq = log_ratio.sum(dim=1, keepdim=True)
        weight = torch.exp(seq.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        clamped = (seq.abs() > MAX_LOG_RATIO).sum()
    elif cfg.loss == "seq-tis":  # VCPO: min(exp(sum), c) for every token, no PPO clip
        seq = log_ratio.sum(dim=1, keepdim=True)
        weight = torch.exp(seq.clamp(max=math.log(cfg.is_threshold)))
        clamped = (seq > math.log(cfg.is_threshold)).sum()
    else:  # miles/slime TIS: truncated per-token weight, no gradient through it
        weight = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO)).clamp(max=cfg.tis_clip)
        clamped = (log_ratio > MAX_LOG_RATIO).sum()
    extra = {}
    if "group_ids" in batch:  # a proxy arm: b* from the logits this forward computed
        from ..opob import proxy_advantages

        adv, extra["proxy_abs_shift"] = proxy_advantages(
            batch["rewards"],
            batch["group_ids"],
            logits[:, -logp.shape[1] :],
            batch["tokens"],
            weight,
        )
    loss = -(adv * weight * logp).mean()
    with torch.no_grad():  # the trainer's per-token entropy on the response positions
        lsm = torch.log_softmax(logits[:, -logp.shape[1] :].detach().float(), dim=-1)
        entropy = -(lsm.exp() * lsm).sum(dim=-1).sum()
    return loss, {"loss": loss.detach(), "clamped": clamped, "entropy": entropy, **extra}


def forward_step(cfg: DemoConfig, stash: list, data_iterator: Any, model_chunk: Any):
    """megatron's forward-step contract: this stage's output and the loss function."""
    batch = next(data_iterator)
    out = model_chunk(batch["input_ids"], batch["position_ids"], None, runtime_gather_output=True)
    return out, partial(policy_loss, cfg, batch, stash)


def micro_batches(
    cfg: DemoConfig, arm_name: str, roll: Rollout, mb: int, *, ones: bool
) -> list[dict[str, torch.Tensor]]:
    """The step's micro-batches of ``mb`` rollouts; ``ones``: advantage 1 (the baseline glue
    rewrites it to R - b* in finalize). The proxy arms also carry rewards and group ids."""
    ids, pos = train_inputs(roll.prompts, roll.tokens)
    adv = torch.ones_like(roll.advantages) if ones else roll.advantages
    return [
        {
            "input_ids": ids[i : i + mb],
            "position_ids": pos[i : i + mb],
            "tokens": roll.tokens[i : i + mb],
            "rollout_logp": roll.logp[i : i + mb],
            "advantages": adv[i : i + mb].to(cfg.device),
            **(
                {
                    "rewards": roll.rewards[i : i + mb].to(cfg.device),
                    "group_ids": torch.arange(mb, device=cfg.device) // cfg.group_size,
                }
                if arm_name in PROXY_ARMS
                else {}
            ),
        }
        for i in range(0, cfg.rollouts_per_rank, mb)
    ]


def forward_backward(cfg: DemoConfig, ddp: Any, micro: list[dict], stash: list) -> Any:
    """megatron's schedule over the step's micro-batches (the last stage's log-probs go to
    ``stash``); returns the losses' reports."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n, mb = cfg.response_len, cfg.rollouts_per_rank // cfg.microbatches
    return get_forward_backward_func()(
        forward_step_func=partial(forward_step, cfg, stash),
        data_iterator=iter(micro),
        model=[ddp],
        num_microbatches=cfg.microbatches,
        seq_length=task_mod.prompt_length(cfg.task, n) + n - 1,
        micro_batch_size=mb,
        forward_only=False,
    )
