"""Rollouts through the REAL actor train path of slime / miles on CPU, for the ledger tests.

What is real: the framework's ``parse_args`` (with ess-patch installed), the actor's
``train_actor`` (its own decision to recompute or reuse log-probs, ``--keep-old-actor``'s model
switch), its advantage routine, ``train`` / ``train_one_step``, ``get_batch``, the loss
(``loss_function`` -> ``policy_loss_function`` -> ``get_log_probs_and_entropy``),
megatron-core's ``forward_backward_no_pipelining``, DDP, the megatron-core optimizer
(``get_megatron_optimizer``, SGD so that an update shows its LR exactly) and the framework's own
LR scheduler builder. What is the test's own: the model (:class:`TinyLM`, a position-free
embedding + head that takes the host's forward arguments; logits depend only on the token, so
the test computes every log-prob independently in float64), the actor object (built without
its Ray ``init``: the attributes ``train_actor`` reads), the weight backups of the tags the
actor switches between, and the rollout (what the rollout side would hand the actor).

:func:`run` returns, per optimizer step: the LR each param group was updated with (read by a
step pre-hook on the inner torch optimizer), the scheduler's LR for it, the weights the step
started from, and what the host logged; plus the rollout, so that the test can compute its
float64 reference.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any
from unittest import mock

import torch

from ess_patch.integrations.actors import INIT_PATH

VOCAB, HIDDEN = 11, 6
VOCAB_TP = 12  # the vocabulary padded to split over TP2 (TinyLM under tensor parallelism)


class TinyLM(torch.nn.Module):
    """Logits ``head(tanh(embedding(token)))`` for every position: ``[1, T, VOCAB]`` float32.

    Takes the keyword arguments slime's and miles' ``forward_step`` pass (packed sequence
    parameters and masks are not needed: no attention). Under tensor parallelism (TP > 1 in
    megatron's parallel_state) the head is vocabulary-parallel as megatron's output layer is:
    ``VOCAB_TP`` rows (the vocabulary padded to split evenly; no token uses the padding), this
    rank's rows of the one seeded head, the input copied into the TP region (its gradient
    all-reduced) and this rank's logits ``[1, T, VOCAB_TP / TP]`` out. Under two pipeline stages
    the first holds the embedding and hands ``tanh(embedding)`` on as megatron's ``[s, b, h]``,
    the second takes it through ``set_input_tensor`` and holds the head (the same seeded
    weights as one stage)."""

    def __init__(self) -> None:
        from megatron.core import parallel_state
        from megatron.core.enums import ModelType
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.model_type = ModelType.encoder_or_decoder  # megatron's schedules read it
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.first = parallel_state.is_pipeline_first_stage()
        self.last = parallel_state.is_pipeline_last_stage()
        # what megatron's finalize_model_grads reads of a stage (no tied embedding here)
        self.pre_process, self.post_process = self.first, self.last
        self.share_embeddings_and_output_weights = False
        self._input: torch.Tensor | None = None
        self.embedding = torch.nn.Embedding(VOCAB, HIDDEN)
        if self.tp == 1:
            self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        else:
            full = torch.nn.Linear(HIDDEN, VOCAB_TP, bias=False).weight.detach()
            rows = VOCAB_TP // self.tp
            rank = parallel_state.get_tensor_model_parallel_rank()
            self.head = torch.nn.Linear(HIDDEN, rows, bias=False)
            with torch.no_grad():
                self.head.weight.copy_(full[rank * rows : (rank + 1) * rows])
            set_tensor_model_parallel_attributes(self.head.weight, True, 0, 1)
        if not self.first:  # built, then dropped: the seed gives every stage the same weights
            del self.embedding
        if not self.last:
            del self.head

    def set_input_tensor(self, tensor: Any) -> None:
        """The previous stage's output (megatron's schedules hand a list of one)."""
        if isinstance(tensor, (list, tuple)):
            tensor = tensor[0]
        self._input = tensor

    def forward(self, input_ids: torch.Tensor, **_ignored: Any) -> torch.Tensor:
        if self.first:
            hidden = torch.tanh(self.embedding(input_ids))
        else:
            hidden = self._input.transpose(0, 1)  # [s, b, h] -> [b, s, h]
        if not self.last:
            return hidden.transpose(0, 1).contiguous()
        if self.tp > 1:
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

            hidden = copy_to_tensor_model_parallel_region(hidden)
        return self.head(hidden).float()


def reference_log_probs(weights: dict[str, torch.Tensor], tokens: torch.Tensor, response: int):
    """float64 log-probs of the response tokens of one sample under ``weights`` (no CP)."""
    emb = weights["embedding.weight"].double()
    head = weights["head.weight"].double()
    logits = torch.tanh(emb[tokens]) @ head.T  # [T, V]
    logp = torch.log_softmax(logits, dim=-1)
    total = tokens.numel()
    positions = torch.arange(total - response - 1, total - 1)
    return logp[positions, tokens[positions + 1]]


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    module = getattr(model, "module", model)
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def whole_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """:func:`weights_of` with a vocabulary-parallel head gathered over TP (every TP rank's
    rows, in rank order) and every pipeline stage's parameters: the weights of the whole
    model, as the rollout engine runs it."""
    from megatron.core import parallel_state

    weights = weights_of(model)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        pp = parallel_state.get_pipeline_model_parallel_group()
        stages: list[Any] = [None] * torch.distributed.get_world_size(pp)
        torch.distributed.all_gather_object(stages, weights, group=pp)
        weights = {k: v for stage in stages for k, v in stage.items()}
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        shard = weights["head.weight"]
        parts = [torch.empty_like(shard) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, shard.contiguous(), group=group)
        weights["head.weight"] = torch.cat(parts)
    return weights


class Backups:
    """The actor's ``weights_backuper`` for the test model (tags -> parameter copies)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = getattr(model, "module", model)
        self._backups: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def backup_tags(self) -> list[str]:
        return list(self._backups)

    @torch.no_grad()
    def backup(self, tag: str) -> None:
        self._backups[tag] = {n: p.detach().clone() for n, p in self._model.named_parameters()}

    @torch.no_grad()
    def restore(self, tag: str) -> None:
        for name, p in self._model.named_parameters():
            p.copy_(self._backups[tag][name])

    def get(self, tag: str) -> dict[str, torch.Tensor]:
        return self._backups[tag]


def make_rollout(
    num: int, *, seed: int, rollout_weights: dict[str, torch.Tensor], noise: float = 0.05
) -> list[dict[str, Any]]:
    """``num`` samples: tokens, prompt/response lengths, a loss mask with holes, a reward, and
    the rollout engine's log-probs (the rollout policy's, plus engine noise; float32)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num):
        prompt = 2 + i % 3
        response = 3 + (i * 5) % 6
        tokens = torch.randint(0, VOCAB, (prompt + response,), generator=g)
        mask = (torch.rand(response, generator=g) > 0.2).int()
        mask[0] = 1
        exact = reference_log_probs(rollout_weights, tokens, response)
        rollout_lp = (
            exact + noise * torch.randn(response, generator=g, dtype=torch.float64)
        ).float()
        samples.append(
            {
                "tokens": tokens,
                "response_length": response,
                "total_length": prompt + response,
                "loss_mask": mask,
                "reward": float(torch.rand((), generator=g)),
                "rollout_log_probs": rollout_lp,
            }
        )
    return samples


def build_optimizer(args: Any, model_chunks: list) -> tuple[Any, Any]:
    """The real megatron-core optimizer (SGD, fp32) and the framework's own scheduler."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="sgd",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=0.0,
        sgd_momentum=0.0,
        clip_grad=0.0,
        bf16=False,
        params_dtype=torch.float32,
        use_distributed_optimizer=False,
    )
    optimizer = get_megatron_optimizer(config, model_chunks)
    return optimizer, config


def ddp_model(seed: int = 7) -> list:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1:
        config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1)
    else:  # the schedule sends [s, b, h] float32 between stages, s varying per micro-batch
        config = TransformerConfig(
            num_layers=pp,
            hidden_size=HIDDEN,
            num_attention_heads=1,
            pipeline_model_parallel_size=pp,
            pipeline_dtype=torch.float32,
        )
        config.variable_seq_lengths = True  # after the MoE check (no MoE here)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=False, overlap_grad_reduce=False
    )
    model = TinyLM()
    model.config = config  # as a GPTModel carries its own (the norm pass reads hidden_size)
    return [DistributedDataParallel(config, ddp_config, model)]


class StepRecorder:
    """Per real update: the LR each param group used, the scheduler's LR for it, the weights
    the step started from (a pre-hook on every inner torch optimizer)."""

    def __init__(self, optimizer: Any, scheduler: Any, model: torch.nn.Module) -> None:
        self.steps: list[dict[str, Any]] = []
        inner = [child.optimizer for child in getattr(optimizer, "chained_optimizers", [optimizer])]
        self._handles = [opt.register_step_pre_hook(self._pre) for opt in inner]
        self._outer = optimizer
        self._scheduler = scheduler
        self._model = model

    def _pre(self, opt: torch.optim.Optimizer, _args: tuple, _kwargs: dict) -> None:
        self.steps.append(
            {
                "lr": [g["lr"] for g in opt.param_groups],
                "scheduled": [self._scheduler.get_lr(g) for g in opt.param_groups],
                "weights": weights_of(self._model),
            }
        )

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def schedule(
    local_indices: Sequence[int], steps: int, micro_per_step: int
) -> tuple[list[int], list[list[int]]]:
    """slime's rollout-side schedule for this rank: ``num_microbatches`` per step and the
    local sample indices of each micro-batch (contiguous, in order)."""
    per_step = len(local_indices) // steps
    per_micro = per_step // micro_per_step
    micro = [
        list(range(s * per_step + m * per_micro, s * per_step + (m + 1) * per_micro))
        for s in range(steps)
        for m in range(micro_per_step)
    ]
    return [micro_per_step] * steps, micro


class LossSpy:
    """What the framework's real ``loss_function`` was handed, per sample of each micro-batch:
    (its tokens, its per-token advantages). Wraps the function the train loop calls (its
    ``model`` module's name for it); the loss itself runs unchanged."""

    def __init__(self, model_module: Any) -> None:
        self.seen: list[tuple[list[int], list[float]]] = []
        real = model_module.loss_function

        def spy(args: Any, *rest: Any, **kw: Any) -> Any:
            # the micro-batch: the first dict (miles @78828a5c8 passes its parallel state first)
            batch = next((a for a in rest if isinstance(a, dict)), None)
            assert batch is not None, "this loss_function got its micro-batch by keyword"
            # packed (THD) micro-batches keep each sample's own tokens as "unconcat_tokens"
            tokens_of = batch["unconcat_tokens"] if "unconcat_tokens" in batch else batch["tokens"]
            for tokens, adv in zip(tokens_of, batch["advantages"], strict=True):
                self.seen.append((tokens.tolist(), adv.tolist()))
            return real(args, *rest, **kw)

        self._patcher = mock.patch.object(model_module, "loss_function", spy)

    def __enter__(self) -> LossSpy:
        self._patcher.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self._patcher.stop()


def slime_rollout_data(
    samples: Sequence[dict[str, Any]],
    local: Sequence[int],
    *,
    steps: int,
    micro_per_step: int,
    dp_size: int,
    cp_slice=None,
    uneven: tuple[list[int], list[list[int]]] | None = None,
) -> dict[str, Any]:
    """What slime's ``_get_rollout_data`` hands ``train_actor`` for this DP rank."""
    if uneven is not None:  # (num_microbatches, micro-batches): e.g. a dynamic-batch schedule
        num_microbatches, micro = uneven
    else:
        num_microbatches, micro = schedule(local, steps, micro_per_step)
    picked = [samples[i] for i in local]
    rollout_lp = [s["rollout_log_probs"] for s in picked]
    if cp_slice is not None:
        rollout_lp = [
            cp_slice(lp, s["total_length"], s["response_length"])
            for lp, s in zip(rollout_lp, picked, strict=True)
        ]
    return {
        "tokens": [s["tokens"].clone() for s in picked],
        "loss_masks": [s["loss_mask"].clone() for s in picked],
        "total_lengths": [s["total_length"] for s in picked],
        "response_lengths": [s["response_length"] for s in picked],
        "rewards": [s["reward"] for s in picked],
        "raw_reward": [s["reward"] for s in picked],
        "rollout_log_probs": rollout_lp,
        "num_microbatches": num_microbatches,
        "micro_batch_indices": micro,
        "global_batch_sizes": _step_sizes(num_microbatches, micro, dp_size),
        "partition": list(local),
    }


def _step_sizes(num_microbatches: list[int], micro: list[list[int]], dp_size: int) -> list[int]:
    """Samples per optimizer step, over every DP rank (each holds as many)."""
    sizes, start = [], 0
    for count in num_microbatches:
        sizes.append(sum(len(b) for b in micro[start : start + count]) * dp_size)
        start += count
    return sizes


def slime_actor(args: Any, models: list, optimizer: Any, scheduler: Any) -> Any:
    """slime's real ``MegatronTrainRayActor`` without its Ray ``init``: the attributes
    ``train_actor`` reads."""
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    actor = object.__new__(MegatronTrainRayActor)
    actor.args = args
    actor.model = models
    actor.optimizer = optimizer
    actor.opt_param_scheduler = scheduler
    actor.weights_backuper = Backups(models[0])
    actor._active_model_tag = "actor"
    actor.rollout_data_postprocess = None
    actor.role = "actor"

    class _Profiler:
        def step(self, **_kw: Any) -> None:
            pass

    class _Updater:
        def pop_metrics(self) -> dict:
            return {}

    actor.prof = _Profiler()
    actor.weight_updater = _Updater()
    return actor


def scaled_ratio(record: dict[str, Any]) -> float:
    """The one scale applied to every param group of a recorded step (checked equal)."""
    ratios = [lr / sched for lr, sched in zip(record["lr"], record["scheduled"], strict=True)]
    assert all(math.isclose(r, ratios[0], rel_tol=1e-12) for r in ratios), ratios
    return ratios[0]


def megatron_groups(tmp_path, *, rank: int = 0, world_size: int = 1, cp: int = 1):
    """A gloo world (FileStore in ``tmp_path``) with megatron's parallel_state, CP = ``cp``,
    DP = world_size // cp, and the gloo duplicates slime's metric gathers use."""
    import contextlib
    import datetime
    import os

    from megatron.core import parallel_state

    @contextlib.contextmanager
    def world():
        store = torch.distributed.FileStore(
            os.path.join(tmp_path, "ledger_world.store"), world_size
        )
        torch.distributed.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            parallel_state.initialize_model_parallel(context_parallel_size=cp)
            try:
                yield
            finally:
                parallel_state.destroy_model_parallel()
        finally:
            torch.distributed.destroy_process_group()

    return world()


def use_cpu_accelerator() -> None:
    """slime (2026-08 on) asks its accelerator registry for the device: register a CPU one
    (test-only: no accelerator exists here). Older slime calls ``torch.cuda`` directly, which
    the CPU shim maps."""
    import importlib

    try:
        accel = importlib.import_module("slime.utils.accelerator")
        base = importlib.import_module("slime.utils.accelerator.base")
    except ModuleNotFoundError:
        return

    class CPUAccelerator(base.Accelerator):
        name = "cpu"
        device_type = "cpu"
        communication_backend_name = "gloo"

        def is_available(self) -> bool:
            return True

        def device(self, index: Any = None) -> torch.device:
            return torch.device("cpu")

        def device_name(self, index: Any = None) -> str:
            return "cpu"

        def set_device(self, index: Any) -> None:
            pass

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def synchronize(self, device: Any = None) -> None:
            pass

        def current_stream(self, device: Any = None) -> Any:
            return None

        def empty_cache(self) -> None:
            pass

        def mem_get_info(self, device: Any = None) -> tuple[int, int]:
            return (1 << 30, 1 << 30)

        def memory_allocated(self, device: Any = None) -> int:
            return 0

        def memory_reserved(self, device: Any = None) -> int:
            return 0

    accel.set_accelerator(CPUAccelerator())


SLIME_ARGV = (
    "--custom-megatron-init-path", INIT_PATH,  # the train actors patched (actors.py)
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "3",
    "--micro-batch-size", "2", "--lr", "1e-1", "--min-lr", "1e-2", "--lr-decay-style", "cosine",
    "--advantage-estimator", "grpo", "--ess-lr-weight-mode", "product",
    # the model dims slime's perf log reads (the test model ignores them)
    "--num-layers", "1", "--hidden-size", str(HIDDEN), "--ffn-hidden-size", str(HIDDEN),
    "--num-attention-heads", "1", "--kv-channels", str(HIDDEN), "--vocab-size", str(VOCAB),
)  # fmt: skip


def slime_parse(flags: Sequence[str]) -> Any:
    """slime's real ``parse_args`` (ess-patch installed by the caller) on the test's argv."""
    from upstream import parse_upstream_args

    args = parse_upstream_args("slime", [*SLIME_ARGV, *flags])
    # what megatron's validate_args (replaced in tests, see upstream.py) would have filled in
    args.start_weight_decay = args.end_weight_decay = 0.0
    args.num_query_groups = args.num_query_groups or 1
    if args.moe_layer_freq is None:
        args.moe_layer_freq = 1
    return args


def _train_actor_extras(actor: Any, **wanted: Any) -> dict[str, Any]:
    """Those of ``wanted`` this ``train_actor`` takes beyond the rollout (miles from @78527b910,
    v0.1.0: ``witness_info`` / ``attempt``; slime from v0.3.0: ``external_data``); critic values for
    a ``train_actor`` without ``external_data`` are refused."""
    import inspect

    taken = inspect.signature(actor.train_actor).parameters
    assert wanted.get("external_data") is None or "external_data" in taken, "no external_data"
    return {k: v for k, v in wanted.items() if k in taken}


def slime_train(
    flags: Sequence[str],
    *,
    rollouts: int = 2,
    steps: int = 1,
    micro_per_step: int = 2,
    num: int = 8,
    seed: int = 0,
    uneven: tuple[list[int], list[list[int]]] | None = None,
    spy: bool = False,
) -> dict[str, Any]:
    """``rollouts`` rollouts of ``num`` samples (all DP ranks together) through slime's real
    ``train_actor``, inside an initialised world; ess-patch installed by the caller. Each
    rollout was generated by a policy away from the actor's weights (the ``old_actor`` under
    --keep-old-actor, which then computes the ``log_probs`` at the advantage hook)."""
    import importlib.util
    import inspect
    from argparse import Namespace

    from megatron.core import parallel_state as mpu
    from megatron.training.global_vars import set_args
    from slime.backends.megatron_utils import data as slime_data
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp
    from slime.backends.megatron_utils.model import get_optimizer_param_scheduler

    if importlib.util.find_spec("slime.observability") is not None:  # slime after v0.3.1
        import slime.observability.logging_utils as logging_utils
        from slime.observability.timer import Timer
    else:
        import slime.utils.logging_utils as logging_utils
        from slime.utils.timer import Timer

        if not hasattr(logging_utils, "wandb"):  # slime v0.2.0: tracking_utils holds it
            import slime.utils.tracking_utils as logging_utils

    own_schedule = "args" in inspect.signature(slime_data.get_data_iterator).parameters
    if own_schedule and "--calculate-per-token-loss" not in flags:
        # slime v0.2.0's loss hands megatron the normalizer 1 (an int) unless it sums per
        # token, and megatron-core >= 0.15's schedule clamps it as a tensor (v0.2.0 ran on
        # 0.14): on this megatron-core, v0.2.0 trains with --calculate-per-token-loss
        flags = [*flags, "--calculate-per-token-loss"]
    args = slime_parse(flags)
    set_args(args)
    use_cpu_accelerator()
    models = ddp_model()
    optimizer, _ = build_optimizer(args, models)
    scheduler = get_optimizer_param_scheduler(args, optimizer)
    actor = slime_actor(args, models, optimizer, scheduler)
    actor.weights_backuper.backup("actor")
    recorder = StepRecorder(optimizer, scheduler, models[0])
    logged: list[dict] = []
    args.use_wandb = True
    # wandb's log, not ess-patch's hook (restored when done)
    patcher = mock.patch.object(logging_utils, "wandb", Namespace(log=logged.append))
    patcher.start()
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=False)
    dp_size = mpu.get_data_parallel_world_size(with_context_parallel=False)
    cp_size = mpu.get_context_parallel_world_size()
    per_rank = num // dp_size
    local = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
    g = torch.Generator().manual_seed(1000 + seed)
    out: dict[str, Any] = {"rollouts": [], "dp_rank": dp_rank, "dp_size": dp_size}
    try:
        for rollout_id in range(rollouts):
            current = whole_weights(models[0])
            behind = {k: v + 0.4 * torch.randn(v.shape, generator=g) for k, v in current.items()}
            samples = make_rollout(num, seed=seed * 100 + rollout_id, rollout_weights=behind)
            if args.keep_old_actor:  # the rollout engines ran the old actor's weights
                actor.weights_backuper._backups["old_actor"] = behind
            data = slime_rollout_data(
                samples,
                local,
                steps=steps,
                micro_per_step=micro_per_step,
                dp_size=dp_size,
                cp_slice=(lambda lp, t, r: slice_log_prob_with_cp(lp, t, r))
                if cp_size > 1
                else None,
                uneven=uneven,
            )
            data["sample_indices"] = list(local)  # the rollout manager's numbering
            schedule = {k: data[k] for k in ("num_microbatches", "micro_batch_indices")}
            if own_schedule:
                # slime v0.2.0: train_actor schedules the micro-batches itself from the
                # arguments (get_data_iterator(args, model, rollout_data)); the schedule keys
                # of v0.3's rollout manager are not its rollout data (it logs every list)
                for key in ("num_microbatches", "micro_batch_indices", "global_batch_sizes"):
                    data.pop(key)
            timer = Timer()
            if "train_wait" not in timer.start_time:
                timer.start("train_wait")
            timer.seq_lens = data["total_lengths"]
            first_step = len(recorder.steps)
            external = None
            if args.use_critic:  # the critic's values for this rank's samples (PPO's GAE)
                external = {
                    "values": [
                        0.1 * torch.randn(len(lp), generator=g) for lp in data["rollout_log_probs"]
                    ]
                }
            import slime.backends.megatron_utils.model as model_module

            with LossSpy(model_module) if spy else contextlib.nullcontext() as seen:
                extras = _train_actor_extras(actor, external_data=external)
                actor.train_actor(rollout_id, data, **extras)
            out["rollouts"].append(
                {
                    "weights": current,
                    "loss_saw": seen.seen if spy else None,
                    "samples": samples,
                    "local": local,
                    **schedule,
                    "hook_log_probs": data.get("log_probs"),  # None: slime reused the loss's
                    "rollout_weights": behind,
                    "steps": list(range(first_step, len(recorder.steps))),
                }
            )
    finally:
        patcher.stop()
    recorder.close()
    out["records"] = recorder.steps
    out["logged"] = [r for r in logged if "train/step" in r]
    return out


MILES_ARGV = (
    "--custom-megatron-init-path", INIT_PATH,  # the train actors patched (actors.py)
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "3",
    "--micro-batch-size", "2", "--lr", "1e-1", "--min-lr", "1e-2", "--lr-decay-style", "cosine",
    "--advantage-estimator", "grpo", "--ess-lr-weight-mode", "product", "--qkv-format", "thd",
    "--num-layers", "1", "--hidden-size", str(HIDDEN), "--ffn-hidden-size", str(HIDDEN),
    "--num-attention-heads", "1", "--kv-channels", str(HIDDEN), "--vocab-size", str(VOCAB),
)  # fmt: skip


def miles_parse(flags: Sequence[str]) -> Any:
    """miles' real ``parse_args`` (ess-patch installed by the caller) on the test's argv."""
    from upstream import parse_upstream_args

    def add(parser: Any) -> Any:
        # miles' --skip-actor-forward-only check reads a Megatron option the Megatron-LM
        # snapshot here does not define yet (a newer miles-main one does)
        if "--moe-router-force-biased" not in parser._option_string_actions:
            parser.add_argument("--moe-router-force-biased", default=None)
        return parser

    args = parse_upstream_args("miles", [*MILES_ARGV, *flags], add_custom_arguments=add)
    args.start_weight_decay = args.end_weight_decay = 0.0
    args.num_query_groups = args.num_query_groups or 1
    if getattr(args, "moe_layer_freq", None) is None:
        args.moe_layer_freq = 1
    return args


def miles_actor(args: Any, models: list, optimizer: Any, scheduler: Any) -> Any:
    """miles' real ``MegatronTrainRayActor`` without its Ray ``init``: the attributes
    ``train_actor`` reads."""
    from miles.backends.megatron_utils.actor import MegatronTrainRayActor

    actor = object.__new__(MegatronTrainRayActor)
    actor.args = args
    actor.model = models
    actor.optimizer = optimizer
    actor.opt_param_scheduler = scheduler
    actor.weights_backuper = Backups(models[0])
    actor._active_model_tag = "actor"
    actor.rollout_data_postprocess = None
    actor.role = "actor"
    actor.with_ref = actor.with_opd_teacher = False
    actor._ft_test_action_executor = None

    class _Nothing:
        def step(self, **_kw: Any) -> None:
            pass

        def bump(self) -> None:
            pass

        def pop_metrics(self) -> dict:
            return {}

    actor.prof = actor._heartbeat = actor.weight_updater = _Nothing()
    return actor


def _give_gloo_groups(state: Any) -> None:
    """miles' metric gathers use each group's ``gloo_group`` (on gloo: the group itself) and
    a real ``indep_dp`` group of one rank (``upstream.miles_parallel_state`` leaves None)."""
    import dataclasses

    world = torch.distributed.get_world_size()
    singles = [torch.distributed.new_group([r]) for r in range(world)]
    for f in dataclasses.fields(state):
        info = getattr(state, f.name)
        if not dataclasses.is_dataclass(info) or not hasattr(info, "gloo_group"):
            continue
        group = info.group if info.group is not None else singles[torch.distributed.get_rank()]
        setattr(state, f.name, dataclasses.replace(info, group=group, gloo_group=group))


def miles_train(
    flags: Sequence[str],
    *,
    rollouts: int = 2,
    num: int = 8,
    seed: int = 0,
    spy: bool = False,
) -> dict[str, Any]:
    """As :func:`slime_train`, through miles' real ``train_actor`` (miles splits the rollout
    into steps itself: ``global_batch_size`` samples each, ``micro_batch_size`` per
    micro-batch, contiguous)."""
    import miles.backends.training_utils.log_utils as log_utils
    from megatron.core import parallel_state as mpu
    from megatron.training.global_vars import set_args
    from miles.backends.megatron_utils.model import get_optimizer_param_scheduler
    from miles.utils.timer import Timer
    from upstream import miles_parallel_state

    args = miles_parse(flags)
    set_args(args)
    state = miles_parallel_state()
    _give_gloo_groups(state)
    models = ddp_model()
    optimizer, _ = build_optimizer(args, models)
    scheduler = get_optimizer_param_scheduler(args, optimizer)
    actor = miles_actor(args, models, optimizer, scheduler)
    actor.parallel_state = state  # what miles @78828a5c8's train_actor reads
    actor.weights_backuper.backup("actor")
    recorder = StepRecorder(optimizer, scheduler, models[0])
    logged: list[dict] = []
    # older miles import miles.utils.tracking_utils as tracking_utils
    tracker = getattr(log_utils, "tracking", None) or log_utils.tracking_utils
    patcher = mock.patch.object(  # the tracker's log, not ess-patch's hook (restored when done)
        tracker, "log", lambda _a, d, step_key=None: logged.append(dict(d))
    )
    patcher.start()
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=False)
    dp_size = mpu.get_data_parallel_world_size(with_context_parallel=False)
    per_rank = num // dp_size
    local = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
    g = torch.Generator().manual_seed(1000 + seed)
    out: dict[str, Any] = {"rollouts": [], "dp_rank": dp_rank, "dp_size": dp_size}
    try:
        for rollout_id in range(rollouts):
            current = whole_weights(models[0])
            behind = {k: v + 0.4 * torch.randn(v.shape, generator=g) for k, v in current.items()}
            samples = make_rollout(num, seed=seed * 100 + rollout_id, rollout_weights=behind)
            if args.keep_old_actor:
                actor.weights_backuper._backups["old_actor"] = behind
            picked = [samples[i] for i in local]
            data = {
                "tokens": [s["tokens"].clone() for s in picked],
                "loss_masks": [s["loss_mask"].clone() for s in picked],
                "total_lengths": [s["total_length"] for s in picked],
                "response_lengths": [s["response_length"] for s in picked],
                "rewards": [s["reward"] for s in picked],
                "raw_reward": [s["reward"] for s in picked],
                "rollout_log_probs": [s["rollout_log_probs"] for s in picked],
                "sample_indices": list(local),  # the rollout manager's numbering
            }
            if args.qkv_format == "bshd":  # what miles' get_rollout_data adds for padded rows
                pad = mpu.get_tensor_model_parallel_world_size() * args.data_pad_size_multiplier
                longest = -(-max(data["total_lengths"]) // pad) * pad
                data["max_seq_lens"] = [longest] * len(picked)
            timer = Timer()
            if "train_wait" not in timer.start_time:
                timer.start("train_wait")
            timer.seq_lens = data["total_lengths"]
            first_step = len(recorder.steps)
            # miles asks CUDA for free memory after each backward and synchronizes after
            # training (no CUDA here: plenty free, nothing to wait for)
            saved = torch.cuda.mem_get_info, torch.cuda.synchronize
            torch.cuda.mem_get_info = lambda *_a: (1 << 30, 1 << 30)
            torch.cuda.synchronize = lambda *_a: None
            import miles.backends.megatron_utils.model as model_module

            try:
                with LossSpy(model_module) if spy else contextlib.nullcontext() as seen:
                    actor.train_actor(
                        rollout_id, data, **_train_actor_extras(actor, witness_info=None, attempt=0)
                    )
            finally:
                torch.cuda.mem_get_info, torch.cuda.synchronize = saved
            per_step = args.global_batch_size // dp_size
            steps = len(recorder.steps) - first_step
            out["rollouts"].append(
                {
                    "weights": current,
                    "loss_saw": seen.seen if spy else None,
                    "samples": samples,
                    "local": local,
                    "micro_batch_indices": [
                        list(range(s * per_step, (s + 1) * per_step)) for s in range(steps)
                    ],
                    "num_microbatches": [1] * steps,
                    "hook_log_probs": data.get("log_probs"),
                    "rollout_weights": behind,
                    "steps": list(range(first_step, len(recorder.steps))),
                }
            )
    finally:
        patcher.stop()
    recorder.close()
    out["records"] = recorder.steps
    out["logged"] = [r for r in logged if "train/step" in r]
    return out
