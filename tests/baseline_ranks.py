"""Rank-side helpers for the baseline tests: the demo's real model, DDP, optimizer and schedule.

Every function runs inside a rank (``harness.run_ranks``) or a ``single_process()`` world.
The data of a DP rank depends only on its DP rank (never on TP/PP), so a one-rank run of the
whole model on that data is the reference for every layout.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ess_patch.baseline import min_variance_baseline
from ess_patch.demo import task as task_mod
from ess_patch.demo.cpu import megatron_on_cpu
from ess_patch.demo.policy import train_inputs
from ess_patch.demo.train import DemoConfig, _build, _forward_step

GROUP = 3


def config(dp: int = 1, tp: int = 1, pp: int = 1, *, loss: str = "sequence") -> DemoConfig:
    """A tiny demo config: 2 prompts x 3 samples per DP rank, 2 micro-batches."""
    return DemoConfig(
        steps=1,
        dp=dp,
        tp=tp,
        pp=pp,
        response_len=4,
        prompts_per_rank=2,
        group_size=GROUP,
        microbatches=2,
        loss=loss,
        lr=1e-3,
    )


def data(cfg: DemoConfig, dp_rank: int) -> dict[str, torch.Tensor]:
    """A DP rank's trajectories: prompts, random responses and rollout log-probs, rewards."""
    gen = torch.Generator().manual_seed(1234 + dp_rank)
    n, rows = cfg.response_len, cfg.rollouts_per_rank
    prompts = task_mod.make_prompts(cfg.task, n, cfg.prompts_per_rank, gen)
    prompts = prompts.repeat_interleave(cfg.group_size, dim=0)
    tokens = torch.randint(0, task_mod.VOCAB, (rows, n), generator=gen)
    rollout_logp = -3.0 + 0.3 * torch.randn(rows, n, generator=gen)
    rewards = torch.rand(rows, generator=gen)
    groups = torch.arange(cfg.prompts_per_rank).repeat_interleave(cfg.group_size)
    return {
        "prompts": prompts,
        "tokens": tokens,
        "rollout_logp": rollout_logp,
        "rewards": rewards,
        "groups": groups,
    }


def step(cfg: DemoConfig, model_ddp: tuple, d: dict, advantages: torch.Tensor, finalize=True):
    """One forward_backward of megatron's schedule with these advantages; grads stay in DDP."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model, ddp = model_ddp
    ids, pos = train_inputs(d["prompts"], d["tokens"])
    mb = cfg.rollouts_per_rank // cfg.microbatches
    micro = [
        {
            "input_ids": ids[i : i + mb],
            "position_ids": pos[i : i + mb],
            "tokens": d["tokens"][i : i + mb],
            "rollout_logp": d["rollout_logp"][i : i + mb],
            "advantages": advantages[i : i + mb].float(),
        }
        for i in range(0, cfg.rollouts_per_rank, mb)
    ]
    saved = model.config.finalize_model_grads_func
    if not finalize:  # the local gradient, before any DP all-reduce
        model.config.finalize_model_grads_func = None
    ddp.zero_grad_buffer()
    try:
        with megatron_on_cpu():
            get_forward_backward_func()(
                forward_step_func=partial(_forward_step, cfg, []),
                data_iterator=iter(micro),
                model=[ddp],
                num_microbatches=cfg.microbatches,
                seq_length=ids.shape[1],
                micro_batch_size=mb,
                forward_only=False,
            )
    finally:
        model.config.finalize_model_grads_func = saved


def _whole_name(name: str, offset: int) -> str:
    if name.startswith("decoder.layers."):
        decoder, layers, index, rest = name.split(".", 3)
        return f"{decoder}.{layers}.{int(index) + offset}.{rest}"
    return name


def grads(model: Any) -> dict[str, torch.Tensor]:
    """This stage's gradients (DDP ``main_grad``) under whole-model names."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(model.config)
    return {
        _whole_name(n, offset): p.main_grad.detach().clone() for n, p in model.named_parameters()
    }


def partitions(model: Any) -> dict[str, int]:
    """Whole-model name -> the dim a TP-sharded parameter is split on (-1: replicated)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(model.config)
    return {
        _whole_name(n, offset): (
            p.partition_dim if getattr(p, "tensor_model_parallel", False) else -1
        )
        for n, p in model.named_parameters()
    }


def build(cfg: DemoConfig) -> tuple:
    with megatron_on_cpu():
        torch.manual_seed(cfg.seed)
        model, ddp, _opt, _sched = _build(cfg)
    return model, ddp


def reference(cfg: DemoConfig, dp_rank: int) -> dict[str, Any]:
    """One rank, whole model: per-trajectory norms by one backward each, b*, the final grads."""
    md = build(config(loss=cfg.loss))
    d = data(cfg, dp_rank)
    rows = cfg.rollouts_per_rank
    sq = torch.zeros(rows, dtype=torch.float64)
    for i in range(rows):
        step(cfg, md, d, torch.nn.functional.one_hot(torch.tensor(i), rows), finalize=False)
        sq[i] = sum(g.double().square().sum() for g in grads(md[0]).values())
    res = min_variance_baseline(None, d["rewards"], sq, d["groups"])
    step(cfg, md, d, res.advantages, finalize=False)
    return {"sq": sq, "advantages": res.advantages, "grads": grads(md[0])}


def layout_run(cfg: DemoConfig) -> dict[str, Any]:
    """This rank in ``cfg``'s layout: the glue's norms, advantages and rewritten local grads."""
    from megatron.core import parallel_state as ps

    from ess_patch.demo.opob import BaselineGlue

    if cfg.tp > 1:  # the harness starts with TP=1: lay the world out again
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tp,
            pipeline_model_parallel_size=cfg.pp,
            create_gloo_process_groups=False,
        )
    dp_rank = ps.get_data_parallel_rank()
    model, ddp = md = build(cfg)
    glue = BaselineGlue(
        model,
        ddp,
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
    )
    d = data(cfg, dp_rank)
    seen: dict[str, Any] = {}
    inner = glue.grads.sq_norms

    def spy() -> torch.Tensor:
        seen["sq"] = inner()
        return seen["sq"]

    glue.grads.sq_norms = spy
    glue.begin(d["rewards"], d["groups"])
    # finalize=False would skip the glue: keep megatron's finalize but with one DP rank per
    # data, compare the local grads by reading them inside the glue's wrapped original
    original = glue._original

    def capture(*args: Any, **kwargs: Any) -> Any:
        seen["grads"] = grads(model)
        return original(*args, **kwargs)

    glue._original = capture
    step(cfg, md, d, torch.ones(cfg.rollouts_per_rank))
    seen["final"] = grads(model)  # after megatron's finalize: averaged over DP
    metrics = glue.metrics()
    glue.remove()
    return {
        "dp_rank": dp_rank,
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "sq": seen["sq"],
        "grads": seen["grads"],
        "final": seen["final"],
        "partition": partitions(model),
        "metrics": metrics,
    }


def references(cfg: DemoConfig) -> list[dict[str, Any]]:
    """:func:`reference` for every DP rank of ``cfg`` (run on one rank)."""
    return [reference(cfg, r) for r in range(cfg.dp)]


def glue_errors() -> dict[str, str]:
    """The glue's clear errors on one rank; each leaves the gradients and the config as found."""
    from megatron.core.distributed import finalize_model_grads

    from ess_patch.demo.opob import BaselineGlue
    from ess_patch.per_trajectory import PerTrajectoryGrads, UnsupportedModuleError

    cfg = config()
    model, ddp = md = build(cfg)
    d = data(cfg, 0)
    out: dict[str, str] = {}
    saved = model.config.finalize_model_grads_func
    model.config.finalize_model_grads_func = None
    try:
        BaselineGlue(model, ddp)
    except ValueError as exc:
        out["no_finalize"] = str(exc)
    model.config.finalize_model_grads_func = saved
    assert saved is finalize_model_grads
    glue = BaselineGlue(model, ddp)
    try:
        glue.begin(torch.ones(3), torch.zeros(2).long())
    except ValueError as exc:
        out["begin_shapes"] = str(exc)
    step(cfg, md, d, torch.ones(cfg.rollouts_per_rank), finalize=False)
    before = grads(model)
    try:  # a step without begin(): finalize refuses before touching a gradient
        glue._finalize([ddp])
    except RuntimeError as exc:
        out["no_begin"] = str(exc)
    out["grads_kept"] = str(all(torch.equal(before[k], v) for k, v in grads(model).items()))
    glue.begin(torch.ones(5), torch.zeros(5).long())  # one row short of the step's 6
    step(cfg, md, d, torch.ones(cfg.rollouts_per_rank), finalize=False)
    before = grads(model)
    try:
        glue._finalize([ddp])
    except RuntimeError as exc:
        out["rows"] = str(exc)
    out["grads_kept_rows"] = str(all(torch.equal(before[k], v) for k, v in grads(model).items()))
    glue.remove()
    out["restored"] = str(model.config.finalize_model_grads_func is finalize_model_grads)
    try:
        PerTrajectoryGrads(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    except UnsupportedModuleError as exc:
        out["unsupported"] = str(exc)
    return out
