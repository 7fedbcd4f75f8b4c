"""Every process of a job: ESS_PATCH_AUTO_INSTALL activates ess-patch with no install() call.

Each case is a fresh interpreter that never calls install() itself: the
``ess_patch-autoinstall.pth`` file the wheel puts in site-packages does it at start-up.
"""

from __future__ import annotations

import os
import site
from pathlib import Path

import pytest
from fresh import Fresh

PTH = "ess_patch-autoinstall.pth"
INSTALLED_PTH = [Path(d) / PTH for d in site.getsitepackages() if (Path(d) / PTH).exists()]
NO_PTH = (
    f"{PTH} is not in site-packages: an editable install does not ship it (tox installs the "
    "wheel, which does)"
)

PROBE = """
import megatron.core.optimizer.optimizer as m
from ess_patch.patching import is_ours
import ess_patch
emit({"wrapped": is_ours(vars(m.FP32Optimizer)["step"]), "installed": ess_patch.is_installed()})
"""


@pytest.fixture
def probe(fresh_python):
    """``probe(value, code=PROBE, extra_env=None, emits=True)``: ``code`` in a fresh
    interpreter with ``ESS_PATCH_AUTO_INSTALL`` set to ``value`` (unset for None)."""

    def run(
        value: str | None,
        code: str = PROBE,
        extra_env: dict[str, str] | None = None,
        emits: bool = True,
    ) -> Fresh:
        env = {k: v for k, v in os.environ.items() if k != "ESS_PATCH_AUTO_INSTALL"}
        env.update(extra_env or {})
        if value is not None:
            env["ESS_PATCH_AUTO_INSTALL"] = value
        return fresh_python(code, env, timeout=120, emits=emits)

    return run


ON = {"wrapped": True, "installed": True}
OFF = {"wrapped": False, "installed": False}


@pytest.mark.skipif(not INSTALLED_PTH, reason=NO_PTH)
@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", ON), ("megatron", ON), (None, OFF), ("0", OFF)],
)
def test_env_var_activates_the_patch_in_a_fresh_process(value, expected, probe):
    assert probe(value).result == expected


@pytest.mark.skipif(not INSTALLED_PTH, reason=NO_PTH)
def test_a_bad_value_says_so_and_does_not_kill_the_process(probe):
    proc = probe("bogus")
    assert proc.result == OFF
    assert proc.stderr.count("ESS_PATCH_AUTO_INSTALL='bogus' was set but not installed") == 1
    assert "unknown ess-patch integration(s) 'bogus'" in proc.stderr


@pytest.mark.skipif(not INSTALLED_PTH, reason=NO_PTH)
def test_the_pth_line_imports_nothing_when_off(probe):
    proc = probe(None, "import sys; emit(['ess_patch' in sys.modules, 'torch' in sys.modules])")
    assert proc.result == [False, False]


def test_install_does_not_import_torch(probe):
    proc = probe(None, "import sys, ess_patch; ess_patch.install(); emit('torch' in sys.modules)")
    assert proc.result is False


def test_requested_values():
    from ess_patch.autoinstall import requested

    assert requested({}) is None
    assert requested({"ESS_PATCH_AUTO_INSTALL": "off"}) is None
    assert requested({"ESS_PATCH_AUTO_INSTALL": "Yes"}) == ""
    assert requested({"ESS_PATCH_AUTO_INSTALL": "megatron,miles"}) == "megatron,miles"


# How many ess-patch wrappers sit on FP32Optimizer.step (0: not patched; 1: patched once).
_COUNT_WRAPS = """
import megatron.core.optimizer.optimizer as m
from ess_patch.patching import is_ours
step, wraps = vars(m.FP32Optimizer)["step"], 0
while is_ours(step):
    step, wraps = step.__wrapped__, wraps + 1
"""


def test_megatron_init_hook_installs_once(clean_ess):
    pytest.importorskip("megatron.core")
    import ess_patch
    from ess_patch.autoinstall import megatron_init

    megatron_init(object())
    assert ess_patch.is_installed()
    targets = ess_patch.installed_targets()
    megatron_init(object())  # a second actor init in the same process: still installed, once
    assert ess_patch.is_installed()
    assert ess_patch.installed_targets() == targets
    found: dict = {}
    exec(_COUNT_WRAPS, found)
    assert found["wraps"] == 1


_PTH_TWICE = (
    f"""
line = open({str(Path(__file__).resolve().parents[1] / PTH)!r}).read()
exec(line)
exec(line)  # site reads a venv's site-packages twice
import ess_patch
installed = ess_patch.is_installed()
"""
    + _COUNT_WRAPS
    + """
emit({"installed": installed, "wraps": wraps})
"""
)


def test_the_pth_running_twice_installs_once_and_says_nothing(probe):
    proc = probe("1", _PTH_TWICE)
    # megatron imported afterwards: wrapped once, not twice
    assert proc.result == {"installed": True, "wraps": 1}
    assert "already installed" not in proc.stderr
    assert proc.stderr.strip() == "" or "Traceback" not in proc.stderr


def test_a_bad_ess_lr_value_is_one_clear_line_once(probe):
    # in the process's environment from the start: where the wheel's .pth sits in
    # site-packages, it has already run once before the probe's own code
    proc = probe("1", _PTH_TWICE, {"ESS_LR_FLOOR": "5"})
    assert proc.result == {"installed": False, "wraps": 0}
    errors = [line for line in proc.stderr.splitlines() if "ESS_PATCH_AUTO_INSTALL='1'" in line]
    assert len(errors) == 1, proc.stderr
    assert "EssLrConfig.floor='5' must be in (0, 1]" in errors[0]
    assert "Traceback" not in proc.stderr


_ARM_AFTER_A_BAD_SETTING = f"""
exec(open({str(Path(__file__).resolve().parents[1] / PTH)!r}).read())
started = True  # the process itself runs on
import ess_patch
try:
    ess_patch.arm(0.5)
    arm = "ARM-OK"
except Exception as exc:
    arm = f"ARM-ERROR {{type(exc).__name__}} {{exc}}"
emit({{"started": started, "arm": arm, "armed_after": ess_patch.armed()}})
"""


@pytest.mark.parametrize(
    ("variable", "value", "allowed"),
    [
        ("ESS_LR_FLOOR", "abc", "a number in (0, 1]"),
        ("ESS_LR_FLOOR", "2.0", "a number in (0, 1]"),
        ("ESS_LR_WEIGHT_MODE", "bogus", "geometric, product"),
        ("ESS_LR_WEIGHT_CLIP", "-1", "a finite number > 0, or none"),
    ],
)
def test_a_bad_setting_names_the_variable_and_arm_reports_the_failed_auto_install(
    variable, value, allowed, probe
):
    proc = probe("1", _ARM_AFTER_A_BAD_SETTING, {variable: value})
    assert proc.result["started"] is True
    errors = [line for line in proc.stderr.splitlines() if "ESS_PATCH_AUTO_INSTALL='1'" in line]
    assert len(errors) == 1, proc.stderr
    assert f"{variable}={value!r}" in errors[0] and allowed in errors[0], errors[0]
    assert "Traceback" not in proc.stderr
    # where ESS-LR is used: arm() says the auto-install failed and why, and arms nothing
    arm_line = proc.result["arm"]
    assert arm_line.startswith("ARM-ERROR ValueError"), arm_line
    assert "auto-install failed" in arm_line and f"{variable}={value!r}" in arm_line
    assert "install() was not called" not in proc.stdout + proc.stderr
    assert proc.result["armed_after"] is None


@pytest.mark.skipif(not INSTALLED_PTH, reason=NO_PTH)
def test_an_unrelated_process_starts_with_a_bad_setting(probe):
    proc = probe("1", "print('hello')", {"ESS_LR_FLOOR": "abc"}, emits=False)
    assert proc.stdout.strip() == "hello", proc.stderr[-2000:]


def test_an_explicit_install_after_a_failed_auto_install_arms_normally(monkeypatch, clean_ess):
    import ess_patch
    from ess_patch.install import INSTALLATION

    monkeypatch.setattr(INSTALLATION, "autoinstall_error", ValueError("ESS_LR_FLOOR='abc' ..."))
    with pytest.raises(ValueError, match="auto-install failed"):
        ess_patch.arm(0.5)
    assert ess_patch.armed() is None
    ess_patch.install("megatron")
    assert ess_patch.arm(0.5).scale == 0.5


@pytest.mark.parametrize(
    ("variable", "value", "allowed"),
    [
        ("ESS_LR_FLOOR", "abc", "a number in (0, 1]"),
        ("ESS_LR_FLOOR", "0", "a number in (0, 1]"),
        ("ESS_LR_BASE_RATIO", "inf", "a finite number > 0"),
        ("ESS_LR_RULE", "cubic", "sqrt, linear"),
        ("ESS_LR_NONFINITE", "ignore", "raise, floor"),
        ("ESS_LR_GRANULARITY", "epoch", "rollout, step"),
        ("ESS_LR_SHADOW", "maybe", "1, 0, true or false"),
        ("ESS_LR_WEIGHT_CLIP", "zero", "a finite number > 0, or none"),
    ],
)
def test_from_env_names_the_variable_and_its_allowed_values(variable, value, allowed):
    from ess_patch.config import EssLrConfig

    with pytest.raises(ValueError) as info:
        EssLrConfig.from_env(
            {variable: value, "ESS_LR_FLOOR" if variable != "ESS_LR_FLOOR" else "X": "0.2"}
        )
    message = str(info.value)
    assert message.startswith(f"{variable}={value!r} is not a valid ESS-LR setting"), message
    assert allowed in message and f"unset {variable}" in message
