"""What one rank runs in the verl baseline tests (``test_verl_baseline.py``).

``refusal_probe``: every verl path that cannot apply VCPO's baseline, called through verl's
own (patched) method with the baseline asked for each way; what each call raised.

``run_baseline``: verl's real ``MegatronPPOActor`` (its ``__init__``, ``make_minibatch_iterator``,
``update_policy`` and ``forward_backward_batch``: verl's own forward, packed THD or padded, its
loss, megatron-core's schedule, pipeline included) around megatron-core's GPTModel (local
spec; the THD attention TE serves on a GPU is ``thd_attention``'s CPU counterpart), megatron
DDP and a real megatron-core optimizer. verl's policy loss records what it gets.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

from verl_rank import _import_verl, has_legacy_actor

#: the ways to ask for the baseline: (environment, actor-config node)
REQUESTS = {
    "env_on": ({"ESS_LR_BASELINE": "1"}, {}),
    "env_shadow": ({"ESS_LR_BASELINE_SHADOW": "1"}, {}),
    "vcpo_key": ({}, {"grad_baselining": {"enable": True}}),
    "off": ({}, {}),
}


def refusal_probe(src: str) -> dict:
    """The legacy FSDP actor's ``update_policy`` and main's Tinker worker, each with every
    request of :data:`REQUESTS` (ESS-LR itself off): the error
    each raised (off: verl's own error on a batch of None)."""
    from omegaconf import OmegaConf

    _import_verl(src)
    import ess_patch

    ess_patch.install("verl")
    out: dict[str, Any] = {}
    for request, (env, node) in REQUESTS.items():
        for key in ("ESS_LR_BASELINE", "ESS_LR_BASELINE_SHADOW", "ESS_LR_ENABLE"):
            os.environ.pop(key, None)
        os.environ.update(env)
        calls = []
        if has_legacy_actor():
            from verl.workers.actor.dp_actor import DataParallelPPOActor

            actor = object.__new__(DataParallelPPOActor)
            vars(actor).update(config=OmegaConf.create({"strategy": "fsdp", **node}))
            calls.append(("fsdp", lambda a=actor: a.update_policy(None)))
        try:
            from verl.workers.engine_workers_tinker import TinkerActorRolloutRefWorker
        except ImportError:
            TinkerActorRolloutRefWorker = None  # only verl main has it
        if TinkerActorRolloutRefWorker is not None:
            tinker = object.__new__(TinkerActorRolloutRefWorker)
            config = OmegaConf.create({"actor": {"strategy": "megatron", **node}})
            vars(tinker).update(config=config, role="rollout")
            calls.append(("tinker", lambda t=tinker: t.forward_backward(None)))
        for name, call in calls:
            try:
                call()
                out[f"{name}_{request}"] = "ok"
            except Exception as exc:
                out[f"{name}_{request}"] = f"{type(exc).__name__}: {exc}"
    return out


# --- the legacy Megatron actor with the baseline --------------------------------------------

#: the rollout: 2 prompts x 4 samples (uid per prompt), left-padded prompts of PROMPT_W
#: tokens, right-padded responses of RESP_W; rows ordered so that verl's contiguous DP chunks
#: split both groups over two DP ranks
N_SAMPLES, N_PER_PROMPT, PROMPT_W, RESP_W, VOCAB = 8, 4, 5, 6, 16
PROMPT_LENS = [3, 5, 4, 2, 5, 3, 4, 5]
RESP_LENS = [6, 4, 5, 3, 6, 2, 5, 4]
REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # row k of the batch is sample ORDER[k]


def gpt_model(tp: int = 1, pp: tuple[int, int] | None = None) -> Any:
    """megatron-core's GPTModel, local spec: RMSNorm, no bias, SwiGLU, GQA, rope, untied
    (TP-sharded over ``tp`` ranks: vocabulary-parallel embedding and output layer; with
    ``pp`` (stage, stages) that stage's layers: :func:`stage_model` loads the weights)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        normalization="RMSNorm",
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1 if pp is None else pp[1],
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # what verl's config converter sets: packed micro-batches differ in length, so the
        # pipeline schedule sends each one's shape before its activations
        variable_seq_lengths=True,
        batch_p2p_comm=False,
        moe_token_dispatcher_type="alltoall",  # megatron refuses the default beside them
    )
    from thd_attention import ThdDotProductAttention

    stage, stages = pp or (0, 1)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    # verl packs its micro-batches (THD): TE's attention on a GPU, its CPU counterpart here
    spec.submodules.self_attention.submodules.core_attention = ThdDotProductAttention
    torch.manual_seed(0)
    return GPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=PROMPT_W + RESP_W,
        pre_process=stage == 0,
        post_process=stage == stages - 1,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )


def stage_model() -> Any:
    """This pipeline stage (of two, one layer each) of :func:`gpt_model`'s weights."""
    from megatron.core import parallel_state as mpu
    from pipeline_ranks import stage_weights

    stage, stages = mpu.get_pipeline_model_parallel_rank(), 2
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(create_gloo_process_groups=False)  # the whole model's weights
    full = gpt_model().state_dict()
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        pipeline_model_parallel_size=stages, create_gloo_process_groups=False
    )
    model = gpt_model(pp=(stage, stages))
    missing, unexpected = model.load_state_dict(stage_weights(full, stage, stages, 2), strict=False)
    assert not unexpected and all(m.endswith("_extra_state") for m in missing), (
        missing,
        unexpected,
    )
    return model


def trajectories(seed: int = 0) -> dict:
    """Each sample unpadded (prompt, response), its response's loss mask and log-probs, its
    reward and prompt, in sample order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list] = {k: [] for k in ("prompt", "response", "mask", "old", "rollout")}
    for p, r in zip(PROMPT_LENS, RESP_LENS, strict=True):
        out["prompt"].append(torch.randint(0, VOCAB, (p,), generator=gen))
        out["response"].append(torch.randint(0, VOCAB, (r,), generator=gen))
        mask = (torch.rand(r, generator=gen) > 0.2).long()
        mask[0] = 1
        out["mask"].append(mask)
        rollout = -torch.rand(r, generator=gen) * 2
        out["rollout"].append(rollout)
        out["old"].append(rollout + 0.3 * torch.randn(r, generator=gen))
    out["uid"] = [f"prompt-{i // N_PER_PROMPT}" for i in range(N_SAMPLES)]
    return out


def verl_batch(seed: int = 0, *, gae_like: bool = False) -> Any:
    """The whole rollout as verl's driver hands it to the actor: left/right padded, GRPO's
    advantages from verl's own ``compute_grpo_outcome_advantage`` (``uid`` groups), in
    :data:`ORDER` (as ``balance_batch`` reorders)."""
    import numpy as np
    import torch
    from verl import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    t = trajectories(seed)
    n, width = N_SAMPLES, PROMPT_W + RESP_W
    tensors = {
        "input_ids": torch.zeros(n, width, dtype=torch.long),
        "attention_mask": torch.zeros(n, width, dtype=torch.long),
        "position_ids": torch.zeros(n, width, dtype=torch.long),
        "prompts": torch.zeros(n, PROMPT_W, dtype=torch.long),
        "responses": torch.zeros(n, RESP_W, dtype=torch.long),
        "response_mask": torch.zeros(n, RESP_W, dtype=torch.long),
        "old_log_probs": torch.zeros(n, RESP_W),
        "rollout_log_probs": torch.zeros(n, RESP_W),
        "token_level_rewards": torch.zeros(n, RESP_W),
    }
    for k, i in enumerate(ORDER):
        p, r = PROMPT_LENS[i], RESP_LENS[i]
        tensors["input_ids"][k, PROMPT_W - p : PROMPT_W] = t["prompt"][i]
        tensors["input_ids"][k, PROMPT_W : PROMPT_W + r] = t["response"][i]
        tensors["attention_mask"][k, PROMPT_W - p : PROMPT_W + r] = 1
        pos = torch.clamp(tensors["attention_mask"][k].cumsum(0) - 1, min=0)
        tensors["position_ids"][k] = pos
        tensors["prompts"][k, PROMPT_W - p :] = t["prompt"][i]
        tensors["responses"][k, :r] = t["response"][i]
        tensors["response_mask"][k, :r] = t["mask"][i]
        tensors["old_log_probs"][k, :r] = t["old"][i]
        tensors["rollout_log_probs"][k, :r] = t["rollout"][i]
        last = int(t["mask"][i].nonzero()[-1])
        tensors["token_level_rewards"][k, last] = REWARDS[i]
    uid = np.array([t["uid"][i] for i in ORDER], dtype=object)
    adv, _ = compute_grpo_outcome_advantage(
        tensors["token_level_rewards"], tensors["response_mask"], uid
    )
    if gae_like:  # a critic's per-token advantages: not one value per trajectory
        adv = adv + 0.1 * torch.arange(RESP_W) * tensors["response_mask"]
    tensors["advantages"] = adv
    del tensors["token_level_rewards"]
    return DataProto.from_dict(
        tensors=tensors,
        non_tensors={"uid": uid},
        meta_info={"temperature": 1.0, "micro_batch_size": 2},
    )


def _record_policy_loss(
    seen: list, steps: list[int], module: Any = None, calls: list[int] | None = None
) -> None:
    """verl's own policy loss, as ``module`` looks it up (this release's
    ``get_policy_loss_fn``, PPO-clipped, eps from the actor config; default: the legacy
    actor's ``forward_backward_batch``), recording each row it gets: its old log-probs (which
    name the sample), its advantages, the log-probs verl's forward computed, and how many
    optimizer steps ran before; and in ``calls`` the rows of each call (one per micro-batch)."""
    if module is None:
        import verl.workers.actor.megatron_actor as module

    real = module.get_policy_loss_fn

    def get_policy_loss_fn(mode: str) -> Any:
        loss_fn = real(mode)

        def recorded(**kwargs: Any) -> Any:
            if calls is not None:
                calls.append(int(kwargs["advantages"].shape[0]))
            for k in range(kwargs["advantages"].shape[0]):
                seen.append(
                    (
                        kwargs["old_log_prob"][k].tolist(),
                        kwargs["advantages"][k].tolist(),
                        kwargs["log_prob"][k].detach().tolist(),
                        steps[0],
                    )
                )
            return loss_fn(**kwargs)

        return recorded

    module.get_policy_loss_fn = get_policy_loss_fn


def _tamper_iterator(cls: Any) -> None:
    """``DataProto.make_iterator`` (this process only) yields mini-batches whose advantages
    are doubled: what a mini-batch trains on is then not what the baseline wrote."""
    original = cls.make_iterator

    def make_iterator(self: Any, *args: Any, **kwargs: Any) -> Any:
        for mini in original(self, *args, **kwargs):
            mini.batch["advantages"] = mini.batch["advantages"] * 2
            yield mini

    cls.make_iterator = make_iterator


def _brute_force_tp(model: Any, seed: int) -> list[float]:
    """The expectation of :func:`expected_probe` on a TP-sharded model: each sample's squared
    norm from one backward over every parameter (gathered logits, plain ``log_softmax``;
    replicated parameters counted once, on TP rank 0), summed over TP; then
    ``min_variance_baseline`` of GRPO's advantages."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from ess_patch.baseline import min_variance_baseline

    t, batch = trajectories(seed), verl_batch(seed)
    tp_group, tp_rank = mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_rank()
    params = [p for p in model.parameters() if p.requires_grad]
    counted = [tp_rank == 0 or getattr(p, "tensor_model_parallel", False) for p in params]
    sq = torch.zeros(N_SAMPLES, dtype=torch.float64)
    for i in range(N_SAMPLES):
        tokens = torch.cat([t["prompt"][i], t["response"][i]])
        total, r = tokens.numel(), RESP_LENS[i]
        logits = model(tokens[None], torch.arange(total)[None], None, runtime_gather_output=True)
        lp = torch.log_softmax(logits[0, total - r - 1 : total - 1].float(), -1)
        lp = lp.gather(1, tokens[total - r :, None]).squeeze(1)
        term = (t["mask"][i] * torch.exp(t["old"][i] - t["rollout"][i]) * lp).sum()
        grads = torch.autograd.grad(term, params)
        sq[i] = sum(g.double().square().sum() for g, c in zip(grads, counted, strict=True) if c)
    dist.all_reduce(sq, group=tp_group)
    grpo = torch.zeros(N_SAMPLES, dtype=torch.float64)
    for k, i in enumerate(ORDER):
        grpo[i] = float(
            batch.batch["advantages"][k][batch.batch["response_mask"][k].bool()].double().mean()
        )
    groups = torch.tensor([i // N_PER_PROMPT for i in range(N_SAMPLES)])
    return min_variance_baseline(None, grpo, sq, groups).advantages.tolist()


def _optimizer(models: list) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, clip_grad=0.0)
    return get_megatron_optimizer(config, models, use_gloo_process_groups=False)


def build(scenario: dict, out: dict) -> tuple[Any, Any, Any]:
    """This rank's GPT model (TP-sharded over ``tp`` ranks, or its stage of two with ``pp``),
    wrapped in megatron DDP, and a real megatron-core optimizer; ``out`` gets this rank's
    coordinates (and, TP-sharded, the brute-force expectation on this very model). Call inside
    ``megatron_on_cpu()``."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    tp = scenario.get("tp", 1)
    if tp > 1:  # the launcher's DP-only world, regrouped: TP inside, DP across
        mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=tp, create_gloo_process_groups=False
        )
    # two pipeline stages of the one-process weights
    model = stage_model() if scenario.get("pp") else gpt_model(tp)
    out.update(
        dp=mpu.get_data_parallel_rank(with_context_parallel=False),
        dp_size=mpu.get_data_parallel_world_size(with_context_parallel=False),
        tp=mpu.get_tensor_model_parallel_rank(),
        pp=mpu.get_pipeline_model_parallel_rank(),
    )
    if tp > 1:  # the brute-force expectation on this very model, before the update
        out["expected_here"] = _brute_force_tp(model, scenario.get("seed", 0))
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    return model, ddp, _optimizer([ddp])


def run_baseline(src: str, scenario: dict) -> dict:
    """One rank: install (unless ``no_install``), build verl's real ``MegatronPPOActor`` around
    the GPT model (megatron DDP, real optimizer) with the config from Hydra (``hydra``), run
    ``make_minibatch_iterator`` and ``update_policy`` on this DP rank's chunk; report what
    verl's loss got (``seen``), the metrics and the weights after."""
    import torch

    os.environ.update(scenario.get("env", {}))
    _import_verl(src)
    import ess_patch

    if not scenario.get("no_install"):
        ess_patch.install()  # the README's call: every integration it finds
    from verl.workers.actor.megatron_actor import MegatronPPOActor
    from verl_rank import composed

    from ess_patch.demo.cpu import megatron_on_cpu

    out: dict[str, Any] = {}
    with megatron_on_cpu():
        model, ddp, optimizer = build(scenario, out)
        dp_rank, dp_size = out["dp"], out["dp_size"]
        import verl.utils.config

        root = composed(src, scenario.get("hydra", []))
        config = verl.utils.config.omega_conf_to_dataclass(root.actor_rollout_ref.actor)
        # verl's own actor, as its worker builds it (a Qwen2 architecture: verl's text forward)
        actor = MegatronPPOActor(
            config=config,
            model_config=None,
            hf_config=SimpleNamespace(architectures=["Qwen2ForCausalLM"]),
            tf_config=model.config,
            actor_module=[ddp],
            actor_optimizer=optimizer,
        )
        seen: list = []
        steps = [0]
        _record_policy_loss(seen, steps)
        step = optimizer.step

        def counted_step(*args: Any, **kwargs: Any) -> Any:
            steps[0] += 1
            return step(*args, **kwargs)

        optimizer.step = counted_step
        before = [p.detach().clone() for p in ddp.parameters()]
        data = verl_batch(scenario.get("seed", 0), gae_like=scenario.get("gae_like", False))
        local = data.chunk(dp_size)[dp_rank]
        if "temperature" in scenario:
            local.meta_info["temperature"] = scenario["temperature"]
        given = local.batch["advantages"].clone()
        if scenario.get("tamper"):  # something between verl's selection and its loss
            _tamper_iterator(type(local))
        try:
            if scenario.get("own_loader"):  # a dataloader make_minibatch_iterator did not make
                loader = local.make_iterator(mini_batch_size=2, epochs=1)
            else:
                loader = actor.make_minibatch_iterator(local)
            # megatron's p2p synchronizes CUDA in its shape exchange (nothing to wait for here)
            synchronize, torch.cuda.synchronize = torch.cuda.synchronize, lambda *_a: None
            try:
                metrics = actor.update_policy(dataloader=loader)
            finally:
                torch.cuda.synchronize = synchronize
            out["metrics"] = {k: v for k, v in metrics.items() if "ess_baseline" in k}
            out["pg_loss"] = metrics.get("actor/pg_loss")
            out["lr_scale"] = metrics.get("actor/lr_scale")
        except Exception as exc:  # reported: the test compares every rank's error
            out["error"] = f"{type(exc).__name__}: {exc}"
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
        out["caller_data_kept"] = torch.equal(local.batch["advantages"], given) and (
            "_ess_patch_row" not in local.batch.keys()  # noqa: SIM118 - a TensorDict
        )
    return out


def expected_probe(src: str, seed: int = 0) -> dict:
    """The independent expectation, single process: each sample's squared gradient norm from
    one backward of ``sum_t mask_t w_t log p(y_t)`` over every parameter (plain
    ``log_softmax`` on the unpadded trajectory, ``w_t = exp(old - rollout)``), GRPO's
    advantage of each sample from verl's batch, and ``min_variance_baseline`` on them: the
    advantage each sample must train with; each sample's response log-probs before any
    step (``log_probs``), and its batch row's old log-probs (``rows``: how a row verl's loss
    got is told to be that sample's)."""
    import torch

    _import_verl(src)
    from ess_patch.baseline import min_variance_baseline
    from ess_patch.demo.cpu import megatron_on_cpu

    t = trajectories(seed)
    batch = verl_batch(seed)
    with megatron_on_cpu():
        model = gpt_model()
        params = [p for p in model.parameters() if p.requires_grad]
        sq, proxy, sq_plain, logps = [], [], [], []
        for i in range(N_SAMPLES):
            tokens = torch.cat([t["prompt"][i], t["response"][i]])
            total, r = tokens.numel(), RESP_LENS[i]
            logits = model(tokens[None], torch.arange(total)[None], None)[0]
            lp = torch.log_softmax(logits[total - r - 1 : total - 1].float(), -1)
            lp = lp.gather(1, tokens[total - r :, None]).squeeze(1)
            logps.append(lp.tolist())
            w = torch.exp(t["old"][i] - t["rollout"][i])
            term = (t["mask"][i] * w * lp).sum()
            grads = torch.autograd.grad(term, params, retain_graph=True)
            sq.append(sum(g.double().square().sum() for g in grads))
            unweighted = torch.autograd.grad((t["mask"][i] * lp).sum(), params)
            sq_plain.append(sum(g.double().square().sum() for g in unweighted))
            # the forward-only proxy by hand: per token, the squared norm of the autograd
            # gradient of log p(y_t) with respect to that position's logits, x mask_t w_t^2
            z = logits[total - r - 1 : total - 1].detach().double().requires_grad_()
            zlp = torch.log_softmax(z, -1).gather(1, tokens[total - r :, None]).squeeze(1)
            per_token = torch.stack(
                [
                    torch.autograd.grad(zlp[k], z, retain_graph=True)[0][k].square().sum()
                    for k in range(r)
                ]
            )
            proxy.append((t["mask"][i].double() * w.double().square() * per_token).sum())
    grpo = torch.zeros(N_SAMPLES, dtype=torch.float64)
    for k, i in enumerate(ORDER):
        row = batch.batch["advantages"][k]
        grpo[i] = float(row[batch.batch["response_mask"][k].bool()].double().mean())
    groups = torch.tensor([i // N_PER_PROMPT for i in range(N_SAMPLES)])
    res = min_variance_baseline(None, grpo, torch.stack(sq), groups)
    res_proxy = min_variance_baseline(None, grpo, torch.stack(proxy), groups)
    res_plain = min_variance_baseline(None, grpo, torch.stack(sq_plain), groups)
    # a row by its old log-probs (what verl's policy loss gets; each sample's are its own)
    rows = {tuple(batch.batch["old_log_probs"][k].tolist()): i for k, i in enumerate(ORDER)}
    return {
        "expected": res.advantages.tolist(),
        "expected_proxy": res_proxy.advantages.tolist(),
        "expected_no_weights": res_plain.advantages.tolist(),
        "grpo": grpo.tolist(),
        "sq": [float(x) for x in sq],
        "rows": rows,
        "log_probs": logps,
        "masks": [m.tolist() for m in t["mask"]],
    }
