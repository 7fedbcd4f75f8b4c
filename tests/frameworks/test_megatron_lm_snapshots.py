"""Megatron-RL on every Megatron-LM snapshot, not only ``$MEGATRON_RL_SRC``.

``test_megatron_rl.py`` runs in this session against ``$MEGATRON_RL_SRC`` (NVIDIA core_v0.16.1);
each other ``megatron-lm-*`` folder under ``$ESS_PATCH_UPSTREAM`` that holds ``megatron/rl``
(radixark's miles-main fork 2e64d788b, core_v0.17.1, core_v0.18.2...) gets the same file in a
fresh interpreter with ``MEGATRON_RL_SRC`` pointing at it and the megatron-core of its own
version first on ``PYTHONPATH`` (tests/megatron_versions.py installs it once from the index):
the real hooks, collectives and writers of that version, against the float64 reference. A new
snapshot is tested by adding its folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from megatron_versions import child_env, core_version_for
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
    "test_every_optimizer_step_of_the_collection_is_scaled_and_restored",
    "test_flags_through_megatrons_parse_args_with_a_user_provider",
    "test_train_rl_entry_parses_through_the_hook",
    "test_a_miles_or_slime_parse_on_a_tree_with_megatron_rl_is_theirs_to_validate",
    "test_use_ess_lr_on_a_plain_megatron_parse_is_refused",
    "test_no_inference_logprobs_is_a_startup_error",
    "test_metrics_reach_megatron_rls_writers",
    "test_mismatched_packed_shapes_are_an_error_on_every_rank",
    "test_cp_peers_with_different_rows_are_an_error_on_every_rank",
    "test_doctor_knows_megatron_rl",
    "test_megatron_core_is_the_trees_own",
}


def test_each_snapshot_goes_with_the_megatron_core_of_its_release():
    """The version comes from the tree (the folder name's release, or the fork's known pin)."""
    for folder in megatron_lm_snapshots():
        version = core_version_for(folder)
        if "core_v" in folder.name:
            assert folder.name.endswith(f"core_v{version}"), (folder, version)
        else:
            assert version == "0.16.1", (folder, version)  # the miles fork: 0.16.0rc0's line


@pytest.mark.skipif(
    not OTHERS,
    reason="no Megatron-LM snapshot besides $MEGATRON_RL_SRC under $ESS_PATCH_UPSTREAM",
)
@pytest.mark.parametrize("folder", OTHERS, ids=lambda f: f.name)
def test_megatron_rl_tests_pass_on_each_megatron_lm_snapshot(folder, tmp_path):
    # the tree first: its megatron/training wins over the one megatron-core 0.17+ wheels ship
    env = child_env(core_version_for(folder), folder)
    env["MEGATRON_RL_SRC"] = str(folder)
    passed, skipped, tail = run_pytest(FRAMEWORKS / "test_megatron_rl.py", env, tmp_path)
    assert passed >= CORE, (CORE - passed, tail)
    assert not skipped, tail  # nothing of that version left untested


#: VCPO's baseline: every snapshot with calculate_grpo_advantages runs these; the fork (no such
#: routine) skips them by name (and test_megatron_rl.py checks its parse-time refusal).
BASELINE = {
    "test_applied_advantages_are_b_star_from_brute_force_norms[dp1-padded]",
    "test_applied_advantages_are_b_star_from_brute_force_norms[dp1-packed]",
    "test_applied_advantages_are_b_star_from_brute_force_norms[dp2-padded]",
    "test_applied_advantages_are_b_star_from_brute_force_norms[dp2-packed]",
    "test_tp2_the_sharded_model_gives_the_b_star_of_one_process[padded]",
    "test_tp2_the_sharded_model_gives_the_b_star_of_one_process[packed]",
    "test_pp2_both_stages_give_the_b_star_of_one_process[padded]",
    "test_pp2_both_stages_give_the_b_star_of_one_process[packed]",
    "test_the_train_step_trains_on_b_star_advantages[padded]",
    "test_the_train_step_trains_on_b_star_advantages[packed]",
    "test_a_baseline_that_would_not_apply_stops_every_rank[unhooked]",
    "test_a_baseline_that_would_not_apply_stops_every_rank[multi-turn]",
}


#: $MEGATRON_RL_SRC's too: in a full run its in-process baseline tests skip by name (an earlier
#: module put another tree's megatron.rl first on the path), so a fresh interpreter runs them
ALL = megatron_lm_snapshots()


@pytest.mark.skipif(not ALL, reason="no Megatron-LM snapshot under $ESS_PATCH_UPSTREAM")
@pytest.mark.parametrize("folder", ALL, ids=lambda f: f.name)
def test_megatron_rl_baseline_on_each_megatron_lm_snapshot(folder, tmp_path):
    env = child_env(core_version_for(folder), folder)
    env["MEGATRON_RL_SRC"] = str(folder)
    rl_utils = (folder / "megatron" / "rl" / "rl_utils.py").read_text()
    passed, skipped, tail = run_pytest(FRAMEWORKS / "test_megatron_rl_baseline.py", env, tmp_path)
    if "def calculate_grpo_advantages(" in rl_utils:
        assert passed >= BASELINE, (BASELINE - passed, tail)
        assert not skipped, tail
    else:  # refused by name at parse time: nothing here may pass as if it were served
        assert not passed and skipped, tail
