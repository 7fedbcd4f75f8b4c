"""What one rank runs in the verl engine-path tests: verl's REAL Megatron engine on CPU.

Real, from the verl tree under test (a snapshot folder or the PyPI wheel): the worker's
``ActorRolloutRefWorker.update_actor`` -> ``TrainingWorker.train_mini_batch`` (verl's own
mini-batch iterator, epochs, shuffle, DP all-gathers) -> ``TrainingWorker.train_batch`` ->
``MegatronEngine.train_batch``: ``optimizer_zero_grad``, ``forward_backward_batch`` (verl's
micro-batching, megatron-core's own ``get_forward_backward_func()`` schedule with the hooks
verl's ``register_megatron_training_hooks`` registers, verl's ``postprocess_micro_batch_func``
and ``postprocess_batch_func``), ``optimizer_step`` around a real megatron-core optimizer
(``tests/megatron_cpu.py`` builds it, the real ``get_megatron_optimizer``), then
``lr_scheduler_step`` on a real ``OptimizerParamScheduler``. The critic is the same chain on
a ``MegatronEngineWithValueHead``, after the actor in the same process.

Stood in, because it cannot exist on CPU: the model (verl builds it through mbridge from HF
weights, with flash-attn / TransformerEngine): each engine's ``forward_step`` runs
megatron_cpu's tiny DDP net on features of each micro-batch's sample ids and returns verl's
``postprocess_micro_batch_func`` for it, as the real one does; the worker's loss function
(``ppo_loss`` needs the model's log-probs) is an MSE on that output. Which samples each
optimizer step trained on is read back from the micro-batches the schedule fed the model.
The ESS inputs (``old_log_probs``, ``rollout_log_probs``, ``response_mask``) are in verl's
layout at ``train_batch``: padded ``[batch, response]``, beside the nested ``input_ids``.
"""

from __future__ import annotations

import os
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from verl_rank import PROMPT, R, _import_verl, _install, _lr_recorder

N_ENGINE = 8


def _features(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic inputs and targets of the tiny net for these sample ids."""
    from megatron_cpu import batch

    xs, ys = zip(*(batch(i, 0, size=1) for i in ids), strict=True)
    return torch.cat(xs), torch.cat(ys)


def _engine(kind: str, setup: Any, fed: list, engine_config: Any) -> Any:
    """A real ``MegatronEngineWith{LMHead,ValueHead}`` around ``setup`` (built without its
    ``__init__``, which builds the model from HF weights), its ``forward_step`` stood in."""
    from omegaconf import OmegaConf
    from verl.utils.megatron_utils import register_megatron_training_hooks
    from verl.workers.engine.megatron import transformer_impl as impl

    cls = impl.MegatronEngineWithLMHead if kind == "actor" else impl.MegatronEngineWithValueHead
    engine = object.__new__(cls)
    tf_config = setup.models[0].config
    tf_config.variable_seq_lengths = True  # verl's tf config: shapes travel through p2p
    tf_config.pipeline_dtype = torch.float32
    vars(engine).update(
        engine_config=engine_config,
        model_config=OmegaConf.create({"mtp": {"enable": False}, "use_remove_padding": True}),
        optimizer_config=None,
        tf_config=tf_config,
        module=setup.models,
        optimizer=setup.optimizer,
        lr_scheduler=setup.scheduler,
        mode=None,
        is_value_model=kind != "actor",
        enable_routing_replay=False,
        _is_offload_param=False,
        _is_offload_grad=False,
        _is_offload_optimizer=False,
    )
    from megatron.core import parallel_state as mpu
    from megatron.core.enums import ModelType

    received: list = []  # the previous stage's output, handed over by megatron's schedule
    for chunk in setup.models:  # what megatron's schedule asks of a model chunk
        chunk.module.set_input_tensor = lambda tensor: (
            received[:].clear()
            or received.append(tensor[0] if isinstance(tensor, list) else tensor)
        )
        chunk.module.model_type = ModelType.encoder_or_decoder
        chunk.module.pre_process = mpu.is_pipeline_first_stage()
        chunk.module.post_process = mpu.is_pipeline_last_stage()
        chunk.module.share_embeddings_and_output_weights = False
    register_megatron_training_hooks(setup.models, setup.optimizer)  # verl's own

    def forward_step(batch_iter, model, postprocess_micro_batch_func, **_kwargs):
        micro = next(batch_iter)
        ids = [int(row[0]) for row in micro["input_ids"].unbind()]
        fed.append(ids)
        x, _ = _features(ids)
        out = model(x)
        if received and received[-1] is not None:  # a later stage: depend on the one before
            out = out + 0.0 * received[-1].sum()
        if not mpu.is_pipeline_last_stage():  # [seq, batch, hidden] to the next stage
            return out.view(len(ids), 1, 1), None
        output = {"log_probs": out} if kind == "actor" else out
        return output, partial(postprocess_micro_batch_func, data=micro)

    engine.forward_step = forward_step
    return engine


def _loss(model_output: Any, data: Any, dp_group: Any = None, **_kwargs: Any) -> tuple:
    """The stand-in for verl's loss (it needs the real model's log-probs): MSE of the net's
    output against the sample ids' targets, with a metric the way verl's losses return it."""
    out = model_output["log_probs"] if "log_probs" in model_output else model_output["values"]
    ids = [int(row[0]) for row in data["input_ids"].unbind()]
    _, y = _features(ids)
    loss = torch.nn.functional.mse_loss(out, y)
    return loss, {"loss_standin": loss.detach().item()}


def _worker(engine: Any, engine_config: Any, dp_rank: int) -> Any:
    """A real ``TrainingWorker`` (no Ray actor: built without its ``__init__``)."""
    from omegaconf import OmegaConf
    from verl.utils.profiler import DistProfiler
    from verl.workers.engine_workers import TrainingWorker

    worker = object.__new__(TrainingWorker)
    vars(worker).update(
        engine=engine,
        loss_fn=_loss,
        engine_config=engine_config,
        model_config=OmegaConf.create({"use_remove_padding": True}),
        device_name="cpu",
        flops_counter=SimpleNamespace(estimate_flops=lambda *_a, **_k: (0.0, 1.0)),
        profiler=DistProfiler(rank=dp_rank, config=None),  # verl's own, disabled
    )
    return worker


def _engine_config(scenario: dict) -> Any:
    from verl.workers.config import McoreEngineConfig

    config = McoreEngineConfig()
    for key, value in {
        "use_dynamic_bsz": scenario.get("dynamic_bsz", False),
        "micro_batch_size_per_gpu": 2,
        "max_token_len_per_gpu": 64,
        "context_parallel_size": scenario.get("cp", 1),
    }.items():
        object.__setattr__(config, key, value)
    return config


def _data(scenario: dict, dp_rank: int, dp_size: int) -> Any:
    """This DP rank's chunk, as verl's driver makes it (``to_tensordict`` then
    ``left_right_2_no_padding``: nested ``input_ids`` / ``position_ids`` / ``loss_mask``; the
    log-probs and ``response_mask`` stay padded), with the driver's non-tensor keys."""
    from verl.utils import tensordict_utils as tu
    from verl_rank import _local

    data = _local(scenario, dp_rank, dp_size).batch
    for key in ("input_ids", "position_ids"):
        data[key] = torch.nested.as_nested_tensor(list(data[key].unbind()), layout=torch.jagged)
    data["loss_mask"] = data["response_mask"]
    for key in ("attention_mask", "responses"):
        del data[key]
    tu.assign_non_tensor(data, max_seq_len=PROMPT + R, max_response_len=R)
    tu.assign_non_tensor(
        data,
        global_batch_size=scenario.get("mini_batch", 2) * dp_size,
        mini_batch_size=scenario.get("mini_batch", 2) * dp_size,
        epochs=scenario.get("epochs", 1),
        seed=7,
        dataloader_kwargs={"shuffle": scenario.get("shuffle", False)},
        calculate_entropy=False,
    )
    return data


def engine_on_cpu(src: str, scenario: dict) -> None:
    """This rank's environment (``scenario["env"]``), verl imported from ``src``, and the
    ``torch.cpu`` memory counters verl's engine metrics read (CUDA-only names)."""
    os.environ.update(scenario.get("env", {}))
    _import_verl(src)
    for name in ("max_memory_allocated", "max_memory_reserved"):
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: 0)


def run(src: str, scenario: dict) -> dict:
    """One rank: install, build the real engines and workers, update the actor, then the
    critic; report the LRs each inner update applied and the samples it trained on."""
    from omegaconf import OmegaConf

    engine_on_cpu(src, scenario)
    import ess_patch

    if not scenario.get("no_install"):
        _install(scenario)
    from megatron.core import parallel_state as mpu
    from megatron_cpu import build_megatron_optimizer
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from ess_patch.demo.cpu import megatron_on_cpu

    dp_rank = mpu.get_data_parallel_rank()
    dp_size = mpu.get_data_parallel_world_size()
    out: dict[str, Any] = {
        "coords": (dp_rank, mpu.get_context_parallel_rank(), mpu.get_pipeline_model_parallel_rank())
    }
    engine_config = _engine_config(scenario)
    # megatron's p2p shape exchange (PP) synchronises the CUDA device; nothing to wait for here
    torch.cuda.synchronize = lambda *_a, **_k: None
    with megatron_on_cpu():
        actor_setup = build_megatron_optimizer("fp32", optimizer="adam", seed=1)
        critic_setup = build_megatron_optimizer("fp32", optimizer="adam", seed=2)
        fed: list = []
        seen: list = []
        engine = _engine("actor", actor_setup, fed, engine_config)
        worker = object.__new__(ActorRolloutRefWorker)
        actor_config = scenario.get("actor_config", {"strategy": "megatron"})
        vars(worker).update(
            actor=_worker(engine, engine_config, dp_rank),
            config=OmegaConf.create({"actor": actor_config}),
            enable_routing_replay=False,
        )
        applied: list = []
        _lr_recorder(actor_setup.optimizer, applied)

        def step_ids(_opt: Any, _a: Any, _k: Any) -> None:  # the samples this step trained on
            if len(seen) < len(applied):
                seen.append(sorted(i for ids in fed for i in ids))
                fed.clear()

        for child in getattr(actor_setup.optimizer, "chained_optimizers", [actor_setup.optimizer]):
            child.optimizer.register_step_pre_hook(step_ids)
        out["scheduled"] = [g["lr"] for g in actor_setup.optimizer.param_groups]
        out["scheduled_each"] = []
        out["params_before"] = [p.detach().clone() for p in actor_setup.models[0].parameters()]
        try:
            output = worker.update_actor(_data(scenario, dp_rank, dp_size))
            out["metrics"] = dict(tu.get(output, "metrics")) if output is not None else None
        except Exception as exc:  # reported, not raised: the test compares every rank's error
            out["error"] = f"{type(exc).__name__}: {exc}"
        out.update(seen=seen, applied=applied, armed_after=ess_patch.armed())
        out["after"] = [g["lr"] for g in actor_setup.optimizer.param_groups]
        groups = actor_setup.optimizer.param_groups
        out["scheduler_after"] = [actor_setup.scheduler.get_lr(g) for g in groups]
        out["params"] = [p.detach().clone() for p in actor_setup.models[0].parameters()]

        critic_engine = _engine("critic", critic_setup, [], engine_config)
        critic = _worker(critic_engine, engine_config, dp_rank)
        critic_applied: list = []
        _lr_recorder(critic_setup.optimizer, critic_applied)
        out["critic_scheduled"] = [g["lr"] for g in critic_setup.optimizer.param_groups]
        critic.train_mini_batch(_data({}, dp_rank, dp_size))
        out["critic_applied"] = critic_applied
    from ess_patch.install import installed_shapes

    out["shapes"] = installed_shapes()
    return out
