"""Every snapshot folder of miles and slime (``upstream.snapshots()``): ess-patch follows the
host's shape, detected by feature, and fails clearly where it cannot serve it.

One fresh process per snapshot (``history_probe.report`` through ``fresh_python``; two
versions of a framework cannot share ``sys.modules``) runs the real code and reports; here
the report is compared with what each framework's history says (miles/slime docstrings in
``ess_patch/integrations``):

- the shape ``install()`` chose and recorded (``installed_shapes()``);
- the ESS metrics through the real train-step log function of that version (miles
  ``log_train_step``'s ``extra_metrics``, positional and by keyword, actor only; slime's
  ``log`` wherever that version keeps it, the ``train/step`` record only), nothing when
  nothing is armed;
- the flags through the real ``parse_args``, the refusals (no train log-probs; miles'
  multi-LoRA where the flag exists);
- each required symbol removed from the imported host: one ``MissingTargetError`` naming the
  framework, the symbol and the supported range, and nothing of that framework left
  patched; for slime also at import time (the train-step module imported while no known log
  location has ``log``).

The advantage hook itself runs on every snapshot in the gloo harness
(test_integration.py::test_advantage_hook_arms_the_reference_scale_on_every_rank).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from upstream import no_snapshot_param, snapshots, tier_reason

HERE = Path(__file__).resolve().parent
# run in the fresh interpreter: the probe module from this folder, its report emitted
PROBE = """
import sys
sys.path.insert(0, {here!r})
from history_probe import report
emit(report({fw!r}, {folder!r}))
"""
METRICS = {
    "train/lr_scale": 0.5,
    "train/rho_ess": 0.25,
    "train/ess": 2.0,
    "train/ess_num_trajectories": 8.0,
    "train/ess_num_nonfinite": 0.0,
}

# What the history says each folder is, by the features the integration reads (the folder
# names are only the test's labels: ess-patch never sees them).
GROUPS = {
    "parallel_state argument": "the parallel_state argument (flat dp_group / cp_group fields)",
    "intra_dp": "get_parallel_state().intra_dp",
    "effective_dp": "get_parallel_state().effective_dp",
}


def _params():
    found = snapshots()
    if not found:
        return [no_snapshot_param()]
    return [
        pytest.param(
            fw,
            folder,
            id=folder.name,
            marks=pytest.mark.skipif(
                tier_reason(fw, "full") is not None, reason=tier_reason(fw, "full") or ""
            ),
        )
        for fw, folder in found
    ]


def _expected_groups(folder: Path) -> str:
    """From the snapshot's own source, not from ess-patch: which ParallelState it has."""
    parallel = folder / "miles/backends/training_utils/parallel.py"
    text = parallel.read_text()
    if "def get_parallel_state" not in text:
        return GROUPS["parallel_state argument"]
    return GROUPS["effective_dp" if "def effective_dp" in text else "intra_dp"]


def _expected_log_module(folder: Path) -> str:
    """The module whose ``log`` slime's train() calls, read from its model.py."""
    model = (folder / "slime/backends/megatron_utils/model.py").read_text()
    name = re.search(r"(\w+)\.log\(args, log_dict, step_key=\"train/step\"\)", model).group(1)
    package = re.search(rf"^from ([\w.]+) import .*\b{name}\b", model, re.MULTILINE).group(1)
    return f"{package}.{name}"


@pytest.fixture(scope="module")
def reports(fresh_python):
    """One probe run per snapshot, on demand (cached for the module)."""
    cache: dict[Path, dict] = {}

    def get(fw: str, folder: Path) -> dict:
        if folder not in cache:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            code = PROBE.format(here=str(HERE), fw=fw, folder=str(folder))
            cache[folder] = fresh_python(code, env, timeout=300).result
        return cache[folder]

    return get


@pytest.mark.parametrize(("fw", "folder"), _params())
def test_each_snapshot_gets_its_shape_metrics_flags_and_clear_errors(fw, folder, reports):
    report = reports(fw, folder)

    # the recorded shape
    shapes = report["shapes"]
    if fw == "miles":
        assert shapes.startswith(f"miles: groups from {_expected_groups(folder)};"), shapes
        assert shapes.endswith("metrics via log_train_step"), shapes
        takes_state = (
            "parallel_state: ParallelState"
            in (folder / "miles/backends/training_utils/loss.py").read_text()
        )
        hook = "(args, parallel_state, rollout_data)" if takes_state else "(args, rollout_data)"
        assert f"hook compute_advantages_and_returns{hook}" in shapes
    else:
        log_module = _expected_log_module(folder)
        assert shapes.endswith(f"metrics via {log_module}.log"), shapes
        assert f"{log_module}.log" in report["targets"]

    # the loss ledger's hooks sit where this snapshot's train loop calls them (slime's one-step
    # reuse and --keep-old-actor are measured there)
    assert report["loss_hooks"] == {
        "policy_loss_function": True,
        "get_log_probs_and_entropy": True,
    }, report["loss_hooks"]

    # the metrics through the real train-step log function
    metrics = report["metrics"]
    if fw == "miles":
        assert not set(METRICS) & set(metrics["plain"])  # nothing armed: unchanged
        for call in ("positional", "keywords"):
            assert metrics[call] == {
                **metrics["plain"],
                "train/lr-pg_0": 1e-3,  # the caller's extra_metrics are kept
                **METRICS,
            }, call
        assert not any(k.endswith(("lr_scale", "rho_ess")) for k in metrics["critic"])
        # not measured: said so, with nothing that looks like a measurement
        assert metrics["unmeasured"] == {**metrics["plain"], "train/ess_lr_measured": 0.0}
    else:
        assert metrics["module"] == log_module
        first, armed, positional, rollout, unmeasured = metrics["logged"]
        assert first == {"train/loss": 1.0, "train/step": 3}
        assert unmeasured == {"train/loss": 1.0, "train/step": 5, "train/ess_lr_measured": 0.0}
        assert armed == {"train/loss": 1.0, "train/step": 3, **METRICS}
        assert positional == {"train/loss": 1.0, "train/step": 4, **METRICS}
        assert rollout == {"rollout/x": 1.0, "rollout/step": 3}

    # the flags through the real parse_args
    parse = report["parse"]
    assert parse["off"] == {"use_ess_lr": False, "floor": 0.1}
    assert parse["on"] == {"use_ess_lr": True, "floor": 0.2}
    assert (
        "--use-rollout-logprobs without --get-mismatch-metrics"
        in parse["no_train_logprobs"]["error"]
    )
    if "multi_lora" in parse:  # the versions whose parser has --multi-lora-n-adapters
        assert parse["multi_lora"]["error"].startswith(
            "EssPatchValueError: --use-ess-lr is not supported"
        )
        assert "multi-LoRA" in parse["multi_lora"]["error"]

    # removed symbols: one clear error, nothing patched
    for case in report["removals"]:
        symbol = case["removed"].rsplit(".", 1)[1]
        assert case["error"] is not None, case
        assert case["error"].startswith(f"ess-patch ({fw}): this {fw} fits no known shape")
        assert symbol in case["error"] and "Supported: " in case["error"]
        assert case["installed"] is False and case["nothing_patched"] is True, case
    assert len(report["removals"]) == 2

    if fw == "slime":  # at import time: the train-step module, no log anywhere
        imported = report["import_error"]
        assert imported["removed"] == [log_module] and imported["wrapped_before"]
        assert "fits no known shape for 'metrics'" in imported["error"]
        assert imported["still_installed"] == [] and imported["nothing_patched"]
