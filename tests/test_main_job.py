"""``ess-patch demo`` (the README's main command): the main job's config, its refusals, and a
``--quick`` run through the CLI whose table, reading and files come from the real runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from ess_patch import cli
from ess_patch.demo.scenarios import collapse, main_job

# the checkout's docs: tox installs the package into site-packages, so not cli.__file__
ROOT = Path(__file__).resolve().parents[1]


def test_the_main_job_is_the_collapse_scenario_at_the_tuned_lr():
    cfg = main_job.main_config()
    assert cfg.arms == ("sync", "off", "product", "ess+baseline")
    assert (cfg.lr, cfg.lag, cfg.staleness) == (3.5e-4, 8, "fixed")
    # everything else is the collapse scenario's
    base = collapse.collapse_config()
    for field in ("steps", "task", "loss", "dp", "rollout_workers", "is_threshold", "warmup"):
        assert getattr(cfg, field) == getattr(base, field), field
    # the LR is the tuning log's choice
    log = (ROOT / "docs/demo-tuned/tuning.txt").read_text()
    assert log.strip().splitlines()[-1] == f"chosen lr {main_job.TUNED_LR:g}"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--dp", "2"], "--dp do not apply to the main job"),
        (["--seeds", "8"], "--seeds do not apply to the main job"),
        (["--arms", "off,product"], "--arms off,product --jobs 2: keep sync"),
        (["--lag", "-1"], "ess-patch demo: --lag must be >= 0 (got -1)"),
    ],
)
def test_bad_main_job_options_name_the_flag(capsys, tmp_path, argv, needle):
    assert cli.main(["demo", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.dist
def test_quick_main_job_through_the_cli(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["demo", "--quick", "--no-progress", "--out", str(out)]
    assert cli.main([*argv, "--cache-dir", str(tmp_path / "cache")]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "main_summary.json").read_text())
    assert list(summary["arms"]) == list(main_job.MAIN_ARMS)
    runs = {p.name.split("-seed")[0]: p for p in (out / "runs").glob("*-seed0-*.jsonl")}
    assert set(runs) == set(main_job.MAIN_ARMS)
    records = {a: [json.loads(x) for x in p.read_text().splitlines()] for a, p in runs.items()}
    assert [r["mean_lag"] for r in records["sync"]] == [0.0] * 16
    assert [r["mean_lag"] for r in records["off"]] == [min(s, 8) for s in range(16)]
    # the table's fractions are the runs' own final rewards over the sync run's
    from ess_patch.demo import criterion

    sync = criterion.judge(records["sync"]).final
    for arm, row in summary["arms"].items():
        assert row["fraction_of_sync"] == pytest.approx(criterion.judge(records[arm]).final / sync)
        assert f"| {main_job.NAMES[arm]} | {row['final']:.3f} |" in printed
    assert all(r["lr_scale"] == 1.0 for r in records["off"] + records["sync"])
    assert any(r["lr_scale"] < 1.0 for r in records["product"])
    assert summary["reading"] in printed and main_job.EIGHT_SEEDS in printed
    assert (out / "main.png").read_bytes()[:4] == b"\x89PNG"
