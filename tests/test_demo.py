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


# --- stress scenario (issue 15) ---------------------------------------------------------------


def test_stress_config_is_the_selected_scenario():
    from ess_patch.demo.stress import STRESS_ARMS, stress_config

    cfg = stress_config()
    # What benchmarks/stress_select.py chose from the off arm alone, and the four arms.
    assert (cfg.is_level, cfg.lag, cfg.lr, cfg.clip_grad, cfg.steps) == (
        "sequence",
        16,
        0.1,
        1.0,
        150,
    )
    assert (cfg.dp, cfg.cp, cfg.pp) == (2, 1, 1)
    assert cfg.arms == STRESS_ARMS == ("off", "geometric", "product", "constant")
    assert cfg.control_of == "product"
    assert stress_config(steps=7).steps == 7


def test_constant_arm_must_follow_its_control():
    from ess_patch.demo import DemoConfig

    with pytest.raises(ValueError, match="control_of='product', which must come before it"):
        DemoConfig(arms=("off", "constant", "product"))
    with pytest.raises(ValueError, match="is_level='tokens'"):
        DemoConfig(is_level="tokens")


def test_bootstrap_ci_hand_values():
    from ess_patch.demo.stats import bootstrap_ci

    assert bootstrap_ci([0.3] * 5) == (0.3, 0.3)
    # Two values: resampled means are a, (a+b)/2, b with P = 1/4, 1/2, 1/4, so the 2.5% and
    # 97.5% points are a and b.
    assert bootstrap_ci([1.0, 3.0]) == (1.0, 3.0)
    # [0, 0, 0, 0, 1]: the resampled mean is Binomial(5, 0.2) / 5. P(0) = 0.328 > 2.5%, so
    # the low end is 0; P(k <= 2) = 0.942 < 97.5% <= P(k <= 3) = 0.993, so the high end is 0.6.
    assert bootstrap_ci([0.0, 0.0, 0.0, 0.0, 1.0]) == (0.0, 0.6)
    # 80%: P(k <= 1) = 0.737 < 90% <= P(k <= 2) = 0.942, so 0.4.
    assert bootstrap_ci([0.0, 0.0, 0.0, 0.0, 1.0], level=0.8) == (0.0, 0.4)
    with pytest.raises(ValueError, match="at least one value"):
        bootstrap_ci([])


def test_paired_differences_hand_values():
    from ess_patch.demo.stats import paired

    p = paired("product", [0.5, 0.7, 0.2, 0.9], "off", [0.25, 0.7, 0.5, 0.4])
    assert p.diffs == (0.25, 0.0, -0.3, 0.5)
    assert p.mean == pytest.approx(0.1125)
    assert p.wins == 2 and p.n == 4  # a tie is not a win
    assert -0.3 <= p.ci_low <= p.mean <= p.ci_high <= 0.5
    with pytest.raises(ValueError, match="paired\\('product', 'off'\\): need the same"):
        paired("product", [0.1, 0.2], "off", [0.1])


def test_stress_flags_need_the_stress_scenario(capsys):
    assert cli.main(["demo", "--seeds", "3", "--no-progress"]) == 2
    assert "--seeds and --lags need --scenario stress" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["demo", "--scenario", "stress", "--lags", "4,x"])


def test_short_stress_run_pairs_arms(tmp_path):
    from ess_patch.demo.stress import run_stress, stress_config

    cfg = stress_config(steps=6, lag=4)
    result = run_stress(cfg, tmp_path, seeds=2)
    rows = [json.loads(line) for line in result.steps_path.read_text().splitlines()]
    for seed in (0, 1):
        by_arm = {
            arm: sorted(
                (r for r in rows if r["seed"] == seed and r["arm"] == arm), key=lambda r: r["step"]
            )
            for arm in cfg.arms
        }
        # Same seed per arm: the first rollout (same weights, same sampling seed) is identical.
        first = {arm: (rs[0]["reward"], rs[0]["rho"]) for arm, rs in by_arm.items()}
        assert len(set(first.values())) == 1, first
        # The control's multiplier is the mean scale of the same seed's product run.
        product_scales = [r["lr_scale"] for r in by_arm["product"]]
        mean_scale = sum(product_scales) / len(product_scales)
        assert product_scales != [1.0] * len(product_scales)  # it did brake
        for r in by_arm["constant"]:
            assert _rel_close(r["lr_scale"], mean_scale)
            assert _rel_close(r["applied_lr"], r["scheduled_lr"] * mean_scale, rel=1e-5)
        assert all(r["lr_scale"] == 1.0 for r in by_arm["off"])
    main = result.summary["by_lag"]["4"]
    off = [main["runs"][str(s)]["off"]["final_reward"] for s in (0, 1)]
    prod = [main["runs"][str(s)]["product"]["final_reward"] for s in (0, 1)]
    pair = next(p for p in main["paired"] if p["arm"] == "product" and p["base"] == "off")
    assert pair["diffs"] == pytest.approx([p - o for p, o in zip(prod, off)])
    assert "| product - constant |" in result.table
    assert result.figure.read_bytes()[:8] == PNG_MAGIC


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
