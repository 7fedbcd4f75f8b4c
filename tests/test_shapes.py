"""Host shapes chosen by feature, arguments bound by name (no framework needed: fake hosts).

The real miles / slime snapshots are in tests/frameworks (test_history.py); here the rules:
which shape wins, what the error names, that nothing stays patched, that wrappers bind by
parameter name and keep what they do not touch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import types
from dataclasses import dataclass

import pytest

import ess_patch
from ess_patch.install import INTEGRATIONS, installed_shapes
from ess_patch.integrations import Integration
from ess_patch.integrations.binding import bind, call_with
from ess_patch.integrations.miles import MILES_FRAMEWORK, log_train_step_wrapper
from ess_patch.integrations.rl_hooks import Framework, Groups, parse_args_wrapper, validate
from ess_patch.integrations.shapes import Aspect, Feature, History, Shape
from ess_patch.integrations.slime import log_wrapper
from ess_patch.patching import MissingTargetError, Target, is_ours

HOST = "ess_fake_host"


@pytest.fixture
def host(monkeypatch):
    """A fake host module: a ParallelState dataclass and an advantage function."""
    module = types.ModuleType(HOST)

    @dataclass
    class ParallelState:
        cp_group: object  # a field without default: not a class attribute
        is_pp_last_stage: bool = True

        @property
        def effective_dp(self):
            return None

    def compute_advantages_and_returns(args, parallel_state, rollout_data):
        return "ran"

    module.ParallelState = ParallelState
    module.compute_advantages_and_returns = compute_advantages_and_returns
    monkeypatch.setitem(sys.modules, HOST, module)
    return module


def test_feature_sees_fields_properties_parameters_and_says_what_is_missing(host):
    assert Feature(HOST, "ParallelState.cp_group").missing() is None
    assert Feature(HOST, "ParallelState.effective_dp").missing() is None
    assert Feature(HOST, "compute_advantages_and_returns", ("parallel_state",)).missing() is None
    assert Feature(HOST, "ParallelState.intra_dp").missing() == (
        f"{HOST}.ParallelState.intra_dp does not exist"
    )
    assert Feature(HOST, "compute_advantages_and_returns", ("x", "args")).missing() == (
        f"{HOST}.compute_advantages_and_returns has no parameter x"
    )
    assert (
        Feature("ess_no_such.module", "f").missing() == "module ess_no_such.module does not exist"
    )


def test_a_broken_host_module_is_its_own_error_not_a_missing_feature(monkeypatch, tmp_path):
    (tmp_path / "ess_broken_host.py").write_text("import ess_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="ess_no_such_dependency"):
        Feature("ess_broken_host", "f").missing()


def _history(*shapes: Shape) -> History:
    return History(
        "fakefw", "fakefw 1.0 to 2.0", (Aspect("groups", shapes, phrase="groups {label}"),)
    )


def test_the_first_shape_whose_features_all_hold_is_chosen_and_recorded(host, clean_ess):
    newest = Shape("new", "2.0", (Feature(HOST, "ParallelState.intra_dp"),))
    older = Shape("old", "1.0", (Feature(HOST, "ParallelState.cp_group"),))
    history = _history(newest, older)
    assert history.describe() == "fakefw: not decided yet"
    assert history.choose("groups") is older
    assert history.describe() == "fakefw: groups old"
    host.ParallelState.intra_dp = None  # recorded: not detected again
    assert history.choose("groups") is older


def test_no_shape_fits_names_framework_symbols_and_range(host, clean_ess):
    history = _history(
        Shape("new", "2.0", (Feature(HOST, "get_parallel_state"),)),
        Shape("old", "1.0", (Feature(HOST, "ParallelState.dp_group"),)),
    )
    with pytest.raises(MissingTargetError) as info:
        history.choose("groups")
    message = str(info.value)
    assert message.startswith("ess-patch (fakefw): this fakefw fits no known shape for 'groups'")
    assert f"new [2.0]: {HOST}.get_parallel_state does not exist" in message
    assert f"old [1.0]: {HOST}.ParallelState.dp_group does not exist" in message
    assert "Supported: fakefw 1.0 to 2.0" in message


def test_install_rolls_back_a_framework_that_fits_no_shape(host, clean_ess, monkeypatch):
    """Decided at install (module already imported): one error, nothing of it patched."""
    original = host.compute_advantages_and_returns
    fake = Integration(
        name="fakefw",
        distribution=None,
        supported="fakefw 1.0",
        targets=(
            Target(HOST, "", "compute_advantages_and_returns", lambda w, i, a, k: w(*a, **k)),
        ),
        history=History(
            "fakefw",
            "fakefw 1.0",
            (Aspect("groups", (Shape("s", "1.0", (Feature(HOST, "nope"),)),), when=(HOST,)),),
        ),
    )
    monkeypatch.setitem(INTEGRATIONS, "fakefw", fake)
    with pytest.raises(MissingTargetError, match=rf"{HOST}\.nope does not exist"):
        ess_patch.install("fakefw")
    assert not ess_patch.is_installed()
    assert host.compute_advantages_and_returns is original and not is_ours(original)
    # the feature present: installed, recorded
    host.nope = True
    ess_patch.install("fakefw")
    assert is_ours(host.compute_advantages_and_returns)
    assert installed_shapes() == {"fakefw": "fakefw: s"}
    ess_patch.uninstall()
    assert host.compute_advantages_and_returns is original


def test_parse_time_check_only_when_ess_lr_is_asked_for(clean_ess):
    history = History(
        "fakefw",
        "fakefw 1.0",
        (Aspect("groups", (Shape("s", "1.0", (Feature("ess_no_such.mod", "f"),)),)),),
    )
    framework = Framework(
        "fakefw",
        lambda: Groups(None, 0, 1, None, None, True),
        lambda a: None,
        lambda a: None,
        history=history,
    )

    def parse_args(add_custom_arguments=None):
        parser = argparse.ArgumentParser()
        parser = add_custom_arguments(parser) or parser
        return parser.parse_args(sys.argv[1:])

    wrapper = parse_args_wrapper(framework)
    sys_argv = sys.argv
    try:
        sys.argv = ["train.py"]
        assert wrapper(parse_args, None, (), {}).use_ess_lr is False  # off: not checked
        sys.argv = ["train.py", "--use-ess-lr"]
        with pytest.raises(MissingTargetError, match=r"module ess_no_such\.mod does not exist"):
            wrapper(parse_args, None, (), {})
    finally:
        sys.argv = sys_argv


@pytest.mark.parametrize("args", [{"multi_lora": True}, {"multi_lora_n_adapters": 2}])
@pytest.mark.parametrize("flag", ["use_ess_lr", "ess_lr_shadow"])
def test_miles_multi_lora_is_refused_with_ess_lr_and_shadow(args, flag):
    with pytest.raises(
        ValueError, match=r"not supported with multi-LoRA \(--multi-lora-n-adapters"
    ):
        validate(MILES_FRAMEWORK, argparse.Namespace(**{flag: True}, **args))
    validate(MILES_FRAMEWORK, argparse.Namespace(multi_lora_n_adapters=0, use_ess_lr=True))


# --- binding by name ----------------------------------------------------------------------------


def test_bind_reads_and_rewrites_by_name_keeping_the_rest():
    def host(args, parallel_state, rollout_data, *, extra=1, **more):
        return args, parallel_state, rollout_data, extra, more

    call = bind(host, ("A", "P"), {"rollout_data": "R", "flag": 3})
    assert call.arguments["rollout_data"] == "R" and call.arguments["extra"] == 1
    assert call_with(host, call, rollout_data="R2") == ("A", "P", "R2", 1, {"flag": 3})
    assert bind(host, (), {}) is None  # does not fit: the caller calls through, host raises


def _log_train_step(
    args,
    loss_dict,
    grad_norm,
    rollout_id,
    step_id,
    num_steps_per_rollout,
    role="actor",
    extra_metrics=None,
    should_log=None,
):
    return dict(extra_metrics or {}), role


def test_miles_log_wrapper_binds_role_and_extra_metrics_by_name(clean_ess):
    ess_patch.arm(ess_patch.EssLrResult(scale=0.5, rho=0.25, ess=2.0, num_trajectories=8))
    base = (None, {}, 1.0, 0, 0, 1)
    positional, _ = log_train_step_wrapper(_log_train_step, None, (*base, "actor", {"a": 1}), {})
    keyword, _ = log_train_step_wrapper(_log_train_step, None, base, {"extra_metrics": {"a": 1}})
    critic, role = log_train_step_wrapper(_log_train_step, None, base, {"role": "critic"})
    # no step has applied it yet: the armed scale is not reported as lr_scale
    expected = {k: v for k, v in ess_patch.armed().metrics().items() if k != "lr_scale"}
    assert positional == keyword == {"a": 1, **expected, "ess_lr_armed_scale": 0.5}
    assert (critic, role) == ({}, "critic")


def test_slime_log_wrapper_keeps_extra_keyword_arguments(clean_ess):
    def log(args, metrics, step_key, **kwargs):
        return metrics, kwargs

    ess_patch.arm(0.5)
    metrics, kwargs = log_wrapper(log, None, (None, {"x": 1}), {"step_key": "train/step", "z": 2})
    assert kwargs == {"z": 2} and metrics["train/ess_lr_armed_scale"] == 0.5
    assert metrics["x"] == 1 and "train/lr_scale" not in metrics  # no step applied it yet
    metrics, _ = log_wrapper(log, None, (None, {"x": 1}, "rollout/step"), {})
    assert metrics == {"x": 1}


def test_doctor_shows_the_chosen_shape_or_the_problem(host, clean_ess):
    from ess_patch.doctor import Report, _shape

    fits = _history(Shape("old", "1.0", (Feature(HOST, "ParallelState.cp_group"),)))
    report = Report()
    _shape(report, "targets: fakefw", fits)
    assert report.sections["targets: fakefw"] == [
        "supported: fakefw 1.0 to 2.0",  # the framework's supported range, then its shape here
        "shape: fakefw: groups old",
    ]
    assert report.problems == []
    ess_patch.state.reset()
    fails = _history(Shape("new", "2.0", (Feature(HOST, "get_parallel_state"),)))
    _shape(report, "targets: fakefw", fails)
    assert len(report.problems) == 1
    assert f"{HOST}.get_parallel_state does not exist" in report.problems[0]


def test_module_found_imports_no_package_above_the_module(monkeypatch, tmp_path):
    """ModuleFound / ModuleGone look a module up without importing its parent packages: a
    package whose ``__init__`` imports the module that is mid-import when the check runs
    (verl v0.7.x: core_algos -> verl.workers.config -> the check of
    verl.workers.actor.megatron_actor, whose package imports dp_actor -> core_algos) would
    otherwise be a circular import."""
    from ess_patch.integrations.shapes import ModuleFound, ModuleGone, module_exists

    root = tmp_path / "hostpkg_found"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("raise RuntimeError('sub imported')\n")
    (root / "sub" / "leaf.py").write_text("")
    (root / "plain.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert ModuleFound("hostpkg_found.sub.leaf").missing() is None
    assert ModuleGone("hostpkg_found.sub.leaf").missing() == "module hostpkg_found.sub.leaf exists"
    assert ModuleFound("hostpkg_found.sub.gone").missing() == (
        "module hostpkg_found.sub.gone does not exist"
    )
    assert not module_exists("hostpkg_found.plain.below")  # a module has no submodules
    assert not module_exists("no_such_top_level_pkg.sub")
    assert "hostpkg_found.sub" not in sys.modules and "hostpkg_found" not in sys.modules
    importlib.import_module("hostpkg_found")  # an imported parent: its __path__ is searched

    assert module_exists("hostpkg_found.sub.leaf")
    assert "hostpkg_found.sub" not in sys.modules
    del sys.modules["hostpkg_found"]
