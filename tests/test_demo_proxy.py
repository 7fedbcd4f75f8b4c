"""The demo's proxy arms: ``b*`` from the forward-only proxy, against a hand computation."""

from __future__ import annotations

import pytest
import torch

from ess_patch.demo.opob import proxy_advantages
from ess_patch.demo.train import DemoConfig, DemoConfigError


def _by_hand(rewards, groups, logits, tokens, weight):
    """Per token, autograd's gradient of ``w * log p(y)`` with respect to the logits; its
    squared norm summed per trajectory; then ``b*_g = sum s R / sum s`` per group."""
    n, t, _ = logits.shape
    s = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        for j in range(t):
            z = logits[i, j].double().clone().requires_grad_(True)
            w = weight[i, j if weight.shape[1] > 1 else 0].double()
            (g,) = torch.autograd.grad(w * torch.log_softmax(z, -1)[tokens[i, j]], z)
            s[i] += g.square().sum()
    adv = torch.empty(n, dtype=torch.float64)
    shifts = []
    for g in groups.unique():
        m = groups == g
        b = (s[m] * rewards[m].double()).sum() / s[m].sum()
        adv[m] = rewards[m].double() - b
        shifts.append(abs(float(b) - float(rewards[m].double().mean())))
    return adv, sum(shifts) / len(shifts)


@pytest.mark.parametrize("per_token", [False, True])
def test_proxy_advantages_are_r_minus_b_star_of_the_logits_gradient_norms(per_token):
    gen = torch.Generator().manual_seed(3)
    n, t, v = 8, 5, 7
    logits = torch.randn(n, t, v, generator=gen) * 2
    tokens = torch.randint(0, v, (n, t), generator=gen)
    rewards = torch.rand(n, generator=gen)
    groups = torch.arange(n) // 4
    weight = torch.rand(n, t if per_token else 1, generator=gen) * 3  # IS weights, as the loss
    adv, shift = proxy_advantages(rewards, groups, logits, tokens, weight)
    want, want_shift = _by_hand(rewards, groups, logits, tokens, weight)
    assert adv.shape == (n, 1)
    torch.testing.assert_close(adv[:, 0].double(), want, rtol=1e-5, atol=1e-6)
    assert shift == pytest.approx(want_shift, rel=1e-5)
    # and it is not the group mean's advantage (the weights make the norms differ)
    mean_adv = rewards - rewards.view(2, 4).mean(1).repeat_interleave(4)
    assert not torch.allclose(adv[:, 0], mean_adv, atol=1e-3)


def test_a_proxy_arm_whose_groups_straddle_micro_batches_is_refused_by_name():
    # 2 prompts x 4 samples in 4 micro-batches of 2: b* would see half a group
    with pytest.raises(DemoConfigError, match=r"microbatches.*whole groups of 4"):
        DemoConfig(arms=("ess+proxy",), prompts_per_rank=2, group_size=4, microbatches=4)
    # the exact-norm arms take b* after the whole step and accept it
    DemoConfig(arms=("ess+baseline",), prompts_per_rank=2, group_size=4, microbatches=4)
