"""compute_ess_lr under every CP/DP/PP layout, with real gloo collectives and parallel_state.

Each rank holds its DP shard of a global batch, CP-sliced in miles' zigzag layout; only the
last pipeline stage computes, then broadcasts. Every rank must match the single-process
float64 reference on the whole batch and agree exactly with every other rank.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from dist_helpers import NUM, CollectiveCounter, cp_local, dp_shard, make_batch
from harness import layout, run_ranks
from reference import reference_ess

from ess_patch import EssLrConfig, NonFiniteLogProbError, broadcast_from_last_stage, compute_ess_lr

pytestmark = pytest.mark.dist

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)]
MODES = ("geometric", "product")


def rank_compute(seed, modes, *, faults=None, floor_policy=False):
    """Per rank: the result for each mode, and the collectives this rank issued."""
    lay = layout()
    faults = faults or {}
    samples = dp_shard(make_batch(seed), lay.dp_rank, lay.dp_size)
    lp, rlp, masks = cp_local(samples, lay.cp_rank, lay.cp_size)
    fault = faults.get(lay.coords)
    if fault == "empty":
        masks = [torch.zeros_like(m) for m in masks]
    elif fault == "nan":
        lp[1] = lp[1].clone()
        lp[1][0] = float("nan")
        masks[1] = torch.ones_like(masks[1])
    elif fault == "missing":
        lp = rlp = None
    elif fault == "invalid":
        rlp[0] = torch.zeros(rlp[0].shape[0] + 3)  # misaligned with its log-probs
    out = {}
    for mode in modes:
        config = EssLrConfig(weight_mode=mode, nonfinite="floor" if floor_policy else "raise")
        with CollectiveCounter() as counter:
            try:
                result = None
                if lay.is_pp_last:
                    result = compute_ess_lr(
                        lp, rlp, masks, config=config, cp_group=lay.cp_group, dp_group=lay.dp_group
                    )
                result = broadcast_from_last_stage(result, lay.pp_group)
                value = dataclasses.asdict(result)
            except (NonFiniteLogProbError, ValueError) as exc:
                value = {"error": f"{type(exc).__name__}: {exc}"}
        out[mode] = {"result": value, "collectives": counter.calls}
    return out


def _assert_all_ranks_equal(values):
    first = values[0]
    for rank, value in enumerate(values):
        assert value == first or _nan_equal(value, first), f"rank {rank} disagrees with rank 0"


def _nan_equal(a, b):
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k]))
        for k in a
    )


@pytest.mark.parametrize(("dp", "cp", "pp"), LAYOUTS)
def test_every_layout_matches_the_single_process_reference(tmp_path, dp, cp, pp):
    seed = 100 + dp * 9 + cp * 3 + pp
    results = run_ranks(
        rank_compute, dp=dp, cp=cp, pp=pp, args=(seed, MODES), tmp_path=tmp_path, timeout=120
    )
    batch = make_batch(seed)
    for mode in MODES:
        ref = reference_ess(
            [s["lp"] for s in batch],
            [s["rlp"] for s in batch],
            [s["mask"] for s in batch],
            mode=mode,
        )
        per_rank = [r[mode]["result"] for r in results]
        _assert_all_ranks_equal(per_rank)
        got = per_rank[0]
        assert got["status"] == "ok"
        assert got["num_trajectories"] == ref["num_trajectories"]
        assert got["num_empty"] == NUM - ref["num_trajectories"]
        for key in ("rho", "ess", "scale"):
            assert got[key] == pytest.approx(ref[key], rel=1e-6), (mode, key)
        assert got["rho"] < 0.999  # the batch is off-policy enough to be a real check

    # per dimension larger than one: DP one all-gather (summaries + envelopes), CP an
    # all-gather of the envelopes before the one all-reduce of the table, PP one all-gather
    calls = {"dp": ["all_gather"], "cp": ["all_gather", "all_reduce"], "pp": ["all_gather"]}
    sizes = {"dp": dp, "cp": cp, "pp": pp}
    for rank, r in enumerate(results):
        for mode in MODES:
            names = sorted(name for name, _ in r[mode]["collectives"])
            is_last = rank // (dp * cp) == pp - 1  # megatron orders ranks tp-cp-dp-pp
            dims = [d for d in ("dp", "cp", "pp") if sizes[d] > 1 and (is_last or d == "pp")]
            want = sorted(n for d in dims for n in calls[d])
            assert names == want, (rank, mode, r[mode]["collectives"])


def test_one_rank_with_no_valid_trajectory(tmp_path):
    seed = 7
    results = run_ranks(
        rank_compute,
        dp=2,
        cp=2,
        args=(seed, ("geometric",)),
        kwargs={"faults": {(1, 0, 0): "empty", (1, 1, 0): "empty"}},
        tmp_path=tmp_path,
    )
    batch = make_batch(seed)
    shard0 = dp_shard(batch, 0, 2)
    ref = reference_ess(
        [s["lp"] for s in shard0], [s["rlp"] for s in shard0], [s["mask"] for s in shard0]
    )
    per_rank = [r["geometric"]["result"] for r in results]
    _assert_all_ranks_equal(per_rank)
    assert per_rank[0]["num_trajectories"] == ref["num_trajectories"]
    assert per_rank[0]["rho"] == pytest.approx(ref["rho"], rel=1e-6)


@pytest.mark.parametrize("floor_policy", [False, True])
def test_one_rank_with_a_nan_log_prob(tmp_path, floor_policy):
    # only CP rank 0 of DP rank 1 sees the NaN; its CP peer and DP peers must still agree
    results = run_ranks(
        rank_compute,
        dp=2,
        cp=2,
        args=(11, ("geometric",)),
        kwargs={"faults": {(1, 0, 0): "nan"}, "floor_policy": floor_policy},
        tmp_path=tmp_path,
    )
    per_rank = [r["geometric"]["result"] for r in results]
    _assert_all_ranks_equal(per_rank)
    if floor_policy:
        assert per_rank[0]["status"] == "nonfinite"
        assert per_rank[0]["scale"] == 0.1
    else:
        assert "sample index 1 of data-parallel rank 1" in per_rank[0]["error"]


def test_one_rank_with_missing_inputs(tmp_path):
    results = run_ranks(
        rank_compute,
        dp=2,
        cp=2,
        pp=2,
        args=(5, ("geometric",)),
        kwargs={"faults": {(0, 1, 1): "missing"}},
        tmp_path=tmp_path,
    )
    per_rank = [r["geometric"]["result"] for r in results]
    _assert_all_ranks_equal(per_rank)
    assert per_rank[0]["status"] == "missing"
    assert per_rank[0]["scale"] == 1.0


def test_one_rank_with_invalid_inputs_fails_every_rank_without_hanging(tmp_path):
    results = run_ranks(
        rank_compute,
        dp=2,
        cp=2,
        args=(5, ("geometric",)),
        kwargs={"faults": {(1, 1, 0): "invalid"}},
        tmp_path=tmp_path,
        timeout=60,
    )
    errors = [r["geometric"]["result"]["error"] for r in results]
    bad = 3  # (dp 1, cp 1) is global rank 3
    assert errors[bad].startswith("EssPatchValueError: sample 0: log_probs has")
    for rank, error in enumerate(errors):
        if rank != bad:
            assert error.startswith("InvalidInputsElsewhereError: ESS-LR failed on rank"), error
