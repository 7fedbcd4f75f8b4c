"""Every per-trajectory rule against one autograd.grad per trajectory, by one shared runner.

Single process (megatron-core local spec on CPU, a gloo world of one): the demo's GPTModel
(LayerNorm with biases, learned positions) and a modern one (RMSNorm, no linear biases,
SwiGLU, rope, grouped-query attention); a module with no rule (its clear error, and the exact
path's answer); tied embeddings (the cross term of the weight's two pieces); the layouts
refused by name (tied embeddings over pipeline stages, sequence parallelism).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ess_patch.per_trajectory import PerTrajectoryGrads, UnsupportedModuleError

VOCAB, PROMPT, RESPONSE, N = 16, 5, 4, 5


@pytest.fixture(scope="module")
def world():
    from ess_patch.demo.policy import single_process

    with single_process():
        yield


def _gpt(**overrides):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    tied = overrides.pop("tied", False)
    rope = overrides.pop("rope", False)
    kw = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kw.update(overrides)
    config = TransformerConfig(**kw)
    torch.manual_seed(0)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(normalization=kw.get("normalization", "LayerNorm")),
        vocab_size=VOCAB,
        max_sequence_length=PROMPT + RESPONSE,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope" if rope else "learned_absolute",
    )


MODERN = dict(
    normalization="RMSNorm",
    add_bias_linear=False,
    gated_linear_unit=True,
    activation_func=F.silu,
    num_query_groups=2,
    ffn_hidden_size=48,
    rope=True,
)


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (N, PROMPT + RESPONSE - 1), generator=gen)
    tokens = torch.randint(0, VOCAB, (N, RESPONSE), generator=gen)
    w = torch.rand(N, RESPONSE, generator=gen) + 0.5
    coeffs = torch.randn(N, generator=gen)
    return ids, tokens, w, coeffs


def _gpt_terms(model, ids, tokens, w):
    """``[b]`` per-trajectory loss terms ``-sum_t w_t log p(y_t)``."""
    from ess_patch.demo.cpu import megatron_on_cpu

    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with megatron_on_cpu():
        logits = model(ids, pos, None)[:, -RESPONSE:]
    logp = torch.log_softmax(logits, -1).gather(2, tokens[..., None]).squeeze(-1)
    return -(w * logp).sum(1)


def run_rules(model, terms_fn, batch, *, exact=False, micro=(slice(0, 3), slice(3, N)), **kw):
    """The shared runner: norms and the rewritten gradient against one backward per trajectory.

    Returns the largest relative errors (norms, gradient).
    """
    ids, tokens, w, coeffs = batch
    params = [p for p in model.parameters() if p.requires_grad]
    brute = []
    for i in range(N):
        term = terms_fn(model, ids[i : i + 1], tokens[i : i + 1], w[i : i + 1])[0]
        brute.append(torch.autograd.grad(term, params))
    pg = PerTrajectoryGrads(model, unsupported="exact" if exact else "error", **kw)
    model.zero_grad(set_to_none=True)
    pg.start()
    for rows in micro:
        terms = terms_fn(model, ids[rows], tokens[rows], w[rows])
        pg.add_exact(terms)
        terms.sum().backward()
    pg.stop()
    sq = pg.sq_norms().double()
    pg.apply(coeffs)
    want_sq = torch.stack([sum(g.double().square().sum() for g in gi) for gi in brute])
    err_sq = float(((sq - want_sq) / want_sq).abs().max())
    err_g = 0.0
    for k, p in enumerate(params):
        want = sum(coeffs[i] * brute[i][k] for i in range(N))
        err_g = max(err_g, float((p.grad - want).abs().max() / want.abs().max().clamp(min=1e-12)))
    pg.remove()
    return err_sq, err_g


@pytest.mark.parametrize(
    ("overrides", "ratio"),
    [
        ({}, 1.0),  # the demo's: LayerNorm + biases, learned positions
        (MODERN, 1.0),  # RMSNorm, no bias, SwiGLU, GQA, rope (factored weights)
        (MODERN, float("inf")),  # the same, every weight materialised
        ({"normalization": "RMSNorm"}, 0.0),  # RMSNorm with biases, all factored
    ],
    ids=["layernorm-bias", "modern", "modern-materialised", "rmsnorm-bias-factored"],
)
def test_gpt_rules_match_one_backward_per_trajectory(world, overrides, ratio):
    model = _gpt(**dict(overrides))
    kinds = {type(m).__name__ for m in model.modules()}
    if overrides.get("normalization") == "RMSNorm":
        assert "RMSNorm" in kinds and "LayerNorm" not in kinds  # the rule is really exercised
    err_sq, err_g = run_rules(model, _gpt_terms, _batch(), materialise_ratio=ratio)
    assert err_sq < 2e-5 and err_g < 2e-5, (err_sq, err_g)


def test_the_runner_can_fail(world):
    """A wrong rule must show: the RMSNorm weight's piece with LayerNorm's normalisation."""
    model = _gpt(**dict(MODERN))
    orig = PerTrajectoryGrads._rms
    PerTrajectoryGrads._rms = staticmethod(
        lambda m, x: PerTrajectoryGrads._normalised(type("M", (), {"weight": m.weight})(), x)
    )
    try:
        err_sq, err_g = run_rules(model, _gpt_terms, _batch())
    finally:
        PerTrajectoryGrads._rms = staticmethod(orig)
    assert max(err_sq, err_g) > 1e-3


class _Mixed(torch.nn.Module):
    """An embedding (rule), a torch Linear and a bare Parameter (no rule), a LayerNorm (rule)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.scale = torch.nn.Parameter(torch.rand(8) + 0.5)
        self.head = torch.nn.Linear(8, VOCAB, bias=False)

    def forward(self, ids):  # [b, s] -> [s, b, V]; the rules' layout is megatron's [s, b, h]
        h = self.emb(ids).transpose(0, 1)
        return self.head(self.norm(torch.tanh(self.proj(h))) * self.scale)


def _mixed_terms(model, ids, tokens, w):
    logits = model(ids).transpose(0, 1)[:, -RESPONSE:]
    logp = torch.log_softmax(logits, -1).gather(2, tokens[..., None]).squeeze(-1)
    return -(w * logp).sum(1)


def test_a_module_with_no_rule_raises_naming_it_and_the_fix():
    with pytest.raises(UnsupportedModuleError) as exc:
        PerTrajectoryGrads(_Mixed())
    msg = str(exc.value)
    assert "proj (Linear)" in msg and "<root> (_Mixed)" in msg and "head (Linear)" in msg
    assert "unsupported='exact'" in msg
    with pytest.raises(ValueError, match="'error' or 'exact'"):
        PerTrajectoryGrads(_Mixed(), unsupported="skip")


def test_the_exact_path_gives_the_right_answer():
    err_sq, err_g = run_rules(_Mixed(), _mixed_terms, _batch(), exact=True)
    assert err_sq < 2e-5 and err_g < 2e-5, (err_sq, err_g)


@pytest.mark.parametrize("ratio", [1.0, float("inf"), 0.0], ids=["mixed", "full", "factored"])
def test_tied_embeddings_match_one_backward_per_trajectory(world, ratio):
    """One weight, two pieces per trajectory (the embedding's rows and the output layer's
    matmul): the norm is ``|E + O|^2`` (the cross term included) and the rewrite their sum,
    in every pairing of materialised and factored pieces."""
    model = _gpt(tied=True, **dict(MODERN))
    assert model.output_layer.weight is None  # the tied layout: handed the embedding's
    err_sq, err_g = run_rules(model, _gpt_terms, _batch(), materialise_ratio=ratio)
    assert err_sq < 2e-5 and err_g < 2e-5, (err_sq, err_g)


def test_the_tied_cross_term_is_the_same_in_every_pairing_of_forms():
    """``<E_i, O_i>`` from factored and materialised pieces (all four pairings) against the
    inner product of the materialised gradients, built here by hand."""
    from ess_patch.per_trajectory import _Piece

    gen = torch.Generator().manual_seed(0)
    b, s, t, v, h = 3, 5, 4, 7, 6
    ids = torch.randint(0, v, (b, s), generator=gen)
    g = torch.randn(b, s, h, generator=gen)
    x, d = torch.randn(t, b, h, generator=gen), torch.randn(t, b, v, generator=gen)
    e_full = torch.zeros(b, v, h).scatter_add_(1, ids[..., None].expand(-1, -1, h), g)
    o_full = d.permute(1, 2, 0) @ x.transpose(0, 1)  # [b, v, h]
    want = (e_full * o_full).sum((1, 2))
    forms_e = [_Piece(x=ids, delta=g, sq=torch.zeros(b)), _Piece(full=e_full)]
    forms_o = [_Piece(x=x, delta=d, sq=torch.zeros(b)), _Piece(full=o_full)]
    for e in forms_e:
        for o in forms_o:
            got = PerTrajectoryGrads._cross(e, o)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (e.full is None, o.full is None)


def test_tied_embeddings_without_the_cross_term_fail_the_check(world):
    model = _gpt(tied=True, **dict(MODERN))
    orig = PerTrajectoryGrads._cross
    PerTrajectoryGrads._cross = staticmethod(lambda e, o: torch.zeros_like(orig(e, o)))
    try:
        err_sq, _ = run_rules(model, _gpt_terms, _batch())
    finally:
        PerTrajectoryGrads._cross = staticmethod(orig)
    assert err_sq > 1e-3


def test_tied_over_pipeline_stages_and_sequence_parallel_are_refused_by_name(world):
    model = _gpt(tied=True)
    model.post_process = False  # as on a first stage whose output layer is on the last
    with pytest.raises(UnsupportedModuleError, match="pipeline"):
        PerTrajectoryGrads(model)
    model = _gpt()
    model.config.sequence_parallel = True
    with pytest.raises(UnsupportedModuleError, match="sequence_parallel"):
        PerTrajectoryGrads(model)


@pytest.mark.dist
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tp2_modern_rules_match_one_backward_per_trajectory(tmp_path, tied):
    from harness import run_ranks
    from per_trajectory_ranks import tp2_modern

    ranks = run_ranks(tp2_modern, dp=2, kwargs={"tied": tied}, timeout=120, tmp_path=tmp_path)
    for got in ranks:
        assert got["err_sq"] < 2e-5 and got["err_g"] < 2e-5, got
