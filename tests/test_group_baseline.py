"""VCPO's baseline over a DP group (``ess_patch.group_baseline``) and the norm pass in TP2.

Expectations: the single-process ``min_variance_baseline`` on the whole rollout (itself checked
by hand in ``test_baseline.py``), a hand-computed group, and brute-force norms per trajectory.
"""

from __future__ import annotations

import pytest
import torch

from ess_patch.baseline import NonFiniteBaselineInputError, min_variance_baseline
from ess_patch.group_baseline import dp_min_variance_baseline

pytest.importorskip("megatron.core")

from group_baseline_ranks import (
    bad_on_rank_one,
    split_rollout,
    tp2_norm_pass,
    tp2_replicated_below_the_head,
)
from harness import run_ranks


def _rollout(n=12, groups=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.bernoulli(torch.full((n,), 0.5), generator=gen)
    ids = torch.arange(n) // (n // groups) + 100  # the framework's ids, not 0..G-1
    sq = torch.rand(n, generator=gen, dtype=torch.float64) + 0.1
    lw = torch.randn(n, generator=gen, dtype=torch.float64)
    return rewards, ids, sq, lw


def test_one_process_is_min_variance_baseline_and_the_metrics_are_its_groups():
    rewards, ids, sq, lw = _rollout()
    res = dp_min_variance_baseline(rewards, ids, sq, log_weights=lw)
    want = min_variance_baseline(lw, rewards, sq, ids)
    assert torch.equal(res.advantages, want.advantages)
    assert res.groups == 3 and res.split_groups == 0 and res.fallback_groups == 0
    means = torch.stack([rewards[ids == g].double().mean() for g in (100, 101, 102)])
    assert res.shift == pytest.approx(float((want.baselines - means).mean()), abs=1e-12)
    assert res.abs_shift == pytest.approx(float((want.baselines - means).abs().mean()), abs=1e-12)


def test_a_hand_computed_group():
    # w^2 ||g||^2 = (1, 3): b* = (1*0 + 3*1) / 4 = 0.75; the group mean would be 0.5
    res = dp_min_variance_baseline(torch.tensor([0.0, 1.0]), torch.tensor([7, 7]), [1.0, 3.0])
    assert res.baselines.tolist() == [0.75, 0.75]
    assert res.advantages.tolist() == [-0.75, 0.25]
    assert res.shift == pytest.approx(0.25)


def test_bad_input_in_one_process_is_named():
    with pytest.raises(ValueError, match="lengths differ"):
        dp_min_variance_baseline([1.0, 0.0], torch.tensor([0, 0]), [1.0])
    with pytest.raises(ValueError, match="integer"):
        dp_min_variance_baseline([1.0, 0.0], torch.tensor([0.0, 0.0]), [1.0, 1.0])
    with pytest.raises(ValueError, match="2\\*\\*53"):
        dp_min_variance_baseline([1.0], torch.tensor([-1]), [1.0])
    with pytest.raises(NonFiniteBaselineInputError, match="sq_grad_norms"):
        dp_min_variance_baseline([1.0], torch.tensor([0]), [float("inf")])


@pytest.mark.dist
def test_dp2_with_every_group_split_is_the_single_process_result(tmp_path):
    rewards, ids, sq, lw = _rollout()
    want = min_variance_baseline(lw, rewards, sq, ids)
    ranks = run_ranks(split_rollout, dp=2, args=(rewards, ids, sq, lw), tmp_path=tmp_path)
    got = torch.zeros(rewards.numel(), dtype=torch.float64)
    for r in ranks:
        got[r["rows"]] = r["result"].advantages
        assert r["result"].split_groups == 3 and r["result"].groups == 3
        assert r["result"].shift == ranks[0]["result"].shift  # every rank logs the same
    assert torch.allclose(got, want.advantages, rtol=0, atol=1e-12)
    # and not what each rank would get alone (each part's own b*): the reduction matters
    alone = min_variance_baseline(lw[0::2], rewards[0::2], sq[0::2], ids[0::2]).advantages
    assert not torch.allclose(alone, want.advantages[0::2])


@pytest.mark.dist
@pytest.mark.parametrize(
    ("fault", "own", "peer"),
    [
        (
            "length",
            "EssPatchValueError: dp_min_variance_baseline: the inputs' lengths",
            "InvalidInputsElsewhereError: dp_min_variance_baseline: the baseline's inputs on DP "
            "rank(s) [1]",
        ),
        (
            "float-ids",
            "EssPatchValueError: dp_min_variance_baseline: group_ids must be",
            "InvalidInputsElsewhereError",
        ),
        (
            "nan",
            "NonFiniteBaselineInputError: min_variance_baseline: rewards[",
            "NonFiniteBaselineInputError: min_variance_baseline: rewards[",
        ),
        (
            "weights-on-one-rank",
            "EssPatchValueError: dp_min_variance_baseline: DP rank(s) [0]",
            "EssPatchValueError: dp_min_variance_baseline: DP rank(s) [0]",
        ),
    ],
)
def test_a_fault_on_one_rank_is_an_error_on_every_rank(fault, own, peer, tmp_path):
    ranks = run_ranks(
        bad_on_rank_one, dp=2, args=(*_rollout(), fault), tmp_path=tmp_path, timeout=60
    )
    assert ranks[1].startswith(own), ranks
    assert ranks[0].startswith(peer), ranks


@pytest.mark.dist
def test_the_norm_pass_in_tp2_matches_one_backward_per_trajectory(tmp_path):
    ranks = run_ranks(tp2_norm_pass, dp=2, timeout=120, tmp_path=tmp_path)
    for r in ranks:
        assert r["rules"] < 2e-5 and r["exact"] < 2e-5, r


@pytest.mark.dist
def test_tp2_with_only_replicated_parameters_below_the_head_meets_every_collective(tmp_path):
    """Every TP rank's backward takes the same route, even where rank 1 counts nothing below
    the head (the exact path differentiated counted parameters only before: rank 0 waited)."""
    ranks = run_ranks(tp2_replicated_below_the_head, dp=2, timeout=90, tmp_path=tmp_path)
    for r in ranks:
        assert r["rules"] < 2e-5 and r["exact"] < 2e-5, r
