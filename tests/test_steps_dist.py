"""Granularity "step" under CP/DP/PP, with real gloo collectives and parallel_state.

Each rank holds its DP shard of a global batch, CP-sliced as miles slices it, and the indices
of its samples in each of the rollout's optimizer steps. Every rank must get, for every step,
the float64 reference over that step's samples of the whole batch, exactly equal on all ranks;
different settings or step counts on one rank end in an error on every rank, never a hang.
"""

from __future__ import annotations

import dataclasses

import pytest
from harness import layout, run_ranks
from reference import reference_steps
from test_reduction_dist import CollectiveCounter, cp_local, dp_shard, make_batch

from ess_patch import (
    EssLrConfig,
    broadcast_from_last_stage,
    broadcast_steps_from_last_stage,
    compute_ess_lr,
    compute_ess_lr_steps,
)

pytestmark = pytest.mark.dist

NUM = 14  # trajectory 13 (step 3, on one DP rank only) has masked tokens
NUM_STEPS = 4
# (mode, weight_clip): the seed's weights, and VCPO's (product, clipped)
SETTINGS = (("geometric", None), ("product", 3.0))


def global_steps(num: int = NUM) -> list[list[int]]:
    """Trajectory g trains in step g % 3, the last one alone in step 3 (one DP rank only)."""
    steps = [[g for g in range(num - 1) if g % 3 == s] for s in range(3)]
    return [*steps, [num - 1]]


def local_steps(dp_rank: int, dp_size: int, num: int = NUM) -> list[list[int]]:
    """The same steps, as indices into this DP rank's shard (dp_shard's bounds)."""
    shard = dp_shard(list(range(num)), dp_rank, dp_size)
    return [[i for i, g in enumerate(shard) if g in step] for step in global_steps(num)]


def rank_steps(seed, *, fault=None, faulty_rank=None):
    """Per rank: per setting, the step results (or the error) and the collectives issued."""
    import torch.distributed as dist

    lay = layout()
    samples = dp_shard(make_batch(seed, NUM), lay.dp_rank, lay.dp_size)
    lp, rlp, masks = cp_local(samples, lay.cp_rank, lay.cp_size)
    steps = local_steps(lay.dp_rank, lay.dp_size)
    me = dist.get_rank() == faulty_rank
    out = {}
    for mode, clip in SETTINGS:
        config = EssLrConfig(weight_mode=mode, weight_clip=clip, granularity="step")
        my_steps = steps
        if me and fault == "clip":
            config = dataclasses.replace(config, weight_clip=2.0)
        elif me and fault == "granularity":
            config = dataclasses.replace(config, granularity="rollout")
        elif me and fault == "count":
            my_steps = [*steps, []]
        elif me and fault == "split":  # the same number of steps, two of them swapped
            my_steps = [steps[1], steps[0], *steps[2:]]
        with CollectiveCounter() as counter:
            results, error = None, None
            # a rank on the other granularity takes the other path, as the hook would
            rollout = config.granularity == "rollout" or (me and fault == "api")
            groups = {"cp_group": lay.cp_group, "dp_group": lay.dp_group}
            try:
                if lay.is_pp_last and rollout:
                    results = compute_ess_lr(lp, rlp, masks, config=config, **groups)
                elif lay.is_pp_last:
                    results = compute_ess_lr_steps(
                        lp, rlp, masks, my_steps, config=config, **groups
                    )
            except ValueError as exc:
                error = exc  # as the hook does: the other stages learn it in the broadcast
            try:
                if rollout:
                    results = [
                        broadcast_from_last_stage(results, lay.pp_group, config=config, error=error)
                    ]
                else:
                    results = broadcast_steps_from_last_stage(
                        results, lay.pp_group, config=config, error=error
                    )
                value = [dataclasses.asdict(r) for r in results]
            except ValueError as exc:
                value = {"error": type(exc).__name__, "message": str(exc)}
        out[(mode, clip)] = {"results": value, "collectives": [n for n, _ in counter.calls]}
    return out


LAYOUTS = [
    pytest.param(2, 1, 1, id="dp2"),
    pytest.param(1, 2, 1, id="cp2"),
    pytest.param(1, 1, 2, id="pp2"),
    pytest.param(2, 2, 2, id="dp2xcp2xpp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("dp", "cp", "pp"), LAYOUTS)
def test_every_step_matches_the_reference_on_every_rank(tmp_path, dp, cp, pp):
    seed = 200 + dp * 9 + cp * 3 + pp
    results = run_ranks(rank_steps, dp=dp, cp=cp, pp=pp, args=(seed,), tmp_path=tmp_path)
    batch = make_batch(seed, NUM)
    columns = [[s[k] for s in batch] for k in ("lp", "rlp", "mask")]
    for mode, clip in SETTINGS:
        per_rank = [r[(mode, clip)]["results"] for r in results]
        assert all(value == per_rank[0] for value in per_rank), "ranks disagree"
        got = per_rank[0]
        refs = reference_steps(*columns, global_steps(), mode=mode, weight_clip=clip, shift=True)
        assert len(got) == NUM_STEPS
        for step, (g, ref) in enumerate(zip(got, refs, strict=True)):
            assert g["status"] == "ok" and g["num_trajectories"] == ref["num_trajectories"]
            for key in ("rho", "ess", "scale"):
                assert g[key] == pytest.approx(ref[key], rel=1e-6), (mode, step, key)
        assert len({g["scale"] for g in got[:3]}) == 3  # each step its own scale
        # collectives for all steps at once: CP envelopes + one table; DP step counts + one
        # [steps x summary] gather; PP envelopes + the results
        for rank, r in enumerate(results):
            is_last = rank // (dp * cp) == pp - 1  # megatron orders ranks tp-cp-dp-pp
            want = []
            if is_last and cp > 1:  # envelopes, the step split, the table
                want += ["all_gather", "all_gather", "all_reduce"]
            if is_last and dp > 1:
                want += ["all_gather", "all_gather"]
            if pp > 1:
                want += ["all_gather", "all_gather"]
            assert r[(mode, clip)]["collectives"] == want, rank


@pytest.mark.parametrize(
    ("fault", "error", "message"),
    [
        ("clip", "ConfigMismatchError", "weight_clip: rank 0 3.0, rank 1 2.0"),
        ("granularity", "ConfigMismatchError", "granularity: rank 0 'step', rank 1 'rollout'"),
        (
            "count",
            "ValueError",
            "different numbers of optimizer steps (rank 0 has 4, rank 1 has 5)",
        ),
    ],
)
def test_a_rank_with_other_settings_or_steps_fails_every_rank(tmp_path, fault, error, message):
    # DP2: global rank 1 is DP rank 1; its peer must raise too, never wait on it
    results = run_ranks(
        rank_steps, dp=2, args=(7,), kwargs={"fault": fault, "faulty_rank": 1}, tmp_path=tmp_path
    )
    for r in results:
        got = r[("product", 3.0)]["results"]
        assert got["error"] == error and message in got["message"], got


@pytest.mark.parametrize(
    ("fault", "error"), [("count", "ValueError"), ("granularity", "ConfigMismatchError")]
)
def test_a_last_stage_fault_reaches_the_other_pipeline_stage(tmp_path, fault, error):
    # DP2 x PP2: rank 3 (DP rank 1 of the last stage) splits into one step more, or runs the
    # rollout granularity (other collectives: the first ones are shaped alike, so no hang)
    results = run_ranks(
        rank_steps,
        dp=2,
        pp=2,
        args=(7,),
        kwargs={"fault": fault, "faulty_rank": 3},
        tmp_path=tmp_path,
    )
    kinds = [r[("product", 3.0)]["results"]["error"] for r in results]
    assert kinds[2:] == [error, error]  # the last stage: the step counts / the settings
    assert kinds[:2] == ["InvalidInputsElsewhereError"] * 2  # the first stage learns it failed


@pytest.mark.parametrize(
    ("dp", "cp", "fault", "error", "message"),
    [
        # a peer on the other API, with the very same settings (granularity "step")
        (2, 1, "api", "ConfigMismatchError", "granularity: rank 0 'step', rank 1 'rollout'"),
        (1, 2, "api", "ConfigMismatchError", "every rank must call the same one"),
        # CP peers hold the same samples: the step count and the split must agree too
        (1, 2, "count", "ValueError", "rank 0: 4 steps"),
        (1, 2, "split", "ValueError", "split their trajectories into optimizer steps differently"),
    ],
    ids=["dp2-api", "cp2-api", "cp2-count", "cp2-split"],
)
def test_peers_that_disagree_on_the_api_or_the_steps_all_raise(
    tmp_path, dp, cp, fault, error, message
):
    results = run_ranks(
        rank_steps,
        dp=dp,
        cp=cp,
        args=(11,),
        kwargs={"fault": fault, "faulty_rank": 1},
        tmp_path=tmp_path,
    )
    for r in results:
        got = r[("product", 3.0)]["results"]
        assert isinstance(got, dict) and got["error"] == error and message in got["message"], got
