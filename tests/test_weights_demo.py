"""``ess-patch demo --scenario weights`` on the demo's real megatron ``GPTModel``, made tiny.

Checks what the measurement claims: the injected noise has the stated mean |d| per token, the
engine's own bf16 mismatch exists at lag 0, product weights brake on-policy under the MoE
noise where geometric weights do not, calibration never brakes more than plain product
weights, and the advice column is the rule ``ess-patch analyze`` applies.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

from ess_patch.analyze.advice import Evidence, advise
from ess_patch.cli import main
from ess_patch.demo.scenarios import weights
from ess_patch.demo.scenarios.weights import WeightsConfig, run_weights

pytestmark = pytest.mark.usefixtures("clean_ess")

TINY = WeightsConfig(
    lengths=(8, 24), lags=(0, 2), batch=16, rollouts=2, calibrate=1, train_length=4
)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("weights")
    return run_weights(TINY, out), out


def test_the_mismatch_is_what_it_says(measured):
    result, _ = measured
    rows = {(r["length"], r["injected"], r["lag"]): r for r in result.rows}
    assert len(rows) == len(result.rows) == 2 * 3 * 2
    for length in TINY.lengths:
        own = rows[(length, 0.0, 0)]["mean_abs_d"]
        assert 0 < own < 0.01  # bf16 engine vs fp32 trainer: a real mismatch at lag 0
        for level in (0.139, 0.369):
            assert rows[(length, level, 0)]["mean_abs_d"] == pytest.approx(
                level, rel=0.2
            )  # >= 3 standard errors


def test_product_brakes_on_policy_under_moe_noise_and_geometric_does_not(measured):
    result, _ = measured
    row = next(r for r in result.rows if (r["length"], r["injected"], r["lag"]) == (24, 0.369, 0))
    assert row["rho_product"] < 0.5 and row["scale_product"] < 0.75
    assert row["rho_geometric"] > 0.9
    for r in result.rows:
        # base = mean on-policy rho <= 1: calibration only ever lifts the product scale
        assert r["scale_calibrated"] >= r["scale_product"] - 1e-12
        assert 0 < r["calibrated_ratio"] <= 1


def test_advice_column_is_the_analyze_rule(measured):
    result, _ = measured
    for r in result.rows:
        if r["lag"] != 0:
            continue
        # the same rule on the row's own numbers (of the scales, only product's mean counts)
        ev = Evidence(
            r["length"],
            r["mean_abs_d"],
            r["token_variance"],
            TINY.batch,
            product_scales=(r["scale_product"],),
        )
        assert r["advice"] == advise(ev).weights


def test_outputs(measured):
    result, out = measured
    payload = json.loads((out / "weights.json").read_text())
    assert payload["rows"] == result.rows  # floats round-trip through json exactly
    assert "| length |" in (out / "weights.md").read_text()
    assert (out / "weights.png").stat().st_size > 10_000


def test_the_cli_runs_the_scenario(tmp_path, monkeypatch, capsys):
    tiny = WeightsConfig(
        lengths=(8,), lags=(0, 1), batch=8, rollouts=2, calibrate=1, train_length=4
    )
    monkeypatch.setattr(weights, "quick_weights_config", lambda **kw: tiny)
    code = main(
        ["demo", "--scenario", "weights", "--quick", "--out", str(tmp_path), "--no-progress"]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "weights.png" in out and "| 8 |" in out
    assert (tmp_path / "weights.json").is_file()


def test_training_flags_are_refused_not_ignored(capsys):
    assert main(["demo", "--scenario", "weights", "--steps", "5", "--floor", "0.3"]) == 2
    assert "--steps, --floor do not apply" in capsys.readouterr().err
