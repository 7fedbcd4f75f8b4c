"""VCPO's baseline (``--use-ess-baseline``) inside the REAL Megatron-RL code (``MEGATRON_RL_SRC``;
test_megatron_lm_snapshots.py runs this file on every other snapshot too).

The real ``prepare_data_for_update`` of the tree (its real ``compute_group_stats`` ->
``calculate_grpo_advantages``, ``prepare_trajectories``, the old / ref log-prob passes through
megatron-core's real forward-only schedule, the real packing path), patched by install(), on a
real megatron-core GPTModel (RMSNorm, no bias, SwiGLU, GQA, rope; local spec on CPU), single
process and DP2 (3 groups of 4 rollouts: the middle group is split over the two ranks). The
advantages checked are those the returned data iterator hands to the training step (unpacked:
each micro-batch's advantage column; packed: each bin's ``bin_advantages``).

The expectation is independent of the package: each rollout's squared gradient norm from one
backward of ``sum_t w_t log p(y_t)`` over all parameters (plain ``log_softmax``; ``w_t`` the
truncated IS weight ``min(exp(log p - inference), coef)`` over the tokens the engine scored, 1 on
the appended eod), ``b*_g = sum sq R / sum sq``, and upstream's normalisation written out:
``(R - b*_g) / (1e-4 + std_g)`` (population std). Off and shadow mode: every tensor the iterator
yields is bit-identical to the unpatched function's. A tree without ``calculate_grpo_advantages``
(radixark's fork) is refused at parse time (test_megatron_rl.py) and skipped here by name.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared helpers
from harness import run_ranks

SRC = os.environ.get("MEGATRON_RL_SRC")
_RL = None if not SRC else Path(SRC) / "megatron" / "rl" / "rl_utils.py"


def _skip_reason() -> str | None:
    if not SRC or not _RL.is_file():
        return "MEGATRON_RL_SRC is not set to a Megatron-LM tree with megatron/rl"
    if "def calculate_grpo_advantages(" not in _RL.read_text():
        return (
            f"{SRC}: no calculate_grpo_advantages (the advantages are inline): the baseline is "
            "refused there by name at parse time (test_megatron_rl.py)"
        )
    loaded = sys.modules.get("megatron.training")
    if loaded is not None and not str(loaded.__path__[0]).startswith(str(Path(SRC).resolve())):
        return f"megatron.training is already imported from {loaded.__path__[0]} (run separately)"
    return None


SKIP = _skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
if SKIP is None and SRC not in sys.path:
    sys.path.append(SRC)


@pytest.fixture(autouse=True)
def _the_tree_under_test():
    """At run time, not collection: an earlier test module may have put another Megatron-LM
    tree (the fork) first on the path; megatron is a namespace package, so megatron.rl would
    then come from it, here and in the ranks."""
    import importlib.util

    spec = importlib.util.find_spec("megatron.rl")
    where = [str(Path(p).resolve()) for p in (spec.submodule_search_locations or [])]
    if not where or not where[0].startswith(str(Path(SRC).resolve())):
        pytest.skip(
            f"megatron.rl resolves to {where[:1]}, not MEGATRON_RL_SRC: runs alone, and in a "
            "fresh interpreter per snapshot in test_megatron_lm_snapshots.py"
        )


G, N, S, VOCAB = 3, 4, 24, 16  # groups, rollouts per group, sequence length, vocabulary
EOD, PAD = 1, 0
TRUNC = 1.5  # --rl-importance-sampling-truncation-coef
REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0, 1.0, 0.0, 0.0, 0.25, 1.0]


def _model(tp: int = 1, pp: tuple[int, int] | None = None):
    """The GPTModel of every rank; with ``tp`` > 1 this rank's shard of the same weights; with
    ``pp`` (stage, stages) that stage's layers (:func:`_stage_model` loads the weights)."""
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
    )
    stage, stages = pp or (0, 1)
    torch.manual_seed(0)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=S,
        pre_process=stage == 0,
        post_process=stage == stages - 1,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )


def _stage_model():
    """This pipeline stage of :func:`_model`'s weights (two stages, one layer each)."""
    from megatron.core import parallel_state as ps
    from pipeline_ranks import stage_weights

    stage, stages = ps.get_pipeline_model_parallel_rank(), 2
    ps.destroy_model_parallel()
    ps.initialize_model_parallel()  # one stage, to build the whole model's weights
    full = _model().state_dict()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=stages)
    model = _model(pp=(stage, stages))
    missing, unexpected = model.load_state_dict(stage_weights(full, stage, stages, 2), strict=False)
    assert not unexpected and all(m.endswith("_extra_state") for m in missing), (
        missing,
        unexpected,
    )
    return model


class _Writer:
    """A tensorboard writer's ``add_scalar``, kept in memory (inside gloo ranks)."""

    def __init__(self):
        self.scalars: dict[str, float] = {}

    def add_scalar(self, key, value, step):
        self.scalars[key] = value

    def __getattr__(self, name):  # upstream's other tensorboard calls: histograms, text
        return lambda *_a, **_k: None


class _Float32Module(torch.nn.Module):
    """What Megatron's ``Float16Module`` is to a bf16 run, in float32 (which it refuses): the
    wrapper that takes ``fp32_output`` (Megatron-RL's ``get_logprobs`` passes it) and holds the
    model as ``.module`` (``get_attr_wrapped_model`` unwraps it). A packed bin (THD with
    ``cu_seqlens``) needs Transformer Engine's attention, CUDA-only; here each ``cu_seqlens``
    segment runs on its own, which is what that attention computes."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.config = module.config
        self._input = None  # a later pipeline stage's input, [s, b, h]

    def set_input_tensor(self, tensor):
        self._input = tensor[0] if isinstance(tensor, list) else tensor
        self.module.set_input_tensor(tensor)

    def forward(self, tokens, position_ids, attention_mask, *, fp32_output=True, **kwargs):
        packed = kwargs.pop("packed_seq_params", None)
        if packed is None:
            return self.module(tokens, position_ids, attention_mask, **kwargs)
        cu = [int(c) for c in packed.cu_seqlens_q]
        pieces = []
        for a, b in itertools.pairwise(cu):
            if b <= a:
                continue
            if self._input is not None:  # this segment's rows of the previous stage's output
                self.module.set_input_tensor(self._input[a:b])
            pieces.append(self.module(tokens[:, a:b], position_ids[:, a:b], None, **kwargs))
        # logits are [b, s, V]; a stage before the last returns hidden states [s, b, h]
        return torch.cat(pieces, dim=1 if self.module.post_process else 0)


def _samples(seed: int = 0) -> list[dict]:
    """G*N single-turn rollouts: prompt, generated tokens ending in the train side's eod,
    inference log-probs for every generated token but the eod, a reward."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(G * N):
        prompt, n_gen = 3 + i % 4, 4 + (5 * i) % 9
        tokens = torch.randint(2, VOCAB, (prompt + n_gen,), generator=gen)
        tokens[-1] = EOD
        inference = -2.8 + 0.6 * torch.randn(n_gen - 1, generator=gen)
        out.append(
            dict(tokens=tokens.tolist(), prompt=prompt, inf=inference.tolist(), reward=REWARDS[i])
        )
    return out


def _rollouts(samples: list[dict], multi_turn: bool = False) -> list:
    from megatron.rl.agent.api import TokenRollout

    fields = getattr(TokenRollout, "model_fields", None) or TokenRollout.__fields__
    # core_v0.17 on: the engine's epochs per turn, (token, epoch) runs; no eviction
    known = {"policy_epoch": [[(0, 0)]], "kv_cache_epoch": [[(0, 0)]], "num_evictions": [0]}
    extra = {k: v for k, v in known.items() if k in fields}
    rollouts = [
        TokenRollout(
            trajectory=[list(s["tokens"])],
            reward=s["reward"],
            generation_mask=[[False] * s["prompt"] + [True] * (len(s["tokens"]) - s["prompt"])],
            logprobs=[list(s["inf"])],
            env_id="test",
            **extra,
        )
        for s in samples
    ]
    if multi_turn:  # rollout 1 gets a second turn (a second training row)
        r = rollouts[1]
        r.trajectory, r.generation_mask = r.trajectory * 2, r.generation_mask * 2
        r.logprobs = r.logprobs * 2
        for key in ("policy_epoch", "kv_cache_epoch"):
            if key in extra:
                setattr(r, key, getattr(r, key) * 2)
        if "num_evictions" in extra:
            r.num_evictions = [0, 0]
    return [rollouts[g * N : (g + 1) * N] for g in range(G)]


def _host(
    mode: str | None, path: str | None = None, packing: bool = False, ess_lr: bool = False
) -> argparse.Namespace:
    return argparse.Namespace(
        use_ess_lr=ess_lr,
        ess_lr_shadow=False,
        use_ess_baseline=mode == "on",
        ess_baseline_shadow=mode == "shadow",
        ess_baseline_path=path,
        perform_rl_step=True,
        rl_inference_logprobs_is_correction=True,
        rl_importance_sampling_truncation_coef=TRUNC,
        rl_use_sequence_packing=packing,
        rl_sequence_packing_max_sequences_per_bin=4,
        rl_sequence_packing_algo="fifo",
        rl_skip_bos_token=False,
        rl_training_cuda_graphs=False,
        rl_calculate_intra_group_similarity=False,
        rl_partial_rollouts=False,
        cuda_graph_impl="none",
        cuda_graph_scope=[],
        seq_length=S,
        decoder_seq_length=None,
        micro_batch_size=2,
        global_batch_size=G * N,
        grpo_prompts_per_step=G,
        grpo_group_size=N,
        rampup_batch_size=None,
        decrease_batch_size_if_needed=False,
        reset_position_ids=False,
        reset_attention_mask=False,
        bf16=False,
        fp16=False,
        curr_iteration=0,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        # what train_rl.py's forward_step and loss_func read (upstream's defaults)
        grpo_clamp_eps_lower=0.2,
        grpo_clamp_eps_upper=0.2,
        grpo_kl_beta=0.02,
        grpo_entropy_term_weight=0.0,
        check_for_nan_in_loss_and_grad=False,
        check_for_spiky_loss=False,
    )


def _prepare(rl_utils, function, model, rollouts, tokenizer, packing: bool):
    import inspect

    kwargs = dict(model=[model], ref_state_dict=dict(model.state_dict()), rollouts=rollouts)
    kwargs["tokenizer"] = tokenizer
    params = inspect.signature(getattr(function, "__wrapped__", function)).parameters
    if "sequence_packing" in params:
        kwargs.update(sequence_packing=packing, is_correction=True)
    out = function(**kwargs)
    if not isinstance(out, tuple):  # up to core_v0.16: it logged the collection itself
        return out
    # core_v0.17 on: the caller (get_grpo_data_iterator) logs it, as here
    iterator, group_stats, example_groups = out
    rl_utils.maybe_log_training_metrics(
        group_stats=group_stats,
        current_iteration=0,
        tokenizer=tokenizer,
        example_groups=example_groups,
    )
    return iterator


def _everything(rl_utils, iterator, packing: bool, batches: int) -> list[list[torch.Tensor]]:
    """Every tensor of the first ``batches`` batches the iterator yields (unpacked: trajs,
    advantages, old / ref log-probs, masks...); packed, the packing context's bins."""
    out = [[t.detach().clone() for t in next(iterator)] for _ in range(batches)]
    if packing:
        ctx = rl_utils.get_rl_runtime_state().packing_context
        out.append([a.detach().clone() for a in ctx.bin_advantages])
        out.append([ctx.packed_trajs.clone(), ctx.old_logprobs.clone()])
    return out


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y)) for x, y in zip(a, b)
    )


def _advantages_of(batches: list[list[torch.Tensor]], packing: bool) -> list[float]:
    """Unpacked: the advantage column (the 2nd tensor) of each yielded batch; packed: this
    rank's bins' advantages, flattened in bin order."""
    if packing:
        return [float(x) for a in batches[-2] for x in a.double()]
    return [float(x) for batch in batches for x in batch[1].double()]


def _train_rl():
    """The tree's own ``train_rl.py`` (its ``forward_step`` and ``loss_func``). Its model
    builders (``gpt_builders``, ``mamba_builders`` / ``hybrid_builders``, ``model_provider``:
    files of a full Megatron-LM checkout, not of these snapshots) are import-time names only:
    the test hands ``forward_step`` its model, so they stand in as modules that refuse a call."""
    import importlib
    import types

    def refuse(*_a, **_k):
        raise AssertionError("train_rl's model builders are not used by this test")

    for name, attr in (
        ("gpt_builders", "gpt_builder"),
        ("mamba_builders", "mamba_builder"),
        ("hybrid_builders", "hybrid_builder"),
        ("model_provider", "model_provider"),
    ):
        if name not in sys.modules:
            module = types.ModuleType(name)
            setattr(module, attr, refuse)
            sys.modules[name] = module
    return importlib.import_module("train_rl")


def _train_step(rl_utils, iterator, model, batches: int, micro: int) -> dict:
    """One real train step on what ``prepare_data_for_update`` returned: megatron-core's
    schedule runs ``train_rl.forward_step`` (upstream's ``get_logprobs`` with grad,
    ``calculate_grpo_loss``: PPO-clipped eps 0.2, KL beta 0.02, the IS correction) and
    ``loss_func``, then an SGD step. Returns the advantages ``calculate_grpo_loss`` was handed,
    per micro-batch (packed: and the bin each loaded), and how far the weights moved."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    train_rl = _train_rl()
    seen: list[list[float]] = []
    real = train_rl.calculate_grpo_loss

    def spy(*args, **kwargs):
        seen.append([float(a) for a in kwargs["advantages"].detach().double().flatten()])
        return real(*args, **kwargs)

    bins: list[int] = []  # packed: the bin each micro-batch loaded
    load = train_rl.load_packed_data_by_index

    def load_spy(bin_idx, *args, **kwargs):
        bins.append(int(bin_idx))
        return load(bin_idx, *args, **kwargs)

    train_rl.calculate_grpo_loss = spy
    train_rl.load_packed_data_by_index = load_spy
    before = [p.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    try:
        get_forward_backward_func()(
            forward_step_func=train_rl.forward_step,
            data_iterator=iterator,
            model=[model],
            num_microbatches=batches,
            seq_length=S,
            micro_batch_size=micro,
            forward_only=False,
        )
    finally:
        train_rl.calculate_grpo_loss = real
        train_rl.load_packed_data_by_index = load
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    moved = max(float((p - b).abs().max()) for p, b in zip(model.parameters(), before))
    return {"seen": seen, "loaded": bins, "moved": moved}


def rank_prepare(packing: bool = False, case: str = "normal", tp: int = 1) -> dict:
    """This rank's view of the real ``prepare_data_for_update``: unpatched, then installed off,
    shadow, and on with each path (the advantages the iterator yields, the metrics, what the
    writer got), and on beside ESS-LR; ``case``: a fault instead ("unhooked": the release
    builds its advantages without the hooked routine; "multi-turn": a rollout with two
    turns), its error. ``tp`` 2: the two ranks are one TP2 group (the model sharded, the
    logits vocabulary-parallel; DP1)."""
    from megatron.core import parallel_state as mpu
    from megatron.training import global_vars

    import ess_patch
    from ess_patch.demo.cpu import megatron_on_cpu
    from ess_patch.integrations.baseline_flags import baseline_metrics

    noop = SimpleNamespace(start=lambda *a, **k: None, stop=lambda *a, **k: None)
    global_vars._GLOBAL_TIMERS = lambda *_a, **_k: noop
    torch.cuda.nvtx.range_push = torch.cuda.nvtx.range_pop = lambda *_a, **_k: None
    torch.cuda.synchronize = torch.cuda.empty_cache = lambda *_a, **_k: None
    tokenizer = SimpleNamespace(
        pad=PAD,
        eod=EOD,
        bos=None,
        vocab_size=VOCAB,
        vocab={},
        library="null",
        detokenize=lambda _t: "x",
    )
    global_vars._GLOBAL_TOKENIZER = tokenizer
    from megatron.rl import rl_utils

    if tp > 1:
        mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp)
    with megatron_on_cpu():
        model = _Float32Module(_stage_model() if case == "pp2" else _model(tp))
    samples = _samples()
    dp_rank, dp = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    share = G * N // dp
    batches = share // 2  # micro-batches of 2 per rank (unpacked)

    from megatron.core import num_microbatches_calculator as calculator

    def run(mode, path=None, multi_turn=False, ess_lr=False):
        global_vars._GLOBAL_ARGS = _host(mode, path, packing, ess_lr)
        calculator.destroy_num_microbatches_calculator()  # as pretrain sets it up, each run
        calculator.init_num_microbatches_calculator(0, None, G * N, 2, dp, False)
        with megatron_on_cpu():
            it = _prepare(
                rl_utils,
                rl_utils.prepare_data_for_update,
                model,
                _rollouts(samples, multi_turn),
                tokenizer,
                packing,
            )
            return _everything(rl_utils, it, packing, 0 if packing else batches)

    global_vars._GLOBAL_ARGS = _host(None, None, packing)
    plain = run(None)
    ess_patch.install(["megatron", "megatron_rl"])
    out: dict = {"dp_rank": dp_rank, "share": share}
    try:
        if case == "train":  # prepare_data_for_update, then the train step on its iterator
            host = global_vars._GLOBAL_ARGS = _host("on", "rules", packing)
            # packed: one bin per micro-batch, as Megatron's argument check requires
            host.micro_batch_size = 1 if packing else 2
            calculator.destroy_num_microbatches_calculator()
            calculator.init_num_microbatches_calculator(
                0, None, G * N, host.micro_batch_size, dp, False
            )
            with megatron_on_cpu():
                it = _prepare(
                    rl_utils,
                    rl_utils.prepare_data_for_update,
                    model,
                    _rollouts(samples),
                    tokenizer,
                    packing,
                )
                count = batches
                if packing:
                    ctx = rl_utils.get_rl_runtime_state().packing_context
                    out["bins"] = [
                        [int(i) for i in seqs] for seqs in ctx.packing_info.bin_seq_indices
                    ]
                    count = len(out["bins"])
                out.update(_train_step(rl_utils, it, model, count, host.micro_batch_size))
            return out
        if case not in ("normal", "pp2"):
            saved = vars(rl_utils)["calculate_grpo_advantages"]
            if case == "unhooked":
                rl_utils.calculate_grpo_advantages = saved.__wrapped__
            try:
                run("on", "rules", multi_turn=case == "multi-turn")
            except Exception as exc:  # the test reads the error each rank raised
                return {"error": f"{type(exc).__name__}: {exc}", "metrics": baseline_metrics()}
            finally:
                rl_utils.calculate_grpo_advantages = saved
            return {"error": None}
        off = run(None)
        shadow = run("shadow")
        out["shadow_metrics"] = baseline_metrics()
        out["off_same"], out["shadow_same"] = _same(off, plain), _same(shadow, plain)
        for path in ("rules", "exact", "proxy"):
            writer = global_vars._GLOBAL_TENSORBOARD_WRITER = _Writer()
            out[path] = _advantages_of(run("on", path), packing)
            global_vars._GLOBAL_TENSORBOARD_WRITER = None
            out[f"{path}_metrics"] = baseline_metrics()
            out[f"{path}_logged"] = dict(writer.scalars)
        # with ESS-LR on too: the same advantages, and the collection's ESS armed
        out["with_ess_lr"] = _advantages_of(run("on", "rules", ess_lr=True), packing)
        out["ess_armed"] = ess_patch.armed() is not None
        out["plain"] = _advantages_of(plain, packing)
        if packing:
            info = rl_utils.get_rl_runtime_state().packing_context.packing_info
            out["bins"] = [[int(i) for i in seqs] for seqs in info.bin_seq_indices]
        return out
    finally:
        ess_patch.uninstall()


# --- the independent expectation -----------------------------------------------------------


def _brute_sq(model, samples) -> torch.Tensor:
    from ess_patch.demo.cpu import megatron_on_cpu

    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    model.eval()
    for s in samples:
        tokens = torch.tensor(s["tokens"])
        total, prompt = tokens.numel(), s["prompt"]
        with megatron_on_cpu():
            logits = model(tokens[None], torch.arange(total)[None], None)[0]
        logp = torch.log_softmax(logits[prompt - 1 : total - 1].float(), -1)
        lp = logp.gather(1, tokens[prompt:, None]).squeeze(1)
        inf = torch.tensor(s["inf"])
        w = torch.ones_like(lp)
        w[: inf.numel()] = torch.clamp(torch.exp(lp[: inf.numel()].detach() - inf), max=TRUNC)
        term = (w * lp).sum()
        out.append(sum(g.double().square().sum() for g in torch.autograd.grad(term, params)))
    return torch.stack(out)


def _brute_proxy_sq(model, samples) -> torch.Tensor:
    """The forward-only proxy by hand: per token, the squared norm of the autograd gradient of
    ``log p(y_t)`` with respect to that position's logits, times ``w_t^2``."""
    from ess_patch.demo.cpu import megatron_on_cpu

    out = []
    model.eval()
    for s in samples:
        tokens = torch.tensor(s["tokens"])
        total, prompt = tokens.numel(), s["prompt"]
        with torch.no_grad(), megatron_on_cpu():
            logits = model(tokens[None], torch.arange(total)[None], None)[0]
        z = logits[prompt - 1 : total - 1].double().requires_grad_()
        lp = torch.log_softmax(z, -1).gather(1, tokens[prompt:, None]).squeeze(1)
        inf = torch.tensor(s["inf"], dtype=torch.float64)
        w = torch.ones_like(lp)
        w[: inf.numel()] = torch.clamp(torch.exp(lp[: inf.numel()].detach() - inf), max=TRUNC)
        per_token = [
            torch.autograd.grad(lp[t], z, retain_graph=True)[0][t].square().sum()
            for t in range(lp.numel())
        ]
        out.append((w.detach().square() * torch.stack(per_token)).sum())
    return torch.stack(out)


def expected(proxy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(b*-advantages, GRPO's advantages, b* per group), all rollouts, upstream's formula."""
    from ess_patch.demo.policy import single_process

    samples = _samples()
    with single_process():
        sq = (_brute_proxy_sq if proxy else _brute_sq)(_model(), samples).reshape(G, N)
    r = torch.tensor(REWARDS, dtype=torch.float64).reshape(G, N)
    b = (sq * r).sum(1) / sq.sum(1)
    std = r.std(1, unbiased=False)
    with_b = (r - b[:, None]) / (1e-4 + std[:, None])
    grpo = (r - r.mean(1, keepdim=True)) / (1e-4 + std[:, None])
    return with_b.flatten(), grpo.flatten(), b


def _check(ranks: list[dict], packing: bool) -> None:
    want, grpo, b = expected()
    want_proxy = expected(proxy=True)[0]
    assert (want - grpo).abs().max() > 1e-3  # b* is not the group mean here: the check can tell
    assert (want - want_proxy).abs().max() > 1e-4  # nor the proxy's b* the exact one
    paths = ("rules", "exact", "proxy")
    got = {p: torch.zeros(G * N, dtype=torch.float64) for p in (*paths, "plain")}
    for r in ranks:
        assert r["off_same"] and r["shadow_same"], r  # off and shadow: bit-identical
        assert r["with_ess_lr"] == r["rules"] and r["ess_armed"]
        assert r["shadow_metrics"]["ess_baseline_applied"] == 0.0
        for path in paths:
            m = r[f"{path}_metrics"]
            assert m["ess_baseline_applied"] == 1.0 and m["ess_baseline_norm_pass_s"] > 0
            assert m["ess_baseline_fallback_groups"] == 0.0
            # the metrics reach Megatron-RL's writer, read from what was applied
            logged = r[f"{path}_logged"]
            assert {k: logged[k] for k in m} == m, (logged, m)
        if packing:  # each bin's sequences, by their global index
            for path in got:
                values = iter(r[path])
                for seqs in r["bins"]:
                    for seq in seqs:
                        got[path][seq] = next(values)
        else:
            rows = slice(r["dp_rank"] * r["share"], (r["dp_rank"] + 1) * r["share"])
            for path in got:
                got[path][rows] = torch.tensor(r[path], dtype=torch.float64)
    assert torch.allclose(got["plain"], grpo, rtol=1e-5, atol=1e-5)  # upstream's own formula
    for path in paths:
        target = want_proxy if path == "proxy" else want
        assert torch.allclose(got[path], target, rtol=1e-5, atol=1e-5), (path, got[path], target)
    mean = torch.tensor(REWARDS, dtype=torch.float64).reshape(G, N).mean(1)
    for r in ranks:
        assert r["rules_metrics"]["ess_baseline_shift"] == pytest.approx(
            float((b - mean).mean()), abs=1e-5
        )
        assert r["shadow_metrics"]["ess_baseline_shift"] == pytest.approx(
            float((b - mean).mean()), abs=1e-5
        )


@pytest.mark.dist
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("dp", [1, 2], ids=["dp1", "dp2"])
def test_applied_advantages_are_b_star_from_brute_force_norms(dp, packing, tmp_path):
    ranks = run_ranks(rank_prepare, dp=dp, args=(packing,), tmp_path=tmp_path, timeout=300)
    _check(ranks, packing)
    if dp == 2:  # the middle group lies on both ranks: reduced over DP, not refused
        assert ranks[0]["rules_metrics"]["ess_baseline_split_groups"] == 1.0


@pytest.mark.dist
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_tp2_the_sharded_model_gives_the_b_star_of_one_process(packing, tmp_path):
    # the norm pass sums the shards' squares over TP (replicated norms once); the log-probs
    # and the proxy come from vocabulary-parallel logits; both ranks hold the whole collection
    ranks = run_ranks(
        rank_prepare, dp=2, args=(packing, "normal", 2), tmp_path=tmp_path, timeout=300
    )
    assert [r["share"] for r in ranks] == [G * N] * 2
    _check(ranks, packing)


@pytest.mark.dist
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_pp2_both_stages_give_the_b_star_of_one_process(packing, tmp_path):
    # the norm pass crosses the two stages (activations down, gradients back); upstream's
    # own log-prob passes run through megatron-core's pipeline schedule
    ranks = run_ranks(
        rank_prepare, dp=1, pp=2, args=(packing, "pp2"), tmp_path=tmp_path, timeout=300
    )
    _check(ranks, packing)


@pytest.mark.dist
@pytest.mark.parametrize("case", ["unhooked", "multi-turn"])
def test_a_baseline_that_would_not_apply_stops_every_rank(case, tmp_path):
    """A release whose advantages do not come through the hooked routine, and a multi-turn
    rollout (on DP rank 0 only): every rank stops with EssLrNotAppliedError, the rank that saw
    it naming it."""
    ranks = run_ranks(rank_prepare, dp=2, args=(False, case), tmp_path=tmp_path, timeout=300)
    errors = [r["error"] for r in ranks]
    assert all(e is not None and e.startswith("EssLrNotAppliedError") for e in errors), errors
    assert all("megatron_rl" in e and "group mean" in e for e in errors), errors
    if case == "unhooked":
        assert all("calculate_grpo_advantages did not run" in e for e in errors), errors
    else:
        assert "multi-turn" in errors[0] and "another DP rank" in errors[1], errors


@pytest.mark.dist
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_the_train_step_trains_on_b_star_advantages(packing, tmp_path):
    """Past ``prepare_data_for_update``: the tree's own ``train_rl.forward_step`` and
    ``loss_func`` through megatron-core's schedule on the iterator it returned (DP2, one group
    split over the ranks): every row ``calculate_grpo_loss`` is handed (packed: every
    sequence of every bin) carries ``(R - b*) / (1e-4 + std)`` from brute-force norms, and the
    step moves the weights."""
    ranks = run_ranks(rank_prepare, dp=2, args=(packing, "train"), tmp_path=tmp_path, timeout=300)
    want, grpo, _ = expected()
    got = torch.full((G * N,), float("nan"), dtype=torch.float64)
    for r in ranks:
        assert r["moved"] > 0
        if packing:
            assert sorted(r["loaded"]) == list(range(len(r["bins"])))  # each bin once
            for b, adv in zip(r["loaded"], r["seen"], strict=True):
                seqs = r["bins"][b]
                assert len(adv) == len(seqs), (seqs, adv)
                got[seqs] = torch.tensor(adv, dtype=torch.float64)
        else:
            rows = slice(r["dp_rank"] * r["share"], (r["dp_rank"] + 1) * r["share"])
            got[rows] = torch.tensor([a for batch in r["seen"] for a in batch])
    assert not torch.isnan(got).any()  # every rollout trained
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got, want)
    assert (got - grpo).abs().max() > 1e-3
