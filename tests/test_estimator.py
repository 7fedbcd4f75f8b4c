"""The single-process ESS estimator against hand-computed values and a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_ess
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ess_patch import EssLrConfig, NonFiniteLogProbError, compute_ess_lr, estimator

MODES = ("geometric", "product")


def _batch(log_ratios, mask=None):
    """One token per trajectory with train - rollout = the given log-ratio."""
    lp = [torch.tensor([float(x)], dtype=torch.float64) for x in log_ratios]
    rlp = [torch.zeros(1, dtype=torch.float64) for _ in log_ratios]
    masks = [torch.ones(1) for _ in log_ratios] if mask is None else mask
    return lp, rlp, masks


def _random_batch(gen, n, *, scale=0.3, max_len=40, empty_every=0, dtype=torch.float32):
    lp, rlp, masks = [], [], []
    for i in range(n):
        length = int(torch.randint(1, max_len, (1,), generator=gen))
        base = -torch.rand(length, generator=gen, dtype=torch.float64) * 3
        lp.append(
            (base + torch.randn(length, generator=gen, dtype=torch.float64) * scale).to(dtype)
        )
        rlp.append(base.to(dtype))
        mask = (torch.rand(length, generator=gen) > 0.3).to(torch.int64)
        if empty_every and i % empty_every == 0:
            mask.zero_()
        masks.append(mask)
    return lp, rlp, masks


# --- the seed's reference values -------------------------------------------------------------


def test_equal_weights_give_rho_one_and_scale_one():
    result = compute_ess_lr(*_batch([0.3] * 8))
    assert result.rho == 1.0
    assert result.scale == 1.0
    assert result.num_trajectories == 8
    assert result.ess == pytest.approx(8.0, rel=1e-12)


def test_weights_one_and_five():
    result = compute_ess_lr(*_batch([0.0, math.log(5.0)]))
    assert result.rho == pytest.approx(36 / 52, rel=1e-12)
    assert result.ess == pytest.approx(36 / 26, rel=1e-12)
    assert result.scale == pytest.approx(math.sqrt(36 / 52), rel=1e-12)
    assert result.scale == pytest.approx(0.832, abs=5e-4)


def test_linear_rule_and_base_ratio():
    batch = _batch([0.0, math.log(5.0)])
    linear = compute_ess_lr(*batch, config=EssLrConfig(rule="linear"))
    assert linear.scale == pytest.approx(36 / 52, rel=1e-12)
    based = compute_ess_lr(*batch, config=EssLrConfig(base_ratio=0.8))
    assert based.scale == pytest.approx(math.sqrt((36 / 52) / 0.8), rel=1e-12)
    capped = compute_ess_lr(*batch, config=EssLrConfig(base_ratio=0.5))
    assert capped.scale == 1.0  # rho / base_ratio > 1 is capped: never raises the LR


def test_collapse_clamps_to_floor():
    # one trajectory dominates: rho ~ 1/1000, sqrt(rho) ~ 0.03, far below the floor
    result = compute_ess_lr(*_batch([0.0] * 999 + [40.0]))
    assert result.rho == pytest.approx(1 / 1000, rel=1e-9)
    assert result.scale == 0.1
    assert compute_ess_lr(*_batch([0.0] * 999 + [40.0]), config=EssLrConfig(floor=0.3)).scale == 0.3


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-30, 30, allow_nan=False), min_size=1, max_size=40),
    st.sampled_from(MODES),
    st.sampled_from(("sqrt", "linear")),
)
def test_properties_rho_bounds_and_scale_at_most_one(ratios, mode, rule):
    config = EssLrConfig(weight_mode=mode, rule=rule, floor=0.05)
    result = compute_ess_lr(*_batch(ratios), config=config)
    n = len(ratios)
    assert 1 / n - 1e-12 <= result.rho <= 1.0
    assert 0.05 <= result.scale <= 1.0
    ref = reference_ess(*_batch(ratios), mode=mode, rule=rule, floor=0.05, shift=True)
    assert result.rho == pytest.approx(ref["rho"], rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(-50, 50), st.sampled_from(MODES))
def test_invariant_to_permutation_and_common_shift(seed, shift, mode):
    gen = torch.Generator().manual_seed(seed)
    lp, rlp, masks = _random_batch(gen, 12, dtype=torch.float64)
    config = EssLrConfig(weight_mode=mode)
    base = compute_ess_lr(lp, rlp, masks, config=config)
    perm = torch.randperm(12, generator=gen).tolist()
    permuted = compute_ess_lr(
        [lp[i] for i in perm], [rlp[i] for i in perm], [masks[i] for i in perm], config=config
    )
    assert permuted.rho == pytest.approx(base.rho, rel=1e-9)
    if mode == "geometric":
        # adding c to every token's log-ratio multiplies every weight by exp(c)
        shifted = compute_ess_lr([x + shift for x in lp], rlp, masks, config=config)
        assert shifted.rho == pytest.approx(base.rho, rel=1e-9)
    else:
        # product mode: add c to one masked token of every trajectory (weights times exp(c))
        bumped = []
        for x, m in zip(lp, masks, strict=True):
            y = x.clone()
            idx = torch.nonzero(m)
            if len(idx):
                y[idx[0, 0]] += shift
            bumped.append(y)
        shifted = compute_ess_lr(bumped, rlp, masks, config=config)
        assert shifted.rho == pytest.approx(base.rho, rel=1e-9)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 5))
def test_geometric_invariant_to_repeating_tokens(seed, times):
    gen = torch.Generator().manual_seed(seed)
    lp, rlp, masks = _random_batch(gen, 10, dtype=torch.float64)
    base = compute_ess_lr(lp, rlp, masks)
    rep = compute_ess_lr(
        [x.repeat(times) for x in lp],
        [x.repeat(times) for x in rlp],
        [m.repeat(times) for m in masks],
    )
    assert rep.rho == pytest.approx(base.rho, rel=1e-9)
    assert rep.scale == pytest.approx(base.scale, rel=1e-9)


# --- agreement with an independent float64 computation ----------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_agrees_with_float64_reference(mode, seed):
    gen = torch.Generator().manual_seed(seed)
    lp, rlp, masks = _random_batch(gen, 64, scale=0.05 if mode == "product" else 0.5, empty_every=7)
    result = compute_ess_lr(lp, rlp, masks, config=EssLrConfig(weight_mode=mode, floor=0.01))
    ref = reference_ess(lp, rlp, masks, mode=mode, floor=0.01)
    assert result.num_trajectories == ref["num_trajectories"]
    assert result.num_empty == 64 - ref["num_trajectories"]
    assert result.rho == pytest.approx(ref["rho"], rel=1e-6)
    assert result.ess == pytest.approx(ref["ess"], rel=1e-6)
    assert result.scale == pytest.approx(ref["scale"], rel=1e-6)


def test_product_mode_stays_finite_where_naive_exp_overflows():
    gen = torch.Generator().manual_seed(0)
    n, length = 16, 4000
    # log-ratios of about +-2 per token over 4000 tokens: sums of several thousand,
    # exp() of which overflows float64 (limit ~709).
    lp = [torch.randn(length, generator=gen, dtype=torch.float64) * 2 + 1 for _ in range(n)]
    rlp = [torch.zeros(length, dtype=torch.float64) for _ in range(n)]
    masks = [torch.ones(length) for _ in range(n)]
    with pytest.raises(OverflowError):
        reference_ess(lp, rlp, masks, mode="product")
    result = compute_ess_lr(lp, rlp, masks, config=EssLrConfig(weight_mode="product"))
    ref = reference_ess(lp, rlp, masks, mode="product", shift=True)
    assert math.isfinite(result.rho) and math.isfinite(result.ess)
    assert result.rho == pytest.approx(ref["rho"], rel=1e-9)
    assert 1 / n <= result.rho <= 1


def test_bf16_inputs_accumulate_in_float64():
    gen = torch.Generator().manual_seed(3)
    lp, rlp, masks = _random_batch(gen, 32, max_len=300, dtype=torch.bfloat16)
    result = compute_ess_lr(lp, rlp, masks)
    # the reference sees exactly the bf16 values, widened
    ref = reference_ess([x.double() for x in lp], [x.double() for x in rlp], masks)
    assert result.rho == pytest.approx(ref["rho"], rel=1e-9)


# --- masks, empty trajectories, no-op -------------------------------------------------------


def test_masked_tokens_are_ignored_even_if_nonfinite():
    lp = [torch.tensor([0.0, float("nan"), 100.0]), torch.tensor([0.5, float("inf")])]
    rlp = [torch.zeros(3), torch.zeros(2)]
    masks = [torch.tensor([1, 0, 0]), torch.tensor([True, False])]
    result = compute_ess_lr(lp, rlp, masks)
    expected = reference_ess(*_batch([0.0, 0.5]))
    assert result.rho == pytest.approx(expected["rho"], rel=1e-12)
    assert result.num_nonfinite == 0


def test_empty_trajectories_are_left_out_of_sums_and_of_b():
    lp, rlp, _ = _batch([0.0, math.log(5.0), 3.0])
    masks = [torch.ones(1), torch.ones(1), torch.zeros(1)]
    result = compute_ess_lr(lp, rlp, masks)
    assert result.num_trajectories == 2
    assert result.num_empty == 1
    assert result.rho == pytest.approx(36 / 52, rel=1e-12)
    zero_length = compute_ess_lr(
        lp + [torch.zeros(0)], rlp + [torch.zeros(0)], masks + [torch.zeros(0)]
    )
    assert zero_length.rho == result.rho and zero_length.num_empty == 2


def test_no_valid_trajectory_is_the_documented_noop():
    for lp, rlp, masks in ([[], [], []], _batch([1.0, 2.0], mask=[torch.zeros(1)] * 2)):
        result = compute_ess_lr(lp, rlp, masks)
        assert (result.scale, result.rho, result.num_trajectories) == (1.0, 1.0, 0)
        assert result.status == "no_valid"
        assert result.metrics() == {"ess_lr_measured": 0.0}  # nothing that looks measured


def test_missing_inputs_give_noop():
    result = compute_ess_lr(None, None, [torch.ones(2)])
    assert (result.scale, result.status) == (1.0, "missing")


# --- non-finite policy ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_raise_names_the_sample(bad):
    lp, rlp, masks = _batch([0.0, 0.1, 0.2])
    lp[2] = torch.tensor([bad], dtype=torch.float64)
    with pytest.raises(NonFiniteLogProbError, match=r"sample index 2 of data-parallel rank 0"):
        compute_ess_lr(lp, rlp, masks)


def test_nonfinite_floor_fails_closed():
    lp, rlp, masks = _batch([0.0, 0.1, 0.2])
    rlp[1] = torch.tensor([float("nan")], dtype=torch.float64)
    result = compute_ess_lr(lp, rlp, masks, config=EssLrConfig(nonfinite="floor", floor=0.25))
    assert result.scale == 0.25
    assert result.status == "nonfinite"
    assert result.num_nonfinite == 1


# --- bad input: a clear error naming the sample -----------------------------------------------

BAD_INPUTS = {
    "different counts": (lambda b: (b[0], b[1][:-1], b[2]), ValueError, r"2 and 3|3, 2 and 3"),
    "length mismatch": (
        lambda b: (b[0], [b[1][0], torch.zeros(5), b[1][2]], b[2]),
        ValueError,
        r"sample 1",
    ),
    "mask length": (
        lambda b: (b[0], b[1], [b[2][0], b[2][1], torch.ones(4)]),
        ValueError,
        r"sample 2",
    ),
    "2-D tensor": (
        lambda b: ([b[0][0], torch.zeros(1, 1), b[0][2]], b[1], b[2]),
        ValueError,
        r"log_probs\[1\] has shape \(1, 1\)",
    ),
    "integer log-probs": (
        lambda b: (b[0], [b[1][0], b[1][1], torch.zeros(1, dtype=torch.long)], b[2]),
        TypeError,
        r"rollout_log_probs\[2\].*floating",
    ),
    "not a tensor": (lambda b: ([0.1, *b[0][1:]], b[1], b[2]), TypeError, r"log_probs\[0\]"),
    "a tensor, not a list": (lambda b: (torch.zeros(3), b[1], b[2]), TypeError, r"sequence"),
    "complex mask": (
        lambda b: (b[0], b[1], [b[2][0], b[2][1], torch.ones(1, dtype=torch.cfloat)]),
        TypeError,
        r"loss_masks\[2\]",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_a_clear_error(case):
    make, exc, pattern = BAD_INPUTS[case]
    batch = _batch([0.0, 0.1, 0.2])
    before = [[t.clone() for t in seq] for seq in batch]
    with pytest.raises(exc, match=pattern):
        compute_ess_lr(*make(batch))
    for seq, saved in zip(batch, before, strict=True):
        for t, s in zip(seq, saved, strict=True):
            assert torch.equal(t, s)  # inputs untouched


# --- issue 18: accuracy at benchmark scale (1e-9 of the float64 reference) ------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_fp32_bf16_trajectories_within_1e9_of_float64_reference(mode, dtype):
    # 16k-token responses in product mode: sums of 16k fp32/bf16 differences, where an
    # fp32 subtraction or fp32 accumulation would be off by far more than 1e-9
    gen = torch.Generator().manual_seed(18)
    lengths = [16384, 16000, 4096, 2, 700]
    lp, rlp, masks = [], [], []
    for n in lengths:
        base = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
        noise = torch.randn(n, generator=gen, dtype=torch.float64) * 1e-3
        lp.append((base + noise).to(dtype))
        rlp.append(base.to(dtype))
        masks.append((torch.rand(n, generator=gen) > 0.1).to(torch.int32))
    cfg = EssLrConfig(weight_mode=mode, floor=0.01)
    result = compute_ess_lr(lp, rlp, masks, config=cfg)
    wide = [x.double() for x in lp], [x.double() for x in rlp]
    ref = reference_ess(*wide, masks, mode=mode, floor=0.01, shift=True)
    assert result.num_trajectories == ref["num_trajectories"]
    assert result.rho == pytest.approx(ref["rho"], rel=1e-9)
    assert result.scale == pytest.approx(ref["scale"], rel=1e-9)
    assert result.ess == pytest.approx(ref["ess"], rel=1e-9)


@pytest.mark.parametrize("mode", MODES)
def test_masked_out_nan_and_exact_counts_at_scale(mode):
    # NaN/inf under mask 0 in long trajectories, all-masked trajectories, float masks
    # with values other than 1 (non-zero counts as masked in): counts are exact integers
    gen = torch.Generator().manual_seed(7)
    lp, rlp, masks = _random_batch(gen, 60, max_len=1500, scale=0.01, empty_every=9)
    for i, (x, mask) in enumerate(zip(lp, masks, strict=True)):
        x[mask == 0] = float("nan") if i % 2 else float("inf")
    masks = [m.to(torch.float32) * 0.5 if i % 3 == 0 else m for i, m in enumerate(masks)]
    result = compute_ess_lr(lp, rlp, masks, config=EssLrConfig(weight_mode=mode, floor=0.01))
    ref = reference_ess(lp, rlp, masks, mode=mode, floor=0.01, shift=True)
    empty = sum(int(m.count_nonzero() == 0) for m in masks)
    assert empty > 0
    assert result.num_nonfinite == 0
    assert result.num_trajectories == ref["num_trajectories"] == 60 - empty
    assert result.num_empty == empty
    assert result.rho == pytest.approx(ref["rho"], rel=1e-9)
    assert result.scale == pytest.approx(ref["scale"], rel=1e-9)


# --- issue 13 item 11: autograd and config type --------------------------------------------


def test_requires_grad_inputs_build_no_autograd_graph():
    gen = torch.Generator().manual_seed(11)
    lp, rlp, masks = _random_batch(gen, 16)
    lp = [x.detach().requires_grad_(True) for x in lp]
    saved = []

    def pack(t):
        saved.append(t)
        return t

    # an autograd graph saves tensors for backward: under no_grad none is saved
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = compute_ess_lr(lp, rlp, masks)
    assert saved == []
    ref = reference_ess([x.detach() for x in lp], rlp, masks)
    assert result.rho == pytest.approx(ref["rho"], rel=1e-9)
    for value in (result.rho, result.scale, result.ess):
        assert isinstance(value, float)  # plain floats: nothing to carry a grad_fn
    assert torch.is_grad_enabled()  # the caller's grad mode is restored
    assert all(x.grad is None for x in lp)


def test_trajectory_stats_called_directly_on_inputs_that_require_grad():
    gen = torch.Generator().manual_seed(12)
    lp, rlp, masks = _random_batch(gen, 8)
    want = _stats_reference(lp, rlp, masks)
    stats = estimator.trajectory_stats([x.requires_grad_(True) for x in lp], rlp, masks)
    assert not stats.requires_grad
    assert stats[:, 0].tolist() == pytest.approx([w[0] for w in want], rel=1e-12, abs=1e-12)


def test_config_dict_is_a_clear_type_error():
    with pytest.raises(TypeError, match="EssLrConfig"):
        compute_ess_lr(*_batch([0.0, 1.0]), config={"weight_mode": "product"})


def test_a_nan_mask_entry_is_rejected_naming_the_sample():
    lp = [torch.zeros(3), torch.zeros(4)]
    rlp = [torch.zeros(3), torch.zeros(4)]
    masks = [torch.ones(3), torch.tensor([1.0, float("nan"), 0.0, 1.0])]
    with pytest.raises(ValueError, match=r"loss_masks\[1\] holds NaN"):
        compute_ess_lr(lp, rlp, masks)


def test_arm_with_a_non_number_says_what_is_wrong():
    import ess_patch

    with pytest.raises(ValueError, match="LR scale 'x' is not a number"):
        ess_patch.arm("x")
    assert ess_patch.armed() is None


# --- per-trajectory sums against math.fsum -----------------------------------------------


def _stats_reference(lp, rlp, masks):
    """Per trajectory: fsum of the masked float64 differences, masked count, non-finite flag."""
    rows = []
    for x, y, k in zip(lp, rlp, masks, strict=True):
        d = [float(a) - float(b) for a, b, m in zip(x.tolist(), y.tolist(), k.tolist()) if m != 0]
        finite = all(math.isfinite(v) for v in d)
        rows.append((math.fsum(d) if finite else 0.0, float(len(d)), 0.0 if finite else 1.0))
    return rows


MASK_DTYPES = (torch.bool, torch.int32, torch.float32, torch.int64, torch.uint8, torch.bfloat16)


def _awkward_batch(lp_dtype, rlp_dtype):
    """Lengths 0..3000 (zero-length and all-masked trajectories, one of 3000 tokens),
    masked-out NaN/inf, masks of several dtypes with values other than 0/1."""
    gen = torch.Generator().manual_seed(1818)
    lengths = [0, 5, 3000, 0, 1, 17, 250, 0, 40, 999, 2, 0]
    lp, rlp, masks = [], [], []
    for i, n in enumerate(lengths):
        base = -torch.rand(n, generator=gen, dtype=torch.float64) * 5
        lp.append((base + torch.randn(n, generator=gen, dtype=torch.float64) * 0.3).to(lp_dtype))
        rlp.append(base.to(rlp_dtype))
        keep = torch.rand(n, generator=gen) > 0.2
        if i == 5:
            keep[:] = False  # all masked out
        lp[-1][~keep] = float("nan") if i % 2 else float("inf")
        rlp[-1][~keep] = float("-inf")
        mask_dtype = MASK_DTYPES[i % len(MASK_DTYPES)]
        masks.append(keep.to(mask_dtype) * (3 if mask_dtype in (torch.int64, torch.uint8) else 1))
    return lp, rlp, masks


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float64, torch.float64),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
    ],
)
def test_trajectory_sums_match_fsum_exact_counts(dtypes):
    lp, rlp, masks = _awkward_batch(*dtypes)
    stats = estimator.trajectory_stats(lp, rlp, masks)
    assert stats.dtype == torch.float64 and stats.shape == (len(lp), 3)
    for got, want in zip(stats.tolist(), _stats_reference(lp, rlp, masks), strict=True):
        assert got[0] == pytest.approx(want[0], rel=1e-12, abs=1e-12)
        assert got[1:] == list(want[1:])  # exact counts, no flag: masked-out NaN ignored
        assert math.copysign(1.0, got[1]) == 1.0  # a count of zero is +0.0


def test_a_masked_in_nan_flags_its_trajectory_only():
    lp, rlp, masks = _awkward_batch(torch.float32, torch.float32)
    lp[9] = lp[9].clone()
    lp[9][masks[9].nonzero()[-1, 0]] = float("nan")
    stats = estimator.trajectory_stats(lp, rlp, masks)
    flags = stats[:, 2].tolist()
    assert flags == [1.0 if i == 9 else 0.0 for i in range(len(lp))]
    assert stats[9, 0].item() == 0.0
    with pytest.raises(NonFiniteLogProbError, match="sample index 9"):
        compute_ess_lr(lp, rlp, masks)


def test_a_nan_mask_in_a_later_sample_is_rejected_naming_it():
    lp = [torch.zeros(50) for _ in range(6)]
    masks = [torch.ones(50) for _ in range(6)]
    masks[4] = masks[4].clone()
    masks[4][7] = float("nan")
    with pytest.raises(ValueError, match=r"loss_masks\[4\] holds NaN"):
        estimator.trajectory_stats(lp, lp, masks)


def test_sums_at_scale_match_a_float64_loop():
    # 300 K tokens in one call: every trajectory's segment sum against its own float64 sum
    gen = torch.Generator().manual_seed(5)
    n = 300_000
    base = -torch.rand(n, generator=gen) * 3
    lengths = torch.randint(100, 2001, (400,), generator=gen)
    lengths = lengths[lengths.cumsum(0) <= n].tolist()
    lengths.append(n - sum(lengths))
    lp = list((base + torch.randn(n, generator=gen) * 0.05).split(lengths))
    rlp = list(base.split(lengths))
    masks = list((torch.rand(n, generator=gen) > 0.1).split(lengths))
    stats = estimator.trajectory_stats(lp, rlp, masks)
    want = torch.stack(
        [
            torch.stack([((x.double() - y.double()) * k).sum(), k.sum(dtype=torch.float64)])
            for x, y, k in zip(lp, rlp, masks, strict=True)
        ]
    )
    assert torch.equal(stats[:, 1], want[:, 1])
    assert not stats[:, 2].any()
    torch.testing.assert_close(stats[:, 0], want[:, 0], rtol=1e-12, atol=1e-12)


# --- the summary against a float64 computation in Python ------------------------------------


def _summary_reference(stats, config, rank, missing, invalid):
    """:func:`estimator.summarize`'s fields from the table's rows, in Python floats."""
    rows = stats.double().tolist()
    ms, valid, empty, bad = [], 0, 0, []
    for i, (total, count, flag) in enumerate(rows):
        m = total / max(count, 1.0) if config.weight_mode == "geometric" else total
        if flag > 0 or not math.isfinite(m):
            bad.append(i)
            continue
        if count == 0:
            empty += 1
            continue
        if config.weight_clip is not None:
            m = min(m, math.log(config.weight_clip))
        valid += 1
        ms.append(m)
    shift = max(ms) if ms else -math.inf
    w = [math.exp(m - shift) for m in ms]
    s1, s2 = math.fsum(w), math.fsum(x * x for x in w)
    first = float(bad[0]) if bad else -1.0
    return [shift, s1, s2, valid, empty, len(bad), first, rank, float(missing), float(invalid)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip", [None, 1.5])
def test_summarize_matches_a_python_reference(mode, clip):
    gen = torch.Generator().manual_seed(11)
    config = EssLrConfig(weight_mode=mode, weight_clip=clip)
    n = 257
    total = torch.randn(n, generator=gen, dtype=torch.float64) * 40
    count = torch.randint(0, 50, (n,), generator=gen).to(torch.float64)  # some empty
    bad = (torch.rand(n, generator=gen) < 0.02).to(torch.float64)
    total[bad > 0] = 0.0
    tables = [
        torch.stack([total, count, bad], 1),
        torch.stack([total, count, torch.zeros(n, dtype=torch.float64)], 1),
        torch.zeros((0, 3), dtype=torch.float64),
        torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64),  # none valid
        torch.tensor([[0.5, 1.0, 0.0], [-0.25, 1.0, 0.0]], dtype=torch.bfloat16),  # widened
    ]
    flag_sets = [
        (3, estimator.Flags(), False, False),
        (1, estimator.Flags(missing=True), True, False),
        (2, estimator.Flags(missing=torch.tensor(1.0), invalid=torch.tensor(0)), True, False),
        (0, estimator.Flags(invalid=True), False, True),
    ]
    for stats in tables:
        for rank, flags, missing, invalid in flag_sets:
            got = estimator.summarize(stats, config, rank=rank, flags=flags)
            assert got.dtype == torch.float64 and got.shape == (estimator.SUMMARY_SIZE,)
            want = _summary_reference(stats, config, rank, missing, invalid)
            assert got[0].item() == want[0]  # the shift: the largest m, exactly
            assert got[1:3].tolist() == pytest.approx(want[1:3], rel=1e-13)
            assert got[3:].tolist() == want[3:]  # tallies, first bad index, rank, flags


def test_combine_copies_one_row():
    row = estimator.summarize(torch.tensor([[0.5, 1.0, 0.0]], dtype=torch.float64), EssLrConfig())
    merged = estimator.combine(row.unsqueeze(0))
    assert torch.equal(merged, row)
    merged[0] = 123.0  # a caller writing to the result must not change the gathered rows
    assert row[0] != 123.0


# --- bad layouts: the per-sample error, inputs untouched --------------------------------------

BAD_LAYOUTS = {
    "the first sample on two devices": (
        lambda b: (b[0], [b[1][0].to("meta"), *b[1][1:]], b[2]),
        ValueError,
        r"sample 0: log_probs on cpu, rollout_log_probs on meta",
    ),
    "every rollout tensor 2-D": (
        lambda b: (b[0], [t.reshape(1, -1) for t in b[1]], b[2]),
        ValueError,
        r"rollout_log_probs\[0\] has shape \(1, 1\)",
    ),
    "2-D after an empty 1-D": (
        lambda b: (
            [torch.zeros(0), torch.zeros(1, 1)],
            [torch.zeros(0), torch.zeros(1, 1)],
            [torch.ones(0), torch.ones(1, 1)],
        ),
        ValueError,
        r"log_probs\[1\] has shape \(1, 1\)",
    ),
    "0-d tensor": (
        lambda b: (b[0], b[1], [b[2][0], torch.tensor(1.0), b[2][2]]),
        ValueError,
        r"loss_masks\[1\] has shape \(\)",
    ),
    "integer log-probs among floats": (
        lambda b: ([b[0][0], b[0][1].long(), b[0][2]], b[1], b[2]),
        TypeError,
        r"log_probs\[1\].*floating",
    ),
    "a list of floats as a mask": (
        lambda b: (b[0], b[1], [b[2][0], [1.0], b[2][2]]),
        TypeError,
        r"loss_masks\[1\] is a list",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_LAYOUTS))
def test_bad_layouts_raise_the_per_sample_error(case):
    make, exc, pattern = BAD_LAYOUTS[case]
    batch = _batch([0.0, 0.1, 0.2])
    before = [[t.clone() for t in seq] for seq in batch]
    with pytest.raises(exc, match=pattern):
        estimator.trajectory_stats(*make(batch))
    with pytest.raises(exc, match=pattern):
        compute_ess_lr(*make(batch))
    for seq, saved in zip(batch, before, strict=True):
        for t, s in zip(seq, saved, strict=True):
            assert torch.equal(t, s)  # inputs untouched


@pytest.mark.parametrize("which", [0, 2])  # log_probs, loss_masks
@pytest.mark.parametrize(
    "sizes",
    [(150,), (0, 0, 150), (40, 50, 150)],
    ids=["alone", "after-empty-samples", "after-1d-samples"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_2d_tensor_is_named(which, sizes, dtype):
    # torch.cat compares dims only across non-empty tensors: a 2-D one alone, or after empty
    # ones, keeps its shape through the concatenation
    batch = [[torch.zeros(n, dtype=dtype) for n in sizes] for _ in range(2)]
    batch.append([torch.ones(n) for n in sizes])
    last = len(sizes) - 1
    batch[which][last] = batch[which][last].reshape(15, 10)
    before = [[t.clone() for t in seq] for seq in batch]
    name = ("log_probs", "rollout_log_probs", "loss_masks")[which]
    with pytest.raises(ValueError, match=rf"{name}\[{last}\] has shape \(15, 10\)"):
        estimator.trajectory_stats(*batch)
    for seq, saved in zip(batch, before, strict=True):
        for t, s in zip(seq, saved, strict=True):
            assert torch.equal(t, s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_all_empty_batch_gives_zero_rows(dtype):
    lp = [torch.zeros(0, dtype=dtype) for _ in range(2)]
    masks = [torch.ones(0, dtype=torch.bool) for _ in range(2)]
    stats = estimator.trajectory_stats(lp, [t.clone() for t in lp], masks)
    assert stats.tolist() == [[0.0, 0.0, 0.0]] * 2
    assert compute_ess_lr(lp, lp, masks).status == "no_valid"
    assert estimator.trajectory_stats([], [], []).shape == (0, 3)


@pytest.mark.slow  # the first CPU/meta concatenation imports torch's meta kernels (~5 s)
def test_a_later_sample_on_another_device_is_named():
    lp, rlp, masks = _batch([0.0, 0.1, 0.2])
    rlp[2] = rlp[2].to("meta")
    with pytest.raises(ValueError, match=r"sample 2: log_probs on cpu, rollout_log_probs on meta"):
        estimator.trajectory_stats(lp, rlp, masks)


# --- issue 25: what the path dispatches (a GPU's kernel launches and host syncs) ------------

# aten ops whose result a GPU must hand to the host: a stream synchronisation each
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2"})
# tensor methods that read the data on the host without dispatching an aten op on CPU
HOST_READS = frozenset({"tolist", "numpy", "__array__"})


class _Dispatched(TorchDispatchMode):
    """aten ops dispatched in the block, and those of them that sync a GPU with the host."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing is compiled here; True would import torch._dynamo (~5 s)

    def __init__(self):
        super().__init__()
        self.ops, self.syncs = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func.overloadpacket.__name__ in SYNC_OPS:
            self.syncs.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class _HostReads(TorchFunctionMode):
    """``tolist``/``numpy`` calls (on a GPU a device-to-host copy that waits for the stream;
    on CPU no aten op shows them)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _dispatched(fn):
    with _HostReads() as host, _Dispatched() as aten:
        fn()
    return aten.ops, aten.syncs + host.reads


def _benchmark_batch(n, lp_dtype, mask_dtype):
    gen = torch.Generator().manual_seed(n)
    lp, rlp, masks = _random_batch(gen, n, max_len=200, empty_every=5, dtype=lp_dtype)
    return lp, rlp, [m.to(mask_dtype) for m in masks]


@pytest.mark.parametrize("lp_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_dtype", [torch.int32, torch.bool, torch.float32])
@pytest.mark.parametrize("mode", MODES)
def test_ops_per_call_are_constant_in_b_and_at_most_100(lp_dtype, mask_dtype, mode):
    config = EssLrConfig(weight_mode=mode, weight_clip=2.0 if mode == "product" else None)
    counts = set()
    for n in (1, 3, 40, 500):
        batch = _benchmark_batch(n, lp_dtype, mask_dtype)
        ops, _ = _dispatched(lambda b=batch: compute_ess_lr(*b, config=config))
        counts.add(ops)
    assert len(counts) == 1, counts
    assert 10 < counts.pop() <= 100


@pytest.mark.parametrize("lp_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_dtype", [torch.int32, torch.bool])
def test_one_host_sync_per_call_the_final_read(lp_dtype, mask_dtype):
    batch = _benchmark_batch(64, lp_dtype, mask_dtype)
    _, syncs = _dispatched(lambda: compute_ess_lr(*batch))
    assert syncs == ["tolist"]  # finalize's, and nothing before it
    # the steps that run between the collectives read nothing back
    stats = estimator.trajectory_stats(*batch)
    for step in (
        lambda: estimator.trajectory_stats(*batch),
        lambda: estimator.summarize(stats, EssLrConfig(), rank=1, flags=estimator.Flags()),
        lambda: estimator.combine(torch.stack([estimator.summarize(stats, EssLrConfig())] * 3)),
    ):
        assert _dispatched(step)[1] == []


def test_float_masks_add_one_sync_for_the_nan_check():
    # the NaN check must raise before any collective (so that peers learn of the fault
    # from this rank's envelope): it reads one flag back, the only other sync
    batch = _benchmark_batch(64, torch.float32, torch.float32)
    _, syncs = _dispatched(lambda: compute_ess_lr(*batch))
    assert syncs == ["_local_scalar_dense", "tolist"]


def test_the_counters_see_a_sync_and_count_ops_per_trajectory():
    # the instruments themselves: a per-trajectory loop with .item() is caught
    batch = _benchmark_batch(8, torch.float32, torch.int32)
    ops, syncs = _dispatched(lambda: [float((x - y).sum()) for x, y, _ in zip(*batch)])
    assert ops == 8 * 3 and syncs == ["_local_scalar_dense"] * 8


@pytest.mark.slow  # the first meta op imports torch's meta kernels (~5 s under load)
@pytest.mark.parametrize("mask_dtype", [torch.int32, torch.bool])
def test_every_step_before_finalize_runs_on_a_device_without_data(mask_dtype):
    # "meta" tensors have no data: any host read (.item(), bool(), .tolist(), a blocking
    # copy of the lengths) raises there. trajectory_stats, summarize and combine run through;
    # finalize is where the one read happens.
    batch = [
        [torch.zeros(n, dtype=torch.bfloat16, device="meta") for n in (5, 0, 300)],
        [torch.zeros(n, device="meta") for n in (5, 0, 300)],
        [torch.ones(n, dtype=mask_dtype, device="meta") for n in (5, 0, 300)],
    ]
    config = EssLrConfig()
    stats = estimator.trajectory_stats(*batch)
    assert stats.shape == (3, 3) and stats.device.type == "meta" and stats.dtype == torch.float64
    summary = estimator.summarize(stats, config, rank=1, flags=estimator.Flags(missing=True))
    assert summary.shape == (estimator.SUMMARY_SIZE,) and summary.device.type == "meta"
    merged = estimator.combine(torch.stack([summary, summary]))
    assert merged.shape == (estimator.SUMMARY_SIZE,) and merged.device.type == "meta"
    with pytest.raises((RuntimeError, NotImplementedError)):
        estimator.finalize(merged, config)
