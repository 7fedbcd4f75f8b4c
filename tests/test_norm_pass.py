"""The norm pass (``ess_patch.norm_pass``) on real megatron-core GPT models, on CPU.

Expectation: one ``autograd.grad`` per trajectory of ``w_i * log p_i`` (brute force). The pass
must change nothing: parameters, ``.grad`` and a PPO-clipped training step run after it are
bit-identical to the step without it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from test_per_trajectory_rules import MODERN, RESPONSE, _batch, _gpt, _gpt_terms

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


def test_packed_rows_take_the_exact_path_and_the_rules_refuse_them(world):
    """Two trajectories in one row (a packed row): the exact path gives each one's norm, the
    rules (one trajectory per row) refuse rather than return one norm for the row."""
    model = _gpt(**dict(MODERN))
    ids, tokens, w, _ = _batch()
    row = ids[:1]
    # the row's last RESPONSE tokens split in two trajectories (2 and 2 tokens)
    seg = torch.tensor([0, 0, 1, 1])

    def terms():
        pos = torch.arange(row.shape[1])[None]
        from ess_patch.demo.cpu import megatron_on_cpu

        with megatron_on_cpu():
            logits = model(row, pos, None)[:, -RESPONSE:]
        lp = torch.log_softmax(logits, -1).gather(2, tokens[:1, :, None]).squeeze(-1)[0]
        return torch.zeros(2).index_add(0, seg, -(w[0] * lp))

    params = [p for p in model.parameters() if p.requires_grad]
    want = torch.stack(
        [
            sum(g.double().square().sum() for g in torch.autograd.grad(terms()[k], params))
            for k in range(2)
        ]
    )
    res = norm_pass(model, terms, path="exact")
    assert torch.allclose(res.sq_norms, want, rtol=1e-6)
    with pytest.raises(ValueError, match="path='exact'"):
        norm_pass(model, terms)


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
