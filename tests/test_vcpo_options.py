"""VCPO's semantics as options, in one process: ``granularity`` and ``weight_clip``.

- config: the new fields, their errors, ``ESS_LR_*``, and the fingerprint that makes ranks with
  different settings raise;
- ``weight_clip``: hand-computed values and the float64 reference;
- ``compute_ess_lr_steps``: one result per step, each the reference over that step alone;
- ``arm_steps``: real megatron-core optimizers (ChainedOptimizer) and a plain torch optimizer
  take one result per real update, each update scaled by its own step's scale, exactly once;
- the miles/slime hook and flags in step mode, and the miles/slime step splits.
"""

from __future__ import annotations

import logging
import math
from argparse import Namespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_ess, reference_steps

import ess_patch
from ess_patch import EssLrConfig, EssLrResult, compute_ess_lr, compute_ess_lr_steps
from ess_patch.config import describe_fingerprint
from ess_patch.integrations.rl_hooks import (
    Framework,
    Groups,
    add_ess_arguments,
    advantage_wrapper,
    ess_metrics,
    validate,
)
from ess_patch.integrations.steps import miles_steps, schedule_steps, slime_step_samples

# --- config ---------------------------------------------------------------------------------------


def test_defaults_are_the_seeds_semantics():
    c = EssLrConfig()
    assert (c.granularity, c.weight_clip) == ("rollout", None)


def test_unknown_granularity_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"granularity='x'.*valid values: rollout, step"):
        EssLrConfig(granularity="x")


@pytest.mark.parametrize(
    ("clip", "message"),
    [
        (0, "must be a finite number > 0"),
        (0.0, "must be a finite number > 0"),
        (-1, "must be a finite number > 0"),
        (float("inf"), "must be a finite number > 0"),
        (float("nan"), "weight_clip is NaN"),
        ("a", "weight_clip='a' is not a number"),
        (True, "must be a number, not a bool"),
    ],
)
def test_bad_weight_clip_is_refused_naming_the_field(clip, message):
    with pytest.raises(ValueError, match=message):
        EssLrConfig(weight_clip=clip)


def test_weight_clip_accepts_numbers_and_none():
    assert EssLrConfig(weight_clip=2).weight_clip == 2.0
    assert EssLrConfig(weight_clip="0.5").weight_clip == 0.5
    assert EssLrConfig(weight_clip=None).weight_clip is None


def test_from_env_reads_granularity_and_weight_clip():
    env = {"ESS_LR_GRANULARITY": "step", "ESS_LR_WEIGHT_CLIP": "2.5"}
    c = EssLrConfig.from_env(env)
    assert (c.granularity, c.weight_clip) == ("step", 2.5)
    assert EssLrConfig.from_env({"ESS_LR_WEIGHT_CLIP": "none"}).weight_clip is None
    with pytest.raises(ValueError, match="weight_clip='a' is not a number"):
        EssLrConfig.from_env({"ESS_LR_WEIGHT_CLIP": "a"})
    with pytest.raises(ValueError, match="granularity='steps'"):
        EssLrConfig.from_env({"ESS_LR_GRANULARITY": "steps"})


@pytest.mark.parametrize(
    ("a", "b", "field"),
    [
        ({}, {"weight_clip": 2.0}, "weight_clip"),
        ({"weight_clip": 2.0}, {"weight_clip": 3.0}, "weight_clip"),
        ({}, {"granularity": "step"}, "granularity"),
    ],
)
def test_fingerprint_tells_the_new_fields_apart(a, b, field):
    fa, fb = EssLrConfig(**a), EssLrConfig(**b)
    assert fa.fingerprint() != fb.fingerprint()
    assert describe_fingerprint(fa.fingerprint())[field] == getattr(fa, field)
    assert describe_fingerprint(fb.fingerprint())[field] == getattr(fb, field)
    # ranks with these two settings all raise: tests/test_steps_dist.py


# --- weight_clip ----------------------------------------------------------------------------------


def _batch(log_ratios):
    """One token per trajectory with train - rollout = the given log-ratio."""
    lp = [torch.tensor([float(x)], dtype=torch.float64) for x in log_ratios]
    rlp = [torch.zeros(1, dtype=torch.float64) for _ in log_ratios]
    return lp, rlp, [torch.ones(1) for _ in log_ratios]


def test_weight_clip_hand_computed():
    # weights 1 and 5, clipped at 2: w = (1, 2), ESS = 9 / 5, rho = 0.9
    clipped = compute_ess_lr(*_batch([0.0, math.log(5.0)]), config=EssLrConfig(weight_clip=2.0))
    assert clipped.ess == pytest.approx(9 / 5, rel=1e-12)
    assert clipped.rho == pytest.approx(0.9, rel=1e-12)
    assert clipped.scale == pytest.approx(math.sqrt(0.9), rel=1e-12)
    plain = compute_ess_lr(*_batch([0.0, math.log(5.0)]))
    assert plain.rho == pytest.approx(36 / 52, rel=1e-12)  # unclipped: the seed's value
    # a clip above every weight changes nothing; one below every weight makes them equal
    above = compute_ess_lr(*_batch([0.0, math.log(5.0)]), config=EssLrConfig(weight_clip=6.0))
    assert above == plain
    below = compute_ess_lr(*_batch([0.0, math.log(5.0)]), config=EssLrConfig(weight_clip=0.5))
    assert (below.rho, below.scale) == (1.0, 1.0)


def test_weight_clip_applies_to_the_true_weight_not_the_shifted_one():
    # product mode, m = (1000, 0, 0): exp(1000) overflows, clipped at 2 it is w = (2, 1, 1)
    config = EssLrConfig(weight_mode="product", weight_clip=2.0)
    result = compute_ess_lr(*_batch([1000.0, 0.0, 0.0]), config=config)
    assert result.ess == pytest.approx(16 / 6, rel=1e-12)
    assert result.rho == pytest.approx(16 / 18, rel=1e-12)


def test_weight_clip_follows_the_weight_mode():
    # two tokens of log 2 each: product w = 4 -> clipped to 3; geometric w = 2 (under the clip)
    lp = [torch.tensor([math.log(2.0)] * 2, dtype=torch.float64), torch.zeros(2)]
    rlp = [torch.zeros(2), torch.zeros(2)]
    masks = [torch.ones(2), torch.ones(2)]
    product = compute_ess_lr(
        lp, rlp, masks, config=EssLrConfig(weight_mode="product", weight_clip=3.0)
    )
    assert product.ess == pytest.approx(16 / 10, rel=1e-12)  # w = (3, 1)
    assert product.rho == pytest.approx(0.8, rel=1e-12)
    geometric = compute_ess_lr(lp, rlp, masks, config=EssLrConfig(weight_clip=3.0))
    assert geometric.ess == pytest.approx(9 / 5, rel=1e-12)  # w = (2, 1)
    assert geometric.rho == pytest.approx(0.9, rel=1e-12)


@pytest.mark.parametrize(
    ("mode", "clip"),  # clips inside each mode's range of weights, so that they act
    [("geometric", 0.9), ("geometric", 1.05), ("product", 0.8), ("product", 1.3), ("product", 4.0)],
)
def test_weight_clip_agrees_with_the_float64_reference(mode, clip):
    lp, rlp, masks = _random_batch(torch.Generator().manual_seed(7), 40)
    config = EssLrConfig(weight_mode=mode, weight_clip=clip)
    got = compute_ess_lr(lp, rlp, masks, config=config)
    ref = reference_ess(lp, rlp, masks, mode=mode, weight_clip=clip, shift=mode == "product")
    for key in ("rho", "ess", "scale"):
        assert getattr(got, key) == pytest.approx(ref[key], rel=1e-9), key
    unclipped = reference_ess(lp, rlp, masks, mode=mode, shift=mode == "product")
    assert ref["rho"] != pytest.approx(unclipped["rho"], rel=1e-6)  # the clip mattered


# --- compute_ess_lr_steps -------------------------------------------------------------------------


def _random_batch(gen, n, *, scale=0.3, max_len=20):
    lp, rlp, masks = [], [], []
    for i in range(n):
        length = int(torch.randint(1, max_len, (1,), generator=gen))
        base = -torch.rand(length, generator=gen, dtype=torch.float64) * 3
        lp.append((base + torch.randn(length, generator=gen, dtype=torch.float64) * scale).float())
        rlp.append(base.float())
        mask = (torch.rand(length, generator=gen) > 0.3).to(torch.int64)
        if i % 7 == 3:
            mask.zero_()
        masks.append(mask)
    return lp, rlp, masks


STEPS = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]]


@pytest.mark.parametrize("mode", ["geometric", "product"])
def test_each_step_is_the_reference_over_its_own_trajectories(mode):
    lp, rlp, masks = _random_batch(torch.Generator().manual_seed(3), 20)  # 18, 19: no step
    config = EssLrConfig(weight_mode=mode, granularity="step")
    results = compute_ess_lr_steps(lp, rlp, masks, STEPS, config=config)
    refs = reference_steps(lp, rlp, masks, STEPS, mode=mode, shift=True)
    assert len(results) == 3
    for got, ref in zip(results, refs, strict=True):
        assert got.num_trajectories == ref["num_trajectories"]
        for key in ("rho", "ess", "scale"):
            assert getattr(got, key) == pytest.approx(ref[key], rel=1e-9), key
    assert len({r.scale for r in results}) == 3  # three different steps, three scales
    # exactly what compute_ess_lr gives on each step's samples alone
    for got, indices in zip(results, STEPS, strict=True):
        pick = [[seq[i] for i in indices] for seq in (lp, rlp, masks)]
        assert got == compute_ess_lr(*pick, config=config)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    assignment=st.lists(st.integers(-1, 3), min_size=1, max_size=24),
    mode=st.sampled_from(["geometric", "product"]),
    clip=st.sampled_from([None, 0.9, 2.0]),
)
def test_property_each_step_is_compute_ess_lr_on_its_samples(seed, assignment, mode, clip):
    """Any split (trajectory i in step assignment[i], -1 = none): step s is exactly
    compute_ess_lr on step s's trajectories, in their order."""
    lp, rlp, masks = _random_batch(torch.Generator().manual_seed(seed), len(assignment))
    steps = [[i for i, a in enumerate(assignment) if a == s] for s in range(4)]
    config = EssLrConfig(weight_mode=mode, weight_clip=clip)
    results = compute_ess_lr_steps(lp, rlp, masks, steps, config=config)
    for got, indices in zip(results, steps, strict=True):
        pick = [[seq[i] for i in indices] for seq in (lp, rlp, masks)]
        assert got == compute_ess_lr(*pick, config=config)


def test_steps_take_numpy_and_torch_integers():
    np = pytest.importorskip("numpy")
    batch = _batch([0.0, 2.0, 1.0])
    plain = compute_ess_lr_steps(*batch, [[0, 1], [2]])
    assert compute_ess_lr_steps(*batch, [[np.int64(0), torch.tensor(1)], (np.int32(2),)]) == plain


def test_a_step_without_valid_trajectories_is_a_noop_and_steps_may_be_a_callable():
    lp, rlp, masks = _batch([0.0, 2.0, 1.0])
    masks[2] = torch.zeros(1)
    results = compute_ess_lr_steps(lp, rlp, masks, lambda: [[0, 1], [2], []])
    assert results[0].status == "ok" and results[0].scale < 1
    assert results[1] == EssLrResult.noop("no_valid", num_empty=1)
    assert results[2] == EssLrResult.noop("no_valid")
    assert compute_ess_lr_steps(lp, rlp, masks, []) == []


def test_a_nonfinite_log_prob_names_its_sample_index_in_the_rollout():
    lp, rlp, masks = _batch([0.0, 1.0, 2.0, 0.5])
    lp[2] = torch.tensor([float("nan")], dtype=torch.float64)
    with pytest.raises(ess_patch.NonFiniteLogProbError, match="sample index 2 of data-parallel"):
        compute_ess_lr_steps(lp, rlp, masks, [[0, 1], [3, 2]])
    floor = compute_ess_lr_steps(
        lp, rlp, masks, [[0, 1], [3, 2]], config=EssLrConfig(nonfinite="floor")
    )
    assert floor[0].status == "ok" and floor[1].status == "nonfinite"
    assert floor[1].scale == 0.1


@pytest.mark.parametrize(
    ("steps", "error", "message"),
    [
        ([[0, 4]], ValueError, r"steps\[0\] holds trajectory index 4, but this rank has 3"),
        ([[0], [-1]], ValueError, r"steps\[1\] holds trajectory index -1"),
        ([[0], [1.0]], TypeError, r"steps\[1\] holds 1.0; trajectory indices are ints"),
        ([[True]], TypeError, r"steps\[0\] holds True; trajectory indices are ints"),
        ([[0], 1], TypeError, r"steps\[1\] is a int"),
        (torch.tensor([[0]]), TypeError, "steps must be a sequence"),
        (lambda: 1 / 0, ZeroDivisionError, "division by zero"),
    ],
)
def test_bad_steps_raise_a_clear_error(steps, error, message):
    with pytest.raises(error, match=message):
        compute_ess_lr_steps(*_batch([0.0, 1.0, 2.0]), steps)


# --- arm_steps on real optimizers -----------------------------------------------------------------

SCALES = (0.5, 0.25, 0.8)


def _results(scales=SCALES):
    return [EssLrResult(scale=s, rho=s * s, ess=1.0, num_trajectories=4) for s in scales]


@pytest.mark.usefixtures("world", "clean_ess")
@pytest.mark.parametrize("kind", ["fp32", "multi_bf16"])
def test_each_megatron_update_uses_its_own_steps_scale_exactly_once(kind):
    from megatron_cpu import batch, build_megatron_optimizer, forward_backward, param_triples

    setup = build_megatron_optimizer(kind, optimizer="sgd")
    ess_patch.install("megatron")
    ess_patch.arm_steps(_results())
    assert ess_patch.armed().scale == SCALES[0]  # before the first step: the first step's
    for step, scale in enumerate(SCALES):
        x, y = batch(0, step)
        forward_backward(setup, x, y)
        before = [(g["lr"], p.detach().clone()) for g, p, _ in param_triples(setup.optimizer)]
        setup.optimizer.step()
        for (lr, p0), (group, p1, _) in zip(before, param_triples(setup.optimizer), strict=True):
            assert group["lr"] == lr  # restored
            assert p1.grad is not None and p1.grad.abs().sum() > 0
            assert torch.equal(p1, p0.add(p1.grad, alpha=-(lr * scale))), (step, "not once")
        assert ess_patch.armed().scale == scale  # what a host logs after this step
        assert ess_patch.armed_steps() is not None
        setup.scheduler.step(increment=1)
    # a fourth step has no result: it raises before touching anything
    x, y = batch(0, 3)
    forward_backward(setup, x, y)
    params = [p.detach().clone() for _, p, _ in param_triples(setup.optimizer)]
    lrs = [g["lr"] for g in setup.optimizer.param_groups]
    with pytest.raises(ess_patch.StepCountError, match="optimizer step 4 of this rollout"):
        setup.optimizer.step()
    assert all(
        torch.equal(a, p)
        for a, (_, p, _) in zip(params, param_triples(setup.optimizer), strict=True)
    )
    assert [g["lr"] for g in setup.optimizer.param_groups] == lrs


@pytest.mark.usefixtures("world", "clean_ess")
def test_a_skipped_step_takes_its_own_result():
    from megatron_cpu import build_megatron_optimizer, train_steps

    setup = build_megatron_optimizer("bf16", optimizer="adam", loss_scale=1.0)
    ess_patch.install("megatron")
    ess_patch.arm_steps(_results())
    records = train_steps(setup, 2, poison_steps=(0,))
    assert records[0].update_successful is False  # (False, None, None): inf/nan grads
    assert ess_patch.armed().scale == SCALES[1]  # the second update used the second result
    assert ess_patch.state.STATE.step_index == 2


@pytest.mark.usefixtures("clean_ess")
def test_a_torch_optimizer_attached_takes_one_result_per_step(caplog):
    param = torch.nn.Parameter(torch.zeros(1))
    opt = ess_patch.attach(torch.optim.SGD([param], lr=1.0))
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ess_patch.attach(other)
    ess_patch.exclude(other)
    ess_patch.arm_steps([0.5, 0.25])
    for scale in (0.5, 0.25):
        before = param.detach().clone()
        param.grad = torch.ones(1)
        other.step()  # excluded: never scaled, takes no result
        opt.step()
        assert torch.equal(param.detach(), before - scale)
        assert opt.param_groups[0]["lr"] == 1.0
    with pytest.raises(ess_patch.StepCountError, match="2 were armed"):
        opt.step()
    # fewer steps than results: said when the next rollout arms
    ess_patch.arm_steps([0.5, 0.25, 0.125])
    opt.step()
    with caplog.at_level(logging.WARNING, logger="ess_patch"):
        ess_patch.arm(0.5)
    assert "had 3 per-step results but only 1 optimizer step(s) used them" in caplog.text
    assert ess_patch.armed_steps() is None and ess_patch.armed().scale == 0.5


@pytest.mark.usefixtures("clean_ess")
def test_arm_steps_checks_scales_and_disarm_and_reset_drop_them():
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        ess_patch.arm_steps([0.5, 1.5])
    assert ess_patch.armed() is None and ess_patch.armed_steps() is None
    ess_patch.arm_steps([0.5])
    ess_patch.disarm()
    assert ess_patch.armed() is None and ess_patch.armed_steps() is None
    assert ess_patch.arm_steps([]) == () and ess_patch.armed() is None
    ess_patch.arm_steps([0.5])
    ess_patch.state.reset()
    assert ess_patch.armed_steps() is None and ess_patch.state.STATE.step_index == 0


# --- the miles/slime hook and flags ---------------------------------------------------------------


def _split(args, data, dp_size):
    return [[0, 1], [2, 3]]


STEPPED = Framework(
    name="single",
    groups=lambda: Groups(None, 0, 1, None, None, True),
    no_input_reason=lambda args: None,
    unsupported_reason=lambda args: None,
    step_samples=_split,
)
NO_STEPS = Framework(
    name="nosteps",
    groups=lambda: Groups(None, 0, 1, None, None, True),
    no_input_reason=lambda args: None,
    unsupported_reason=lambda args: None,
)


def _parser():
    import argparse

    return add_ess_arguments(argparse.ArgumentParser())


def test_flags_parse_and_reach_the_config():
    from ess_patch.integrations.rl_hooks import config_from_args

    args = _parser().parse_args(
        ["--use-ess-lr", "--ess-lr-granularity", "step", "--ess-lr-weight-clip", "2"]
    )
    assert config_from_args(args) == EssLrConfig(granularity="step", weight_clip=2.0)
    assert config_from_args(_parser().parse_args(["--use-ess-lr"])) == EssLrConfig()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ess-lr-granularity", "x"], "EssLrConfig.granularity='x' is not a known value"),
        (["--ess-lr-weight-clip", "0"], "must be a finite number > 0"),
        (["--ess-lr-weight-clip", "-1"], "must be a finite number > 0"),
        (["--ess-lr-weight-clip", "nan"], "EssLrConfig.weight_clip is NaN"),
        (["--ess-lr-weight-clip", "a"], "EssLrConfig.weight_clip='a' is not a number"),
    ],
)
def test_bad_flags_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--use-ess-lr", *argv])
    assert message in capsys.readouterr().err


def test_step_is_refused_where_the_split_is_unknown_and_with_shadow(clean_ess):
    args = Namespace(use_ess_lr=True, ess_lr_granularity="step")
    with pytest.raises(ValueError, match=r"granularity 'step'.*not supported with nosteps"):
        validate(NO_STEPS, args)
    validate(STEPPED, args)
    shadow = Namespace(use_ess_lr=False, ess_lr_shadow=True, ess_lr_granularity="step")
    with pytest.raises(ValueError, match="--ess-lr-shadow with granularity 'step'"):
        validate(STEPPED, shadow)


def test_megatron_rl_refuses_step_granularity():
    from ess_patch.integrations.megatron_rl import MEGATRON_RL_FRAMEWORK

    args = Namespace(
        use_ess_lr=True, ess_lr_granularity="step", rl_inference_logprobs_is_correction=True
    )
    with pytest.raises(ValueError, match="not supported with megatron_rl"):
        validate(MEGATRON_RL_FRAMEWORK, args)


def test_the_hook_arms_one_result_per_step_and_logs_each_steps_own(clean_ess):
    lp, rlp, masks = _batch([0.0, 2.0, 0.1, 0.3])
    data = {"log_probs": lp, "rollout_log_probs": rlp, "loss_masks": masks}
    args = Namespace(use_ess_lr=True, ess_lr_granularity="step", ess_lr_weight_mode="product")
    hook = advantage_wrapper(STEPPED)
    out = hook(lambda args, rollout_data: "advantages", None, (args, data), {})
    assert out == "advantages"
    refs = reference_steps(lp, rlp, masks, [[0, 1], [2, 3]], mode="product")
    steps = ess_patch.armed_steps()
    assert len(steps) == 2
    for got, ref in zip(steps, refs, strict=True):
        assert got.scale == pytest.approx(ref["scale"], rel=1e-12)
    assert steps[0].scale < steps[1].scale < 1
    param = torch.nn.Parameter(torch.zeros(1))
    opt = ess_patch.attach(torch.optim.SGD([param], lr=1.0))
    logged = []
    for step in steps:
        param.grad = torch.ones(1)
        opt.step()
        logged.append(ess_metrics())
        assert logged[-1]["lr_scale"] == step.scale and logged[-1]["rho_ess"] == step.rho
    # the rollout path is unchanged: one result for every step
    args.ess_lr_granularity = "rollout"
    advantage_wrapper(STEPPED)(lambda args, rollout_data: None, None, (args, data), {})
    assert ess_patch.armed_steps() is None
    assert ess_patch.armed().scale == pytest.approx(
        reference_ess(lp, rlp, masks, mode="product")["scale"], rel=1e-12
    )


# --- how miles and slime split a rollout into optimizer steps -------------------------------------


def test_schedule_steps_joins_each_steps_micro_batches():
    assert schedule_steps([2, 1], [[0, 3], [1], [2, 4]]) == [[0, 3, 1], [2, 4]]
    data = {"num_microbatches": [1, 1], "micro_batch_indices": [[1, 0], [2]]}
    assert slime_step_samples(None, data, 2) == [[1, 0], [2]]
    with pytest.raises(ValueError, match=r"asks for 3 micro-batches but .* has 2"):
        schedule_steps([2, 1], [[0], [1]])


def test_miles_split_without_a_rollout_side_schedule():
    data = {"total_lengths": [5] * 10}
    static = Namespace(global_batch_size=8, micro_batch_size=2, use_dynamic_batch_size=False)
    # dp 2: 4 local samples per step, 10 // 4 = 2 steps, trailing samples not trained on
    assert miles_steps(static, data, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # 3 local samples per step with micro-batches of 2: the iterator takes 2 per step
    odd = Namespace(global_batch_size=6, micro_batch_size=2, use_dynamic_batch_size=False)
    assert miles_steps(odd, data, 2) == [[0, 1], [2, 3], [4, 5]]
    dynamic = Namespace(global_batch_size=6, micro_batch_size=1, use_dynamic_batch_size=True)
    assert miles_steps(dynamic, data, 2) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    scheduled = {**data, "num_microbatches": [1, 1], "micro_batch_indices": [[0, 1], [2]]}
    assert miles_steps(static, scheduled, 2) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="smaller than the data-parallel size"):
        miles_steps(Namespace(global_batch_size=1), data, 2)
