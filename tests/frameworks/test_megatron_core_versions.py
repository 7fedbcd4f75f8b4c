"""The megatron-core optimizer tests on every supported release, each in a fresh interpreter.

``tests/test_megatron_integration.py`` (every wrapped class, each real update scaled exactly
once, the LR restored on raise and on a skipped step, bit-exact when off) runs in the default
environment against its megatron-core (0.16.1); here it runs again against 0.14.0, 0.17.1,
0.18.2 and 0.19.2, each installed once from the index into a cache and put first on
``PYTHONPATH`` (tests/megatron_versions.py; 0.17+ declare Python >= 3.12, their cp311 wheels run
here). A kind whose class the release lacks (``LayerWiseDistributedOptimizer`` before 0.16) is
left out for that release only, and the test says which.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from megatron_versions import OPTIMIZER_VERSIONS, child_env, core_path, installed_core
from packaging.version import Version
from upstream import run_pytest

TESTS = Path(__file__).resolve().parents[1]

OTHERS = [v for v in OPTIMIZER_VERSIONS if v != installed_core()]
#: at least these must pass on every release (the kinds every release has)
CORE = {
    f"test_{name}[{kind}]"
    for name in (
        "installed_but_disarmed_and_scale_one_are_bit_exact",
        "adam_equals_a_run_with_the_lr_scaled_by_hand",
    )
    for kind in ("fp32", "bf16", "dist_fp32", "dist_bf16", "multi_fp32", "multi_dist_bf16")
} | {
    "test_every_inner_update_sees_the_scaled_lr_once",
    "test_lr_restored_when_the_step_raises",
    "test_skipped_step_restores_lr_and_updates_nothing",
    "test_sgd_update_is_scaled_exactly_once[fp32]",
}


@pytest.mark.parametrize("version", OTHERS)
def test_megatron_optimizer_tests_pass_on_each_release(version, tmp_path, fresh_python):
    env = {**child_env(version), "OMP_NUM_THREADS": "1"}
    found = fresh_python("from megatron.core import package_info as p; emit(p.__version__)", env)
    # a release's package_info appends the git commit of the folder it sits in ("+<sha>"),
    # here the checkout that holds the tox env: compare the release itself
    assert Version(found.result).public == version, found.stderr[-2000:]
    layerwise = core_path(version) / "megatron/core/optimizer/layer_wise_optimizer.py"
    args = [] if layerwise.is_file() else ["-k", "not layerwise"]
    passed, skipped, tail = run_pytest(
        TESTS / "test_megatron_integration.py", env, tmp_path, extra_args=args
    )
    assert passed >= CORE, (CORE - passed, tail)
    assert not skipped, tail
    if layerwise.is_file():
        assert {"test_adam_equals_a_run_with_the_lr_scaled_by_hand[layerwise_bf16]"} <= passed
