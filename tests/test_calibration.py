"""``calibrate_rollouts``: a base ratio calibrated from the run's first rollouts.

Single process against hand-computed values, bad settings rejected with nothing changed, a
real megatron-core optimizer (applied LR = scheduled x scale, after calibration), and real
gloo ranks (DP2 x CP2 x PP2) that all reach the same calibrated ratio, a restarted rank
included.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from dist_helpers import cp_local, dp_shard, make_batch
from harness import layout, run_ranks
from reference import reference_ess

import ess_patch
from ess_patch import EssLrConfig, compute_ess_lr
from ess_patch.integrations.flags import add_ess_arguments, config_from_args
from ess_patch.state import STATE, reset

pytestmark = pytest.mark.usefixtures("clean_ess")


def _two(a: float):
    """Two one-token trajectories with weights 1 and ``a``: rho = (1 + a)^2 / (2 (1 + a^2))."""
    lp = [
        torch.tensor([0.0], dtype=torch.float64),
        torch.tensor([math.log(a)], dtype=torch.float64),
    ]
    return lp, [torch.zeros(1, dtype=torch.float64)] * 2, [torch.ones(1)] * 2


# a = 1, 3, 7 give rho = 1, 0.8, 0.64 exactly
RHO = {1.0: 1.0, 3.0: 0.8, 7.0: 0.64}


def test_scale_one_while_calibrating_then_rho_over_the_mean_of_the_first_k():
    config = EssLrConfig(weight_mode="product", calibrate_rollouts=2)
    results = [compute_ess_lr(*_two(a), config=config) for a in (1.0, 3.0, 3.0, 7.0)]
    assert [r.rho for r in results] == pytest.approx([1.0, 0.8, 0.8, 0.64], rel=1e-12)
    assert [r.status for r in results] == ["calibrating", "calibrating", "ok", "ok"]
    assert [r.scale for r in results[:2]] == [1.0, 1.0]  # rho 0.8 would brake without it
    # base = (1 + 0.8) / 2 = 0.9: scale = sqrt(rho / 0.9)
    assert results[2].scale == pytest.approx(math.sqrt(0.8 / 0.9), rel=1e-12)
    assert results[3].scale == pytest.approx(math.sqrt(0.64 / 0.9), rel=1e-12)
    assert [r.calibrated_ratio for r in results] == pytest.approx([0, 0, 0.9, 0.9], rel=1e-12)
    # the metrics say what happened; uncalibrated runs log what they logged before
    assert results[0].metrics()["ess_lr_calibrating"] == 1.0
    assert results[3].metrics()["ess_lr_base_ratio"] == pytest.approx(0.9)
    assert "ess_lr_base_ratio" not in compute_ess_lr(*_two(3.0)).metrics()
    # without calibration the same rollout brakes by sqrt(0.8)
    assert compute_ess_lr(*_two(3.0), config=EssLrConfig()).scale == pytest.approx(math.sqrt(0.8))


def test_another_config_starts_a_new_calibration_and_restart_forgets_it():
    """A ratio counted under one config is never applied under another (a run that changes
    weight mode, or a second run in the same process), and ``calibration.restart()`` starts over
    while keeping the rest of the state."""
    from ess_patch import calibration

    geometric = EssLrConfig(calibrate_rollouts=1)
    product = EssLrConfig(weight_mode="product", calibrate_rollouts=1)
    # geometric calibrates on rho 1 (one-token trajectories: both modes see rho 0.8 for a = 3)
    assert compute_ess_lr(*_two(1.0), config=geometric).status == "calibrating"
    assert compute_ess_lr(*_two(3.0), config=geometric).calibrated_ratio == pytest.approx(1.0)
    # product weights never saw a rollout: they calibrate on their own first one (rho 0.8)
    first = compute_ess_lr(*_two(3.0), config=product)
    assert (first.status, first.scale) == ("calibrating", 1.0)
    after = compute_ess_lr(*_two(7.0), config=product)
    assert after.calibrated_ratio == pytest.approx(0.8)
    assert after.scale == pytest.approx(math.sqrt(0.64 / 0.8), rel=1e-12)
    ess_patch.arm(after)
    calibration.restart()
    assert compute_ess_lr(*_two(7.0), config=product).status == "calibrating"
    assert ess_patch.armed() is after  # restart() forgets the calibration only


def test_base_ratio_is_relative_to_the_calibrated_rho_and_rule_and_floor_hold():
    config = EssLrConfig(calibrate_rollouts=1, base_ratio=0.5, rule="linear", floor=0.3)
    first = compute_ess_lr(*_two(3.0), config=config)
    assert (first.scale, first.status) == (1.0, "calibrating")
    # base = 0.5 x 0.8 = 0.4: rho 0.64 / 0.4 > 1 -> 1; a far-off rollout -> the floor
    assert compute_ess_lr(*_two(7.0), config=config).scale == 1.0
    lp, rlp, masks = _two(1e6)  # rho ~ 0.5: 0.5 / 0.4 > 1 as well
    assert compute_ess_lr(lp, rlp, masks, config=config).scale == 1.0
    many = [torch.tensor([x], dtype=torch.float64) for x in (0.0, 20.0, 0.0, 0.0)]
    zeros, ones = [torch.zeros(1, dtype=torch.float64)] * 4, [torch.ones(1)] * 4
    far = compute_ess_lr(many, zeros, ones, config=config)  # rho ~ 1/4: 0.25 / 0.4 linear
    assert far.scale == pytest.approx(max(0.3, far.rho / 0.4), rel=1e-12)
    assert far.scale == pytest.approx(0.625, rel=1e-6)


def test_unmeasured_and_nonfinite_rollouts_are_not_counted():
    config = EssLrConfig(calibrate_rollouts=1, nonfinite="floor", floor=0.2)
    empty = compute_ess_lr([torch.zeros(2)], [torch.zeros(2)], [torch.zeros(2)], config=config)
    assert (empty.status, empty.scale) == ("no_valid", 1.0)
    nan = compute_ess_lr(
        [torch.tensor([math.nan])], [torch.zeros(1)], [torch.ones(1)], config=config
    )
    assert (nan.status, nan.scale) == ("nonfinite", 0.2)  # fails closed, even while calibrating
    assert STATE.calibration == (0.0, 0.0)
    assert compute_ess_lr(*_two(3.0), config=config).status == "calibrating"
    assert compute_ess_lr(*_two(7.0), config=config).scale == pytest.approx(math.sqrt(0.8))


def test_off_by_default_and_reset_starts_a_new_calibration():
    assert EssLrConfig().calibrate_rollouts == 0
    compute_ess_lr(*_two(3.0), config=EssLrConfig(weight_mode="product"))
    assert STATE.calibration == (0.0, 0.0)  # off: nothing counted
    config = EssLrConfig(calibrate_rollouts=1)
    compute_ess_lr(*_two(3.0), config=config)
    assert STATE.calibration == (1.0, pytest.approx(0.8))
    reset()
    assert compute_ess_lr(*_two(7.0), config=config).status == "calibrating"


@pytest.mark.parametrize("bad", [-1, 2.5, "x", True, "", None, 10**7])
def test_bad_calibration_values_are_rejected_by_name(bad):
    with pytest.raises(ValueError, match="calibrate_rollouts"):
        EssLrConfig(calibrate_rollouts=bad)


def test_env_and_option_reach_the_field_and_bad_ones_say_what_to_do(monkeypatch, capsys):
    for f in ("FLOOR", "WEIGHT_MODE", "BASE_RATIO", "CALIBRATE_ROLLOUTS"):
        monkeypatch.delenv("ESS_LR_" + f, raising=False)
    assert EssLrConfig.from_env({"ESS_LR_CALIBRATE_ROLLOUTS": "4"}).calibrate_rollouts == 4
    with pytest.raises(ValueError, match=r"ESS_LR_CALIBRATE_ROLLOUTS='-2'.*integer >= 0"):
        EssLrConfig.from_env({"ESS_LR_CALIBRATE_ROLLOUTS": "-2"})
    parser = add_ess_arguments(argparse.ArgumentParser(prog="train.py"))
    args = parser.parse_args(["--use-ess-lr", "--ess-lr-calibrate-rollouts", "8"])
    assert config_from_args(args).calibrate_rollouts == 8
    with pytest.raises(SystemExit):
        parser.parse_args(["--ess-lr-calibrate-rollouts", "1.5"])
    assert "--ess-lr-calibrate-rollouts" in capsys.readouterr().err
    # a rejected setting changes nothing: the calibration in progress is kept
    compute_ess_lr(*_two(3.0), config=EssLrConfig(calibrate_rollouts=3))
    before = STATE.calibration
    with pytest.raises(ValueError):
        EssLrConfig(calibrate_rollouts=-1)
    assert STATE.calibration == before


# --- a real megatron-core optimizer -----------------------------------------------------------


@pytest.mark.usefixtures("world")
def test_megatron_applied_lr_is_scheduled_times_the_calibrated_scale():
    pytest.importorskip("megatron.core")
    from megatron_cpu import batch, build_megatron_optimizer, forward_backward, param_triples

    setup = build_megatron_optimizer("fp32", optimizer="sgd")
    ess_patch.install("megatron")
    config = EssLrConfig(weight_mode="product", calibrate_rollouts=2)
    expected = [1.0, 1.0, math.sqrt(0.8 / 0.9), math.sqrt(0.64 / 0.9)]
    try:
        for step, (a, scale) in enumerate(zip((1.0, 3.0, 3.0, 7.0), expected, strict=True)):
            ess_patch.arm(compute_ess_lr(*_two(a), config=config))
            x, y = batch(0, step)
            forward_backward(setup, x, y)
            before = [
                (g, p.detach().clone(), g["lr"]) for g, p, _ in param_triples(setup.optimizer)
            ]
            setup.optimizer.step()
            for (group, p0, lr), (_, p1, _) in zip(before, param_triples(setup.optimizer)):
                assert group["lr"] == lr  # the scheduler's LR, restored
                assert torch.equal(p1, p0.add(p1.grad, alpha=-(lr * scale))), (step, scale)
            setup.scheduler.step(increment=1)
    finally:
        ess_patch.uninstall()


# --- gloo ranks: every rank the same calibrated ratio ------------------------------------------

K = 2
SEEDS = (11, 12, 13, 14, 15)


def _rollout(seed: int, lay):
    samples = dp_shard(make_batch(seed, num=8), lay.dp_rank, lay.dp_size)
    lp, rlp, mask = cp_local(samples, lay.cp_rank, lay.cp_size)
    if lay.pp_rank != lay.pp_size - 1:
        return None, None, mask
    return lp, rlp, mask


def rank_calibration(restarted: int, restart_before: int):
    import logging

    lay = layout()
    config = EssLrConfig(calibrate_rollouts=K)
    groups = {"cp_group": lay.cp_group, "dp_group": lay.dp_group, "pp_group": lay.pp_group}
    out = []
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("ess_patch.calibration")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    for i, seed in enumerate(SEEDS):
        if i == restart_before and lay.rank == restarted:
            reset()  # this rank restarted: it lost its calibration
        r = compute_ess_lr(*_rollout(seed, lay), config=config, **groups)
        out.append((r.status, r.scale, r.rho, r.calibrated_ratio))
    return {"results": out, "lines": lines, "held": STATE.calibration}


def _expected():
    rhos, out = [], []
    for seed in SEEDS:
        b = make_batch(seed, num=8)
        rho = reference_ess([s["lp"] for s in b], [s["rlp"] for s in b], [s["mask"] for s in b])[
            "rho"
        ]
        rhos.append(rho)
    base = sum(rhos[:K]) / K
    for i, rho in enumerate(rhos):
        scale = 1.0 if i < K else min(1.0, max(0.1, math.sqrt(rho / base)))
        out.append((scale, rho, 0.0 if i < K else base))
    return out


@pytest.mark.dist
@pytest.mark.parametrize(("restarted", "restart_before"), [(-1, 0), (5, 1), (6, 3)], ids=str)
def test_every_rank_gets_the_same_calibrated_ratio(tmp_path, restarted, restart_before):
    """DP2 x CP2 x PP2 (ranks 4-7 are the last stage): no restart, a last-stage rank that
    restarts mid-calibration (5) or after it (6): it catches up with its peers."""
    results = run_ranks(
        rank_calibration,
        dp=2,
        cp=2,
        pp=2,
        args=(restarted, restart_before),
        tmp_path=tmp_path,
        timeout=180,
    )
    # the INFO lines on one rank only, the last (Megatron's print_rank_last)
    assert [bool(r["lines"]) for r in results] == [False] * 7 + [True], results
    assert any("base ratio calibrated" in line for line in results[-1]["lines"])
    # every stage holds the calibration (a checkpoint of any rank keeps it)
    assert all(r["held"] == results[-1]["held"] != (0.0, 0.0) for r in results)
    results = [r["results"] for r in results]
    assert all(r == results[0] for r in results), results  # bitwise, on every rank
    expected = _expected()
    assert [s for s, *_ in results[0]] == ["calibrating"] * K + ["ok"] * (len(SEEDS) - K)
    got = [(scale, rho, ratio) for _, scale, rho, ratio in results[0]]
    for (scale, rho, ratio), (e_scale, e_rho, e_ratio) in zip(got, expected, strict=True):
        assert rho == pytest.approx(e_rho, rel=1e-9)
        assert ratio == pytest.approx(e_ratio, rel=1e-9)
        assert scale == pytest.approx(e_scale, rel=1e-9)
    assert min(s for s, *_ in got[K:]) < 0.999  # the calibrated scale really brakes somewhere


# --- on-policy samples only (policy versions) --------------------------------------------------


def _weights(*ws: float):
    """One-token trajectories with weights ``ws`` (inputs for compute_ess_lr)."""
    lp = [torch.tensor([math.log(w)], dtype=torch.float64) for w in ws]
    n = len(ws)
    return lp, [torch.zeros(1, dtype=torch.float64)] * n, [torch.ones(1)] * n


def _rho(*ws: float) -> float:
    """float64 by hand: (sum w)^2 / (n sum w^2)."""
    return sum(ws) ** 2 / (len(ws) * sum(w * w for w in ws))


def test_on_policy_by_version_int_str_multi_turn_and_unknown():
    from ess_patch.policy_version import on_policy

    versions = [3, "3", ["3", 3], ["3", "2"], 2, None, [], " 3"]
    assert on_policy(versions, "3") == [True, True, True, False, False, False, False, True]
    assert on_policy(versions, 2) == [False, False, False, False, True, False, False, False]
    for bad in ([3.0], [True], "33"):
        with pytest.raises(TypeError, match=r"policy version|sequence"):
            on_policy(bad, 3)


def test_only_the_on_policy_trajectories_of_a_rollout_are_counted():
    """Calibration counts the rho of each rollout's on-policy subset (hand-computed), not the
    whole rollout's; the scale of every rollout is still over all of its trajectories."""
    config = EssLrConfig(weight_mode="product", calibrate_rollouts=2)
    # rollout 0: all four generated by version 7, the weights being trained
    r0 = compute_ess_lr(
        *_weights(1, 3, 1, 3), config=config, policy_versions=[7, 7, "7", 7], current_version=7
    )
    # rollout 1 (trainer now at version 8): two trajectories of version 8, two stale ones
    r1 = compute_ess_lr(
        *_weights(1, 7, 9, 9),
        config=config,
        policy_versions=[8, 8, 7, [7, 8]],
        current_version=8,
    )
    assert [r0.status, r1.status] == ["calibrating", "calibrating"]
    assert r1.rho == pytest.approx(_rho(1, 7, 9, 9), rel=1e-12)  # the result: every trajectory
    counted = (_rho(1, 3, 1, 3) + _rho(1, 7)) / 2  # 0.8 and 0.64: the on-policy subsets
    assert STATE.calibration == (2.0, pytest.approx(2 * counted, rel=1e-12))
    after = compute_ess_lr(*_weights(1, 1, 1, 7), config=config)
    assert after.calibrated_ratio == pytest.approx(counted, rel=1e-12)
    assert after.scale == pytest.approx(math.sqrt(_rho(1, 1, 1, 7) / counted), rel=1e-12)
    # without the versions the stale trajectories would have counted: another ratio
    reset()
    compute_ess_lr(*_weights(1, 3, 1, 3), config=config)
    compute_ess_lr(*_weights(1, 7, 9, 9), config=config)
    unfiltered = (_rho(1, 3, 1, 3) + _rho(1, 7, 9, 9)) / 2
    assert compute_ess_lr(*_weights(1, 1), config=config).calibrated_ratio == pytest.approx(
        unfiltered, rel=1e-12
    )
    assert unfiltered != pytest.approx(counted, rel=1e-3)


def test_a_stale_rollout_while_calibrating_is_not_counted_and_is_braked_with_a_warning(caplog):
    """Too few on-policy trajectories (under a quarter, or under 2): not counted, never trained
    unbraked: scaled by the ratio counted so far (base_ratio before any), warned once."""
    config = EssLrConfig(weight_mode="product", calibrate_rollouts=3)
    stale = {"policy_versions": [0, 0, 1, 0], "current_version": 1}  # 1 of 4: under 2
    with caplog.at_level("WARNING", logger="ess_patch.calibration"):
        first = compute_ess_lr(*_weights(1, 3, 1, 3), config=config, **stale)
        assert (first.status, first.calibrated_ratio) == ("ok", 0.0)
        assert first.scale == pytest.approx(math.sqrt(0.8), rel=1e-12)  # base_ratio 1
        assert STATE.calibration == (0.0, 0.0)
        on = compute_ess_lr(
            *_weights(1, 7, 1, 7), config=config, policy_versions=[1] * 4, current_version=1
        )
        assert on.status == "calibrating" and STATE.calibration == (1.0, pytest.approx(0.64))
        later = compute_ess_lr(
            *_weights(1, 3), config=config, **{**stale, "policy_versions": [0, 1]}
        )
    assert (later.status, later.calibrated_ratio) == ("ok", pytest.approx(0.64))
    assert later.scale == pytest.approx(min(1.0, math.sqrt(0.8 / 0.64)), rel=1e-12)
    assert STATE.calibration == (1.0, pytest.approx(0.64))  # still 1 of 3 counted
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "not counted" in warnings[0], warnings


def test_bad_versions_are_refused_by_name_and_change_nothing():
    config = EssLrConfig(calibrate_rollouts=2)
    compute_ess_lr(*_two(3.0), config=config)
    before = STATE.calibration
    with pytest.raises(TypeError, match="policy_versions was given without current_version"):
        compute_ess_lr(*_two(3.0), config=config, policy_versions=[1, 1])
    with pytest.raises(TypeError, match="current_version was given without policy_versions"):
        compute_ess_lr(*_two(3.0), config=config, current_version=1)
    with pytest.raises(ValueError, match="policy_versions has 3 entries for 2 trajectories"):
        compute_ess_lr(*_two(3.0), config=config, policy_versions=[1, 1, 1], current_version=1)
    with pytest.raises(TypeError, match="must be an int or a str"):
        compute_ess_lr(*_two(3.0), config=config, policy_versions=[1.0, 1], current_version=1)
    assert STATE.calibration == before


def test_shadow_mode_counts_a_rollout_once_whatever_its_steps():
    """Shadow mode measured inside the loss with granularity 'rollout' and two optimizer steps
    per rollout: calibration counts the rollout (its first step), not each step."""
    from ess_patch.estimator import trajectory_stats
    from ess_patch.ledger import LedgerRun, add, begin_step, start

    config = EssLrConfig(weight_mode="product", calibrate_rollouts=2, shadow=True)
    optimizer = object()
    for a in (3.0, 7.0):  # one rollout, two steps (rho 0.8, then 0.64)
        if a == 3.0:
            start(LedgerRun(framework="slime", reason="x", config=config, shadow=True))
        add(trajectory_stats(*_two(a)))
        assert begin_step(optimizer) is None  # shadow: nothing applied
        assert STATE.shadow.status == "calibrating"
    assert STATE.calibration == (1.0, pytest.approx(0.8))  # one rollout, not two steps
    start(LedgerRun(framework="slime", reason="x", config=config, shadow=True))
    add(trajectory_stats(*_two(1.0)))
    begin_step(optimizer)
    assert STATE.calibration == (2.0, pytest.approx(1.8))


@pytest.mark.parametrize(("total", "on", "counted"), [(8, 2, True), (12, 2, False), (12, 3, True)])
def test_a_rollout_counts_from_a_quarter_of_its_trajectories_on_policy(total, on, counted):
    config = EssLrConfig(weight_mode="product", calibrate_rollouts=2)
    weights = [1.0, 3.0, 7.0] * (total // 3) + [1.0] * (total % 3)
    versions = [1] * on + [0] * (total - on)
    r = compute_ess_lr(
        *_weights(*weights), config=config, policy_versions=versions, current_version=1
    )
    assert r.status == ("calibrating" if counted else "ok")
    expected = (1.0, pytest.approx(_rho(*weights[:on]), rel=1e-12)) if counted else (0.0, 0.0)
    assert STATE.calibration == expected
