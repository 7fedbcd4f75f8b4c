"""ess-patch doctor: a clear line, and exit 1, for each class of problem; 0 when healthy."""

from __future__ import annotations

import site

import pytest

pytest.importorskip("megatron.core")

from megatron.core.optimizer import optimizer as mo

from ess_patch.cli import main
from ess_patch.doctor import collect, render

FP32_STEP = "megatron.core.optimizer.optimizer.FP32Optimizer.step"


def _lines(report):
    return [line for entries in report.sections.values() for line in entries]


def test_healthy_environment(clean_ess, monkeypatch, capsys):
    monkeypatch.delenv("ESS_PATCH_AUTO_INSTALL", raising=False)
    report = collect()
    assert report.problems == []
    assert f"ok {FP32_STEP}: install() would wrap it" in _lines(report)
    assert any(line.startswith("megatron-core 0.16.1") for line in _lines(report))
    assert main(["doctor"]) == 0
    assert "no problems found" in capsys.readouterr().out


def test_reports_what_install_wrapped(clean_ess):
    import ess_patch

    ess_patch.install("megatron")
    assert f"ok {FP32_STEP}: wrapped by install() in this process" in _lines(collect())


def test_missing_symbol_is_a_problem(clean_ess, monkeypatch, capsys):
    monkeypatch.delattr(mo.FP32Optimizer, "step_with_ready_grads")
    report = collect()
    assert report.problems == [f"{FP32_STEP}_with_ready_grads is missing; supported: >=0.14,<0.20"]
    assert main(["doctor"]) == 1
    assert "1 problem(s):" in capsys.readouterr().out


def test_vendored_tree_is_recognised(clean_ess, monkeypatch):
    from ess_patch.vendored import optimizer_step

    monkeypatch.setattr(mo.FP32Optimizer, "step", optimizer_step(vars(mo.FP32Optimizer)["step"]))
    assert f"ok {FP32_STEP}: vendored diff applied (install() skips it)" in _lines(collect())


def test_bad_environment_config_is_a_problem(clean_ess, monkeypatch):
    monkeypatch.setenv("ESS_LR_FLOOR", "2")
    [problem] = collect().problems
    assert problem.startswith("ESS_LR_* environment: ESS_LR_FLOOR='2' is not a valid ESS-LR")
    assert "EssLrConfig.floor='2' must be in (0, 1]" in problem


def test_auto_install_without_its_pth_is_a_problem(clean_ess, monkeypatch, tmp_path):
    monkeypatch.setenv("ESS_PATCH_AUTO_INSTALL", "1")
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(tmp_path)])
    [problem] = collect().problems
    assert (
        "ESS_PATCH_AUTO_INSTALL is set but ess_patch-autoinstall.pth is not in site-packages"
        in (problem)
    )
    assert "PROBLEM" in render(collect())
