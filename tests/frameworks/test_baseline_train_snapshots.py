"""VCPO's baseline through the real miles / slime train path on every snapshot, not only the
newest: ``test_baseline_train_step.py``'s one-process cases (``--use-ess-baseline``, rules
and exact, miles packed and padded: every token trains on ``r - b*`` from float64
per-sample norms), each snapshot in a fresh interpreter (its own ``sys.modules``) with
``MILES_SRC`` / ``SLIME_SRC`` naming it.

slime v0.2.0 schedules its micro-batches itself (``get_data_iterator(args, model,
rollout_data)``), which ``ledger_run`` reads by feature, and on this megatron-core (>= 0.15
clamps the loss normalizer as a tensor; v0.2.0 ran on 0.14 and hands it the int 1 unless it
sums per token) it trains with ``--calculate-per-token-loss``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from upstream import no_snapshot_param, run_pytest, snapshots

HERE = Path(__file__).resolve().parent
#: the snapshots test_baseline_train_step.py itself runs on (every layout there)
ALREADY = {Path(os.environ[v]).resolve() for v in ("MILES_SRC", "SLIME_SRC") if v in os.environ}
CASES = [
    pytest.param(fw, src, id=src.name) for fw, src in snapshots() if src.resolve() not in ALREADY
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
