"""The documented one call per rollout, ``compute_ess_lr(..., pp_group=)``, on every rank.

Real gloo process groups (DP2 x CP2 x PP2, and PP3 for a middle stage). Non-last pipeline
stages pass no log-probs. Healthy: every rank returns the float64 reference's scale over
the whole batch. Each fault is injected at every rank position in turn (each DP and CP index,
each PP stage): the faulty rank raises its own error, every other rank a clear one, quickly,
with nothing armed. The failing rank stays alive (as a Ray actor does), so a rank left
waiting would show as a timeout. The lower-level pattern (last stage computes, every stage
calls ``broadcast_from_last_stage(..., error=)``) is checked for a last-stage fault too.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dist_helpers import cp_local, dp_shard, make_batch
from harness import layout, run_ranks
from reference import reference_ess

import ess_patch

pytestmark = pytest.mark.dist

COLLECTIVE_TIMEOUT = 40.0  # a safety net only: a correct run never gets near it
FLOOR = 0.1
FAULTS = ("bad_config", "mismatch", "nan", "bad_input")


def _inputs(lay, faulty: bool, fault: str | None):
    samples = dp_shard(make_batch(5, num=8), lay.dp_rank, lay.dp_size)
    lp = [s["lp"] for s in samples]
    rlp = [s["rlp"] for s in samples]
    mask = [s["mask"] for s in samples]
    if lay.cp_size > 1:
        lp, rlp, mask = cp_local(samples, lay.cp_rank, lay.cp_size)
    last = lay.pp_rank == lay.pp_size - 1
    config: object = ess_patch.EssLrConfig(floor=FLOOR)
    if faulty and fault == "bad_config":
        config = {"floor": FLOOR}  # not an EssLrConfig: a TypeError on that rank
    elif faulty and fault == "mismatch":
        config = ess_patch.EssLrConfig(floor=0.3)
    elif faulty and fault == "nan":
        lp = [t.clone() for t in lp]
        lp[0].fill_(float("nan"))
        mask = [torch.ones_like(m) for m in mask]
        return lp, rlp, mask, config  # given on any stage: checked there
    elif faulty and fault == "bad_input":
        return [t.unsqueeze(0) for t in lp], rlp, mask, config  # 2-D: a ValueError there
    if not last:
        return None, None, None, config  # the usual non-last stage: nothing
    return lp, rlp, mask, config


def rank_public_api(faulty_ranks: list[int]):
    lay = layout()
    groups = {
        "cp_group": lay.cp_group if lay.cp_size > 1 else None,
        "dp_group": lay.dp_group if lay.dp_size > 1 else None,
        "pp_group": lay.pp_group if lay.pp_size > 1 else None,
    }
    out = {}
    for faulty, fault in [(None, None)] + [(f, x) for f in faulty_ranks for x in FAULTS]:
        lp, rlp, mask, config = _inputs(lay, lay.rank == faulty, fault)
        ess_patch.arm(0.5)  # the previous rollout's scale
        ess_patch.disarm()  # as the hooks do: a failed rollout leaves nothing armed
        start = time.monotonic()
        try:
            result = ess_patch.compute_ess_lr(lp, rlp, mask, config=config, **groups)
            ess_patch.arm(result)
            outcome = (None, result.scale)
        except Exception as exc:  # stay alive, as a Ray actor does
            outcome = (type(exc).__name__, str(exc)[:300])
        armed = ess_patch.armed()
        out[(faulty, fault)] = (*outcome, time.monotonic() - start, armed and armed.scale)
        dist.barrier()  # every rank got here: nobody is stuck in a collective
    out["lowlevel"] = _lowlevel(lay, groups)
    ess_patch.disarm()
    return out


def _lowlevel(lay, groups):
    """The documented lower-level pattern with a NaN on the last stage's first rank."""
    lp, rlp, mask, config = _inputs(lay, False, None)
    last = lay.pp_rank == lay.pp_size - 1
    if last and lay.dp_rank == 0 and lay.cp_rank == 0:
        lp = [t.clone() for t in lp]
        lp[0].fill_(float("nan"))
        mask = [torch.ones_like(m) for m in mask]
    start = time.monotonic()
    result, error = None, None
    try:
        if last:
            try:
                result = ess_patch.compute_ess_lr(
                    lp, rlp, mask, config=config, cp_group=groups["cp_group"],
                    dp_group=groups["dp_group"],
                )  # fmt: skip
            except Exception as exc:
                error = exc
        result = ess_patch.broadcast_from_last_stage(result, groups["pp_group"], error=error)
        outcome = (None, result.scale)
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc)[:300])
    return (*outcome, time.monotonic() - start)


def _reference_scale() -> float:
    batch = make_batch(5, num=8)
    ref = reference_ess(
        [s["lp"] for s in batch],
        [s["rlp"] for s in batch],
        [s["mask"] for s in batch],
        mode="geometric",
        rule="sqrt",
        floor=FLOOR,
    )
    return ref["scale"]


def _is_last(rank: int, dp: int, cp: int, pp: int) -> bool:
    return rank // (dp * cp) == pp - 1  # Megatron's order: the stage is the slowest index


@pytest.mark.parametrize(("dp", "cp", "pp"), [(2, 2, 2), (1, 1, 3)], ids=str)
def test_one_call_on_every_rank_every_fault_everywhere(tmp_path, dp, cp, pp):
    world = dp * cp * pp
    results = run_ranks(
        rank_public_api,
        dp=dp,
        cp=cp,
        pp=pp,
        args=(list(range(world)),),
        tmp_path=tmp_path,
        timeout=240,
        collective_timeout=COLLECTIVE_TIMEOUT,
    )
    reference = _reference_scale()
    assert reference < 1.0  # the batch really brakes
    for rank, r in enumerate(results):
        kind, scale, _, armed = r[(None, None)]
        assert kind is None and scale == pytest.approx(reference, rel=1e-9), (rank, r)
        assert armed == scale
    assert len({r[(None, None)][1] for r in results}) == 1  # bitwise the same everywhere
    for faulty in range(world):
        for fault in FAULTS:
            case = (faulty, fault)
            kinds = [r[case][0] for r in results]
            for rank, r in enumerate(results):
                kind, message, elapsed, armed = r[case]
                assert kind is not None, (case, rank, "returned a scale")
                assert armed is None, (case, rank, "something armed after a failed rollout")
                assert elapsed < COLLECTIVE_TIMEOUT / 4, (case, rank, elapsed)
                if kind == "InvalidInputsElsewhereError" and fault in ("bad_config", "bad_input"):
                    assert f"rank(s) {faulty} " in message, (case, rank, message)
            own = {
                "bad_config": "EssPatchTypeError",
                "mismatch": "ConfigMismatchError",
                "nan": "NonFiniteLogProbError",
                "bad_input": "EssPatchValueError",
            }[fault]
            assert kinds[faulty] == own, (case, kinds)
            others = set(kinds) - {own}
            assert others <= {"InvalidInputsElsewhereError"}, (case, kinds)
            if fault == "nan" and _is_last(faulty, dp, cp, pp):
                # found in the reduction: every last-stage rank names it itself
                last = [k for rank, k in enumerate(kinds) if _is_last(rank, dp, cp, pp)]
                assert set(last) == {"NonFiniteLogProbError"}, (case, kinds)
    # the lower-level pattern, with its error path: every rank raises, none waits
    low = [r["lowlevel"] for r in results]
    for rank, (kind, message, elapsed) in enumerate(low):
        expected = (
            {"NonFiniteLogProbError"}
            if _is_last(rank, dp, cp, pp)
            else {"NonFiniteLogProbError", "InvalidInputsElsewhereError"}
        )
        assert kind in expected, (rank, kind, message)
        assert elapsed < COLLECTIVE_TIMEOUT / 4, (rank, elapsed)


def rank_single_stage_pp_group():
    """A PP group of one stage (pp_group of size 1 given) is the plain call."""
    lay = layout()
    samples = make_batch(5, num=8)
    lp, rlp, mask = ([s[k] for s in samples] for k in ("lp", "rlp", "mask"))
    solo = dist.new_group([lay.rank])
    config = ess_patch.EssLrConfig(floor=FLOOR)
    with_group = ess_patch.compute_ess_lr(lp, rlp, mask, config=config, pp_group=solo)
    return with_group.scale, ess_patch.compute_ess_lr(lp, rlp, mask, config=config).scale


def test_a_pp_group_of_one_stage_is_the_plain_call(tmp_path):
    results = run_ranks(rank_single_stage_pp_group, dp=2, tmp_path=tmp_path, timeout=60)
    for with_group, plain in results:
        assert with_group == plain == pytest.approx(_reference_scale(), rel=1e-9)
