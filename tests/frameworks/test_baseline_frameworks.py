"""VCPO's baseline (``--use-ess-baseline``) inside the REAL miles and slime code.

Every snapshot folder's real ``compute_advantages_and_returns``, patched by install(), on a real
megatron-core GPTModel (RMSNorm, no bias, SwiGLU, GQA, rope; local spec on CPU) lent by the
train-actor hook, single process and DP2 with every prompt group split over the two ranks. The
expectation is independent: each sample's squared gradient norm from one backward of
``sum_t w_t log p(y_t)`` over all parameters (plain ``log_softmax``), then the single-process
``min_variance_baseline``; the advantage the framework computes must be ``r_i - b*``. The
forward-only proxy path (``--ess-baseline-path proxy``) is checked the same way against the
proxy computed by hand (autograd of each token's log-prob with respect to its logits).
Shadow mode leaves every advantage bit-identical to the unpatched routine; a routine that does
not take the rewritten rewards stops the run on every rank; the parser refuses by name.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared helpers
from harness import run_ranks
from rollouts import SHAPES, host_args
from upstream import (
    MINIMAL_ARGV,
    miles_parallel_state,
    no_snapshot_param,
    parse_upstream_args,
    snapshots,
    tier_reason,
    use_snapshot,
)

import ess_patch

N_PER_PROMPT, VOCAB = 4, 16


def _params():
    found = snapshots()
    if not found:
        return [no_snapshot_param()]
    return [
        pytest.param(
            fw,
            str(folder),
            id=folder.name,
            marks=pytest.mark.skipif(
                tier_reason(fw, "full") is not None, reason=tier_reason(fw, "full") or ""
            ),
        )
        for fw, folder in found
    ]


def _model(tp: int = 1, pp: tuple[int, int] | None = None):
    """The GPTModel of every rank; with ``tp`` > 1 this rank's shard of the same weights (CPU
    initialisation builds each master weight from the seed, then splits it); with ``pp``
    (stage, stages) the stage's layers only (the caller loads the whole model's weights)."""
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
        max_sequence_length=max(p + r for p, r in SHAPES),
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


def _rollout(seed: int = 0) -> dict:
    """8 samples, 2 prompts of 4 (sample_indices 40..47: groups 10 and 11), rewards
    group-normalised as the rollout manager does, IS weights from the two log-probs."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    groups = raw.reshape(-1, N_PER_PROMPT)
    norm = (groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-6)
    data = {
        k: []
        for k in (
            "tokens",
            "response_lengths",
            "total_lengths",
            "loss_masks",
            "log_probs",
            "rollout_log_probs",
        )
    }
    for prompt, response in SHAPES:
        data["tokens"].append(torch.randint(0, VOCAB, (prompt + response,), generator=gen))
        data["response_lengths"].append(response)
        data["total_lengths"].append(prompt + response)
        mask = (torch.rand(response, generator=gen) > 0.2).float()
        mask[0] = 1
        data["loss_masks"].append(mask)
        rollout_lp = -torch.rand(response, generator=gen) * 2
        data["rollout_log_probs"].append(rollout_lp)
        data["log_probs"].append(rollout_lp + 0.3 * torch.randn(response, generator=gen))
    data["rewards"] = norm.flatten().tolist()
    data["sample_indices"] = list(range(40, 48))
    return data


def _brute_sq(model, data) -> torch.Tensor:
    from ess_patch.demo.cpu import megatron_on_cpu

    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i, tokens in enumerate(data["tokens"]):
        total, resp = tokens.numel(), data["response_lengths"][i]
        with megatron_on_cpu():
            logits = model(tokens[None], torch.arange(total)[None], None)[0]
        logp = torch.log_softmax(logits[total - resp - 1 : total - 1].float(), -1)
        lp = logp.gather(1, tokens[total - resp :, None]).squeeze(1)
        w = torch.exp(data["log_probs"][i] - data["rollout_log_probs"][i])
        term = (data["loss_masks"][i] * w * lp).sum()
        out.append(sum(g.double().square().sum() for g in torch.autograd.grad(term, params)))
    return torch.stack(out)


def _brute_proxy_sq(model, data) -> torch.Tensor:
    """The proxy by hand: per token, the squared norm of the autograd gradient of
    ``log p(y_t)`` with respect to that position's logits, times ``mask_t * w_t^2``."""
    from ess_patch.demo.cpu import megatron_on_cpu

    out = []
    for i, tokens in enumerate(data["tokens"]):
        total, resp = tokens.numel(), data["response_lengths"][i]
        with torch.no_grad(), megatron_on_cpu():
            logits = model(tokens[None], torch.arange(total)[None], None)[0]
        z = logits[total - resp - 1 : total - 1].double().requires_grad_()
        lp = torch.log_softmax(z, -1).gather(1, tokens[total - resp :, None]).squeeze(1)
        w = torch.exp(data["log_probs"][i] - data["rollout_log_probs"][i]).double()
        coef = data["loss_masks"][i].double() * w.square()
        per_token = [
            torch.autograd.grad(lp[t], z, retain_graph=True)[0][t].square().sum()
            for t in range(resp)
        ]
        out.append((coef * torch.stack(per_token)).sum())
    return torch.stack(out)


def expected_advantages(seed: int = 0, proxy: bool = False) -> torch.Tensor:
    from ess_patch.baseline import min_variance_baseline
    from ess_patch.demo.policy import single_process

    data = _rollout(seed)
    with single_process():
        sq = (_brute_proxy_sq if proxy else _brute_sq)(_model(), data)
    ids = torch.tensor(data["sample_indices"]) // N_PER_PROMPT
    return min_variance_baseline(None, torch.tensor(data["rewards"]), sq, ids).advantages


def _args(fw: str, mode: str | None, **extra):
    args = host_args(fw, False)
    args.normalize_advantages = False
    args.n_samples_per_prompt = N_PER_PROMPT
    args.micro_batch_size = 3
    args.use_ess_baseline = mode == "on"
    args.ess_baseline_shadow = mode == "shadow"
    args.ess_baseline_path = None
    for k, v in extra.items():
        setattr(args, k, v)
    return args


def rank_baseline(fw: str, snapshot: str, case: str) -> dict:
    """This rank's share (sample i on DP rank i % dp) through the real routine, off / shadow /
    on (and, for ``case``, a fault); returns the first-token advantage of each sample.
    ``case`` "tp2": the two ranks are one TP2 group (DP1: every sample on both), the model
    sharded, the logits vocabulary-parallel; "pp2": two pipeline stages of the same weights
    (the advantages are built on the last stage only: None on the first)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ess_patch.demo.cpu import megatron_on_cpu
    from ess_patch.integrations.baseline_flags import baseline_metrics, train_actor_wrapper

    tp = 2 if case == "tp2" else 1
    if tp > 1:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    stage_model = None
    if case == "pp2":  # before the framework's state object takes the groups
        with megatron_on_cpu():
            stage_model = _stage_model()
    use_snapshot(fw, snapshot, tier="full")
    state = None
    if fw == "miles":
        import miles.backends.training_utils.loss as loss
        from miles.backends.megatron_utils.actor import MegatronTrainRayActor

        state = miles_parallel_state()
    else:
        import slime.backends.megatron_utils.loss as loss
        from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    rank, size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    assert size * tp * ps.get_pipeline_model_parallel_world_size() == dist.get_world_size()
    full = _rollout()
    rows = list(range(rank, len(SHAPES), size))

    def local() -> dict:
        data = {k: [v[i] for i in rows] for k, v in full.items()}
        if not ps.is_pipeline_last_stage():  # forward_only keeps its log-probs on the last
            del data["log_probs"]
        return data

    def compute(args, data):
        f = loss.compute_advantages_and_returns
        if "parallel_state" in inspect.signature(f).parameters:
            return f(args, state, data)
        return f(args, data)

    plain = local()
    compute(_args(fw, None), plain)
    ess_patch.install(["megatron", fw])
    assert ess_patch.patching.is_ours(MegatronTrainRayActor.__dict__["train_actor"])
    actor = object.__new__(MegatronTrainRayActor)
    with megatron_on_cpu():
        actor.model = [stage_model if stage_model is not None else _model(tp)]
    out: dict = {"rows": rows}

    def run(args, data):
        actor.args = args
        with megatron_on_cpu():  # the body of train_actor that matters here: the routine
            train_actor_wrapper(lambda: compute(args, data), actor, (), {})
        if "advantages" not in data:  # an earlier pipeline stage: the routine returned early
            assert not ps.is_pipeline_last_stage()
            return None
        return [float(a[0]) for a in data["advantages"]]

    try:
        if case == "no-actor":  # the routine outside train_actor: no model to take norms with
            try:
                compute(_args(fw, "on"), local())
            except Exception as exc:  # the test reads the error each rank raised
                return {"error": f"{type(exc).__name__}: {exc}"}
            return {"error": None}
        if case == "custom-advantages":  # the routine builds advantages without the rewards
            for module in list(sys.modules.values()):
                if getattr(module, "get_grpo_returns", None) is not None:
                    module.get_grpo_returns = lambda rewards, kl: [torch.ones_like(k) for k in kl]
            try:
                run(_args(fw, "on"), local())
            except Exception as exc:  # the test reads the error each rank raised
                return {"error": f"{type(exc).__name__}: {exc}"}
            return {"error": None}
        out["plain"] = [float(a[0]) for a in plain["advantages"]] if "advantages" in plain else None
        out["off"] = run(_args(fw, None), local())
        out["shadow"] = run(_args(fw, "shadow"), local())
        out["shadow_metrics"] = baseline_metrics()
        out["on"] = run(_args(fw, "on"), local())
        out["on_metrics"] = baseline_metrics()
        out["exact"] = run(_args(fw, "on", ess_baseline_path="exact"), local())
        out["proxy"] = run(_args(fw, "on", ess_baseline_path="proxy"), local())
        out["proxy_metrics"] = baseline_metrics()
        return out
    finally:
        ess_patch.uninstall()


def _check_proxy(ranks, want: torch.Tensor) -> None:
    got = torch.zeros(len(SHAPES), dtype=torch.float64)
    for r in ranks:
        assert r["proxy_metrics"]["ess_baseline_applied"] == 1.0
        got[r["rows"]] = torch.tensor(r["proxy"], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got, want)


def _check(ranks, want: torch.Tensor) -> None:
    got = torch.zeros(len(SHAPES), dtype=torch.float64)
    for r in ranks:
        # off and shadow: the unpatched routine's advantages, bit for bit
        assert r["off"] == r["plain"] and r["shadow"] == r["plain"]
        assert r["shadow_metrics"]["ess_baseline_applied"] == 0.0
        assert r["on_metrics"]["ess_baseline_applied"] == 1.0
        assert r["on_metrics"]["ess_baseline_norm_pass_s"] > 0
        assert r["on_metrics"]["ess_baseline_fallback_groups"] == 0.0
        got[r["rows"]] = torch.tensor(r["on"], dtype=torch.float64)
        assert torch.allclose(
            torch.tensor(r["exact"], dtype=torch.float64), got[r["rows"]], rtol=1e-5, atol=1e-6
        )
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got, want)
    # and it is not GRPO's group mean: the baseline moved the advantages
    plain = torch.zeros(len(SHAPES), dtype=torch.float64)
    for r in ranks:
        plain[r["rows"]] = torch.tensor(r["plain"], dtype=torch.float64)
    assert (got - plain).abs().max() > 1e-3
    shift = ranks[0]["on_metrics"]["ess_baseline_shift"]
    assert all(r["on_metrics"]["ess_baseline_shift"] == shift for r in ranks)
    assert shift == pytest.approx(float((plain - got).reshape(2, -1).mean(1).mean()), abs=1e-5)


@pytest.mark.dist
@pytest.mark.parametrize(("fw", "snapshot"), _params())
def test_applied_advantages_are_r_minus_b_star_from_brute_force_norms(fw, snapshot, tmp_path):
    want, want_proxy = expected_advantages(), expected_advantages(proxy=True)
    # the proxy's b* is its own (not the exact one's): the check can tell them apart
    assert (want - want_proxy).abs().max() > 1e-4
    for dp in (1, 2):
        ranks = run_ranks(
            rank_baseline,
            dp=dp,
            args=(fw, snapshot, "normal"),
            tmp_path=tmp_path / f"dp{dp}",
            timeout=180,
        )
        _check(ranks, want)
        _check_proxy(ranks, want_proxy)
        if dp == 2:
            assert ranks[0]["on_metrics"]["ess_baseline_split_groups"] == 2.0


@pytest.mark.dist
@pytest.mark.parametrize(("fw", "snapshot"), _params()[:1] + _params()[-1:])
def test_tp2_the_sharded_model_gives_the_same_b_star_as_one_process(fw, snapshot, tmp_path):
    # the norm pass sums the shards' squares over TP (replicated norms counted once) and the
    # log-probs and the proxy come from vocabulary-parallel logits: both paths, both ranks
    ranks = run_ranks(
        rank_baseline, dp=2, args=(fw, snapshot, "tp2"), tmp_path=tmp_path, timeout=180
    )
    assert [r["rows"] for r in ranks] == [list(range(len(SHAPES)))] * 2
    _check(ranks, expected_advantages())
    _check_proxy(ranks, expected_advantages(proxy=True))
    assert ranks[0]["on_metrics"]["ess_baseline_split_groups"] == 0.0


@pytest.mark.dist
@pytest.mark.parametrize(("fw", "snapshot"), _params()[:1] + _params()[-1:])
def test_pp2_both_stages_compute_the_b_star_of_one_process(fw, snapshot, tmp_path):
    # the pass crosses the stages (activations down, gradients back); the routine builds the
    # advantages on the last stage, and the first stage holds the same record and metrics
    ranks = run_ranks(
        rank_baseline, dp=1, pp=2, args=(fw, snapshot, "pp2"), tmp_path=tmp_path, timeout=180
    )
    first, last = ranks
    assert first["on"] is None and first["plain"] is None
    _check([last], expected_advantages())
    _check_proxy([last], expected_advantages(proxy=True))
    for key in ("on_metrics", "proxy_metrics"):
        for name in ("ess_baseline_shift", "ess_baseline_applied"):
            assert first[key][name] == last[key][name], (key, name)


@pytest.mark.dist
@pytest.mark.parametrize("case", ["no-actor", "custom-advantages"])
@pytest.mark.parametrize(("fw", "snapshot"), _params()[:1] + _params()[-1:])
def test_a_baseline_that_would_not_apply_stops_every_rank(fw, snapshot, case, tmp_path):
    ranks = run_ranks(
        rank_baseline, dp=2, args=(fw, snapshot, case), tmp_path=tmp_path, timeout=180
    )
    for r in ranks:
        assert r["error"] is not None and r["error"].startswith("EssLrNotAppliedError"), ranks
        assert ("train_actor" if case == "no-actor" else "r - b*") in r["error"]


@pytest.mark.parametrize(
    "fw",
    [
        pytest.param(
            fw,
            marks=pytest.mark.skipif(
                tier_reason(fw, "full") is not None,
                reason=f"{tier_reason(fw, 'full')}: runs in tox -e frameworks, which installs it",
            ),
        )
        for fw in ("miles", "slime")
    ],
)
@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--advantage-estimator", "ppo"], "advantage-estimator ppo"),
        (["--disable-rewards-normalization"], "disable-rewards-normalization"),
        (["--n-samples-per-prompt", "1"], "n-samples-per-prompt"),
        (["--context-parallel-size", "2"], "context-parallel-size 2"),
        (["--ess-baseline-shadow"], "both on"),
    ],
)
def test_the_parser_refuses_what_the_baseline_cannot_serve(fw, argv, match):
    ess_patch.install(["megatron", fw])
    try:
        base = [*MINIMAL_ARGV, "--n-samples-per-prompt", "4", "--use-ess-baseline"]
        with pytest.raises(ValueError, match=match):
            parse_upstream_args(fw, [*base, *argv])
        args = parse_upstream_args(fw, base)
        assert args.use_ess_baseline is True and not getattr(args, "use_ess_lr", False)
        off = parse_upstream_args(fw, list(MINIMAL_ARGV))
        assert off.use_ess_baseline is None and off.ess_baseline_path is None
    finally:
        ess_patch.uninstall()
