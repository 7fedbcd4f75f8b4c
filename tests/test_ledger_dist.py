"""Granularity "step" under CP/DP/PP: the per-step ledger, real gloo collectives, a real step.

Each rank holds its DP shard of a global batch, CP-sliced as miles slices it. In each of the
rollout's optimizer steps the last pipeline stage adds the partial sums of its samples of that
step to the ledger, as the policy-loss hook does, and every rank steps a real torch optimizer
attached with ``ess_patch.attach``. Every rank must get, for every step, the float64 reference
over that step's samples of the whole batch, exactly equal on all ranks, applied to that step's
LR; different settings or a fault on one rank end in an error on every rank, never a hang, and
the failed step changes no parameter and no LR.
"""

from __future__ import annotations

import dataclasses

import pytest
from dist_helpers import CollectiveCounter, cp_local, dp_shard, make_batch
from harness import layout, run_ranks
from reference import reference_steps

from ess_patch import EssLrConfig

pytestmark = pytest.mark.dist

NUM = 14  # trajectory 13 (step 3, on one DP rank only) has masked tokens
NUM_STEPS = 4
# (mode, weight_clip): the seed's weights, and VCPO's (product, clipped)
SETTINGS = (("geometric", None), ("product", 3.0))
LR = 0.5


def global_steps(num: int = NUM) -> list[list[int]]:
    """Trajectory g trains in step g % 3, the last one alone in step 3 (one DP rank only)."""
    steps = [[g for g in range(num - 1) if g % 3 == s] for s in range(3)]
    return [*steps, [num - 1]]


def local_steps(dp_rank: int, dp_size: int, num: int = NUM) -> list[list[int]]:
    """The same steps, as indices into this DP rank's shard (dp_shard's bounds)."""
    shard = dp_shard(list(range(num)), dp_rank, dp_size)
    return [[i for i, g in enumerate(shard) if g in step] for step in global_steps(num)]


def rank_steps(seed, *, fault=None, faulty_rank=None):
    """Per rank: per setting, each step's result and applied LR (or the error), the collectives
    issued, and whether a failed step left the parameters and LR as they were."""
    import torch
    import torch.distributed as dist

    import ess_patch
    from ess_patch import ledger
    from ess_patch.estimator import trajectory_stats

    lay = layout()
    samples = dp_shard(make_batch(seed, NUM), lay.dp_rank, lay.dp_size)
    lp, rlp, masks = cp_local(samples, lay.cp_rank, lay.cp_size)
    steps = local_steps(lay.dp_rank, lay.dp_size)
    me = dist.get_rank() == faulty_rank
    out = {}
    for mode, clip in SETTINGS:
        config = EssLrConfig(weight_mode=mode, weight_clip=clip, granularity="step")
        if me and fault == "clip":
            config = dataclasses.replace(config, weight_clip=2.0)
        elif me and fault == "granularity":
            config = dataclasses.replace(config, granularity="rollout")
        param = torch.nn.Parameter(torch.ones(3))
        optimizer = ess_patch.attach(torch.optim.SGD([param], lr=LR))
        applied = []
        optimizer.register_step_pre_hook(
            lambda o, a, k, seen=applied: seen.append(o.param_groups[0]["lr"])
        )
        ledger.start(
            ledger.LedgerRun(
                framework="test",
                reason="granularity 'step'",
                config=config,
                cp_group=lay.cp_group,
                dp_group=lay.dp_group,
                pp_group=lay.pp_group,
                is_pp_last=lay.is_pp_last,
            )
        )
        results: list | dict = []
        with CollectiveCounter() as counter:
            for s, indices in enumerate(steps):
                if lay.is_pp_last:  # the loss runs on the last stage only
                    if me and fault == "table" and s == 1:
                        ledger.fail(ValueError("rank's policy loss saw a bad batch"))
                    else:
                        pick = [lp[i] for i in indices], [rlp[i] for i in indices]
                        ledger.add(trajectory_stats(*pick, [masks[i] for i in indices]))
                param.grad = torch.ones(3)
                before = param.detach().clone()
                try:
                    optimizer.step()
                except ValueError as exc:
                    results = {
                        "error": type(exc).__name__,
                        "message": str(exc),
                        "step": s,
                        "untouched": bool(torch.equal(param.detach(), before))
                        and optimizer.param_groups[0]["lr"] == LR,
                    }
                    break
                results.append(dataclasses.asdict(ess_patch.armed()))
        ledger.stop()
        ess_patch.detach(optimizer)
        out[(mode, clip)] = {
            "results": results,
            "applied": applied,
            "lr_after": optimizer.param_groups[0]["lr"],
            "collectives": [n for n, _ in counter.calls],
        }
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
        for rank, r in enumerate(results):
            # step k ran at the scheduled LR times step k's scale; the LR is back after it
            assert r[(mode, clip)]["applied"] == [LR * g["scale"] for g in got], rank
            assert r[(mode, clip)]["lr_after"] == LR
            # per step: CP envelopes + the table, one DP gather, one PP gather
            is_last = rank // (dp * cp) == pp - 1  # megatron orders ranks tp-cp-dp-pp
            want = []
            if is_last and cp > 1:
                want += ["all_gather", "all_reduce"]
            if is_last and dp > 1:
                want += ["all_gather"]
            if pp > 1:
                want += ["all_gather"]
            assert r[(mode, clip)]["collectives"] == want * NUM_STEPS, rank


@pytest.mark.parametrize(
    ("fault", "error", "message"),
    [
        ("clip", "ConfigMismatchError", "weight_clip: rank 0 3.0, rank 1 2.0"),
        ("granularity", "ConfigMismatchError", "granularity: rank 0 'step', rank 1 'rollout'"),
    ],
)
@pytest.mark.parametrize(("dp", "cp"), [(2, 1), (1, 2)], ids=["dp2", "cp2"])
def test_a_rank_with_other_settings_fails_every_rank(tmp_path, dp, cp, fault, error, message):
    # global rank 1 is DP rank 1 (dp2) or CP rank 1 (cp2); its peer must raise too, never wait
    results = run_ranks(
        rank_steps,
        dp=dp,
        cp=cp,
        args=(7,),
        kwargs={"fault": fault, "faulty_rank": 1},
        tmp_path=tmp_path,
    )
    for r in results:
        got = r[("product", 3.0)]
        assert got["results"]["error"] == error and message in got["results"]["message"], got
        assert got["results"]["step"] == 0 and got["results"]["untouched"]
        assert got["applied"] == []  # the failed step never ran


def test_a_last_stage_fault_reaches_every_rank_and_changes_nothing(tmp_path):
    # DP2 x PP2: rank 3 (DP rank 1 of the last stage) fails to build step 1's table
    results = run_ranks(
        rank_steps,
        dp=2,
        pp=2,
        args=(7,),
        kwargs={"fault": "table", "faulty_rank": 3},
        tmp_path=tmp_path,
    )
    got = [r[("product", 3.0)] for r in results]
    kinds = [g["results"]["error"] for g in got]
    assert kinds == ["InvalidInputsElsewhereError"] * 3 + ["ValueError"]  # the loss's own error
    assert "bad batch" in got[3]["results"]["message"]
    assert "rank(s) 3" in got[0]["results"]["message"]
    for g in got:  # step 0 ran on every rank, step 1 on none
        assert g["results"]["step"] == 1 and g["results"]["untouched"]
        assert len(g["applied"]) == 1 and g["lr_after"] == LR
