"""The collapse scenario's criterion and early-warning rule (ess_patch/demo/criterion.py).

Pure Python over hand-built runs; every expected value is worked out by hand from the rule
stated in the module docstring. Written before any run of the scenario.
"""

from __future__ import annotations

import math

import pytest

from ess_patch.demo import criterion as c


def run(rewards, grads=None, loss=0.0):
    grads = grads or [0.1] * len(rewards)
    return [
        {"reward": r, "grad_norm": g, "loss": loss, "rho": 1.0}
        for r, g in zip(rewards, grads, strict=True)
    ]


LEARN = [0.5 + 0.001 * i for i in range(400)]  # 0.5 -> 0.899: gains ~0.38


def test_window_and_smoothing_hand_values():
    assert c.window(400) == 20 and c.window(100) == 10 and c.window(5) == 1
    assert c.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_a_run_that_keeps_learning_did_not_collapse():
    v = c.judge(run(LEARN), run(LEARN))
    assert not v.collapsed and v.reasons == () and v.onset is None
    # start: the mean of the first 20 rewards = 0.5 + 0.001 * 9.5
    assert v.start == pytest.approx(0.5095)
    assert v.final == pytest.approx(0.5 + 0.001 * 389.5)


def test_giving_back_more_than_half_the_gain_is_a_collapse_with_its_onset():
    # learns 0.5 -> 0.7 over 200 steps, then falls to 0.5 and stays
    rewards = [0.5 + 0.001 * i for i in range(200)] + [0.5] * 200
    v = c.judge(run(rewards))
    assert v.collapsed and v.reasons == ("giveback",)
    start, peak = 0.5095, 0.5 + 0.001 * 189.5
    line = peak - 0.5 * (peak - start)  # 0.5995
    s = c.smooth(rewards)
    # the smoothed reward stays below the line from the onset on, and was above it just before
    assert all(x < line for x in s[v.onset :]) and s[v.onset - 1] >= line
    assert 200 <= v.onset <= 220  # the trailing window of 20 steps delays it
    # against a sync run that keeps learning it also stalled: the onset is the earlier one,
    # the step where its smoothed reward peaked
    both = c.judge(run(rewards), run(LEARN))
    assert both.reasons == ("giveback", "stalled") and both.onset == 199


def test_a_dip_that_recovers_is_no_collapse():
    rewards = [0.5 + 0.001 * i for i in range(200)] + [0.5] * 50 + [0.75] * 150
    assert not c.judge(run(rewards), run(LEARN)).collapsed


def test_a_run_that_never_learned_cannot_give_back():
    # gains 0.04 < MIN_GAIN, then falls: no giveback (and no sync: no stall test)
    rewards = [0.5 + 0.0004 * i for i in range(100)] + [0.45] * 100
    assert not c.judge(run(rewards)).collapsed


def test_nonfinite_values_are_a_collapse_at_their_step():
    rewards = list(LEARN)
    rewards[123] = math.nan
    v = c.judge(run(rewards), run(LEARN))
    assert v.collapsed and v.reasons[0] == "nonfinite" and v.onset == 123
    grads = [0.1] * 400
    grads[7] = math.inf
    v = c.judge(run(LEARN, grads), run(LEARN))
    assert v.reasons == ("nonfinite",) and v.onset == 7


def test_a_grad_norm_spike_followed_by_lost_reward():
    rewards = [0.5 + 0.001 * i for i in range(300)] + [0.75] * 100  # keeps ~its level
    grads = [0.1] * 400
    grads[250] = 1.5  # 15x the median of the previous 50 steps
    assert not c.judge(run(rewards, grads), run(LEARN)).collapsed  # no reward lost
    lost = [0.5 + 0.001 * i for i in range(250)] + [0.6] * 150  # 0.74 -> 0.6 after it
    v = c.judge(run(lost, grads), run(LEARN))
    assert "spike" in v.reasons and v.onset <= 250
    small = list(grads)
    small[250] = 0.9  # 9x the median: below SPIKE_FACTOR
    assert "spike" not in c.judge(run(lost, small), run(LEARN)).reasons


def test_a_policy_that_stops_learning_while_the_sync_one_does_not():
    # rises 0.5 -> 0.55 in 50 steps then flat; sync gains ~0.38
    flat = [0.5 + 0.001 * min(i, 50) for i in range(400)]
    v = c.judge(run(flat), run(LEARN))
    assert v.reasons == ("stalled",) and v.sync_gain == pytest.approx(0.38)
    assert v.onset == 50 + 19  # the first step where the smoothed reward reaches its plateau
    # the same run against a sync run that does not learn either: no collapse
    assert not c.judge(run(flat), run([0.5] * 400)).collapsed
    # slower than sync but still learning in its last quarter: no collapse
    slow = [0.5 + 0.0004 * i for i in range(400)]
    assert not c.judge(run(slow), run(LEARN)).collapsed


def test_judge_refuses_an_empty_run():
    with pytest.raises(ValueError, match="no records"):
        c.judge([])


def test_the_demo_scores_the_rule_users_get():
    from ess_patch import EssLrConfig
    from ess_patch.early_warning import firings

    # the shipped defaults: rho below 0.2 for 3 consecutive steps
    cfg = EssLrConfig()
    assert (cfg.warn_threshold, cfg.warn_patience) == (c.WARN_THRESHOLD, c.WARN_PATIENCE)
    rhos = [0.9] * 10 + [0.1] * 10
    assert c.warning_steps(rhos) == firings(rhos) == [12]  # steps 10, 11, 12 below 0.2
    assert c.warning_steps([0.19, 0.19, 0.9] * 5) == []  # never 3 in a row
    assert c.warning_steps([0.9, math.nan, math.nan, math.nan, 0.9], 0.5) == [3]  # NaN as 0
    # a firing within STALE_GRACE steps of the first stale rollout is left out
    early = [0.9] + [0.1] * 5 + [0.9] * 20 + [0.1] * 5
    assert c.warning_steps(early) == [3, 28]
    assert c.warning_steps(early, first_stale=1) == [28]  # 3 <= 1 + 10


def test_early_warning_scores_hits_misses_and_false_alarms():
    def verdict(onset):
        return c.Verdict(onset is not None, ("giveback",) if onset else (), onset, 0, 0, 0, None)

    low = [0.9] * 20 + [0.0] * 80  # fires at step 22 (20, 21, 22 below 0.2)
    at_start = [0.0] * 5 + [0.9] * 95  # fires at step 2 only: staleness beginning
    runs = [
        (low, verdict(50)),  # hit, lead 50 - 22 = 28
        (low, verdict(5)),  # collapsed before the warning: miss
        ([0.9] * 100, verdict(40)),  # never warned: miss
        (low, verdict(None)),  # false alarm
        ([0.9] * 100, verdict(None)),  # quiet
        (at_start, verdict(60)),  # fired only within the grace: a miss, counted apart
    ]
    s = c.early_warning(runs, 0.2, first_stale=1)
    assert (s["collapses"], s["hits"], s["misses"], s["quiet_runs"], s["false_alarms"]) == (
        4,
        1,
        3,
        2,
        1,
    )
    assert s["lead_steps"] == (28,) and s["only_at_staleness_start"] == 1
    assert s["hit_rate"] == pytest.approx(1 / 4) and s["false_alarm_rate"] == pytest.approx(0.5)
    # without a stale start (sync runs) the early firing counts: a hit, lead 58
    s = c.early_warning(runs[-1:], 0.2)
    assert (s["hits"], s["lead_steps"], s["only_at_staleness_start"]) == (1, (58,), 0)
    assert math.isnan(c.early_warning([], 0.2)["hit_rate"])


def test_the_peak_is_taken_from_the_first_full_window_on():
    # one lucky first sample: the 1-step "average" at step 0 is 0.9, but the run never
    # learns (flat 0.5): start = peak = the first full window's mean, (0.9 + 19 x 0.5) / 20
    rewards = [0.9] + [0.5] * 399
    v = c.judge(run(rewards), run([0.5] * 400))
    assert not v.collapsed and v.start == v.peak == pytest.approx(0.52)
