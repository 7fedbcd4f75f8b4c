"""The demo's BaselineGlue: its clear errors (on a real one-rank megatron setup).

Its numbers (norms, b*, the rewritten gradient) are checked against one backward per
trajectory in tests/test_per_trajectory_dist.py.
"""

from __future__ import annotations

import pytest
from baseline_ranks import glue_errors
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
