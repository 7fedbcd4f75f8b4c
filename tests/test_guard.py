"""The fail-closed invariant (issue 35, ``ess_patch/guard.py``), with real megatron-core
optimizers and real torch optimizers in one process, and the auto-install in fresh ones.

A request for ESS-LR either applies the armed scale at every optimizer step, or stops with one
clear error before a parameter moves; ``ESS_PATCH_ALLOW_UNSCALED=1`` is the only way through,
and it says so. Metrics report the scale read back from the step.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

import ess_patch
from ess_patch.config import EssLrConfig
from ess_patch.guard import EssLrNotAppliedError, applied_scale
from ess_patch.state import STATE

ROOT = Path(__file__).resolve().parents[1]
OPT_OUT = "ESS_PATCH_ALLOW_UNSCALED"


def _megatron_step(lr: float = 1e-3):
    """A real megatron-core ChainedOptimizer (fp32, SGD): its params before one step, the LR
    its inner torch optimizer saw inside the step, and its params after (or the error)."""
    from megatron_cpu import build_megatron_optimizer, forward_backward, main_params

    setup = build_megatron_optimizer("fp32", optimizer="sgd", lr=lr, min_lr=lr, warmup_steps=0)
    setup.scheduler.step(increment=1)
    inside = []
    for child in setup.optimizer.chained_optimizers:
        child.optimizer.register_step_pre_hook(
            lambda o, a, k: inside.append(o.param_groups[0]["lr"])
        )
    from megatron_cpu import batch

    forward_backward(setup, *batch(0, 0))
    before = [p.detach().clone() for p in main_params(setup.optimizer)]
    scheduled = setup.optimizer.param_groups[0]["lr"]
    error = None
    try:
        setup.optimizer.step()
    except EssLrNotAppliedError as exc:
        error = exc
    moved = any(
        not torch.equal(a, b) for a, b in zip(before, main_params(setup.optimizer), strict=True)
    )
    return {"scheduled": scheduled, "inside": inside, "moved": moved, "error": error}


@pytest.fixture
def nothing_elsewhere(clean_ess, monkeypatch):
    """No optimizer attach()ed or vendored step decorated by earlier tests in this process."""
    monkeypatch.setattr(STATE, "applied_elsewhere", False)
    monkeypatch.delenv(OPT_OUT, raising=False)
    yield


def _roll_back_megatron():
    from ess_patch.install import _roll_back

    _roll_back("megatron", ImportError("megatron.core.optimizer lacks a symbol (test)"))


# --- the table: integrations without megatron --------------------------------------------


@pytest.mark.parametrize("how", ["install-slime", "env-slime", "rolled-back"], ids=lambda how: how)
def test_no_step_wrapper_stops_at_arm_before_any_step(world, nothing_elsewhere, monkeypatch, how):
    """install(["slime"]) / ESS_PATCH_INTEGRATIONS=slime / megatron rolled back by a late
    import: 0.3.0 armed 0.5, stepped at 1e-3 and reported lr_scale 0.5."""
    if how == "env-slime":
        monkeypatch.setenv("ESS_PATCH_INTEGRATIONS", "slime")
        ess_patch.install()
    elif how == "install-slime":
        ess_patch.install(["slime"])
    else:
        ess_patch.install(["megatron", "slime"])
        _roll_back_megatron()
    with pytest.raises(EssLrNotAppliedError) as error:
        ess_patch.arm(0.5)
    message = str(error.value)
    assert message.startswith("ess-patch (slime): ESS-LR was requested but nothing wraps")
    assert "install(['megatron', ...])" in message and "ESS_PATCH_ALLOW_UNSCALED=1" in message
    if how == "rolled-back":
        assert "rolled back" in message and "lacks a symbol" in message
    assert ess_patch.armed() is None
    from ess_patch.integrations.rl_hooks import ess_metrics

    assert ess_metrics() == {}  # nothing armed, nothing reported


def test_a_scale_armed_then_unwrapped_stops_at_the_step_before_the_update(world, nothing_elsewhere):
    """The step guard: the megatron integration rolled back after the arm; the real
    ChainedOptimizer's inner torch optimizer refuses to step."""
    ess_patch.install(["megatron", "slime"])
    ess_patch.arm(0.5)
    _roll_back_megatron()
    out = _megatron_step()
    assert isinstance(out["error"], EssLrNotAppliedError)
    assert "SGD.step() runs outside every ess-patch step wrapper" in str(out["error"])
    assert out["inside"] == [] and not out["moved"] and applied_scale() is None


def test_with_megatron_the_step_applies_and_reports_what_it_applied(world, nothing_elsewhere):
    """The issue's second row: LR inside the step 5e-4, and lr_scale read back from it."""
    from ess_patch.integrations.rl_hooks import ess_metrics

    ess_patch.install(["megatron", "slime"])
    ess_patch.arm(0.5)
    assert "lr_scale" not in ess_metrics()  # no step yet: nothing applied to report
    out = _megatron_step()
    assert out["error"] is None and out["moved"]
    assert out["scheduled"] == 1e-3 and out["inside"] == [5e-4]
    assert ess_metrics()["lr_scale"] == out["inside"][0] / out["scheduled"]


def test_a_plain_torch_optimizer_under_install_without_attach_never_steps_unscaled(
    nothing_elsewhere,
):
    ess_patch.install()
    ess_patch.arm(0.5)  # megatron is installed: the guard decides at the step
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.ones(2)
    with pytest.raises(EssLrNotAppliedError, match=r"AdamW\.step\(\) runs outside"):
        optimizer.step()
    assert torch.equal(param.detach(), torch.ones(2)) and not optimizer.state
    # not the policy's: exclude() lets it through at its own LR
    ess_patch.exclude(optimizer)
    optimizer.step()
    assert not torch.equal(param.detach(), torch.ones(2))
    # the policy's, attached: scaled, and the metrics say what the step applied
    other = torch.nn.Parameter(torch.ones(2))
    sgd = ess_patch.attach(torch.optim.SGD([other], lr=0.1))
    other.grad = torch.ones(2)
    sgd.step()
    assert torch.equal(other.detach(), torch.ones(2).add(torch.ones(2), alpha=-0.05))
    assert applied_scale() == pytest.approx(0.5, rel=1e-15)


def test_the_opt_out_lets_the_step_through_and_says_so(nothing_elsewhere, monkeypatch, caplog):
    monkeypatch.setenv(OPT_OUT, "1")
    ess_patch.install(["slime"])
    with caplog.at_level(logging.WARNING, logger="ess_patch"):
        ess_patch.arm(0.5)
        param = torch.nn.Parameter(torch.ones(1))
        optimizer = torch.optim.SGD([param], lr=0.1)
        param.grad = torch.ones(1)
        optimizer.step()
        optimizer.step()
    assert param.item() == pytest.approx(0.8)  # two plain steps: unscaled, as the user chose
    opt_outs = [r.getMessage() for r in caplog.records if "(opt-out)" in r.getMessage()]
    assert len(opt_outs) == 2  # the arm's refusal and the step's, each once
    assert all(m.startswith(f"{OPT_OUT}=1 (opt-out): going on unscaled") for m in opt_outs)


def test_a_critic_or_no_request_is_never_stopped(nothing_elsewhere):
    ess_patch.install(["slime"])
    param = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    param.grad = torch.ones(1)
    optimizer.step()  # nothing armed: no request in this step
    ess_patch.set_role("critic")
    STATE.armed = ess_patch.EssLrResult.from_scale(0.5)  # whatever arms it, a critic steps
    optimizer.step()
    assert param.item() == pytest.approx(0.8)  # two plain steps at lr 0.1


# --- unknown ESS_LR_* names --------------------------------------------------------------------


def test_an_unknown_setting_name_names_the_closest_valid_one():
    with pytest.raises(ValueError, match=r"ESS_LR_FLOR is not an ESS-LR setting: did you mean "):
        EssLrConfig.from_env({"ESS_LR_FLOR": "0.3"})
    with pytest.raises(ValueError, match=r"ESS_LR_FLOOR\?"):
        EssLrConfig.from_env({"ESS_LR_FLOR": "0.3"})
    assert EssLrConfig.from_env({"ESS_LR_FLOOR": "0.3", "ESS_LR_ENABLE": "1"}).floor == 0.3


# --- the auto-install, through the real .pth line, in fresh interpreters -----------------------

PTH_LINE = """
import sys
sys.argv = {argv!r}
exec(open({pth!r}).read())  # what site does with the wheel's .pth line
import ess_patch, torch
from ess_patch.install import INSTALLATION
param = torch.nn.Parameter(torch.ones(1))
optimizer = torch.optim.SGD([param], lr=0.1)
param.grad = torch.ones(1)
try:
    optimizer.step()
    error = None
except Exception as exc:
    error = f"{{type(exc).__name__}}: {{exc}}"
emit({{"installed": ess_patch.is_installed(), "autoinstall": INSTALLATION.autoinstall,
      "error": error, "param": param.item()}})
"""


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"ESS_PATCH_AUTO_INSTALL": "1", "ESS_LR_FLOOR": "5"}, "ESS_LR_FLOOR='5'"),
        ({"ESS_PATCH_AUTO_INSTALL": "sliem"}, "unknown ess-patch integration(s) 'sliem'"),
        ({"ESS_PATCH_AUTO_INSTALL": "1", "ESS_LR_FLOR": "0.3"}, "did you mean ESS_LR_FLOOR?"),
    ],
    ids=["bad-value", "unknown-integration", "unknown-name"],
)
def test_a_failed_auto_install_stops_the_first_optimizer_step(fresh_python, env, expected):
    """0.3.0 logged one ERROR and the worker trained unscaled (nothing ever called arm())."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ESS_")}
    code = PTH_LINE.format(argv=["worker.py"], pth=str(ROOT / "ess_patch-autoinstall.pth"))
    out = fresh_python(code, {**base, **env}, timeout=120).result
    assert out["installed"] is False and out["autoinstall"].startswith("failed")
    assert out["error"].startswith("EssLrNotAppliedError: ess-patch (auto-install)")
    assert expected in out["error"] and "Fix that and restart the job" in out["error"]
    assert out["param"] == 1.0  # the step never updated


def test_use_ess_lr_on_the_command_line_installs_through_the_pth(fresh_python):
    """A driver that forgot install(): its own --use-ess-lr patches it, so its parser keeps the
    flags (slime >= v0.3.0 would drop them) and checks its actors."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ESS_")}
    pth = str(ROOT / "ess_patch-autoinstall.pth")
    on = fresh_python(PTH_LINE.format(argv=["train.py", "--use-ess-lr"], pth=pth), base).result
    assert on["installed"] is True and on["autoinstall"] == "installed"
    assert on["error"] is None and on["param"] == pytest.approx(0.9)  # nothing armed yet
    off = fresh_python(PTH_LINE.format(argv=["train.py", "--lr", "1"], pth=pth), base).result
    assert off["installed"] is False and off["autoinstall"] is None


@pytest.mark.parametrize(("value", "installed"), [("1", True), ("0", False)])
def test_verl_s_enable_variable_installs_through_the_pth(fresh_python, value, installed):
    """A verl worker given ESS_LR_ENABLE=1 (runtime_env) without ESS_PATCH_AUTO_INSTALL: 0.3.0
    left it unpatched, so it trained unscaled; now the .pth installs ess-patch there."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ESS_")}
    pth = str(ROOT / "ess_patch-autoinstall.pth")
    code = PTH_LINE.format(argv=["worker.py"], pth=pth)
    out = fresh_python(code, {**base, "ESS_LR_ENABLE": value}, timeout=120).result
    assert out["installed"] is installed
    assert out["autoinstall"] == ("installed" if installed else None)
