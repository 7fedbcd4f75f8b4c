"""``ess-patch demo --quick``: real ranks, real megatron optimizer; outputs exist and agree.

Multi-process (gloo ranks from a forkserver), so marked ``dist``. Needs the ``demo`` extra
(matplotlib, tqdm) besides megatron-core.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from ess_patch import cli
from ess_patch.demo import report

pytestmark = pytest.mark.dist

FLOOR = 0.1
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rel_close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``ess-patch demo --quick`` through the CLI (default layout dp=2 x cp=2)."""
    out = tmp_path_factory.mktemp("demo") / "out"
    code = cli.main(["demo", "--quick", "--no-progress", "--out", str(out)])
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return code, out, records


def test_quick_run_writes_outputs(quick_run, capsys):
    code, out, _ = quick_run
    assert code == 0
    for name in ("steps.jsonl", "summary.json", "ess_demo.png", "config.json"):
        assert (out / name).is_file(), name
    assert (out / "ranks" / "rank0.log").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert [a["arm"] for a in summary["arms"]] == ["off", "on"]
    assert summary["config"]["dp"] == 2 and summary["config"]["cp"] == 2


def test_figure_is_a_png(quick_run):
    _, out, _ = quick_run
    data = (out / "ess_demo.png").read_bytes()
    assert data[:8] == PNG_MAGIC
    import matplotlib.image

    image = matplotlib.image.imread(out / "ess_demo.png")
    assert image.shape[0] > 300 and image.shape[1] > 300


def test_both_arms_have_the_same_steps(quick_run):
    _, _, records = quick_run
    off = [r["step"] for r in records if r["arm"] == "off"]
    on = [r["step"] for r in records if r["arm"] == "on"]
    assert off == on == list(range(12))
    assert {r["arm"] for r in records} == {"off", "on"}


def test_off_arm_applies_the_scheduled_lr(quick_run):
    _, _, records = quick_run
    for r in (r for r in records if r["arm"] == "off"):
        assert r["lr_scale"] == 1.0
        assert r["applied_lrs"] and len(r["applied_lrs"]) == len(r["scheduled_lrs"])
        assert r["applied_lrs"] == r["scheduled_lrs"], r["step"]
        assert r["update_successful"]


def test_on_arm_applies_scheduled_times_scale(quick_run):
    _, _, records = quick_run
    on = [r for r in records if r["arm"] == "on"]
    for r in on:
        assert FLOOR <= r["lr_scale"] <= 1.0
        assert 0.0 < r["rho"] <= 1.0 + 1e-12
        assert len(r["applied_lrs"]) == len(r["scheduled_lrs"])
        for applied, scheduled in zip(r["applied_lrs"], r["scheduled_lrs"]):
            assert _rel_close(applied, scheduled * r["lr_scale"]), r["step"]
        assert _rel_close(r["applied_lr"], r["scheduled_lr"] * r["lr_scale"])
        # the default rule: sqrt(rho), clamped to the floor
        assert _rel_close(r["lr_scale"], max(FLOOR, min(1.0, math.sqrt(r["rho"]))), 1e-9)
    # step 0 is on-policy (no stale version yet): nothing to scale
    assert on[0]["rho"] == pytest.approx(1.0) and on[0]["mismatch"] == pytest.approx(0.0, abs=1e-6)
    assert any(r["lr_scale"] < 1.0 for r in on)  # stale rollouts did move rho
    # the scheduler ran: warmup, so the scheduled LR changes over the run
    assert len({r["scheduled_lr"] for r in on}) > 1


def test_records_are_finite_and_consistent(quick_run):
    _, _, records = quick_run
    for r in records:
        for key in ("reward", "rho", "ess", "grad_norm", "mismatch", "mean_lag"):
            assert math.isfinite(r[key]), (key, r)
        assert 0.0 <= r["reward"] <= 1.0
        assert r["num_trajectories"] == 64  # 2 DP ranks x 8 prompts x 4 samples
        assert r["ess"] == pytest.approx(r["rho"] * r["num_trajectories"])


def test_pipeline_layout_gives_the_same_run(quick_run, tmp_path):
    """dp=2 x pp=2 sees the same global batch as dp=2 x cp=2: same numbers up to rounding."""
    from ess_patch.demo import quick_config, run

    _, _, records = quick_run
    other = run(quick_config(dp=2, cp=1, pp=2), tmp_path / "pp").records
    assert [(r["arm"], r["step"]) for r in other] == [(r["arm"], r["step"]) for r in records]
    for a, b in zip(records, other):
        for key in ("reward", "rho", "lr_scale", "mismatch", "applied_lr", "scheduled_lr"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a["step"])


def test_collapse_criterion():
    rising = [0.1 + 0.01 * i for i in range(100)]
    assert not report.collapsed(rising)
    assert report.collapsed(rising + [0.1] * 40)  # gave back all its gain
    assert not report.collapsed([0.1] * 100)  # never learned: nothing to collapse
    assert report.collapsed([0.1, float("nan")])


def _rows(arm: str, scales: list[float]) -> list[dict]:
    return [
        {"arm": arm, "step": i, "reward": 0.5, "rho": s * s, "lr_scale": s,
         "scheduled_lr": 1e-2, "applied_lr": 1e-2 * s, "mismatch": 0.1}
        for i, s in enumerate(scales)
    ]  # fmt: skip


def test_table_counts_scaled_steps():
    """399 of 400 steps scaled reads 399/400, not a rounded "100%"."""
    records = _rows("off", [1.0] * 400) + _rows("on", [1.0] + [0.99] * 399)
    summaries = report.summarize(records, ("off", "on"))
    assert [(s.scaled_steps, s.steps) for s in summaries] == [(0, 400), (399, 400)]
    table = report.format_table(summaries)
    assert "0/400 steps" in table and "399/400 steps" in table
    assert "%" not in table


def test_rho_and_scale_axes_follow_the_data():
    """rho in [0.95, 1]: the axis spans about that range (not 0-1) and keeps a line at 1.0."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    try:
        report._scale_to_data(ax, [0.95, 0.97, 1.0])
        low, high = ax.get_ylim()
        assert 0.9 < low < 0.95 and 1.0 < high < 1.01
        assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.get_lines())
    finally:
        plt.close(fig)
