"""Test-only helpers: real megatron-core 0.16.1 optimizers on CPU over gloo.

The CPU shim comes from ``ess_patch.demo.cpu`` (the demo needs the same one); the rest is
test-only: it lets tests drive the *real* megatron optimizer classes (ChainedOptimizer,
FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer,
LayerWiseDistributedOptimizer) through DDP grad buffers on a CPU-only torch build, so that
an LR-scaling wrapper can be checked against real parameter updates.

Typical use (also inside a forkserver/spawn child: enter the shim in that process)::

    with megatron_on_cpu(), megatron_world(tmp_path):
        setup = build_megatron_optimizer("dist_bf16", optimizer="adam")
        records = train_steps(setup, 3, data_seed=0)

Kinds (``KINDS``); all but ``layerwise_*`` come from ``get_megatron_optimizer``, so the
outer object is a ``ChainedOptimizer``:

- ``fp32``: Chained[FP32Optimizer]
- ``bf16``: Chained[Float16OptimizerWithFloat16Params]
- ``dist_fp32`` / ``dist_bf16``: Chained[DistributedOptimizer] (Adam only)
- ``multi_fp32``: Chained[FP32Optimizer, FP32Optimizer]; the second child holds the
  "expert" parameter (``param.allreduce = False``), as megatron does for MoE
- ``multi_bf16``: Chained[Float16..., Float16...]
- ``multi_dist_bf16``: Chained[DistributedOptimizer, DistributedOptimizer] (Adam only)
- ``layerwise_fp32`` / ``layerwise_bf16``: LayerWiseDistributedOptimizer over two
  FP32Optimizer / Float16OptimizerWithFloat16Params children

The dense child holds two param groups (weights; biases with half the max LR), so the LR
differs per group and changes every step (linear warmup then cosine decay).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

__all__ = [
    "KINDS",
    "MegatronSetup",
    "StepRecord",
    "TinyNet",
    "batch",
    "build_megatron_optimizer",
    "forward_backward",
    "inner_optimizers",
    "main_params",
    "megatron_world",
    "param_triples",
    "snapshot",
    "snapshots_equal",
    "train_steps",
]

# --------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def megatron_world(tmp_path, *, rank: int = 0, world_size: int = 1) -> Iterator[None]:
    """Gloo process group (FileStore in ``tmp_path``) plus megatron parallel_state, tp=pp=cp=1.

    Gloo duplicates are not created (``create_gloo_process_groups=False``), so optimizers must
    be built with ``use_gloo_process_groups=False`` (``build_megatron_optimizer`` does).
    Tears both down on exit. With ``world_size`` > 1 (one process per rank, same ``tmp_path``)
    dp = world_size; checked for the fp32/bf16/dist/multi kinds, but LayerWise with dp > 1
    fails on gloo (its all-gather has uneven sizes). ``model_parallel_cuda_manual_seed`` is
    not needed: the test model uses plain ``torch.nn`` layers, not megatron's tensor-parallel
    ones.
    """
    from megatron.core import parallel_state

    store = torch.distributed.FileStore(os.path.join(tmp_path, "megatron_world.store"), world_size)
    torch.distributed.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            context_parallel_size=1,
            create_gloo_process_groups=False,
        )
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
    finally:
        torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------

KINDS = (
    "fp32",
    "bf16",
    "dist_fp32",
    "dist_bf16",
    "multi_fp32",
    "multi_bf16",
    "multi_dist_bf16",
    "layerwise_fp32",
    "layerwise_bf16",
)

D_IN, D_HIDDEN = 4, 8


class TinyNet(torch.nn.Module):
    """Two linear layers; with ``expert`` an extra bias-free head marked ``allreduce=False``.

    megatron treats ``allreduce=False`` params as expert-parallel: DDP puts them in
    ``expert_parallel_buffers`` and ``get_megatron_optimizer`` builds a second child optimizer.
    """

    def __init__(self, expert: bool = False):
        super().__init__()
        self.fc1 = torch.nn.Linear(D_IN, D_HIDDEN)
        self.fc2 = torch.nn.Linear(D_HIDDEN, 1)
        self.expert = torch.nn.Linear(D_HIDDEN, 1, bias=False) if expert else None
        if self.expert is not None:
            self.expert.weight.allreduce = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        out = self.fc2(h)
        if self.expert is not None:
            out = out + self.expert(h)
        return out


class MegatronSetup(NamedTuple):
    """What ``build_megatron_optimizer`` returns (unpacks as a 3-tuple first)."""

    models: list  # megatron.core.distributed.DistributedDataParallel chunks
    optimizer: Any  # the outer MegatronOptimizer
    scheduler: Any  # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler
    config: Any  # the OptimizerConfig


def build_megatron_optimizer(
    kind: str,
    *,
    optimizer: str = "adam",
    lr: float = 1e-2,
    min_lr: float = 1e-3,
    init_lr: float | None = None,
    clip_grad: float = 0.0,
    weight_decay: float = 0.0,
    sgd_momentum: float = 0.0,
    loss_scale: float | None = None,
    grad_reduce_in_fp32: bool = True,
    n_models: int = 1,
    warmup_steps: int = 2,
    decay_steps: int = 12,
    seed: int = 1234,
) -> MegatronSetup:
    """Build DDP model chunk(s), the real megatron optimizer and an LR scheduler.

    Call inside ``megatron_on_cpu()`` and ``megatron_world(...)``. ``kind`` is one of ``KINDS``.
    DistributedOptimizer kinds need ``optimizer="adam"`` (megatron asserts it).
    ``n_models`` > 1 gives several model chunks (virtual-pipeline style) under the same
    child optimizer(s). ``loss_scale`` (e.g. 1.0) gives bf16 / distributed kinds a
    ``ConstantGradScaler``, which is what makes megatron check for inf/nan; without one only
    fp16 would check. The scheduler warms up linearly from ``init_lr`` (default ``lr / 10``, so
    the first update is not zero) over ``warmup_steps``, then decays (cosine) to ``min_lr`` by
    ``decay_steps``; biases get half the max/min LR, so every child
    has two param groups with different LRs. Raises ``ValueError`` for an unknown kind.
    """
    from megatron.core import optimizer as megatron_optimizer
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    bf16 = kind.endswith("bf16")
    distributed = kind.startswith(("dist_", "multi_dist_"))
    layerwise = kind.startswith("layerwise_")
    expert = kind.startswith(("multi_", "layerwise_"))
    params_dtype = torch.bfloat16 if bf16 else torch.float32

    config = OptimizerConfig(
        optimizer=optimizer,
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        sgd_momentum=sgd_momentum,
        clip_grad=clip_grad,
        # LayerWise wraps in Float16OptimizerWithFloat16Params itself: build FP32 children.
        bf16=bf16 and not layerwise,
        params_dtype=params_dtype,
        use_distributed_optimizer=distributed,
        loss_scale=loss_scale,
    )
    transformer_config = TransformerConfig(
        num_layers=1,
        hidden_size=D_HIDDEN,
        num_attention_heads=1,
        bf16=bf16,
        params_dtype=params_dtype,
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        use_distributed_optimizer=distributed,
        overlap_grad_reduce=False,
    )
    torch.manual_seed(seed)
    models = []
    for _ in range(n_models):
        module = TinyNet(expert=expert).to(params_dtype)
        models.append(DistributedDataParallel(transformer_config, ddp_config, module))
    ParamKey = getattr(megatron_optimizer, "ParamKey", None)
    if ParamKey is not None:
        overrides = {
            ParamKey(name="*.bias"): {"max_lr": lr / 2, "min_lr": min_lr / 2, "wd_mult": 0.0}
        }
        opt = get_megatron_optimizer(
            config, models, config_overrides=overrides, use_gloo_process_groups=False
        )
    else:  # before 0.16: the same half LR through lr_mult (biases get no weight decay there)
        opt = get_megatron_optimizer(
            config,
            models,
            scale_lr_cond=lambda name, _param: name.endswith(".bias"),
            lr_mult=0.5,
            use_gloo_process_groups=False,
        )
    if layerwise:
        opt = _make_layerwise(opt, config, bf16)
    scheduler = OptimizerParamScheduler(
        opt,
        init_lr=lr / 10 if init_lr is None else init_lr,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style="cosine",
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return MegatronSetup(models, opt, scheduler, config)


def _make_layerwise(chained, config, bf16: bool):
    """Rebuild the children of ``chained`` as megatron's muon path does (``muon.py``).

    ``LayerWiseDistributedOptimizer`` (exists in 0.16.1, ``optimizer/layer_wise_optimizer.py``)
    takes FP32Optimizer children; with ``config.bf16`` it re-wraps their torch optimizers in
    ``Float16OptimizerWithFloat16Params`` itself. With dp size 1 it shards nothing and its
    all-gather is a no-op.
    """
    import inspect

    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.core.process_groups_config import ProcessGroupCollection

    children = list(chained.chained_optimizers)
    config.bf16 = bf16
    init_fns = [child.init_state_fn for child in children]
    if bf16 and "expects base torch optimizers" in inspect.getsource(LayerWiseDistributedOptimizer):
        children = [child.optimizer for child in children]  # 0.19: bf16 wraps them itself
    return LayerWiseDistributedOptimizer(
        children,
        config,
        ProcessGroupCollection.use_mpu_process_groups(),
        init_state_fn_list=init_fns,
    )


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------


class StepRecord(NamedTuple):
    update_successful: bool
    grad_norm: float | None
    lrs: list[float]  # param_groups' lr after scheduler.step, in optimizer.param_groups order


def batch(data_seed: int, step: int, size: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic fp32 inputs ``(size, D_IN)`` and targets ``(size, 1)`` for one step."""
    gen = torch.Generator().manual_seed(data_seed * 100003 + step)
    x = torch.randn(size, D_IN, generator=gen)
    y = torch.randn(size, 1, generator=gen)
    return x, y


def forward_backward(setup: MegatronSetup, x: torch.Tensor, y: torch.Tensor, *, poison=False):
    """One DDP forward/backward on every chunk; grads end up in ``param.main_grad``.

    ``poison`` adds NaN to the loss so every gradient is NaN.
    """
    for model in setup.models:
        model.zero_grad_buffer()
    setup.optimizer.zero_grad()
    for model in setup.models:
        dtype = next(model.parameters()).dtype
        out = model(x.to(dtype)).float()
        loss = torch.nn.functional.mse_loss(out, y)
        if poison:
            loss = loss * float("nan")
        setup.optimizer.scale_loss(loss).backward()
    for model in setup.models:
        model.finish_grad_sync()


def train_steps(
    setup: MegatronSetup, n: int, data_seed: int = 0, *, poison_steps=()
) -> list[StepRecord]:
    """Run ``n`` deterministic steps: forward/backward, ``optimizer.step()``,
    ``scheduler.step(increment=1)``. Steps whose index is in ``poison_steps`` get NaN grads.

    Returns one ``StepRecord`` per step. Megatron's own return value is recorded as is:
    ``(False, None, None)`` from a skipped step gives ``StepRecord(False, None, lrs)``.
    """
    records = []
    for i in range(n):
        x, y = batch(data_seed, i)
        forward_backward(setup, x, y, poison=i in poison_steps)
        ok, grad_norm, _ = setup.optimizer.step()
        setup.scheduler.step(increment=1)
        lrs = [group["lr"] for group in setup.optimizer.param_groups]
        records.append(StepRecord(bool(ok), None if grad_norm is None else float(grad_norm), lrs))
    return records


# --------------------------------------------------------------------------------------
# Inspection
# --------------------------------------------------------------------------------------


def inner_optimizers(optimizer) -> list:
    """The leaf megatron optimizers (the children of a ChainedOptimizer, or itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def main_params(optimizer) -> list[torch.Tensor]:
    """The tensors the inner torch optimizers update (fp32 main params / shards), in order.

    For FP32Optimizer these are the model params; for Float16OptimizerWithFloat16Params the
    fp32 copies; for DistributedOptimizer the flat fp32 shards of the main-param buffer.
    """
    return [
        p
        for leaf in inner_optimizers(optimizer)
        for group in leaf.optimizer.param_groups
        for p in group["params"]
    ]


def param_triples(optimizer) -> list[tuple[dict, torch.Tensor, torch.Tensor]]:
    """``(param_group, main_param, model_param)`` for every tensor an inner torch optimizer
    updates, in ``optimizer.param_groups`` order.

    ``main_param`` is what the torch optimizer steps (its ``.grad`` is set by
    ``prepare_grads``); ``model_param`` is the DDP model's parameter it belongs to. For
    DistributedOptimizer ``main_param`` is a flat shard (the whole param at dp size 1).
    """
    owner: dict[int, torch.Tensor] = {}
    for leaf in inner_optimizers(optimizer):
        if hasattr(leaf, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
            pairs = [
                (leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups),
                (leaf.model_fp32_groups, leaf.shard_fp32_groups),
            ]
        elif hasattr(leaf, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
            pairs = [(leaf.float16_groups, leaf.fp32_from_float16_groups)]
        else:  # FP32Optimizer: the model params themselves
            pairs = []
        for model_groups, main_groups in pairs:
            for model_group, main_group in zip(model_groups, main_groups):
                for model_param, main_param in zip(model_group, main_group):
                    owner[id(main_param)] = model_param
    return [
        (group, p, owner.get(id(p), p))
        for leaf in inner_optimizers(optimizer)
        for group in leaf.optimizer.param_groups
        for p in group["params"]
    ]


def snapshot(setup: MegatronSetup) -> dict[str, Any]:
    """Detached copies of model params, main params, torch-optimizer state and LRs."""

    def clone(obj):
        if isinstance(obj, torch.Tensor):
            return obj.detach().clone()
        if isinstance(obj, dict):
            return {k: clone(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(clone(v) for v in obj)
        return obj

    leaves = inner_optimizers(setup.optimizer)
    return {
        "model": [clone(list(m.module.state_dict().values())) for m in setup.models],
        "main": clone(main_params(setup.optimizer)),
        "state": [clone(leaf.optimizer.state_dict()["state"]) for leaf in leaves],
        "lr": [group["lr"] for group in setup.optimizer.param_groups],
    }


def snapshots_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of nested snapshots (NaN equals NaN, dtypes must match)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bytes(a), _bytes(b))
        )
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(snapshots_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(snapshots_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)
