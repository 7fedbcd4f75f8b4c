"""Faults through the REAL miles / slime ``compute_advantages_and_returns`` (issue 13).

The fault matrix of ``tests/test_faults_dist.py`` drives ``rl_hooks.arm_from_rollout``
directly; here the same faults go through the upstream function as ``install()`` patches it,
in a DP=2 x CP=2 gloo world with each framework's own CP slicing and its own collectives
(advantage whitening over DP) interleaved with ours. One rank (DP 1, CP 1) is faulty:

- a NaN train log-prob: ``NonFiniteLogProbError`` there, ``InvalidInputsElsewhereError`` or
  the same error elsewhere;
- one trajectory fewer than its CP peer: ``ValueError`` (each CP rank's count) on both CP
  ranks of that DP rank, ``InvalidInputsElsewhereError`` on the others;
- ``--ess-lr-floor 0.9`` where the others have 0.1: ``ConfigMismatchError`` /
  ``InvalidInputsElsewhereError``.

The failing rank stays alive (a Ray actor does). Every rank must end with its error in a
small fraction of the gloo timeout, with nothing armed (the previous rollout's scale 0.5
cleared), and with the advantages the upstream function wrote bitwise equal to an unpatched
call on the same inputs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared helpers
from harness import run_ranks
from rollouts import CP, DP, host_args, local_batch
from upstream import miles_parallel_state, skip_reason

import ess_patch

LOSS = {fw: skip_reason(fw, "loss") for fw in ("miles", "slime")}

COLLECTIVE_TIMEOUT = 60.0  # a safety net only: a correct run is far below it
FAULTS = ("nonfinite", "count", "config")
FAULTY = (1, 1)  # (DP rank, CP rank) of the faulty rank


def _faulty_input(fw: str, fault: str | None, faulty: bool, batch: dict) -> tuple:
    data = {k: list(v) for k, v in batch.items()}
    args = host_args(fw)
    if not faulty or fault is None:
        return args, data
    if fault == "nonfinite":
        data["log_probs"][0] = torch.full_like(data["log_probs"][0], float("nan"))
        data["loss_masks"][0] = torch.ones_like(data["loss_masks"][0])
    elif fault == "count":
        data = {k: v[:-1] for k, v in data.items()}
    elif fault == "config":
        args.ess_lr_floor = 0.9
    return args, data


def rank_faults(fw: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    if fw == "miles":
        import miles.backends.training_utils.loss as loss
        from miles.backends.training_utils.cp_utils import slice_log_prob_with_cp

        miles_parallel_state()
    else:
        import slime.backends.megatron_utils.loss as loss
        from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=False)
    dp_size = mpu.get_data_parallel_world_size(with_context_parallel=False)
    cp_rank = mpu.get_context_parallel_rank()
    faulty = (dp_rank, cp_rank) == FAULTY
    _, batch = local_batch(slice_log_prob_with_cp, dp_rank, dp_size)
    cases = (None, *FAULTS)

    # the unpatched upstream call on exactly the inputs of each case (same world, same peers)
    plain = {}
    for fault in cases:
        args, data = _faulty_input(fw, fault, faulty, batch)
        loss.compute_advantages_and_returns(args, data)
        plain[fault] = data["advantages"]

    ess_patch.install(["megatron", fw])
    out = {"coords": (dp_rank, cp_rank)}
    for fault in cases:
        args, data = _faulty_input(fw, fault, faulty, batch)
        ess_patch.arm(0.5)  # the previous rollout's scale: a failed rollout must clear it
        start = time.monotonic()
        try:
            loss.compute_advantages_and_returns(args, data)
            outcome = (None, "ok")
        except Exception as exc:  # stay alive, as a Ray actor does
            outcome = (type(exc).__name__, str(exc)[:300])
        elapsed = time.monotonic() - start
        armed = ess_patch.armed()
        advantages = data.get("advantages")
        same = advantages is not None and all(
            torch.equal(a, b) for a, b in zip(advantages, plain[fault], strict=True)
        )
        out[fault] = (*outcome, elapsed, None if armed is None else armed.scale, same)
        dist.barrier()  # every rank got here: nobody is stuck in a collective
    ess_patch.uninstall()
    return out


def _expected(fault: str, coords: tuple[int, int]) -> set[str]:
    if fault == "nonfinite":
        if coords == FAULTY:
            return {"NonFiniteLogProbError"}
        return {"NonFiniteLogProbError", "InvalidInputsElsewhereError"}
    if fault == "count":
        return {"EssPatchValueError"} if coords[0] == FAULTY[0] else {"InvalidInputsElsewhereError"}
    return {"ConfigMismatchError", "InvalidInputsElsewhereError"}


@pytest.mark.dist
@pytest.mark.parametrize(
    "fw",
    [
        pytest.param(fw, marks=pytest.mark.skipif(LOSS[fw] is not None, reason=LOSS[fw] or ""))
        for fw in ("miles", "slime")
    ],
)
def test_faults_through_the_real_advantage_hook_reach_every_rank(fw, tmp_path):
    results = run_ranks(
        rank_faults,
        dp=DP,
        cp=CP,
        args=(fw,),
        tmp_path=tmp_path,
        timeout=240,
        collective_timeout=COLLECTIVE_TIMEOUT,
    )
    assert sorted(r["coords"] for r in results) == [(d, c) for d in range(DP) for c in range(CP)]
    healthy = [r[None] for r in results]
    assert {h[:2] for h in healthy} == {(None, "ok")}, healthy
    scales = {h[3] for h in healthy}
    assert len(scales) == 1 and scales.pop() < 1.0  # a real scale was armed, the same everywhere
    assert all(h[4] for h in healthy)  # advantages bitwise as upstream wrote them
    for fault in FAULTS:
        kinds = []
        for r in results:
            kind, message, elapsed, armed, same = r[fault]
            kinds.append(kind)
            assert kind in _expected(fault, r["coords"]), (fault, r["coords"], kind, message)
            assert armed is None, (fault, r["coords"], "the previous rollout's scale survived")
            assert elapsed < COLLECTIVE_TIMEOUT / 10, (fault, r["coords"], elapsed)
            # the upstream function completed before our hook failed: its output is untouched
            assert same, (fault, r["coords"], "advantages differ from the unpatched call")
        if fault == "config":
            assert "ConfigMismatchError" in kinds, kinds
        if fault == "count":
            messages = [r[fault][1] for r in results if r["coords"][0] == FAULTY[0]]
            assert all("different numbers of trajectories" in m for m in messages), messages
