"""The per-step ledger: ESS measured inside the policy loss, decided at the optimizer step.

Single process (the CP/DP/PP path is the frameworks' own: tests/frameworks/test_ledger_matrix.py
runs it through the real slime and miles train paths, DP2 and CP2 included).
"""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch
from reference import reference_ess

from ess_patch import EssLrConfig, compute_ess_lr
from ess_patch.compute import compute_ess_lr_from_stats
from ess_patch.estimator import trajectory_stats
from ess_patch.integrations.loss_ledger import steps_per_rollout_refusal
from ess_patch.ledger import LedgerRun, add, start
from ess_patch.lr import step_wrapper
from ess_patch.state import STATE, StepCountError, reset, set_role

CONFIG = EssLrConfig(weight_mode="product")


def _start(config=CONFIG, reason="x", *, shadow=False, framework="slime"):
    """A rollout measured inside the loss, on one rank."""
    start(LedgerRun(framework=framework, reason=reason, config=config, shadow=shadow))


@pytest.fixture(autouse=True)
def _clean():
    reset()
    yield
    reset()


def _samples(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    lens = [3 + (i * 7) % 9 for i in range(n)]
    lp = [torch.randn(k, generator=g) * 0.3 - 2 for k in lens]
    rlp = [x + 0.4 * torch.randn(x.shape, generator=g) for x in lp]
    masks = [(torch.rand(k, generator=g) > 0.2).int() for k in lens]
    masks[1].zero_()  # a trajectory with no masked token: left out
    return lp, rlp, masks


def test_stats_entry_point_equals_the_reference_and_compute_ess_lr():
    lp, rlp, masks = _samples(0, 9)
    # two loss calls' tables, as the ledger holds them
    table = torch.cat(
        [trajectory_stats(lp[:4], rlp[:4], masks[:4]), trajectory_stats(lp[4:], rlp[4:], masks[4:])]
    )
    got = compute_ess_lr_from_stats(table, config=CONFIG)
    ref = reference_ess(lp, rlp, masks, mode="product")
    assert got.scale == pytest.approx(ref["scale"], rel=1e-12)
    assert got.rho == pytest.approx(ref["rho"], rel=1e-12)
    assert got.num_trajectories == ref["num_trajectories"] == 8 and got.num_empty == 1
    assert got == compute_ess_lr(lp, rlp, masks, config=CONFIG)


@pytest.mark.parametrize("bad", [torch.zeros(4), torch.zeros((2, 4)), None])
def test_stats_entry_point_names_a_bad_table(bad):
    with pytest.raises(ValueError, match=r"\[B, 3\]"):
        compute_ess_lr_from_stats(bad)


class _Optimizer:
    """What the step wrapper touches: ``param_groups`` (two LRs)."""

    def __init__(self):
        self.param_groups = [{"lr": 0.1}, {"lr": 0.05}]


def _step(optimizer):
    """One wrapped step; returns the LRs the update saw."""
    seen = []
    step_wrapper(lambda: seen.append([g["lr"] for g in optimizer.param_groups]), optimizer, (), {})
    return seen


def test_each_step_applies_its_own_ledger_once_and_restores_the_lr():
    _start(EssLrConfig(weight_mode="product", granularity="step"))
    optimizer = _Optimizer()
    for seed in (1, 2):
        lp, rlp, masks = _samples(seed, 6)
        add(trajectory_stats(lp, rlp, masks))
        ref = reference_ess(lp, rlp, masks, mode="product")
        assert ref["scale"] < 0.9
        [lrs] = _step(optimizer)
        assert lrs == pytest.approx([0.1 * ref["scale"], 0.05 * ref["scale"]], rel=1e-12)
        assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.05]
        assert STATE.armed.scale == pytest.approx(ref["scale"], rel=1e-12)  # what is logged
        assert STATE.ledger == []  # emptied for the next step


def test_a_second_step_with_granularity_rollout_is_refused_before_any_update():
    _start(reason="--keep-old-actor ...")
    optimizer = _Optimizer()
    lp, rlp, masks = _samples(3, 4)
    add(trajectory_stats(lp, rlp, masks))
    assert len(_step(optimizer)) == 1
    add(trajectory_stats(lp, rlp, masks))
    seen = []
    with pytest.raises(StepCountError, match="--ess-lr-granularity step"):
        step_wrapper(lambda: seen.append(1), optimizer, (), {})
    assert seen == [] and [g["lr"] for g in optimizer.param_groups] == [0.1, 0.05]


def test_a_step_without_any_policy_loss_call_fails_instead_of_logging_a_no_op():
    _start(framework="miles")
    seen = []
    with pytest.raises(RuntimeError, match="no policy-loss call"):
        step_wrapper(lambda: seen.append(1), _Optimizer(), (), {})
    assert seen == [] and STATE.armed is None


def test_the_critic_is_never_measured_or_scaled():
    # the critic's process takes its role in train_critic (rl_hooks.critic_wrapper)
    _start()
    set_role("critic")
    lp, rlp, masks = _samples(4, 4)
    add(trajectory_stats(lp, rlp, masks))
    [lrs] = _step(_Optimizer())
    assert lrs == [0.1, 0.05] and STATE.armed is None and STATE.shadow is None


def test_parse_time_refusals_name_the_flag():
    reason = "--keep-old-actor computes log_probs with the old actor's weights"
    two_steps = Namespace(num_steps_per_rollout=2)
    assert "--ess-lr-granularity step" in steps_per_rollout_refusal(two_steps, reason)
    derived = Namespace(rollout_batch_size=4, n_samples_per_prompt=2, global_batch_size=4)
    assert "2 optimizer steps" in steps_per_rollout_refusal(derived, reason)
    assert steps_per_rollout_refusal(Namespace(num_steps_per_rollout=1), reason) is None
    step = Namespace(num_steps_per_rollout=2, ess_lr_granularity="step")
    assert steps_per_rollout_refusal(step, reason) is None
    assert steps_per_rollout_refusal(two_steps, None) is None  # measured at the hook
    allgather = Namespace(num_steps_per_rollout=1, allgather_cp=True)
    assert "drop --allgather-cp" in steps_per_rollout_refusal(allgather, reason)


def test_shadow_mode_keeps_each_steps_result_and_changes_no_lr():
    _start(shadow=True)
    lp, rlp, masks = _samples(5, 5)
    add(trajectory_stats(lp, rlp, masks))
    [lrs] = _step(_Optimizer())
    ref = reference_ess(lp, rlp, masks, mode="product")
    assert lrs == [0.1, 0.05] and STATE.armed is None
    assert ref["scale"] < 0.9
    assert STATE.shadow.scale == pytest.approx(ref["scale"], rel=1e-12)


def test_shadow_mode_with_several_steps_is_refused_naming_shadow_and_never_stops_a_run():
    reason = "--keep-old-actor computes log_probs with the old actor's weights"
    shadow = Namespace(num_steps_per_rollout=2, ess_lr_shadow=True)
    assert "drop --ess-lr-shadow" in steps_per_rollout_refusal(shadow, reason)
    # step count unknown at parse time: the second step logs its own result, changes no LR
    _start(shadow=True)
    optimizer = _Optimizer()
    for seed in (6, 7):
        lp, rlp, masks = _samples(seed, 4)
        add(trajectory_stats(lp, rlp, masks))
        [lrs] = _step(optimizer)
        ref = reference_ess(lp, rlp, masks, mode="product")
        assert lrs == [0.1, 0.05] and STATE.armed is None
        assert STATE.shadow.scale == pytest.approx(ref["scale"], rel=1e-12)
