"""Megatron-RL on every Megatron-LM snapshot, not only ``$MEGATRON_RL_SRC``.

``test_megatron_rl.py`` runs in this session against ``$MEGATRON_RL_SRC`` (NVIDIA core_v0.16.1);
each other ``megatron-lm-*`` folder under ``$ESS_PATCH_UPSTREAM`` that holds ``megatron/rl``
(today radixark's miles-main fork, 2e64d788b) gets the same file in a fresh interpreter with
``MEGATRON_RL_SRC`` pointing at it: the real hooks, collectives and writers of that version,
against the float64 reference. A new snapshot is tested by adding its folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from upstream import megatron_lm_snapshots, run_pytest

FRAMEWORKS = Path(__file__).resolve().parent
CURRENT = os.environ.get("MEGATRON_RL_SRC")
OTHERS = [
    f for f in megatron_lm_snapshots() if CURRENT is None or f.resolve() != Path(CURRENT).resolve()
]
# the tests every version must pass (the others may not apply to an older shape)
CORE = {
    "test_unpacked_arms_the_reference_scale_on_every_rank[dp2xcp2]",
    "test_unpacked_arms_the_reference_scale_on_every_rank[dp2xpp2]",
    "test_packed_arms_the_reference_scale_on_every_rank[dp2xcp2]",
    "test_packed_arms_the_reference_scale_on_every_rank[dp2xpp2]",
    "test_flags_through_megatrons_parse_args_with_a_user_provider",
    "test_no_inference_logprobs_is_a_startup_error",
    "test_metrics_reach_megatron_rls_writers",
    "test_mismatched_packed_shapes_are_an_error_on_every_rank",
}


@pytest.mark.skipif(
    not OTHERS,
    reason="no Megatron-LM snapshot besides $MEGATRON_RL_SRC under $ESS_PATCH_UPSTREAM",
)
@pytest.mark.parametrize("folder", OTHERS, ids=lambda f: f.name)
def test_megatron_rl_tests_pass_on_each_megatron_lm_snapshot(folder, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ESS_PATCH_AUTO_INSTALL"}
    env["MEGATRON_RL_SRC"] = str(folder)
    tests = str(FRAMEWORKS.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, env.get("PYTHONPATH", "")]))
    passed, skipped, tail = run_pytest(FRAMEWORKS / "test_megatron_rl.py", env, tmp_path)
    assert passed >= CORE, tail
    assert not skipped, tail  # nothing of that version left untested
