"""The norm pass (``ess_patch.norm_pass``) on real megatron-core GPT models, on CPU.

Expectation: one ``autograd.grad`` per trajectory of ``w_i * log p_i`` (brute force). The pass
must change nothing: parameters, ``.grad`` and a PPO-clipped training step run after it are
bit-identical to the step without it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from test_per_trajectory_rules import MODERN, RESPONSE, VOCAB, _batch, _gpt, _gpt_terms

from ess_patch.errors import EssPatchError
from ess_patch.norm_pass import norm_pass


@pytest.fixture(scope="module")
def world():
    from ess_patch.demo.policy import single_process

    with single_process():
        yield


def _brute(model, ids, tokens, w):
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(ids.shape[0]):
        term = _gpt_terms(model, ids[i : i + 1], tokens[i : i + 1], w[i : i + 1])[0]
        g = torch.autograd.grad(term, params)
        out.append(sum(x.double().square().sum() for x in g))
    return torch.stack(out)


@pytest.mark.parametrize("path", ["rules", "exact"])
@pytest.mark.parametrize(
    "overrides", [{}, MODERN, {**MODERN, "tied": True}], ids=["layernorm-bias", "modern", "tied"]
)
def test_norms_match_one_backward_per_trajectory(world, overrides, path):
    model = _gpt(**dict(overrides))
    ids, tokens, w, _ = _batch()
    want = _brute(model, ids, tokens, w)
    res = norm_pass(model, lambda: _gpt_terms(model, ids, tokens, w), path=path)
    assert res.path == path and res.seconds > 0
    assert res.sq_norms.dtype == torch.float64
    assert torch.allclose(res.sq_norms, want, rtol=2e-5), (res.sq_norms, want)
    # what it held: the exact path one set of fp32 gradients, the rules their captures
    params = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    if path == "exact":
        assert res.held_bytes == params
    else:
        assert 0 < res.held_bytes != params


def _packed_row(model, lengths=(6, 9, 4, 7), seed=1):
    """One packed (THD) row of ``len(lengths)`` trajectories that do not see each other
    (block-diagonal causal mask), each scoring its last 3 tokens: ``terms()`` gives each
    trajectory's ``-sum_t w_t log p(y_t)``, ``cu`` its cumulative lengths."""
    from ess_patch.demo.cpu import megatron_on_cpu

    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    row = torch.randint(0, VOCAB, (1, total), generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    causal = torch.ones(total, total).tril().bool()
    masked = ~(causal & (seg[:, None] == seg[None, :]))  # megatron: True = masked out
    scored = torch.cat([torch.arange(e - 3, e) for e in cu[1:].tolist()])
    targets = torch.randint(0, VOCAB, (scored.numel(),), generator=gen)
    w = torch.rand(scored.numel(), generator=gen) + 0.5

    def terms():
        pos = torch.arange(total)[None]
        with megatron_on_cpu():
            logits = model(row, pos, masked[None, None])[0, scored]
        lp = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
        return torch.zeros(len(lengths)).index_add(0, seg[scored], -(w * lp))

    return terms, cu


def test_packed_rows_on_both_paths_match_one_backward_per_trajectory(world):
    """Several trajectories in one packed row: the exact path and the rules given
    ``cu_seqlens`` (each token laid back into its trajectory's row) give each trajectory's
    norm; the rules without ``cu_seqlens`` refuse rather than return one norm for the row."""
    model = _gpt(**dict(MODERN))
    terms, cu = _packed_row(model)
    params = [p for p in model.parameters() if p.requires_grad]
    want = torch.stack(
        [
            sum(g.double().square().sum() for g in torch.autograd.grad(terms()[k], params))
            for k in range(len(cu) - 1)
        ]
    )
    assert torch.allclose(norm_pass(model, terms, path="exact").sq_norms, want, rtol=1e-6)
    got = norm_pass(model, terms, cu_seqlens=cu).sq_norms
    assert torch.allclose(got, want, rtol=2e-5), (got, want)
    with pytest.raises(ValueError, match="cu_seqlens=") as refused:
        norm_pass(model, terms)
    assert "path='exact'" in str(refused.value)


def test_the_rewrite_on_a_packed_row_is_the_coefficient_weighted_gradient(world):
    """The in-step form on a packed row: ``apply(c)`` writes ``sum_i c_i grad(term_i)``."""
    from ess_patch.per_trajectory import PerTrajectoryGrads

    model = _gpt(**dict(MODERN))
    terms, cu = _packed_row(model)
    params = [p for p in model.parameters() if p.requires_grad]
    c = torch.tensor([0.7, -1.3, 0.2, 2.0])
    want = torch.autograd.grad((c * terms()).sum(), params)
    pg = PerTrajectoryGrads(model)
    pg.start()
    pg.packed(cu)
    terms().sum().backward()
    pg.stop()
    pg.apply(c)
    pg.remove()
    for p, g in zip(params, want, strict=True):
        assert torch.allclose(p.grad, g, rtol=1e-4, atol=1e-6 * float(g.abs().max())), p.shape


@pytest.mark.parametrize(
    ("cu", "match"),
    [([0, 9, 5, 26], "never decrease"), ([1, 26], "start at 0"), ([0, 10, 40], "at least")],
    ids=["decreasing", "not-from-0", "longer-than-the-row"],
)
def test_bad_cu_seqlens_are_named_and_change_nothing(world, cu, match):
    model = _gpt(**dict(MODERN))
    terms, _ = _packed_row(model)
    before = {k: v.clone() for k, v in model.named_parameters()}
    with pytest.raises(ValueError, match=match):
        norm_pass(model, terms, cu_seqlens=cu)
    assert all(torch.equal(before[k], v) for k, v in model.named_parameters())
    assert all(p.grad is None and p.requires_grad for p in model.parameters())


def _ppo_step(model, ids, tokens, old_lp, adv):
    """One PPO-clipped (eps 0.2) backward with a KL-style term: not linear in the advantage."""
    from ess_patch.demo.cpu import megatron_on_cpu

    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with megatron_on_cpu():
        logits = model(ids, pos, None)[:, -RESPONSE:]
    lp = torch.log_softmax(logits, -1).gather(2, tokens[..., None]).squeeze(-1)
    ratio = torch.exp(lp - old_lp)
    pg = -torch.min(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None]).mean()
    kl = (lp - old_lp).square().mean()
    (pg + 0.1 * kl).backward()


def test_the_pass_changes_nothing_the_step_uses(world):
    model = _gpt(**dict(MODERN))
    ids, tokens, w, adv = _batch()
    old_lp = -torch.rand(ids.shape[0], RESPONSE)
    params = [p for p in model.parameters() if p.requires_grad]
    # a gradient already accumulated (a previous micro-batch) must survive the pass untouched
    _ppo_step(model, ids[:2], tokens[:2], old_lp[:2], adv[:2])
    before = [(p.detach().clone(), p.grad.clone()) for p in params]
    norm_pass(model, lambda: _gpt_terms(model, ids, tokens, w))
    for (p0, g0), p in zip(before, params, strict=True):
        assert torch.equal(p, p0) and torch.equal(p.grad, g0)
    assert all(p.requires_grad for p in params)
    assert not any(m._forward_hooks for m in model.modules())  # the hooks are gone
    # the training step after the pass is bit-identical to the step without it
    _ppo_step(model, ids, tokens, old_lp, adv)
    with_pass = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    _ppo_step(model, ids[:2], tokens[:2], old_lp[:2], adv[:2])
    _ppo_step(model, ids, tokens, old_lp, adv)
    for a, p in zip(with_pass, params, strict=True):
        assert torch.equal(a, p.grad)


def test_weights_the_user_froze_stay_frozen_and_count_for_nothing(world):
    """The pass freezes the trainable linear weights for its backward (megatron's frozen-weight
    path computes no weight gradient) and gives back exactly what it took: a weight frozen
    before the pass stays frozen, the others trainable, and the norms are over the trainable
    parameters only, as one backward per trajectory gives them."""
    model = _gpt(**dict(MODERN))
    frozen = model.decoder.layers[0].self_attention.linear_qkv.weight
    frozen.requires_grad_(False)
    ids, tokens, w, _ = _batch()
    want = _brute(model, ids, tokens, w)
    states = {n: p.requires_grad for n, p in model.named_parameters()}
    res = norm_pass(model, lambda: _gpt_terms(model, ids, tokens, w))
    assert {n: p.requires_grad for n, p in model.named_parameters()} == states
    assert not frozen.requires_grad
    assert torch.allclose(res.sq_norms, want, rtol=2e-5), (res.sq_norms, want)


@pytest.mark.parametrize(
    ("terms", "match"),
    [
        (lambda m, b: _gpt_terms(m, *b[:3]).detach(), "no grad"),
        (lambda m, b: _gpt_terms(m, *b[:3])[None], "1-D"),
        (lambda m, b: _gpt_terms(m, *b[:3]).tolist(), "1-D"),
        (lambda m, b: _gpt_terms(m, *b[:3]) * float("nan"), "trajectory 0"),
    ],
    ids=["detached", "2-D", "list", "nan"],
)
def test_bad_loss_terms_are_named_and_change_nothing(world, terms, match):
    model = _gpt(**dict(MODERN))
    batch = _batch()
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(EssPatchError, match=match):
        norm_pass(model, lambda: terms(model, batch))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    assert not any(m._forward_hooks for m in model.modules())


def test_an_unknown_path_is_refused(world):
    model = _gpt()
    with pytest.raises(ValueError, match="'rules', 'exact'"):
        norm_pass(model, lambda: torch.zeros(1), path="fast")
