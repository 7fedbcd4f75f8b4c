"""The README's "ess-patch vs VCPO's code" table, row by row, on the same inputs.

``vcpo_step`` is a small independent re-implementation of VCPO's per-step rule as DESIGN.md
section 3 writes it (not VCPO's code): per trajectory ``s_i = sum_t (old - rollout)`` over the
response mask in float32 (an empty trajectory gives ``s_i = 0``, so ``w_i = 1``), ``w_i =
exp(s_i)`` in float32 without a shift, optionally ``min(w_i, threshold)``, ``ESS = S^2 / (Q +
1e-8)``, ``rho = ESS / B`` over every trajectory gathered, ``lr = base_lr * min(1, rho /
base_ess_ratio) ** 0.5`` (or linear) with Python's ``min`` (``min(1, nan) == 1``), no floor; a
rank that gathered no records (TP rank != 0; with PP > 1 every rank) has ``S = Q = 0``.
ess-patch is ``compute_ess_lr`` in product mode. Pure torch: no verl needed.
"""

from __future__ import annotations

import math

import pytest
import torch

from ess_patch import EssLrConfig, compute_ess_lr
from ess_patch.estimator import NonFiniteLogProbError

pytestmark = pytest.mark.filterwarnings("ignore")


def vcpo_step(
    old,
    rollout,
    masks,
    *,
    base_ess_ratio: float = 1.0,
    scaling_rule: str = "sqrt",
    threshold: float | None = None,
    contributes: bool = True,
    batch_size: int | None = None,
) -> dict:
    """VCPO's rule for one optimizer step, as DESIGN.md states it (float32, no shift)."""
    if contributes:
        sums = torch.stack(
            [((o.float() - r.float()) * m.float()).sum() for o, r, m in zip(old, rollout, masks)]
        )
        w = torch.exp(sums)  # float32: overflows to inf above ~88.7
        if threshold is not None:
            w = torch.minimum(w, torch.tensor(threshold, dtype=torch.float32))
        s, q = w.sum(), (w * w).sum()
    else:
        s = q = torch.tensor(0.0)
    ess = float(s * s / (q + 1e-8))
    rho = ess / (len(old) if batch_size is None else batch_size)
    ratio = min(1.0, rho / base_ess_ratio)  # Python's min: a NaN rho gives 1.0
    scale = math.sqrt(ratio) if scaling_rule == "sqrt" else ratio
    return {"scale": scale, "rho": rho, "ess": ess}


def _ours(old, rollout, masks, **config):
    config.setdefault("floor", 1e-6)  # VCPO has no floor: ours that never binds
    return compute_ess_lr(old, rollout, masks, config=EssLrConfig(weight_mode="product", **config))


def _trajectories(sums, length: int = 4, seed: int = 0):
    """Trajectories whose masked log-ratios add up to ``sums`` (float32 log-probs)."""
    gen = torch.Generator().manual_seed(seed)
    old, rollout, masks = [], [], []
    for total in sums:
        r = -torch.rand(length, generator=gen, dtype=torch.float64) * 3
        d = torch.full((length,), float(total) / length, dtype=torch.float64)
        old.append((r + d).float())
        rollout.append(r.float())
        masks.append(torch.ones(length, dtype=torch.int64))
    return old, rollout, masks


@pytest.mark.parametrize(("rule", "base", "clip"), [("sqrt", 1.0, None), ("linear", 0.9, 1.5)])
def test_ordinary_inputs_agree(rule, base, clip):
    gen = torch.Generator().manual_seed(3)
    sums = (torch.rand(16, generator=gen) * 2 - 1).tolist()
    data = _trajectories(sums)
    theirs = vcpo_step(*data, base_ess_ratio=base, scaling_rule=rule, threshold=clip)
    ours = _ours(*data, rule=rule, base_ratio=base, weight_clip=clip)
    assert 0.1 < ours.scale < 1
    assert ours.scale == pytest.approx(theirs["scale"], rel=1e-5)
    assert ours.rho == pytest.approx(theirs["rho"], rel=1e-5)


def test_very_negative_sums_collapse_vcpo_not_ours():
    """Every summed log-ratio near -25: VCPO's 1e-8 dominates Q, its rho goes to ~0 (LR ~0);
    ours is shift-invariant: the same rho as the same spread around 0."""
    spread = torch.linspace(0, 0.5, 16).tolist()
    low = _trajectories([-25 + x for x in spread])
    centred = _trajectories(spread)
    theirs = vcpo_step(*low)
    assert theirs["rho"] < 1e-6 and theirs["scale"] < 1e-3
    ours = _ours(*low)
    assert ours.rho == pytest.approx(_ours(*centred).rho, rel=1e-4)
    assert ours.rho == pytest.approx(vcpo_step(*centred)["rho"], rel=1e-4)
    assert ours.rho > 0.95


def test_overflow_leaves_vcpo_unscaled_ours_brakes():
    """One summed log-ratio above exp's float32 range (88.7): VCPO's weight is inf, rho NaN,
    min(1, NaN) = 1, the LR is not scaled; ours sees one dominant weight: rho ~ 1/B, brakes."""
    data = _trajectories([90.0] + [0.0] * 7)
    theirs = vcpo_step(*data)
    assert math.isnan(theirs["rho"]) and theirs["scale"] == 1.0
    ours = _ours(*data)
    assert ours.rho == pytest.approx(1 / 8, rel=1e-6)
    assert ours.scale == pytest.approx(math.sqrt(1 / 8), rel=1e-6)


def test_empty_trajectories_count_as_weight_one_in_vcpo_and_are_left_out_in_ours():
    old, rollout, masks = _trajectories([1.0, 0.0, -1.0, 0.0])
    masks[3] = torch.zeros_like(masks[3])  # no counted token
    theirs = vcpo_step(old, rollout, masks)
    w = [math.e, 1.0, 1 / math.e, 1.0]  # the empty one as w = 1, in B = 4
    assert theirs["rho"] == pytest.approx(sum(w) ** 2 / sum(x * x for x in w) / 4, rel=1e-5)
    ours = _ours(old, rollout, masks)
    w = w[:3]
    assert ours.num_trajectories == 3 and ours.num_empty == 1
    assert ours.rho == pytest.approx(sum(w) ** 2 / sum(x * x for x in w) / 3, rel=1e-6)


def test_vcpo_has_no_floor_ours_clamps_at_it():
    data = _trajectories([10.0] + [0.0] * 199)  # one weight dominates: rho ~ 1/200
    theirs = vcpo_step(*data)
    assert theirs["scale"] < 0.1
    ours = _ours(*data, floor=0.1)
    assert ours.scale == 0.1
    assert ours.rho == pytest.approx(theirs["rho"], rel=1e-5)


def test_nan_leaves_vcpo_unscaled_ours_raises_or_floors():
    old, rollout, masks = _trajectories([0.5, -0.5, 0.2])
    old[1][2] = float("nan")
    theirs = vcpo_step(old, rollout, masks)
    assert theirs["scale"] == 1.0
    with pytest.raises(NonFiniteLogProbError):
        _ours(old, rollout, masks)
    floored = _ours(old, rollout, masks, floor=0.2, nonfinite="floor")
    assert (floored.scale, floored.status) == (0.2, "nonfinite")


def test_tp_ranks_other_than_zero_get_lr_zero_in_vcpo_same_scale_everywhere_in_ours():
    """VCPO: only TP rank 0 contributes records, so another TP rank has S = Q = 0: rho 0,
    LR x 0 (PP > 1 alike: no rank gathers the last stage's values). Ours: every TP/PP rank
    holds the same batch and computes (or receives) the same scale."""
    data = _trajectories([0.3, -0.2, 0.8, -1.0])
    rank0 = vcpo_step(*data)
    other = vcpo_step(*data, contributes=False)
    assert 0 < rank0["scale"] < 1
    assert (other["rho"], other["scale"]) == (0.0, 0.0)
    ours = _ours(*data)
    assert ours.scale == pytest.approx(rank0["scale"], rel=1e-5)


def test_cp_duplicates_change_vcpos_ess_not_its_rho():
    """VCPO gathers over DP x CP: each CP rank adds the same whole sequences, so ESS and B
    both double and rho (so the LR) is unchanged; ess-patch counts each sequence once."""
    data = _trajectories([0.3, -0.2, 0.8, -1.0, 0.1])
    once = vcpo_step(*data)
    twice = vcpo_step(*(x + x for x in data))
    assert twice["rho"] == pytest.approx(once["rho"], rel=1e-6)
    assert twice["ess"] == pytest.approx(2 * once["ess"], rel=1e-6)
    ours = _ours(*data)
    assert ours.ess == pytest.approx(once["ess"], rel=1e-5)
    assert ours.num_trajectories == 5
