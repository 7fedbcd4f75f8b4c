"""VCPO's baseline through the real miles / slime train path on every snapshot, not only the
newest: ``test_baseline_train_step.py``'s one-process cases (``--use-ess-baseline``, rules
and exact, miles packed and padded: every token trains on ``r - b*`` from float64
per-sample norms), each snapshot in a fresh interpreter (its own ``sys.modules``) with
``MILES_SRC`` / ``SLIME_SRC`` naming it.

The one snapshot left out, by name: slime v0.2.0. ``ledger_run`` lays the rollout out as
slime v0.3 does (``num_microbatches``, ``micro_batch_indices``), which v0.2.0's train loop does
not read; its baseline hook is tested on the framework's own routine in
``test_baseline_frameworks.py``, as every snapshot's is.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from upstream import no_snapshot_param, run_pytest, snapshots

HERE = Path(__file__).resolve().parent
#: the rollout layout ledger_run writes is slime v0.3's (see the module docstring)
NOT_HERE = {"slime-v0.2.0"}
#: the snapshots test_baseline_train_step.py itself runs on (every layout there)
ALREADY = {Path(os.environ[v]).resolve() for v in ("MILES_SRC", "SLIME_SRC") if v in os.environ}
CASES = [
    pytest.param(fw, src, id=src.name)
    for fw, src in snapshots()
    if src.name not in NOT_HERE and src.resolve() not in ALREADY
] or [no_snapshot_param()]


@pytest.mark.parametrize(("fw", "src"), CASES)
def test_each_snapshot_trains_on_r_minus_b_star(fw, src, tmp_path):
    """The snapshot's one-process train-path cases pass (both paths), none skipped."""
    env = {**os.environ, f"{fw.upper()}_SRC": str(src)}
    passed, skipped, tail = run_pytest(
        HERE / "test_baseline_train_step.py",
        env,
        tmp_path,
        timeout=600,
        extra_args=["-k", f"test_{fw}_trains"],
    )
    assert not skipped, skipped
    # rules and exact; miles also packed (thd) and padded (bshd)
    assert len(passed) == (4 if fw == "miles" else 2), tail
