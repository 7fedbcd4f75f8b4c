"""install()/uninstall(): import order, idempotence, exact restore, version and symbol checks.

The import-order cases each run in a fresh interpreter (as ddtrace's patch tests do): the
state under test is the interpreter's module table.
"""

from __future__ import annotations

import logging
import textwrap

import pytest

import ess_patch
from ess_patch.state import reset

PRELUDE = """
import logging, sys, warnings
warnings.simplefilter("ignore")
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
import ess_patch
from ess_patch.patching import is_ours

CLASSES = [("megatron.core.optimizer.optimizer", c) for c in
           ("MixedPrecisionOptimizer", "FP32Optimizer", "ChainedOptimizer")]
CLASSES.append(("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"))
CLASSES.append(("megatron.core.optimizer.layer_wise_optimizer", "LayerWiseDistributedOptimizer"))

def methods():
    import importlib
    out = {}
    for mod, cls in CLASSES:
        klass = getattr(importlib.import_module(mod), cls)
        for name in ("step", "step_with_ready_grads"):
            if name in vars(klass):
                out[cls + "." + name] = vars(klass)[name]
    return out

def report(originals, **extra):
    now = methods()
    res = {
        "wrapped": sorted(k for k, v in now.items() if is_ours(v)),
        "double": sorted(k for k, v in now.items() if is_ours(v) and is_ours(v.__wrapped__)),
        "inner_is_original": all(now[k].__wrapped__ is originals[k] for k in now
                                 if is_ours(now[k])),
        "identity": all(now[k] is originals[k] for k in now),
        "installed": ess_patch.is_installed(),
    }
    res.update(extra)
    emit(res)
"""

CASES = {
    "install_then_import": """
        ess_patch.install()
        assert "megatron.core" not in sys.modules  # install() itself never imports megatron
        import megatron.core.optimizer
        from ess_patch.patching import Target
        originals = {k: (v.__wrapped__ if is_ours(v) else v) for k, v in methods().items()}
        report(originals)
    """,
    "import_then_install": """
        import megatron.core.optimizer
        originals = methods()
        ess_patch.install()
        report(originals)
    """,
    "install_twice": """
        import megatron.core.optimizer
        originals = methods()
        ess_patch.install()
        ess_patch.install()
        report(originals)
    """,
    "install_uninstall_install": """
        import megatron.core.optimizer
        originals = methods()
        ess_patch.install()
        ess_patch.uninstall()
        restored = methods()
        ess_patch.install()
        report(originals, restored_identity=all(restored[k] is originals[k] for k in originals))
    """,
    "uninstall_without_install": """
        import megatron.core.optimizer
        originals = methods()
        ess_patch.uninstall()
        report(originals)
    """,
    "install_uninstall_then_import": """
        ess_patch.install()
        ess_patch.uninstall()
        import megatron.core.optimizer   # the left-over post-import hook must do nothing
        report(methods())
    """,
}

ALL_WRAPPED = sorted(
    [
        "MixedPrecisionOptimizer.step",
        "MixedPrecisionOptimizer.step_with_ready_grads",
        "FP32Optimizer.step",
        "FP32Optimizer.step_with_ready_grads",
        "ChainedOptimizer.step",
        "ChainedOptimizer.step_with_ready_grads",
        "DistributedOptimizer.step_with_ready_grads",
        "LayerWiseDistributedOptimizer.step",
    ]
)


@pytest.fixture
def run(fresh_python):
    """``run(case)``: the case after PRELUDE in a fresh interpreter: (its report, its stdout)."""

    def go(case: str) -> tuple[dict, str]:
        fresh = fresh_python(PRELUDE + textwrap.dedent(CASES[case]), timeout=120)
        return fresh.result, fresh.stdout

    return go


@pytest.mark.parametrize("case", ["install_then_import", "import_then_install"])
def test_both_import_orders_wrap_every_defining_class_once(case, run):
    res, _ = run(case)
    assert res["wrapped"] == ALL_WRAPPED
    assert res["double"] == []
    assert res["inner_is_original"]
    assert res["installed"]


def test_install_twice_warns_and_wraps_once(run):
    res, out = run("install_twice")
    assert res["wrapped"] == ALL_WRAPPED and res["double"] == [] and res["inner_is_original"]
    assert "LOG ess-patch is already installed" in out


def test_install_uninstall_install(run):
    res, _ = run("install_uninstall_install")
    assert res["restored_identity"]  # uninstall put back the very same function objects
    assert res["wrapped"] == ALL_WRAPPED and res["double"] == [] and res["inner_is_original"]


def test_uninstall_without_install_changes_nothing(run):
    res, out = run("uninstall_without_install")
    assert res["identity"] and res["wrapped"] == [] and not res["installed"]
    assert "LOG ess-patch is not installed" in out


def test_left_over_hook_after_uninstall_does_nothing(run):
    res, _ = run("install_uninstall_then_import")
    assert res["wrapped"] == [] and not res["installed"]


# --- in-process checks (megatron already imported by other tests is fine) ---------------------


@pytest.fixture
def clean():
    reset()
    yield
    if ess_patch.is_installed():
        ess_patch.uninstall()
    reset()


def test_missing_symbol_names_it_and_the_supported_versions(clean, monkeypatch):
    from megatron.core.optimizer import optimizer as mo

    original_step = vars(mo.MixedPrecisionOptimizer)["step"]
    monkeypatch.delattr(mo.FP32Optimizer, "step_with_ready_grads")
    with pytest.raises(ess_patch.MissingTargetError) as info:
        ess_patch.install("megatron")
    message = str(info.value)
    assert "megatron.core.optimizer.optimizer.FP32Optimizer.step_with_ready_grads" in message
    assert "megatron-core >=0.14,<0.20" in message
    assert not ess_patch.is_installed()
    assert vars(mo.MixedPrecisionOptimizer)["step"] is original_step  # rolled back


def test_version_outside_range_warns_without_importing(clean, monkeypatch, caplog):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda d: "0.99.0" if d == "megatron-core" else real(d)
    )
    with caplog.at_level(logging.WARNING, logger="ess_patch"):
        ess_patch.install("megatron")
    assert "megatron-core 0.99.0 is outside the supported range >=0.14,<0.20" in caplog.text


def test_unknown_integration_lists_the_valid_ones(clean):
    with pytest.raises(ValueError, match=r"unknown ess-patch integration\(s\) 'bogus'; valid: "):
        ess_patch.install(["megatron", "bogus"])
    assert not ess_patch.is_installed()


def test_integrations_and_config_from_environment(clean, monkeypatch):
    monkeypatch.setenv("ESS_PATCH_INTEGRATIONS", "megatron")
    monkeypatch.setenv("ESS_LR_FLOOR", "0.3")
    ess_patch.install()
    from ess_patch.install import INSTALLATION
    from ess_patch.state import STATE

    assert list(INSTALLATION.patches) == ["megatron"]
    assert STATE.config.floor == 0.3
