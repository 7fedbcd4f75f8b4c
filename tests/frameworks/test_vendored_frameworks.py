"""The patches/ series on the real miles, slime, Megatron-RL and megatron-core code, without
install().

Copies of the upstream snapshots (``$MILES_SRC``, ``$SLIME_SRC``, ``$MEGATRON_RL_SRC``) and of
the installed megatron-core are patched with ``ess-patch patches apply`` in a scratch folder.
Then, in fresh processes that see only the patched copies:

- the framework tests (test_integration.py and test_megatron_rl.py,
  ``ESS_PATCH_TEST_MODE=vendored``) pass with no ``install()`` and none of them skipped
  (except the ones that are about install() itself: the ``.pth`` file, which an editable
  install lacks, as in the default mode; the parser of a tree that was never patched);
- ``install()`` on the patched trees wraps nothing and says why, once per target.

Needs the frameworks' dependencies (tox -e frameworks); skipped with the reason otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
from skips import missing_packages, missing_snapshot
from upstream import ENV_VARS, run_pytest, skip_reason

from ess_patch import patchset
from ess_patch.patchset.cli import main as patches_main

FRAMEWORKS = Path(__file__).resolve().parent
TESTS = FRAMEWORKS.parent
REASON = skip_reason("miles", "full") or skip_reason("slime", "full")
MILES_SLIME = pytest.mark.skipif(REASON is not None, reason=REASON or "")
MRL_REASON = missing_snapshot(
    "MEGATRON_RL_SRC", "Megatron-LM core_v0.16.1", "megatron/rl/rl_utils.py"
) or missing_packages(
    "the Megatron-RL tests",
    [n for n in ("tensorboard", "wandb", "pydantic") if importlib.util.find_spec(n) is None],
    "pip install -r tests/frameworks/requirements-full.txt",
)
MEGATRON_RL = pytest.mark.skipif(MRL_REASON is not None, reason=MRL_REASON or "")

# The tests that may skip in vendored mode: the .pth file ships with a wheel, not with an
# editable install (as in the default mode); and a run without ess-patch's megatron
# integration cannot exist on a tree whose optimizer step is patched in its source.
ALLOWED_SKIPS = (
    "the .pth ships with the wheel",
    "vendored trees decorate the optimizer step themselves",
)
# In test_megatron_rl.py: what a tree looks like before install() is moot once it is patched.
ALLOWED_MRL_SKIP = "a patched tree always has the flags"


def _apply(target: Path, component: str) -> None:
    assert patches_main(["apply", "--target", str(target), "--component", component]) == 0
    assert patches_main(["check", "--target", str(target), "--component", component]) == 0
    tree = patchset.detect(target, component)
    series, statuses = patchset.select_series(tree)
    assert {s.state for s in statuses} == {patchset.State.APPLIED}, series.name
    assert patchset.series_gaps(series, tree.root) == []


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> dict[str, Path]:
    """{"miles", "slime": patched snapshot copies; "megatron": a folder holding a patched
    copy of the installed megatron/core}."""
    root = tmp_path_factory.mktemp("vendored")
    out = {}
    for component in ("miles", "slime"):
        out[component] = root / component
        shutil.copytree(os.environ[ENV_VARS[component]], out[component])
        _apply(out[component], component)
    spec = importlib.util.find_spec("megatron.core")
    assert spec is not None and spec.submodule_search_locations
    out["megatron"] = root / "megatron-core"
    shutil.copytree(
        spec.submodule_search_locations[0],
        out["megatron"] / "megatron" / "core",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    _apply(out["megatron"], "megatron-core")
    return out


def _env(patched: dict[str, Path], **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MILES_SRC=str(patched["miles"]), SLIME_SRC=str(patched["slime"]), **extra)
    paths = [str(patched["megatron"]), str(TESTS), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    env.pop("ESS_PATCH_AUTO_INSTALL", None)
    return env


@MILES_SLIME
def test_framework_tests_pass_on_the_patched_trees_without_install(patched, tmp_path):
    names, skipped, tail = run_pytest(
        FRAMEWORKS / "test_integration.py", _env(patched, ESS_PATCH_TEST_MODE="vendored"), tmp_path
    )
    for fw in ("miles", "slime"):
        assert {
            f"test_parser_accepts_the_flags_and_changes_no_default[{fw}]",
            f"test_parser_rejects_settings_that_never_give_train_log_probs[{fw}]",
            f"test_user_custom_arguments_still_apply[{fw}]",
            f"test_advantage_hook_arms_the_reference_scale_on_every_rank[{fw}]",
        } <= names, tail
    assert {
        "test_miles_train_step_scales_once_restores_the_lr_and_logs",
        "test_slime_train_log_gets_the_metrics",
        "test_fsdp_actor_attaches_its_optimizer_when_enabled",
    } <= names, tail
    assert len(names) + len(skipped) >= 19, tail
    for name, message in skipped:
        assert any(reason in message for reason in ALLOWED_SKIPS), f"{name} skipped: {tail}"


@MILES_SLIME
def test_install_wraps_nothing_on_the_patched_trees_and_says_why(patched, tmp_path, fresh_python):
    code = f"""
import importlib, logging, sys
sys.path.insert(0, {str(FRAMEWORKS)!r})
from upstream import skip_reason
assert skip_reason("miles", "full") is None and skip_reason("slime", "full") is None
import ess_patch
from ess_patch.install import INTEGRATIONS
from ess_patch.patching import MISSING, VENDORED, target_status
marked = 0
for name in ("megatron", "miles", "slime"):
    for module in INTEGRATIONS[name].modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:  # another version's location (optional targets)
            if not (module + ".").startswith(exc.name + "."):
                raise
    for t in INTEGRATIONS[name].targets:
        status = target_status(t)
        assert status != MISSING or not t.required, t.path
        if status != MISSING and t.vendored:  # install()-only targets: no series carries them
            assert status == VENDORED, t.path + " is not patched"
            marked += 1
# after the imports: miles and slime configure the root logger when imported
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s", force=True)
ess_patch.install(["megatron", "miles", "slime"])
only = {{t.path for n in ("megatron", "miles", "slime") for t in INTEGRATIONS[n].targets
        if not t.vendored}}
emit(dict(wrapped=[p for p in ess_patch.installed_targets() if p not in only], marked=marked))
"""
    result = fresh_python(code, _env(patched), cwd=tmp_path, timeout=300)
    # nothing a series carries is wrapped again (the install()-only targets are, by design)
    assert result.result["wrapped"] == []
    marked = result.result["marked"]
    # megatron-core 0.16.1, miles, slime: every target (train_critic, and the policy loss
    # targets: the definitions and the names other modules import)
    assert marked == 8 + 13 + 7
    assert result.stdout.count("already calls ess-patch (vendored diff") == marked


# --- Megatron-RL (Megatron-LM core_v0.16.1: megatron/training, megatron/rl) --------------------


@pytest.fixture(scope="module")
def patched_megatron_rl(tmp_path_factory) -> Path:
    """A copy of ``$MEGATRON_RL_SRC`` with patches/megatron_rl applied by the tool."""
    tree = tmp_path_factory.mktemp("vendored-mrl") / "Megatron-LM"
    shutil.copytree(os.environ["MEGATRON_RL_SRC"], tree)
    _apply(tree, "megatron_rl")
    return tree


def _mrl_env(tree: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MEGATRON_RL_SRC=str(tree), **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH", "")]))
    env.pop("ESS_PATCH_AUTO_INSTALL", None)
    return env


@MEGATRON_RL
def test_megatron_rl_tests_pass_on_the_patched_tree_without_install(patched_megatron_rl, tmp_path):
    env = _mrl_env(patched_megatron_rl, ESS_PATCH_TEST_MODE="vendored")
    names, skipped, tail = run_pytest(FRAMEWORKS / "test_megatron_rl.py", env, tmp_path)
    assert {
        "test_unpacked_arms_the_reference_scale_on_every_rank[dp2xcp2]",
        "test_unpacked_arms_the_reference_scale_on_every_rank[dp2xpp2]",
        "test_packed_arms_the_reference_scale_on_every_rank[dp2xcp2]",
        "test_packed_arms_the_reference_scale_on_every_rank[dp2xpp2]",
        "test_flags_through_megatrons_parse_args_with_a_user_provider",
        "test_no_inference_logprobs_is_a_startup_error",
        "test_metrics_reach_megatron_rls_writers",
        "test_mismatched_packed_shapes_are_an_error_on_every_rank",
    } <= names, tail
    assert len(names) >= 15 and len(names) + len(skipped) >= 16, tail
    for name, message in skipped:
        assert ALLOWED_MRL_SKIP in message, f"{name} skipped: {tail}"


@MEGATRON_RL
def test_install_wraps_nothing_on_the_patched_megatron_rl_tree(
    patched_megatron_rl, tmp_path, fresh_python
):
    code = f"""
import importlib, logging, sys
sys.path.append({str(patched_megatron_rl)!r})
import ess_patch
from ess_patch.install import INTEGRATIONS
from ess_patch.vendored import is_vendored
integration = INTEGRATIONS["megatron_rl"]
for module in integration.modules:
    importlib.import_module(module)
marked = 0
for t in integration.targets:
    if not t.vendored:  # install()-only targets (VCPO's baseline): no series carries them
        continue
    value = vars(sys.modules[t.module]).get(t.attribute)
    assert value is not None and is_vendored(value), t.path + " is not patched"
    marked += 1
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s", force=True)
ess_patch.install("megatron_rl")
only = {{t.path for t in integration.targets if not t.vendored}}
emit(dict(wrapped=[p for p in ess_patch.installed_targets() if p not in only], marked=marked))
"""
    result = fresh_python(code, _mrl_env(patched_megatron_rl), cwd=tmp_path, timeout=300)
    assert result.result["wrapped"] == []
    marked = result.result["marked"]
    assert marked == 7  # every target, the re-imported names included
    assert result.stdout.count("already calls ess-patch (vendored diff") == marked
