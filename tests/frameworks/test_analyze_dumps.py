"""``ess-patch analyze`` on dumps written by the REAL miles and slime writers (snapshots).

- miles: ``miles.utils.train_dump_utils.save_debug_train_data`` on every rank of a CP=2 x DP=2
  gloo world, log-probs CP-sliced by miles' own ``slice_log_prob_with_cp``: one file per rank
  and rollout with ``cp_rank``/``cp_size``/``qkv_format``;
- slime: ``slime.observability.train_data_utils.save_debug_train_data`` in the same world
  (it all-gathers the CP fields and gathers the DP shards into one file per rollout);
- each number analyze reports equals the float64 reference over the full rollout; the dumps
  load with ``torch.load(weights_only=True)``; bad input from the real writers (a missing
  rank, no train log-probs, slime's rollout-only dump) is refused with a clear message.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared helpers
from analyze_data import SIGMAS, check_against_reference, make_rollout
from harness import run_ranks
from upstream import miles_parallel_state, skip_reason

from ess_patch.analyze import analyze
from ess_patch.cli import main

LOSS = {fw: skip_reason(fw, "loss") for fw in ("miles", "slime")}
DP, CP = 2, 2


def _needs(fw: str):
    return pytest.mark.skipif(LOSS[fw] is not None, reason=LOSS[fw] or "")


def _batch(slice_log_prob, rid: int, dp_rank: int) -> dict:
    """This rank's rollout_data: its DP share, log-probs CP-sliced by the framework."""
    mine = [i for i in range(len(make_rollout(rid, 0.0))) if i % DP == dp_rank]
    full = make_rollout(rid, SIGMAS[rid])
    data = {
        k: []
        for k in (
            "log_probs",
            "rollout_log_probs",
            "loss_masks",
            "total_lengths",
            "response_lengths",
            "partition",
        )
    }
    for i in mine:
        s = full[i]
        data["log_probs"].append(slice_log_prob(s["lp"], s["total"], s["resp"]))
        data["rollout_log_probs"].append(slice_log_prob(s["rlp"], s["total"], s["resp"]))
        data["loss_masks"].append(s["mask"])
        data["total_lengths"].append(s["total"])
        data["response_lengths"].append(s["resp"])
        data["partition"].append(i)
    return data


def rank_dump(fw: str, folder: str) -> int:
    from megatron.core import parallel_state as mpu

    args = Namespace(save_debug_train_data=folder + "/{rollout_id}_{rank}.pt", qkv_format="thd")
    if fw == "miles":
        from miles.backends.training_utils.cp_utils import slice_log_prob_with_cp
        from miles.utils.train_dump_utils import save_debug_train_data

        miles_parallel_state()
    else:
        from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp
        from slime.observability.train_data_utils import save_debug_train_data
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=False)
    for rid in range(len(SIGMAS)):
        data = _batch(slice_log_prob_with_cp, rid, dp_rank)
        save_debug_train_data(args, rollout_id=rid, rollout_data=data)
    return torch.distributed.get_rank()


def _dumps(fw: str, tmp_path: Path) -> Path:
    folder = tmp_path / f"{fw}_train_data"
    folder.mkdir()
    run_ranks(
        rank_dump,
        dp=DP,
        cp=CP,
        args=(fw, str(folder)),
        tmp_path=tmp_path,
        timeout=180,
        gloo_groups=True,
    )
    return folder


@pytest.mark.dist
@pytest.mark.parametrize("fw", [pytest.param(f, marks=_needs(f)) for f in ("miles", "slime")])
def test_real_dumps_match_the_float64_reference(fw, tmp_path, capsys):
    folder = _dumps(fw, tmp_path)
    files = sorted(folder.glob("*.pt"))
    per_rollout = DP * CP if fw == "miles" else 1  # slime gathers CP and DP into one file
    assert len(files) == len(SIGMAS) * per_rollout
    first = torch.load(files[0], weights_only=True)  # the real layout is weights_only-safe
    if fw == "miles":
        assert {first["cp_size"], first["qkv_format"]} == {CP, "thd"}
    else:
        assert first["format_version"] == 2
    out = tmp_path / "out"
    assert main(["analyze", str(folder), "--out", str(out), "--no-progress"]) == 0
    assert "mean scale" in capsys.readouterr().out
    result = analyze([folder], tmp_path / "again", figure=False)
    check_against_reference(result.rows, [make_rollout(r, s) for r, s in enumerate(SIGMAS)])
    assert any(r["scale"] < 1 for r in result.rows)
    if fw == "miles":
        # A rank's file lost: its CP peer's slice has no partner.
        (folder / "1_2.pt").unlink()
        assert main(["analyze", str(folder), "--out", str(tmp_path / "bad"), "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert "rollout 1" in err and "lacks CP slice" in err
        assert not (tmp_path / "bad").exists()


@_needs("miles")
def test_miles_dump_without_train_log_probs(tmp_path, capsys):
    from miles.utils.train_dump_utils import save_debug_train_data_for_rank

    args = Namespace(
        save_debug_train_data=str(tmp_path / "{rollout_id}_{rank}.pt"), qkv_format="thd"
    )
    s = make_rollout(0, 0.1)[0]
    data = {
        "rollout_log_probs": [s["rlp"]],
        "loss_masks": [s["mask"]],
        "total_lengths": [s["total"]],
        "response_lengths": [s["resp"]],
    }
    save_debug_train_data_for_rank(args, rollout_id=0, rollout_data=data, rank=0)
    assert main(["analyze", str(tmp_path / "0_0.pt"), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "no train log-probs" in err and "--use-rollout-logprobs" in err


@_needs("slime")
def test_slime_rollout_only_dump_is_refused(tmp_path, capsys):
    from slime.observability.rollout_data_utils import save_debug_rollout_data
    from slime.utils.types import Sample

    samples = [
        Sample(
            prompt="p",
            tokens=[1, 2, 3],
            response="r",
            response_length=2,
            reward=1.0,
            rollout_log_probs=[-0.5, -0.2],
        )
    ]
    save_debug_rollout_data(
        str(tmp_path / "rollout_data/{rollout_id}.pt"), samples, rollout_id=0, evaluation=False
    )
    dump = tmp_path / "rollout_data" / "0.pt"
    torch.load(dump, weights_only=True)  # loads safely: plain dicts and lists
    assert main(["analyze", str(dump), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "--save-debug-rollout-data" in err and "no train log-probs" in err
