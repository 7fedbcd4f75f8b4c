"""Fault injection: a fault on any rank ends in an error on every rank, never a hang.

Each world runs every fault in turn through the real advantage-hook path
(``rl_hooks.arm_from_rollout``: CP slicing, ``compute_ess_lr``, the PP exchange, arming).
The rank that fails catches its error and stays alive, as a Ray actor would, so a peer
left waiting in a collective would show as a timeout, not as "connection closed". After
each fault every rank must hold the expected error, nothing armed (the previous rollout's
scale included), and the ranks re-synchronise on a barrier before the next fault.

In every layout each rank also holds a real megatron-core optimizer (``install("megatron")``,
SGD, LR scheduler): before each rollout it has gradients and the previous rollout's scale
0.5 armed; after a failed rollout its parameters, LRs and optimizer state are bitwise what
they were, and its next ``step()`` is the plain SGD update at the scheduled LR (after a
healthy rollout: at the scheduled LR times that rollout's scale).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import pytest
import torch
import torch.distributed as dist
from dist_helpers import cp_local, dp_shard, make_batch
from harness import layout, run_ranks
from megatron_cpu import (
    batch,
    build_megatron_optimizer,
    forward_backward,
    param_triples,
    snapshot,
    snapshots_equal,
)

import ess_patch
from ess_patch.demo.cpu import megatron_on_cpu
from ess_patch.integrations.rl_hooks import Framework, Groups, arm_from_rollout

pytestmark = pytest.mark.dist

COLLECTIVE_TIMEOUT = 40.0  # a safety net only: a correct run never gets near it

# (name, which rank is faulty) -> what every rank must raise
FAULTS = ("runtime", "index", "count", "all_none", "config", "nonfinite", "none_result")


def _framework(lay) -> Framework:
    def groups() -> Groups:
        return Groups(
            cp_group=lay.cp_group if lay.cp_size > 1 else None,
            cp_rank=lay.cp_rank,
            cp_size=lay.cp_size,
            dp_group=lay.dp_group if lay.dp_size > 1 else None,
            pp_group=lay.pp_group if lay.pp_size > 1 else None,
            is_pp_last=lay.pp_rank == lay.pp_size - 1,
        )

    return Framework("test", groups, lambda a: None, lambda a: None)


def _rollout(lay, fault: str | None, faulty: bool) -> tuple[argparse.Namespace, dict]:
    samples = dp_shard(make_batch(3, num=8), lay.dp_rank, lay.dp_size)
    data = {
        "log_probs": [s["lp"] for s in samples],
        "rollout_log_probs": [s["rlp"] for s in samples],
        "loss_masks": [s["mask"] for s in samples],
        "total_lengths": [s["total"] for s in samples],
        "response_lengths": [s["response"] for s in samples],
    }
    if lay.cp_size > 1:
        lp, rlp, _ = cp_local(samples, lay.cp_rank, lay.cp_size)
        data["log_probs"], data["rollout_log_probs"] = lp, rlp
    args = argparse.Namespace(use_ess_lr=True, ess_lr_floor=0.1, qkv_format="thd")
    if faulty and fault == "runtime":
        data["log_probs"] = [t.to(torch.float16).to_sparse() for t in data["log_probs"]]
    elif faulty and fault == "index":
        args.qkv_format = "bshd"
        data["max_seq_lens"] = []  # too short: local_response_masks raises IndexError
    elif faulty and fault == "count":
        for key in ("log_probs", "rollout_log_probs", "loss_masks"):
            data[key] = data[key][:-1]
        for key in ("total_lengths", "response_lengths"):
            data[key] = data[key][:-1]
    elif faulty and fault == "all_none":
        for key in ("log_probs", "rollout_log_probs", "loss_masks"):
            data[key] = None
    elif faulty and fault == "config":
        args.ess_lr_floor = 0.9
    elif faulty and fault == "nonfinite":
        data["log_probs"][0] = data["log_probs"][0].clone().fill_(float("nan"))
        data["loss_masks"][0] = torch.ones_like(data["loss_masks"][0])
    elif faulty and fault == "none_result":
        data["log_probs"] = "not a list"
    return args, data


def _step_is_plain_sgd(setup, scale: float) -> bool:
    """``optimizer.step()``, then: is every update ``p - lr * scale * grad`` exactly (lr the
    scheduled one, restored in the group afterwards)? Then the scheduler steps."""
    before = [(g["lr"], p.detach().clone()) for g, p, _ in param_triples(setup.optimizer)]
    ok, _, _ = setup.optimizer.step()
    exact = bool(ok)
    for (lr, p0), (group, p1, _) in zip(before, param_triples(setup.optimizer), strict=True):
        exact &= p1.grad is not None and bool(p1.grad.abs().sum() > 0)
        exact &= torch.equal(p1.detach(), p0.add(p1.grad, alpha=-(lr * scale)))
        exact &= group["lr"] == lr
    setup.scheduler.step(increment=1)
    return exact


def rank_faults(faulty_ranks: list[int], with_optimizer: bool = False):
    """Per (faulty rank, fault): (error type name or None, message head, seconds, armed
    after, optimizer untouched by the rollout, next step exact, scale) -- the optimizer
    entries None without an optimizer. One healthy rollout first, keyed (None, None)."""
    lay = layout()
    framework = _framework(lay)
    out = {}
    cases = [(None, None)] + [(f, fault) for f in faulty_ranks for fault in FAULTS]
    with megatron_on_cpu() if with_optimizer else contextlib.nullcontext():
        setup = None
        if with_optimizer:
            ess_patch.install("megatron")
            setup = build_megatron_optimizer("multi_fp32", optimizer="sgd")
        for index, (faulty, fault) in enumerate(cases):
            before = None
            if setup is not None:
                forward_backward(setup, *batch(lay.rank, index))
                before = snapshot(setup)
            ess_patch.arm(0.5)  # the "previous rollout": must not survive a failed one
            args, data = _rollout(lay, fault, lay.rank == faulty)
            start = time.monotonic()
            result = None
            try:
                result = arm_from_rollout(framework, args, data)
                outcome = (None, result.status)
            except Exception as exc:  # stay alive, as a Ray actor does
                outcome = (type(exc).__name__, str(exc)[:200])
            elapsed = time.monotonic() - start
            armed = ess_patch.armed()
            untouched = step_exact = None
            if setup is not None:
                untouched = snapshots_equal(before, snapshot(setup))
                step_exact = _step_is_plain_sgd(setup, 1.0 if result is None else result.scale)
            out[(faulty, fault)] = (
                *outcome,
                elapsed,
                None if armed is None else armed.scale,
                untouched,
                step_exact,
                None if result is None else result.scale,
            )
            dist.barrier()  # every rank got here: nobody is stuck in a collective
        if with_optimizer:
            ess_patch.uninstall()
    ess_patch.disarm()
    return out


def _is_last_stage(rank: int, lay: tuple[int, int, int]) -> bool:
    # Megatron's default order "tp-cp-ep-dp-pp": the pipeline stage is the slowest index
    dp, cp, pp = lay
    return rank // (dp * cp) == pp - 1


def _no_fault(fault: str, faulty: int, lay: tuple[int, int, int]) -> bool:
    """Faults that are valid input where they are injected: every rank gets the result."""
    cp = lay[1]
    if fault in ("count", "index") and cp == 1:
        return True  # without CP: valid input (fewer samples), or no mask slicing at all
    # a non-last stage's inputs are not used: fewer samples, or none at all, are no fault
    return fault in ("count", "all_none") and not _is_last_stage(faulty, lay)


def _expect(fault: str, rank: int, faulty: int, lay: tuple[int, int, int]) -> set[str]:
    dp, cp, pp = lay
    if fault == "config":
        return {"ConfigMismatchError", "InvalidInputsElsewhereError"}
    if fault == "nonfinite":
        return {"NonFiniteLogProbError", "InvalidInputsElsewhereError"}
    if fault == "count" and cp > 1:
        same_cp = {r for r in range(dp * cp * pp) if r // cp == faulty // cp}
        return {"EssPatchValueError"} if rank in same_cp else {"InvalidInputsElsewhereError"}
    if rank == faulty:
        return {
            # the injected fault's own type, or ess-patch's error naming it (EssPatch*)
            "runtime": {"RuntimeError", "TypeError", "NotImplementedError", "EssPatchValueError"},
            "index": {"IndexError", "EssPatchValueError"},
            "count": {"EssPatchValueError"},
            "all_none": {"EssPatchValueError"},
            "none_result": {"TypeError", "EssPatchTypeError", "EssPatchValueError"},
        }[fault]
    return {"InvalidInputsElsewhereError"}


# faults whose error is the faulty rank's alone (a NaN or a CP count is found by several)
_OWN_ERROR = ("runtime", "index", "all_none", "none_result")

# (1, 1, 3): a middle pipeline stage
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (1, 1, 3), (2, 2, 2)]
# the layouts whose ranks also hold a real megatron optimizer (cheap: all of them)
WITH_OPTIMIZER = set(LAYOUTS)


@pytest.mark.parametrize(("dp", "cp", "pp"), LAYOUTS, ids=lambda v: str(v))
def test_every_fault_reaches_every_rank(tmp_path, dp, cp, pp):
    """Each fault injected at every rank position in turn (each DP, CP index, PP stage)."""
    world = dp * cp * pp
    lay = (dp, cp, pp)
    with_optimizer = lay in WITH_OPTIMIZER
    results = run_ranks(
        rank_faults,
        dp=dp,
        cp=cp,
        pp=pp,
        args=(list(range(world)), with_optimizer),
        tmp_path=tmp_path,
        timeout=300,
        collective_timeout=COLLECTIVE_TIMEOUT,
    )
    healthy = {r[(None, None)][1] for r in results}
    assert healthy == {"ok"}, results[0][(None, None)]
    scales = {r[(None, None)][6] for r in results}
    assert len(scales) == 1 and (healthy_scale := scales.pop()) < 1.0  # really scaled
    if with_optimizer:
        for case in results[0]:
            for rank, r in enumerate(results):
                # the rollout, failed or not, touched no parameter, LR or optimizer state;
                # the next step used the scheduled LR (times the scale only if it succeeded)
                assert r[case][4] is True, (case, rank, "optimizer changed by the rollout")
                assert r[case][5] is True, (case, rank, "next step not the expected SGD")
    for faulty in range(world):
        for fault in FAULTS:
            case = (faulty, fault)
            if fault == "all_none" and cp == 1 and _is_last_stage(faulty, lay):
                # without CP peers a rank with no inputs makes the rollout "missing": ESS-LR
                # was requested and cannot be measured, so every rank stops (fail closed, since
                # 0.4.0; 0.3.0 trained that rollout unscaled), with nothing left armed
                assert {r[case][0] for r in results} == {"EssLrNotAppliedError"}, [
                    r[case] for r in results
                ]
                assert {r[case][3] for r in results} == {None}, case
                continue
            if _no_fault(fault, faulty, lay):
                assert {r[case][:2] for r in results} == {(None, "ok")}, [r[case] for r in results]
                if not _is_last_stage(faulty, lay):  # its inputs are not used
                    assert {r[case][6] for r in results} == {healthy_scale}, case
                continue
            for rank, r in enumerate(results):
                kind, message, elapsed, armed = r[case][:4]
                if fault != "config" and kind == "ConfigMismatchError":
                    pytest.fail(f"{case}: rank {rank} got {message}")
                expected = _expect(fault, rank, faulty, lay)
                assert kind in expected, (case, rank, kind, message)
                assert armed is None, (case, rank, "a failed rollout left a scale armed")
                assert elapsed < COLLECTIVE_TIMEOUT / 4, (case, rank, elapsed)
                if kind == "InvalidInputsElsewhereError" and fault in _OWN_ERROR:
                    # names the rank the fault came from, wherever it was relayed
                    assert f"rank(s) {faulty}" in message, (case, rank, message)
            kinds = [r[case][0] for r in results]
            if fault == "config":
                assert "ConfigMismatchError" in kinds, kinds
            if fault == "nonfinite":
                assert kinds[faulty] == "NonFiniteLogProbError", kinds


def rank_outside_group():
    lay = layout()
    only_zero = dist.new_group([0])
    lp, rlp, mask = [torch.zeros(3)], [torch.zeros(3)], [torch.ones(3)]
    try:
        ess_patch.compute_ess_lr(lp, rlp, mask, dp_group=only_zero)
        return lay.rank, None
    except ValueError as exc:
        return lay.rank, str(exc)


def test_a_rank_outside_the_group_it_is_given_raises(tmp_path):
    results = run_ranks(rank_outside_group, dp=2, tmp_path=tmp_path, timeout=60)
    assert results[0] == (0, None)  # rank 0 is the group's only member: local result
    assert results[1][1] is not None and "not a member of the DP group" in results[1][1]
