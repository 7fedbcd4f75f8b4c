"""The forward-only proxy (ess_patch.proxy) against autograd on the logits, one token at a time."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks
from proxy_ranks import vocab_parallel

from ess_patch.baseline import min_variance_baseline
from ess_patch.proxy import proxy_baseline, proxy_sq_norms, segments_from_cu_seqlens


def _brute(logits, tokens, mask, weights=None):
    """Sum over tokens of ||d (w_t log p(y_t)) / d logits_t||^2, one autograd.grad per token."""
    b, s, _ = logits.shape
    out = torch.zeros(b, dtype=torch.float64)
    for i in range(b):
        for t in range(s):
            if not mask[i, t]:
                continue
            z = logits[i, t].detach().double().requires_grad_(True)
            lp = torch.log_softmax(z, -1)[tokens[i, t]]
            w = 1.0 if weights is None else float(weights[i, t])
            (g,) = torch.autograd.grad(w * lp, z)
            out[i] += g.square().sum()
    return out


def _data(b=4, s=5, v=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(b, s, v, generator=gen)
    tokens = torch.randint(0, v, (b, s), generator=gen)
    mask = torch.rand(b, s, generator=gen) > 0.3
    weights = torch.rand(b, s, generator=gen) + 0.5
    return logits, tokens, mask, weights


def test_matches_autograd_per_token_with_mask_and_weights():
    logits, tokens, mask, w = _data()
    got = proxy_sq_norms(logits, tokens, mask, token_weights=w)
    want = _brute(logits, tokens, mask, w)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)
    # and not trivially: the mask and the weights change the answer
    assert not torch.allclose(proxy_sq_norms(logits, tokens).double(), want, rtol=1e-2)


def test_packed_segments_give_the_padded_rows_answer():
    logits, tokens, mask, w = _data(b=3, s=4)
    padded = proxy_sq_norms(logits, tokens, mask, token_weights=w)
    # pack the three rows into one row of 12 tokens (+2 padding), cu_seqlens [0, 4, 8, 12]
    pad = 2
    packed = torch.cat([logits.reshape(12, -1), torch.randn(pad, logits.shape[-1])])
    seg = segments_from_cu_seqlens(torch.tensor([0, 4, 8, 12]), total=12 + pad)
    assert seg.tolist()[-3:] == [2, -1, -1]
    got = proxy_sq_norms(
        packed[None],
        torch.cat([tokens.reshape(12), torch.zeros(pad, dtype=torch.long)])[None],
        torch.cat([mask.reshape(12), torch.ones(pad, dtype=torch.bool)])[None],
        segments=seg[None],
        token_weights=torch.cat([w.reshape(12), torch.ones(pad)])[None],
    )
    assert torch.allclose(got, padded, rtol=1e-6)


def test_baseline_from_the_proxy_is_min_variance_baseline_of_its_norms():
    logits, tokens, mask, _ = _data(b=6)
    rewards = torch.rand(6)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    res = proxy_baseline(rewards, groups, logits, tokens, mask)
    want = min_variance_baseline(None, rewards, _brute(logits, tokens, mask), groups)
    assert torch.allclose(res.baselines, want.baselines, rtol=1e-5)


def test_bad_shapes_and_token_ids_raise():
    logits, tokens, _, _ = _data()
    with pytest.raises(ValueError, match="one token per logits row"):
        proxy_sq_norms(logits, tokens[:, :-1])
    with pytest.raises(ValueError, match="outside"):
        proxy_sq_norms(logits[..., :5], tokens.clamp(min=5))
    with pytest.raises(ValueError, match="cu_seqlens"):
        segments_from_cu_seqlens(torch.tensor([1, 3]))


@pytest.mark.dist
def test_vocab_parallel_tp2_matches_the_whole_vocabulary(tmp_path):
    logits, tokens, mask, _ = _data(v=12)
    ranks = run_ranks(vocab_parallel, dp=2, args=(logits, tokens, mask), tmp_path=tmp_path)
    want = proxy_sq_norms(logits, tokens, mask)
    for got in ranks:
        assert torch.allclose(got, want, rtol=1e-6)
