"""What one rank runs in the verl engine-path baseline tests (``test_verl_engine_baseline.py``).

verl's real engine path end to end: ``ActorRolloutRefWorker.update_actor`` ->
``TrainingWorker.train_mini_batch`` (verl's mini-batch iterator) -> ``train_batch`` ->
``MegatronEngineWithLMHead.train_batch`` (its ``forward_backward_batch``, its own
``forward_step``: verl's engine forward from ``verl.models.mcore``, packed THD with
``use_remove_padding`` or padded bshd without, through megatron-core's schedule, pipeline
included) -> ``ppo_loss`` (verl's own, PPO-clipped at eps 0.2) -> ``optimizer_step`` on a real
megatron-core optimizer. The engine is built without its ``__init__`` (which builds the model
from HF weights through mbridge): around ``verl_baseline_rank``'s GPTModel (local spec; THD
attention is ``thd_attention``'s CPU counterpart of TE's). The batch is the driver's:
``DataProto.to_tensordict`` then ``left_right_2_no_padding``, verl's own, chunked over DP with
``tu.chunk_tensordict``. verl's policy loss records what it gets.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

from verl_baseline_rank import _record_policy_loss, build, verl_batch
from verl_engine_rank import engine_on_cpu
from verl_rank import composed


def _engine(ddp: Any, optimizer: Any, remove_padding: bool, dynamic_bsz: bool = False) -> Any:
    """verl's real ``MegatronEngineWithLMHead`` around ``ddp`` (its ``forward_step`` and
    everything under it verl's own), as its ``__init__`` leaves it for a Qwen2 text model.
    With ``dynamic_bsz``, micro-batches of at most 12 tokens: about one trajectory each (11
    at most), so verl regroups each mini-batch."""
    from verl.utils.megatron_utils import register_megatron_training_hooks
    from verl.workers.config import McoreEngineConfig
    from verl.workers.engine.megatron import transformer_impl as impl

    engine_config = McoreEngineConfig()
    for key, value in {
        "use_dynamic_bsz": dynamic_bsz,  # micro-batches by tokens (max_token_len_per_gpu)
        "micro_batch_size_per_gpu": 2,
        "max_token_len_per_gpu": 12 if dynamic_bsz else 64,
        "use_remove_padding": remove_padding,
    }.items():
        object.__setattr__(engine_config, key, value)
    engine = object.__new__(impl.MegatronEngineWithLMHead)
    vars(engine).update(
        engine_config=engine_config,
        model_config=SimpleNamespace(
            hf_config=SimpleNamespace(architectures=["Qwen2ForCausalLM"]),
            tokenizer=SimpleNamespace(pad_token_id=0),
            mtp=SimpleNamespace(enable=False, enable_train=False),
            use_remove_padding=remove_padding,
            get=lambda key, default=None: (
                remove_padding if key == "use_remove_padding" else default
            ),
        ),
        optimizer_config=None,
        tf_config=ddp.config,
        module=[ddp],
        optimizer=optimizer,
        lr_scheduler=_constant_schedule(optimizer),
        mode=None,
        is_value_model=False,
        enable_routing_replay=False,
        _is_offload_param=False,
        _is_offload_grad=False,
        _is_offload_optimizer=False,
        mini_layer_topk_idx_list=[],
    )
    register_megatron_training_hooks([ddp], optimizer)  # verl's own
    return engine


def _constant_schedule(optimizer: Any) -> Any:
    """megatron-core's scheduler at the optimizer's LR throughout (the engine steps it after
    the last mini-batch)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    lr = optimizer.param_groups[0]["lr"]
    return OptimizerParamScheduler(
        optimizer,
        init_lr=lr,
        max_lr=lr,
        min_lr=lr,
        lr_warmup_steps=0,
        lr_decay_steps=10,
        lr_decay_style="constant",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )


def _worker(
    engine: Any, actor_node: Any, actor_config: Any, dp_rank: int, strategy: str | None
) -> Any:
    """verl's real ``ActorRolloutRefWorker`` holding a real ``TrainingWorker`` (no Ray actor:
    both built without their ``__init__``) with verl's ``ppo_loss`` on ``actor_config``; the
    worker's own actor config says ``strategy`` when given (what an FSDP actor's would)."""
    from omegaconf import OmegaConf
    from verl.utils.profiler import DistProfiler
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    trainer = object.__new__(TrainingWorker)
    vars(trainer).update(
        engine=engine,
        loss_fn=partial(ppo_loss, config=actor_config),
        engine_config=engine.engine_config,
        model_config=OmegaConf.create(
            {"use_remove_padding": engine.engine_config.use_remove_padding}
        ),
        device_name="cpu",
        flops_counter=SimpleNamespace(estimate_flops=lambda *_a, **_k: (0.0, 1.0)),
        profiler=DistProfiler(rank=dp_rank, config=None),  # verl's own, disabled
    )
    worker = object.__new__(ActorRolloutRefWorker)
    node = OmegaConf.to_container(actor_node, resolve=True)
    if strategy is not None:
        node["strategy"] = strategy
    vars(worker).update(
        actor=trainer,
        config=OmegaConf.create({"actor": node}),
        enable_routing_replay=False,
    )
    return worker


def _torch_padding() -> None:
    """verl unpads through flash-attn's ``bert_padding`` (CUDA builds only, not installable
    here) or, on NPUs, through its own torch implementation of the same four functions
    (``verl.utils.npu_flash_attn_utils``): this process takes verl's own."""
    from verl.utils import attention_utils
    from verl.utils import npu_flash_attn_utils as own

    functions = (own.index_first_axis, own.pad_input, own.rearrange, own.unpad_input)
    attention_utils._get_attention_functions = lambda: functions


def driver_chunk(scenario: dict, dp_rank: int, dp_size: int, actor_node: Any) -> Any:
    """This DP rank's chunk of the rollout as verl's driver hands it to ``update_actor``
    (``_update_actor``: ``to_tensordict``, ``left_right_2_no_padding``, the trainer's keys)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    _torch_padding()
    batch = verl_batch(scenario.get("seed", 0), gae_like=scenario.get("gae_like", False))
    batch.meta_info["temperature"] = scenario.get("temperature", 1.0)
    batch.meta_info["multi_turn"] = False
    td = left_right_2_no_padding(batch.to_tensordict())
    # rollout.n is 1 (each row its own sample): the global mini-batch, split over DP by verl
    mini = actor_node.ppo_mini_batch_size
    tu.assign_non_tensor(
        td,
        calculate_entropy=False,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=mini,
        mini_batch_size=mini,
        epochs=actor_node.ppo_epochs,
        seed=actor_node.data_loader_seed or 0,
        dataloader_kwargs={"shuffle": actor_node.shuffle},
        compute_loss=True,
    )
    return tu.chunk_tensordict(td, dp_size)[dp_rank]


def _tamper_iterator(how: str) -> None:
    """verl's mini-batch iterator (this process only) yields mini-batches whose advantages
    are doubled (``"double"``: not what the baseline wrote) or whose rows are unknown
    (``"drop"``: the row key taken out, as an iterator ess-patch did not see would)."""
    from verl.utils import tensordict_utils as tu

    original = tu.make_iterator

    def make_iterator(*args: Any, **kwargs: Any) -> Any:
        for mini in original(*args, **kwargs):
            if how == "double":
                mini["advantages"] = mini["advantages"] * 2
            else:
                del mini["_ess_patch_row"]
            yield mini

    tu.make_iterator = make_iterator


def run(src: str, scenario: dict) -> dict:
    """One rank: install (unless ``no_install``), build the model, the engine and the workers,
    ``update_actor`` on this DP rank's chunk; report what verl's loss got (``seen``), the
    metrics and the weights after."""
    import torch

    engine_on_cpu(src, scenario)
    import ess_patch

    if not scenario.get("no_install"):
        ess_patch.install()  # the README's call: every integration it finds
    import verl.utils.config
    from verl.utils import tensordict_utils as tu

    from ess_patch.demo.cpu import megatron_on_cpu

    out: dict[str, Any] = {}
    with megatron_on_cpu():
        model, ddp, optimizer = build(scenario, out)
        root = composed(src, scenario.get("hydra", []))
        node = root.actor_rollout_ref.actor
        actor_config = verl.utils.config.omega_conf_to_dataclass(node)
        remove_padding = node.megatron.get("use_remove_padding", True)
        engine = _engine(ddp, optimizer, remove_padding, scenario.get("dynamic_bsz", False))
        worker = _worker(engine, node, actor_config, out["dp"], scenario.get("strategy"))
        seen: list = []
        steps = [0]
        out["micro_batch_rows"] = []
        import verl.workers.utils.losses as losses  # ppo_loss's own policy-loss lookup

        _record_policy_loss(seen, steps, losses, out["micro_batch_rows"])
        step = optimizer.step

        def counted_step(*args: Any, **kwargs: Any) -> Any:
            steps[0] += 1
            return step(*args, **kwargs)

        optimizer.step = counted_step
        before = [p.detach().clone() for p in ddp.parameters()]
        data = driver_chunk(scenario, out["dp"], out["dp_size"], node)
        given = data["advantages"].clone()
        if scenario.get("tamper"):  # something between verl's selection and its loss
            _tamper_iterator(scenario["tamper"])
        try:
            # megatron's p2p synchronizes CUDA in its shape exchange (nothing to wait for here)
            synchronize, torch.cuda.synchronize = torch.cuda.synchronize, lambda *_a: None
            try:
                output = worker.update_actor(data)
            finally:
                torch.cuda.synchronize = synchronize
            metrics = dict(tu.get(output, "metrics")) if output is not None else {}
            out["metrics"] = {k: v for k, v in metrics.items() if "ess_baseline" in k}
            out["lr_scale"] = metrics.get("lr_scale")
        except Exception as exc:  # reported: the test compares every rank's error
            import traceback

            out["error"] = f"{type(exc).__name__}: {exc}"
            out["traceback"] = traceback.format_exc()
        out["seen"] = seen
        out["params_unchanged"] = all(
            torch.equal(a, b.detach()) for a, b in zip(before, ddp.parameters(), strict=True)
        )
        out["params"] = [p.detach().clone() for p in ddp.parameters()]
        out["state"] = {
            k: v.detach().clone()
            for k, v in model.state_dict().items()
            if not k.endswith("_extra_state")
        }
        out["caller_data_kept"] = torch.equal(data["advantages"], given) and (
            "_ess_patch_row" not in data.keys()  # noqa: SIM118 - a TensorDict
        )
    return out
