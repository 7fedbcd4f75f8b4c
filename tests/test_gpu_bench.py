"""benchmarks/gpu.py: skips cleanly without a GPU; on CPU (``--device cpu --quick``) every
section's code path runs: the estimator, the collectives on a 1-rank gloo group, and the
wrapped ``optimizer.step()`` of a real megatron-core DistributedOptimizer (CPU shim)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench_path(monkeypatch):
    """``benchmarks/`` importable for one test. Not at module level: the repository root on
    sys.path would shadow the installed wheel (and its metadata) for every later test."""
    monkeypatch.syspath_prepend(str(ROOT))


def parse_tables(text: str) -> dict[str, list[dict[str, str]]]:
    """Rows (header -> cell) of every markdown table, by the ``## `` title above it."""
    out: dict[str, list[dict[str, str]]] = {}
    title, header = None, None
    for line in text.splitlines():
        if line.startswith("## "):
            title, header = line, None
            out[title] = []
        elif line.startswith("|") and title is not None:
            if set(line) <= set("|-: "):
                continue  # the alignment row
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
            else:
                out[title].append(dict(zip(header, cells, strict=True)))
    return out


def world_is_clean() -> None:
    """Nothing the dry run set up outlives it (it runs inside the pytest process)."""
    from megatron.core import parallel_state

    import ess_patch

    assert not dist.is_initialized()
    assert not parallel_state.model_parallel_is_initialized()
    assert not ess_patch.is_installed()
    assert ess_patch.armed() is None
    assert not torch.overrides._get_current_function_mode_stack()  # the CPU shim is gone


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


def test_cpu_dry_run_runs_every_section(tmp_path, monkeypatch, clean_ess, bench_path):
    pytest.importorskip("megatron.core")
    from benchmarks import gpu

    # the "as issued" paths must really run the collectives (ess_patch skips them at 1 rank)
    issued = {"all_reduce": 0, "all_gather": 0}
    for name in issued:
        original = getattr(dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            issued[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(dist, name, counted)

    out = tmp_path / "gpu.md"
    assert gpu.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    world_is_clean()
    text = out.read_text()
    assert "FAILED" not in text and "MISSED" not in text
    tables = parse_tables(text)
    assert set(tables) == {
        gpu.ESTIMATOR_TITLE,
        gpu.COLLECTIVES_TITLE,
        gpu.STEP_TITLE,
        gpu.gpu_baseline.TITLE,
    }

    # 1. the estimator: 2 sizes x (fp32, bf16), the same ops whatever B and dtype (the one
    # torch path every device runs), one host read (finalize's)
    est = tables[gpu.ESTIMATOR_TITLE]
    assert [r["dtype"] for r in est] == ["float32", "bfloat16"] * 2
    assert len({r["B"] for r in est}) == 2
    for column in ("aten ops", "kernels"):
        counts = {int(r[column]) for r in est}
        assert len(counts) == 1 and 0 < counts.pop() <= gpu.MAX_ESTIMATOR_OPS, column
    assert all(float(r["best ms"]) > 0 and r["host syncs"] == "n/a" for r in est)
    assert all(r["host reads (dispatch)"] == "1" for r in est)

    # 2. the collectives: ess_patch's call (a view at most) and the same collective as issued
    coll = tables[gpu.COLLECTIVES_TITLE]
    assert len(coll) == 2 * (1 + len(gpu.TABLE_ROWS) + 2)
    assert all(r["same result"] == "yes" for r in coll)
    for ours, as_issued in zip(coll[::2], coll[1::2], strict=True):
        assert ours["collective"] == as_issued["collective"]
        assert ours["path"].startswith("ess_patch") and as_issued["path"].startswith("as issued")
        assert int(ours["aten ops"]) <= 1 and int(ours["kernels"]) <= 1
        assert int(as_issued["aten ops"]) >= 1
    assert "B=32768" in coll[-6]["collective"] and "(32768, 3) float64" in coll[-6]["payload"]
    assert issued["all_reduce"] > 0 and issued["all_gather"] > 0
    assert "gloo world of one rank" in text

    # 3. the wrapped step: the same ops in every variant
    step = tables[gpu.STEP_TITLE]
    assert [r["variant"] for r in step] == [gpu.STEP_LABELS[v] for v in gpu.STEP_VARIANTS]
    for column in ("aten ops", "kernels"):
        counts = {int(r[column]) for r in step}
        assert len(counts) == 1 and counts.pop() > 0, column
    assert all(r["extra ops / kernels / syncs"] == "+0 / +0 / n/a" for r in step)
    assert all(float(r["best ms/step"]) > 0 for r in step)
    assert "bfloat16 params on cpu" in text
    assert "ChainedOptimizer[DistributedOptimizer]" in text

    # 4. the baseline: on CPU the local spec stands in (said so), both paths agree with one
    # backward per trajectory at float32 tolerance
    base = tables[gpu.gpu_baseline.TITLE]
    assert [r["path"] for r in base] == ["brute force", "rules", "exact"]
    assert all(r["spec"] == "local (TE check not run)" for r in base)
    for r in base[1:]:
        assert r["ok"] == "ok" and float(r["max rel err vs brute force"]) < 1e-4, r
    assert "the TE check" in text or "TE's layers" in text


def test_a_failing_section_is_reported_and_the_world_torn_down(
    tmp_path, monkeypatch, clean_ess, bench_path
):
    pytest.importorskip("megatron.core")
    from benchmarks import gpu

    def broken(*args, **kwargs):
        raise RuntimeError("step section broke")

    monkeypatch.setattr(gpu, "step_section", broken)
    monkeypatch.setattr(gpu, "QUICK_TOKENS", (1 << 12,))
    monkeypatch.setattr(gpu, "TABLE_ROWS", (16,))
    out = tmp_path / "gpu.md"
    assert gpu.main(["--device", "cpu", "--quick", "--out", str(out)]) == 1
    world_is_clean()
    tables = parse_tables(out.read_text())
    assert len(tables[gpu.ESTIMATOR_TITLE]) == 2
    assert len(tables[gpu.COLLECTIVES_TITLE]) == 2 * 4
    assert tables[gpu.STEP_TITLE] == []
    assert "FAILED" in out.read_text() and "step section broke" in out.read_text()
