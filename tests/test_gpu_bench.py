"""benchmarks/gpu.py: skips cleanly without a GPU; its counting and table run on CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path needs a machine without a GPU")
def test_without_gpu_prints_one_line_and_exits_zero(tmp_path):
    out = tmp_path / "gpu.md"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": ""},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "skipped, no CUDA GPU" in lines[0]
    assert not out.exists()


def test_cpu_dry_run_counts_ops_and_writes_the_table(tmp_path):
    sys.path.insert(0, str(ROOT))
    from benchmarks import gpu

    out = tmp_path / "gpu.md"
    assert gpu.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("|") and "M |" in line]
    assert len(rows) == 4  # 2 sizes x (fp32, bf16)
    # the op count is constant in B: same count at both sizes
    counts = {int(r.split("|")[5]) for r in rows}
    assert len(counts) == 1 and counts.pop() > 0
    assert "all_gather (nccl, 1 rank)" in text
