"""The demo's BaselineGlue: its clear errors, and PerTrajectoryGrads without DDP.

Its numbers (norms, b*, the rewritten gradient) are checked against one backward per
trajectory in tests/test_per_trajectory_dist.py.
"""

from __future__ import annotations

import pytest
from baseline_ranks import dp_fault, glue_errors, plain_autograd
from harness import run_ranks

pytestmark = pytest.mark.dist


def test_glue_errors_name_the_problem_and_change_nothing(tmp_path):
    out = run_ranks(glue_errors, timeout=120, tmp_path=tmp_path)[0]
    assert "finalize_model_grads_func is None" in out["no_finalize"]
    assert "3 rewards but 2 group ids" in out["begin_shapes"]
    assert "without begin(rewards, group_ids)" in out["no_begin"]
    assert out["grads_kept"] == "True"
    assert "trained 6 trajectories on this rank but begin() got 5" in out["rows"]
    assert out["grads_kept_rows"] == "True"
    assert out["restored"] == "True"
    assert "0 (Linear)" in out["unsupported"]


@pytest.mark.parametrize(
    ("kind", "error", "mine", "other"),
    [
        ("nan_reward", "NonFiniteBaselineInputError", "(this rank;", "(another rank;"),
        ("rows", "EssPatchRuntimeError", "got 5 rewards", "on another rank"),
    ],
)
def test_a_fault_on_one_dp_rank_raises_on_every_rank_before_any_write(
    tmp_path, kind, error, mine, other
):
    rank0, rank1 = run_ranks(dp_fault, dp=2, args=(kind,), timeout=120, tmp_path=tmp_path)
    for r in (rank0, rank1):
        assert r["error"] is not None and r["error"].startswith(error), r["error"]
        assert r["kept"] and not r["reached"]
    assert mine in rank1["error"]
    assert other in rank0["error"]


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "autograd-then-overwritten"])
def test_per_trajectory_grads_without_ddp_write_param_grad(tmp_path, defer):
    out = run_ranks(plain_autograd, args=(defer,), timeout=120, tmp_path=tmp_path)[0]
    assert out["sq"] < 2e-5 and out["grad"] < 2e-5, out
    assert out["any_frozen_after"] == 0.0  # stop() gave every weight its requires_grad back
