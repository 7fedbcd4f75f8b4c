"""VCPO's minimum-variance baseline (ess_patch.baseline) against a float64 loop, and its edges."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ess_patch.baseline import NonFiniteBaselineInputError, min_variance_baseline


def _loop(log_w, rewards, sq, groups, lengths=None):
    """The formula as written, per group, in Python floats (with a shift for huge weights)."""
    out = {}
    for g in sorted(set(groups)):
        idx = [i for i, x in enumerate(groups) if x == g]
        scores = []
        for i in idx:
            s = (2 * log_w[i] if log_w is not None else 0.0) + (
                math.log(sq[i]) if sq[i] > 0 else -math.inf
            )
            if lengths is not None:
                s -= 2 * math.log(lengths[i])
            scores.append(s)
        top = max(scores)
        if top == -math.inf:
            out[g] = sum(rewards[i] for i in idx) / len(idx)
            continue
        e = [math.exp(s - top) for s in scores]
        out[g] = sum(w * rewards[i] for w, i in zip(e, idx, strict=True)) / sum(e)
    return out


def test_matches_the_formula_per_group():
    log_w = [0.1, -0.3, 0.7, 0.0, 1.2]
    rewards = [1.0, 0.0, 0.5, 1.0, 0.25]
    sq = [2.0, 0.5, 1.0, 3.0, 0.1]
    groups = [7, 7, 7, 3, 3]
    f64 = torch.float64
    res = min_variance_baseline(
        torch.tensor(log_w, dtype=f64),
        torch.tensor(rewards, dtype=f64),
        torch.tensor(sq, dtype=f64),
        torch.tensor(groups),
    )
    want = _loop(log_w, rewards, sq, groups)
    assert res.group_ids.tolist() == [3, 7]
    assert res.baselines.tolist() == pytest.approx([want[3], want[7]], rel=1e-12)
    assert res.advantages.tolist() == pytest.approx(
        [r - want[g] for r, g in zip(rewards, groups, strict=True)], rel=1e-12
    )
    # hand check of group 3: weights e^0 * 3 and e^2.4 * 0.1
    a, b = 3.0, math.exp(2.4) * 0.1
    assert res.baselines[0].item() == pytest.approx((a * 1.0 + b * 0.25) / (a + b), rel=1e-12)


def test_product_mode_weights_do_not_overflow():
    # exp(2 * 900) overflows float64; the group shift keeps it finite
    res = min_variance_baseline(
        torch.tensor([900.0, 899.0, -900.0]),
        torch.tensor([1.0, 0.0, 5.0]),
        torch.ones(3),
        torch.tensor([0, 0, 0]),
    )
    w = math.exp(2.0)  # relative weight of the first to the second
    assert res.baselines[0].item() == pytest.approx(w / (w + 1), rel=1e-12)
    assert torch.isfinite(res.advantages).all()


def test_group_of_one_zero_norms_and_all_zero_fallback():
    res = min_variance_baseline(
        None,
        torch.tensor([0.3, 1.0, 0.0, 0.2, 0.6]),
        torch.tensor([5.0, 0.0, 2.0, 0.0, 0.0]),
        torch.tensor([0, 1, 1, 2, 2]),
    )
    assert res.advantages[0].item() == 0.0  # a group of one: b* = R
    assert res.baselines[1].item() == 0.0  # the zero-norm trajectory has no say
    assert res.baselines[2].item() == pytest.approx(0.4)  # all zero: the group's mean
    assert res.fallback_groups == 1


def test_lengths_and_log_weights_are_the_same_factor():
    r, sq, g = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([1.0, 2.0, 3.0]), torch.zeros(3).long()
    lengths = torch.tensor([4.0, 9.0, 1.0], dtype=torch.float64)
    a = min_variance_baseline(None, r, sq, g, lengths=lengths)
    b = min_variance_baseline(-torch.log(lengths), r, sq, g)
    assert torch.allclose(a.baselines, b.baselines, rtol=1e-9, atol=0)


def test_empty_batch():
    res = min_variance_baseline(None, torch.zeros(0), torch.zeros(0), torch.zeros(0).long())
    assert res.advantages.numel() == 0 and res.baselines.numel() == 0
    assert res.fallback_groups == 0


@pytest.mark.parametrize(
    ("name", "bad", "error"),
    [
        ("rewards", float("nan"), NonFiniteBaselineInputError),
        ("sq_grad_norms", float("inf"), NonFiniteBaselineInputError),
        ("log_weights", float("inf"), NonFiniteBaselineInputError),
        ("log_weights", float("nan"), NonFiniteBaselineInputError),
        ("sq_grad_norms", -1.0, ValueError),
    ],
)
def test_bad_input_raises_naming_it_and_changes_nothing(name, bad, error):
    inputs = {
        "log_weights": torch.zeros(4),
        "rewards": torch.ones(4),
        "sq_grad_norms": torch.ones(4),
        "group_ids": torch.tensor([0, 0, 1, 1]),
    }
    inputs[name][2] = bad
    before = {k: v.clone() for k, v in inputs.items()}
    with pytest.raises(error, match=rf"{name}\[2\]"):
        min_variance_baseline(**inputs)
    for k, v in inputs.items():
        assert torch.equal(v, before[k]) or (k == name and torch.isnan(v[2]))


def test_minus_infinite_log_weight_is_weight_zero():
    res = min_variance_baseline(
        torch.tensor([float("-inf"), 0.0]),
        torch.tensor([9.0, 1.0]),
        torch.ones(2),
        torch.zeros(2).long(),
    )
    assert res.baselines.tolist() == [1.0]


def test_shape_and_id_errors():
    with pytest.raises(ValueError, match="sq_grad_norms has 2 entries, rewards has 3"):
        min_variance_baseline(None, torch.ones(3), torch.ones(2), torch.zeros(3).long())
    with pytest.raises(ValueError, match="group_ids must be an integer"):
        min_variance_baseline(None, torch.ones(2), torch.ones(2), torch.zeros(2))
    with pytest.raises(ValueError, match="must be 1-D"):
        min_variance_baseline(None, torch.ones(2, 1), torch.ones(2), torch.zeros(2).long())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(-30, 30),  # log weight
            st.floats(-2, 2),  # reward
            st.one_of(st.just(0.0), st.floats(1e-6, 1e3)),  # squared norm
            st.integers(0, 3),  # group
        ),
        min_size=1,
        max_size=20,
    )
)
def test_property_matches_loop_and_the_baseline_lies_within_the_groups_rewards(rows):
    log_w, rewards, sq, groups = (list(c) for c in zip(*rows, strict=True))
    res = min_variance_baseline(
        torch.tensor(log_w, dtype=torch.float64),
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(sq, dtype=torch.float64),
        torch.tensor(groups),
    )
    want = _loop(log_w, rewards, sq, groups)
    for g, b in zip(res.group_ids.tolist(), res.baselines.tolist(), strict=True):
        assert b == pytest.approx(want[g], rel=1e-9, abs=1e-12)
        mine = [r for r, x in zip(rewards, groups, strict=True) if x == g]
        assert min(mine) - 1e-12 <= b <= max(mine) + 1e-12  # a convex combination
