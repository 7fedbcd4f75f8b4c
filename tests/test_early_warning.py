"""The early-warning rule (``ess_patch.early_warning``) on hand-computed rho series."""

from __future__ import annotations

import math

import pytest
import torch

from ess_patch.early_warning import (
    DEFAULT_PATIENCE,
    DEFAULT_THRESHOLD,
    EarlyWarning,
    evaluate,
    firings,
    first_firing,
    lead_time,
)

# VCPO's shapes, at the demo's scale: a synchronous run near 0.7, a stale one that holds, then
# falls towards 0 from step 5 (collapse onset, as a reward criterion would place it, at 8)
STEADY = [0.72, 0.68, 0.7, 0.65, 0.71, 0.69, 0.7, 0.73, 0.7, 0.68]
COLLAPSING = [0.7, 0.6, 0.5, 0.4, 0.3, 0.15, 0.1, 0.05, 0.02, 0.01]
# dips below 0.2 twice but never three results in a row: noise, not an episode
NOISY = [0.5, 0.1, 0.4, 0.15, 0.18, 0.3, 0.19, 0.5, 0.1, 0.6]


def test_defaults_are_vcpos_band():
    # below the healthy band (0.3-0.7) and above a collapse's ~0; three in a row
    assert (DEFAULT_THRESHOLD, DEFAULT_PATIENCE) == (0.2, 3)
    rule = EarlyWarning()
    assert (rule.threshold, rule.patience, rule.armed) == (0.2, 3, True)


def test_streaming_fires_once_at_the_third_low_result():
    rule = EarlyWarning()
    fired = [rule.update(r) for r in COLLAPSING]
    # below 0.2 at indices 5 (0.15), 6 (0.1), 7 (0.05): fires at 7, once, no re-arm after
    assert fired == [False] * 7 + [True, False, False]
    assert rule.fired == [7]
    assert rule.last_firing == [(5, 0.15), (6, 0.1), (7, 0.05)]
    assert not rule.armed


def test_streaming_uses_the_given_steps_and_reads_tensors():
    rule = EarlyWarning(threshold=0.5, patience=2)
    out = [rule.update(torch.tensor(r), step=s) for s, r in [(10, 0.6), (20, 0.4), (30, 0.3)]]
    assert out == [False, False, True]
    assert rule.fired == [30]
    assert rule.last_firing == [(20, pytest.approx(0.4)), (30, pytest.approx(0.3))]


def test_a_recovery_of_patience_results_re_arms_a_new_episode():
    series = [0.1, 0.1, 0.1, 0.5, 0.5, 0.1, 0.5, 0.5, 0.5, 0.1, 0.1, 0.1, 0.1]
    # fires at 2; 0.5, 0.5 then a 0.1 breaks the recovery (two, not three); 6-8 re-arm;
    # 9-11 fire again at 11; 12 is the same episode
    assert firings(series) == [2, 11]
    rule = EarlyWarning()
    for r in series:
        rule.update(r)
    assert rule.fired == [2, 11] and not rule.armed


def test_the_streak_must_be_consecutive():
    assert firings(NOISY) == []
    assert first_firing(NOISY) is None
    assert firings(STEADY) == []
    # exactly at the threshold is not below it
    assert firings([0.2, 0.2, 0.2, 0.2]) == []


def test_batch_steps_and_lead_time():
    steps = list(range(0, 100, 10))  # one rho every 10 steps
    assert first_firing(COLLAPSING, steps=steps) == 70
    assert lead_time(COLLAPSING, onset=80, steps=steps) == 10  # warned 10 steps ahead
    assert lead_time(COLLAPSING, onset=60, steps=steps) == -10  # late
    assert lead_time(STEADY, onset=60) is None  # missed
    assert first_firing(COLLAPSING, threshold=0.45, patience=2) == 4
    assert first_firing(COLLAPSING, threshold=0.0) is None  # 0 turns the rule off


def test_evaluate_over_many_runs():
    runs = {
        "collapse-early": COLLAPSING,  # fires at 7, onset 8: lead 1, a hit
        "collapse-late": COLLAPSING,  # onset 6: fired at 7, lead -1, late
        "collapse-missed": NOISY,  # onset 5: never fired
        "steady": STEADY,  # quiet
        "false": [0.1, 0.1, 0.1, 0.7],  # fired at 2, never collapsed
    }
    onsets = {
        "collapse-early": 8,
        "collapse-late": 6,
        "collapse-missed": 5,
        "steady": None,
        "false": None,
    }
    score = evaluate(runs, onsets)
    assert [r.outcome for r in score.runs] == ["hit", "late", "missed", "quiet", "false alarm"]
    assert score.leads == {"collapse-early": 1, "collapse-late": -1, "collapse-missed": None}
    assert score.hit_rate == pytest.approx(1 / 3)
    assert score.false_alarm_rate == pytest.approx(1 / 2)
    assert [r.first_fired for r in score.runs] == [7, 7, None, None, 2]
    assert (score.threshold, score.patience) == (0.2, 3)


def test_evaluate_with_steps_and_without_one_side():
    only_collapsed = evaluate({"a": COLLAPSING}, {"a": 100}, steps={"a": list(range(0, 100, 10))})
    assert only_collapsed.leads == {"a": 30} and only_collapsed.hit_rate == 1.0
    assert only_collapsed.false_alarm_rate is None
    only_steady = evaluate({"s": STEADY}, {"s": None})
    assert only_steady.hit_rate is None and only_steady.false_alarm_rate == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threshold": 1.5}, "threshold 1.5 must be in \\[0, 1\\]"),
        ({"threshold": math.nan}, "threshold nan must be in"),
        ({"threshold": True}, "not a bool"),
        ({"threshold": "x"}, "'x' is not a number"),
        ({"patience": 0}, "patience 0 must be a whole number >= 1"),
        ({"patience": 2.5}, "patience 2.5 must be"),
    ],
)
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EarlyWarning(**kwargs)
    with pytest.raises(ValueError, match=match):
        firings(STEADY, **kwargs)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -0.1, "x"])
def test_a_bad_rho_raises_and_changes_nothing(bad):
    rule = EarlyWarning(patience=2)
    rule.update(0.1)
    with pytest.raises(ValueError, match="rho"):
        rule.update(bad)
    assert rule.streak == [(0, 0.1)] and rule.armed and rule.fired == []
    assert rule.update(0.1) is True and rule.fired == [1]  # the bad value took no step


def test_evaluate_names_the_bad_run_and_mismatched_names():
    with pytest.raises(ValueError, match="run 'b': rho nan"):
        evaluate({"a": STEADY, "b": [0.5, math.nan]}, {"a": None, "b": None})
    with pytest.raises(ValueError, match=r"only in runs: \['b'\], only in onsets: \['c'\]"):
        evaluate({"a": STEADY, "b": STEADY}, {"a": None, "c": 3})
    with pytest.raises(ValueError, match="steps has 2 entries and the rho series 10"):
        first_firing(STEADY, steps=[0, 1])


def test_reset_starts_over():
    rule = EarlyWarning(patience=1)
    assert rule.update(0.1) is True
    rule.reset()
    assert rule.armed and rule.fired == [] and rule.last_firing == []
    assert rule.update(0.1) is True and rule.fired == [0]
