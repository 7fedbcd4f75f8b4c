"""VCPO's semantics as options, in one process: ``granularity`` and ``weight_clip``.

- config: the new fields, their errors, ``ESS_LR_*``, and the fingerprint that makes ranks with
  different settings raise;
- ``weight_clip``: hand-computed values and the float64 reference;
- granularity "step": ``compute_ess_lr`` over each step's samples is the reference over that
  step alone, and so is the per-step ledger, however the step's samples reach it (loss call by
  loss call); real megatron-core optimizers (ChainedOptimizer) and a plain torch optimizer take
  one result per real update, each update scaled by its own step's scale, exactly once;
- the miles/slime hook and flags in step mode (the real train loop: tests/frameworks).
"""

from __future__ import annotations

import math
from argparse import Namespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_ess, reference_steps

import ess_patch
from ess_patch import EssLrConfig, EssLrResult, compute_ess_lr, ledger
from ess_patch.config import describe_fingerprint
from ess_patch.estimator import trajectory_stats
from ess_patch.integrations.rl_hooks import (
    Framework,
    Groups,
    add_ess_arguments,
    advantage_wrapper,
    ess_metrics,
    validate,
)

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


# --- granularity "step": one result per optimizer step --------------------------------------------


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


def _pick(batch, indices):
    return [[seq[i] for i in indices] for seq in batch]


def _run(config=None, **groups):
    return ledger.LedgerRun(
        framework="test", reason="granularity 'step'", config=config or EssLrConfig(), **groups
    )


@pytest.mark.parametrize("mode", ["geometric", "product"])
def test_each_step_is_the_reference_over_its_own_trajectories(mode):
    batch = _random_batch(torch.Generator().manual_seed(3), 20)  # 18, 19: no step
    config = EssLrConfig(weight_mode=mode, granularity="step")
    results = [compute_ess_lr(*_pick(batch, indices), config=config) for indices in STEPS]
    refs = reference_steps(*batch, STEPS, mode=mode, shift=True)
    for got, ref in zip(results, refs, strict=True):
        assert got.num_trajectories == ref["num_trajectories"]
        for key in ("rho", "ess", "scale"):
            assert getattr(got, key) == pytest.approx(ref[key], rel=1e-9), key
    assert len({r.scale for r in results}) == 3  # three different steps, three scales


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    calls=st.lists(st.integers(0, 4), min_size=1, max_size=8),
    mode=st.sampled_from(["geometric", "product"]),
    clip=st.sampled_from([None, 0.9, 2.0]),
)
def test_property_the_ledger_of_a_step_is_compute_ess_lr_on_its_samples(seed, calls, mode, clip):
    """A step's samples reach the ledger loss call by loss call (``calls[k]`` samples in call
    k): the step's result is exactly ``compute_ess_lr`` on all of them, in their order."""
    batch = _random_batch(torch.Generator().manual_seed(seed), sum(calls))
    config = EssLrConfig(weight_mode=mode, weight_clip=clip, granularity="step")
    tables, start = [], 0
    for count in calls:
        tables.append(trajectory_stats(*_pick(batch, range(start, start + count))))
        start += count
    got = ledger.reduce_tables(tables, None, _run(config))
    assert got == compute_ess_lr(*batch, config=config)


def test_a_step_without_valid_trajectories_is_a_noop_and_a_nonfinite_one_names_its_row():
    lp, rlp, masks = _batch([0.0, 2.0, 1.0])
    masks[2] = torch.zeros(1)
    empty = trajectory_stats(lp[2:], rlp[2:], masks[2:])
    assert ledger.reduce_tables([empty], None, _run()) == EssLrResult.noop("no_valid", num_empty=1)
    lp[1] = torch.tensor([float("nan")], dtype=torch.float64)
    table = trajectory_stats(lp[:2], rlp[:2], masks[:2])
    with pytest.raises(ess_patch.NonFiniteLogProbError, match="sample index 1 of data-parallel"):
        ledger.reduce_tables([table], None, _run())
    floor = ledger.reduce_tables([table], None, _run(EssLrConfig(nonfinite="floor")))
    assert floor.status == "nonfinite" and floor.scale == 0.1


# --- per-step results on real optimizers -------------------------------------------------------


def _step_tables(gen_seed=5):
    """Three steps' tables, each of a different staleness: three different scales."""
    batch = _random_batch(torch.Generator().manual_seed(gen_seed), 18, scale=0.6)
    return [trajectory_stats(*_pick(batch, indices)) for indices in STEPS]


@pytest.mark.usefixtures("world", "clean_ess")
@pytest.mark.parametrize("kind", ["fp32", "multi_bf16"])
def test_each_megatron_update_uses_its_own_steps_scale_exactly_once(kind):
    from megatron_cpu import batch, build_megatron_optimizer, forward_backward, param_triples

    setup = build_megatron_optimizer(kind, optimizer="sgd")
    ess_patch.install("megatron")
    config = EssLrConfig(granularity="step")
    ledger.start(_run(config))
    tables = _step_tables()
    scales = [ledger.reduce_tables([t], None, _run(config)).scale for t in tables]
    assert len(set(scales)) == 3 and max(scales) < 1
    for step, (table, scale) in enumerate(zip(tables, scales, strict=True)):
        ledger.add(table)  # what the policy-loss hook adds during the step's micro-batches
        x, y = batch(0, step)
        forward_backward(setup, x, y)
        before = [(g["lr"], p.detach().clone()) for g, p, _ in param_triples(setup.optimizer)]
        setup.optimizer.step()
        for (lr, p0), (group, p1, _) in zip(before, param_triples(setup.optimizer), strict=True):
            assert group["lr"] == lr  # restored
            assert p1.grad is not None and p1.grad.abs().sum() > 0
            assert torch.equal(p1, p0.add(p1.grad, alpha=-(lr * scale))), (step, "not once")
        assert ess_patch.armed().scale == scale  # what a host logs after this step
        setup.scheduler.step(increment=1)
    # a step that no policy-loss call reached: it raises before touching anything
    x, y = batch(0, 3)
    forward_backward(setup, x, y)
    params = [p.detach().clone() for _, p, _ in param_triples(setup.optimizer)]
    lrs = [g["lr"] for g in setup.optimizer.param_groups]
    with pytest.raises(RuntimeError, match="no policy-loss call reached ESS-LR"):
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
    config = EssLrConfig(granularity="step")
    ledger.start(_run(config))
    first, second = _step_tables()[:2]
    ledger.add(first)
    records = train_steps(setup, 1, poison_steps=(0,))
    assert records[0].update_successful is False  # (False, None, None): inf/nan grads
    assert ess_patch.armed() == ledger.reduce_tables([first], None, _run(config))
    ledger.add(second)
    train_steps(setup, 1)
    assert ess_patch.armed() == ledger.reduce_tables([second], None, _run(config))


@pytest.mark.usefixtures("clean_ess")
def test_a_torch_optimizer_attached_takes_one_result_per_step():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = ess_patch.attach(torch.optim.SGD([param], lr=1.0))
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ess_patch.attach(other)
    ess_patch.exclude(other)
    ledger.start(_run(EssLrConfig(granularity="step")))
    for log_ratios in ([0.0, 2.0], [0.0, 0.5]):
        want = compute_ess_lr(*_batch(log_ratios)).scale
        ledger.add(trajectory_stats(*_batch(log_ratios)))
        before = param.detach().clone()
        param.grad = torch.ones(1)
        other.step()  # excluded: never scaled, reduces nothing
        opt.step()
        assert torch.equal(param.detach(), before - want)
        assert opt.param_groups[0]["lr"] == 1.0
    with pytest.raises(RuntimeError, match="no policy-loss call reached ESS-LR"):
        opt.step()
    assert opt.param_groups[0]["lr"] == 1.0


# --- the miles/slime hook and flags ---------------------------------------------------------------


STEPPED = Framework(
    name="single",
    groups=lambda: Groups(None, 0, 1, None, None, True),
    no_input_reason=lambda args: None,
    unsupported_reason=lambda args: None,
    measure_in_loss=lambda args, data: None,  # the hook's log-probs are the current policy's
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


def test_step_is_refused_where_there_is_no_loss_hook(clean_ess):
    args = Namespace(use_ess_lr=True, ess_lr_granularity="step")
    with pytest.raises(ValueError, match=r"granularity 'step'.*not supported with nosteps"):
        validate(NO_STEPS, args)
    validate(STEPPED, args)
    # shadow mode logs each step's result, as --use-ess-lr would apply it
    validate(STEPPED, Namespace(use_ess_lr=False, ess_lr_shadow=True, ess_lr_granularity="step"))


def test_megatron_rl_refuses_step_granularity():
    from ess_patch.integrations.megatron_rl import MEGATRON_RL_FRAMEWORK

    args = Namespace(
        use_ess_lr=True, ess_lr_granularity="step", rl_inference_logprobs_is_correction=True
    )
    with pytest.raises(ValueError, match="not supported with megatron_rl"):
        validate(MEGATRON_RL_FRAMEWORK, args)


@pytest.mark.parametrize("shadow", [False, True])
def test_the_hook_measures_each_step_inside_the_loss_and_logs_each_steps_own(clean_ess, shadow):
    """Granularity step: the hook arms nothing (its log-probs predate every update) and starts
    the ledger; each step's result is the reference over that step's samples, logged after it
    (shadow mode: as ess_lr_shadow_scale, never applied)."""
    lp, rlp, masks = _batch([0.0, 2.0, 0.1, 0.3])
    data = {"log_probs": lp, "rollout_log_probs": rlp, "loss_masks": masks}
    args = Namespace(
        use_ess_lr=not shadow,
        ess_lr_shadow=shadow,
        ess_lr_granularity="step",
        ess_lr_weight_mode="product",
    )
    param = torch.nn.Parameter(torch.zeros(1))
    opt = ess_patch.attach(torch.optim.SGD([param], lr=1.0))
    hook = advantage_wrapper(STEPPED)
    assert hook(lambda args, rollout_data: "advantages", None, (args, data), {}) == "advantages"
    assert ess_patch.armed() is None and ledger.running() is not None
    refs = reference_steps(lp, rlp, masks, [[0, 1], [2, 3]], mode="product")
    assert refs[0]["scale"] < refs[1]["scale"] < 1
    for indices, ref in zip([[0, 1], [2, 3]], refs, strict=True):
        ledger.add(trajectory_stats(*_pick((lp, rlp, masks), indices)))  # the step's loss calls
        before = param.detach().clone()
        param.grad = torch.ones(1)
        opt.step()
        logged = ess_metrics()
        key = "ess_lr_shadow_scale" if shadow else "lr_scale"
        assert logged[key] == pytest.approx(ref["scale"], rel=1e-12)
        assert logged["rho_ess"] == pytest.approx(ref["rho"], rel=1e-12)
        applied = 1.0 if shadow else ref["scale"]
        assert torch.allclose(param.detach(), before - applied, rtol=0, atol=1e-12)
    # the rollout granularity: one result at the hook, for every step
    args.ess_lr_granularity = "rollout"
    advantage_wrapper(STEPPED)(lambda args, rollout_data: None, None, (args, data), {})
    assert ledger.running() is None
    if not shadow:
        assert ess_patch.armed().scale == pytest.approx(
            reference_ess(lp, rlp, masks, mode="product")["scale"], rel=1e-12
        )
