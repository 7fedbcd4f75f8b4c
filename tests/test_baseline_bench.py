"""benchmarks/baseline_bench.py runs, and its VCPO-style loop (one backward per trajectory, two
buffers) gives the same gradient as the one-pass glue: an independent check of the rewrite
through a second, brute-force implementation on the demo's real trainer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_baseline_bench_quick_runs_and_the_two_ways_agree():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.baseline_bench", "--quick", "--repeats", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| demo")]
    assert len(rows) == 1, out.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert float(cells[-1]) < 1e-5  # one-pass vs one backward per trajectory
    assert cells[2] == "32"  # trajectories per step: the demo's 8 prompts x 4
