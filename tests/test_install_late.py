"""A library imported AFTER install() that lacks a required symbol (issue 13, item 10).

The host's import must succeed; that one integration is rolled back completely (the exact
original objects back, none of its later modules wrapped) and the reason is logged and shown
by ``ess-patch doctor``; the other integrations stay installed. Each case runs in a fresh
interpreter: the state under test is the interpreter's module table and import hooks.

The incompatible library is a tiny fake ``miles`` package written to ``tmp_path`` (same module
paths as the real one, ``compute_advantages_and_returns`` left out): what is under test is
ess-patch's install machinery, not miles.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FAKE_MILES = {
    "miles/__init__.py": "",
    "miles/utils/__init__.py": "",
    "miles/utils/arguments.py": "def parse_args(add_custom_arguments=None):\n    return 'parsed'\n",
    "miles/backends/__init__.py": "",
    "miles/backends/training_utils/__init__.py": "",
    # an "incompatible version": the advantage routine was renamed
    "miles/backends/training_utils/loss.py": "def compute_advantages(args, rollout_data):\n"
    "    return None\n",
    "miles/backends/training_utils/log_utils.py": "def log_train_step(*args, **kwargs):\n"
    "    return 'logged'\n",
}

SCRIPT = """
import logging, sys, warnings
warnings.simplefilter("ignore")
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
import ess_patch
from ess_patch.install import failed_integrations, installed_targets
from ess_patch.patching import is_ours
from ess_patch.install import INSTALLATION

ess_patch.install()
import miles.utils.arguments as arguments
parse_wrapped_first = is_ours(vars(arguments)["parse_args"])
original_parse = vars(arguments)["parse_args"].__wrapped__

import miles.backends.training_utils.loss as loss      # lacks the symbol: must not raise
import miles.backends.training_utils.log_utils as log_utils   # imported after the rollback
import megatron.core.optimizer.optimizer as mo

result = {
    "parse_wrapped_first": parse_wrapped_first,
    "parse_is_original": vars(arguments)["parse_args"] is original_parse,
    "parse_call": arguments.parse_args(),
    "log_utils_wrapped": is_ours(vars(log_utils)["log_train_step"]),
    "loss_names": sorted(n for n in vars(loss) if not n.startswith("_")),
    "megatron_wrapped": is_ours(vars(mo.FP32Optimizer)["step_with_ready_grads"])
        and is_ours(vars(mo.ChainedOptimizer)["step"]),
    "installed": ess_patch.is_installed(),
    "integrations": sorted(INSTALLATION.patches),
    "miles_targets": [t for t in installed_targets() if t.startswith("miles.")],
    "failed": failed_integrations(),
}
if "--doctor" in sys.argv:
    from ess_patch.doctor import collect, render
    result["doctor"] = render(collect())
emit(result)
"""


def _fake_tree(root: Path) -> Path:
    for rel, text in FAKE_MILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _run(fresh_python, tmp_path: Path, *extra: str) -> tuple[dict, str]:
    tree = _fake_tree(tmp_path / "fake")
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ESS_", "MILES", "SLIME"))}
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(repo)])
    fresh = fresh_python(SCRIPT, env, args=extra, cwd=tmp_path, timeout=180)
    return fresh.result, fresh.stdout


MISSING = "miles.backends.training_utils.loss.compute_advantages_and_returns"


def test_late_import_missing_a_symbol_rolls_back_that_integration_only(fresh_python, tmp_path):
    res, out = _run(fresh_python, tmp_path)
    # miles was wrapped while its modules were compatible...
    assert res["parse_wrapped_first"]
    # ...then the incompatible module imported fine, and miles' wraps are all gone
    assert "compute_advantages" in res["loss_names"]
    assert res["parse_is_original"] and res["parse_call"] == "parsed"
    assert res["miles_targets"] == []
    assert not res["log_utils_wrapped"]  # a miles module imported later is left alone
    # the other integrations stay installed and keep wrapping what gets imported
    assert res["installed"]
    assert "miles" not in res["integrations"]
    assert {"megatron", "slime"} <= set(res["integrations"])
    assert res["megatron_wrapped"]
    # the reason names the integration, what is missing and the supported versions (the
    # fake tree fits no known miles shape before its missing symbol is even looked up)
    reason = res["failed"]["miles"]
    assert reason.startswith("miles: not installed: ")
    assert MISSING in reason or "fits no known shape" in reason, reason
    assert "31f1ca961" in reason
    assert list(res["failed"]) == ["miles"]
    log = [line for line in out.splitlines() if line.startswith("LOG ")]
    assert any(reason in line and "still installed: megatron" in line for line in log), log


@pytest.mark.slow
def test_doctor_shows_the_rolled_back_integration(fresh_python, tmp_path):
    res, _ = _run(fresh_python, tmp_path, "--doctor")
    doctor = res["doctor"]
    assert res["failed"]["miles"] in doctor
    assert f"PROBLEM {res['failed']['miles']} (rolled back at import" in doctor
    assert "-- miles.utils.arguments.parse_args: not wrapped (miles was rolled back)" in doctor
