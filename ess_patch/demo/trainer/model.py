"""This rank's part of the demo's model: its layout (DP x TP x PP), its stage in megatron's
``DistributedDataParallel`` with the optimizer and scheduler, and the whole policy's weights
published to the rollout workers."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...errors import EssPatchValueError
from ..policy import build_policy, global_weights
from .config import DemoConfig

__all__ = ["Layout", "build", "digest", "is_writer", "publish"]


@dataclass
class Layout:
    dp_rank: int
    tp_rank: int
    pp_rank: int
    dp_group: Any
    pp_group: Any
    layer_offset: int

    @classmethod
    def current(cls, config: Any) -> Layout:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        return cls(
            dp_rank=ps.get_data_parallel_rank(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_group=ps.get_data_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            layer_offset=get_transformer_layer_offset(config),
        )


def is_writer(cfg: DemoConfig, lay: Layout) -> bool:
    """The rank that records the steps: last pipeline stage, first DP and TP rank."""
    return lay.pp_rank == cfg.pp - 1 and lay.dp_rank == 0 and lay.tp_rank == 0


def build(cfg: DemoConfig):
    """This rank's model stage in megatron's DDP, its optimizer and scheduler."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    # The whole model first, from the seed, then this stage's slice of it: every pipeline
    # layout starts from the same weights as pp=1 (a stage alone would draw its layers from
    # another point of the RNG stream).
    whole = (
        build_policy(cfg.spec, tp=cfg.tp, pp=1, device=cfg.device)
        if cfg.pp > 1 and cfg.init_weights is None
        else None
    )
    model = build_policy(
        cfg.spec,
        tp=cfg.tp,
        pp=cfg.pp,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        device=cfg.device,
    )
    if whole is not None:
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        source = whole.state_dict()
        local = model.state_dict()
        names = global_weights(model, get_transformer_layer_offset(model.config))
        # global_weights keeps the stage's order: local name i <-> whole-model name i
        model.load_state_dict(
            {mine: source[name] for mine, name in zip(local, names, strict=True)}, strict=True
        )
    del whole
    if cfg.init_weights is not None:
        _load_init(model, cfg)
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
        model,
    )
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.lr,
        weight_decay=0.0,
        clip_grad=cfg.clip_grad,
        bf16=False,
        params_dtype=torch.float32,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=False)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.grad_scale_func = optimizer.scale_loss
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
    return model, ddp, optimizer, scheduler


def _load_init(model: Any, cfg: DemoConfig) -> None:
    """Load ``cfg.init_weights`` (whole model, TP = 1) into this rank's stage and TP shard.

    A tensor-parallel parameter is the whole one cut into ``tp`` equal slices along the one
    dimension whose size differs (megatron's QKV rows are grouped per query group, so a
    contiguous slice is this rank's heads); this rank takes its slice.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    source = torch.load(cfg.init_weights, map_location="cpu", weights_only=True)
    local = model.state_dict()
    names = global_weights(model, get_transformer_layer_offset(model.config))
    rank, out = ps.get_tensor_model_parallel_rank(), {}
    for mine, name in zip(local, names, strict=True):
        if not isinstance(local[mine], torch.Tensor):
            out[mine] = local[mine]
            continue
        if name not in source:
            raise EssPatchValueError(
                f"init_weights {cfg.init_weights}: no {name!r} (another model?)"
            )
        value = source[name]
        dims = [d for d, (a, b) in enumerate(zip(local[mine].shape, value.shape)) if a != b]
        if dims:
            if len(dims) != 1 or value.shape[dims[0]] != local[mine].shape[dims[0]] * cfg.tp:
                raise EssPatchValueError(
                    f"init_weights {cfg.init_weights}: {name!r} has shape "
                    f"{tuple(value.shape)}, this rank's {tuple(local[mine].shape)} (tp={cfg.tp})"
                )
            value = value.chunk(cfg.tp, dim=dims[0])[rank]
        out[mine] = value.to(local[mine].device, local[mine].dtype)
    model.load_state_dict(out, strict=True)


def publish(model: Any, lay: Layout, cfg: DemoConfig) -> dict[str, Any]:
    """The whole current policy under whole-model names, on every rank (PP: all-gather)."""
    mine = global_weights(model, lay.layer_offset)
    if cfg.pp == 1:
        return mine
    parts: list[Any] = [None] * cfg.pp
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in mine.items()}
    dist.all_gather_object(parts, cpu, group=lay.pp_group)
    whole: dict[str, Any] = {}
    for part in parts:
        whole.update(part)
    return {k: v.to(cfg.device) if isinstance(v, torch.Tensor) else v for k, v in whole.items()}


def digest(weights: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        value = weights[name]
        if isinstance(value, torch.Tensor):
            h.update(name.encode())
            h.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
