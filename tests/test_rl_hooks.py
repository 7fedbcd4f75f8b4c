"""The framework-independent half of the miles/slime integration, in one process.

The real upstream functions are exercised in tests/frameworks (tox -e frameworks); here the
rules that do not need them: validation messages, flag parsing, the no-op and critic paths.
"""

from __future__ import annotations

import argparse
import logging
from argparse import Namespace

import pytest
import torch

import ess_patch
from ess_patch.integrations.miles import MILES_FRAMEWORK
from ess_patch.integrations.rl_hooks import (
    Framework,
    Groups,
    add_ess_arguments,
    advantage_wrapper,
    compose_custom_arguments,
    validate,
)
from ess_patch.integrations.slime import SLIME_FRAMEWORK

SINGLE = Framework(
    name="single",
    groups=lambda: Groups(None, 0, 1, None, None, True),
    no_input_reason=lambda args: None,
    unsupported_reason=lambda args: None,
)


@pytest.mark.parametrize(
    ("framework", "args", "message"),
    [
        (
            MILES_FRAMEWORK,
            {"train_backend": "xla"},
            r"--train-backend xla \(supported: megatron, fsdp\)",
        ),
        (MILES_FRAMEWORK, {"use_fault_tolerance": True}, r"--use-fault-tolerance"),
        # measured inside the loss (one ESS per optimizer step): refused with several steps
        # per rollout and granularity "rollout"
        (
            MILES_FRAMEWORK,
            {"skip_actor_forward_only": True, "num_steps_per_rollout": 2},
            r"--skip-actor-forward-only skips.*--ess-lr-granularity step",
        ),
        (
            MILES_FRAMEWORK,
            {"use_rollout_logprobs": True, "num_steps_per_rollout": 2},
            r"--use-rollout-logprobs without.*--ess-lr-granularity step",
        ),
        (
            SLIME_FRAMEWORK,
            {"use_rollout_logprobs": True, "num_steps_per_rollout": 2},
            r"--use-rollout-logprobs without.*--ess-lr-granularity step",
        ),
        (
            SLIME_FRAMEWORK,
            {"train_backend": "fsdp"},
            r"--train-backend fsdp \(supported: megatron\)",
        ),
        (MILES_FRAMEWORK, {"ess_lr_floor": 0.0}, r"floor"),  # set in code, not by the parser
    ],
)
def test_validation_names_the_setting(framework, args, message):
    with pytest.raises(ValueError, match=message):
        validate(framework, Namespace(use_ess_lr=True, **args))
    validate(framework, Namespace(use_ess_lr=False, **args))  # disabled: nothing to check


def test_flags_parse_and_reject_bad_values(capsys):
    parser = add_ess_arguments(argparse.ArgumentParser(prog="train.py"))
    add_ess_arguments(parser)  # idempotent: no "conflicting option" error
    args = parser.parse_args(["--use-ess-lr", "--ess-lr-floor", "1", "--ess-lr-rule", "linear"])
    assert (args.use_ess_lr, args.ess_lr_floor, args.ess_lr_rule) == (True, 1.0, "linear")
    for bad in (["--ess-lr-floor", "0"], ["--ess-lr-base-ratio", "-1"], ["--ess-lr-rule", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    err = capsys.readouterr().err
    assert "floor='0' must be in (0, 1]" in err and "must be a finite number > 0" in err
    assert "EssLrConfig.rule='x' is not a known value; valid values: sqrt, linear" in err


def test_composed_custom_arguments_keep_the_users():
    seen = []
    add = compose_custom_arguments(lambda parser: seen.append(parser))  # returns None
    parser = add(argparse.ArgumentParser())
    assert seen == [parser]
    assert parser.parse_args([]).use_ess_lr is False


def _rollout(log_probs=True):
    lp = [torch.tensor([0.0, 0.1]), torch.tensor([1.0])]
    return {
        "log_probs": lp if log_probs else None,
        "rollout_log_probs": [torch.zeros(2), torch.zeros(1)],
        "loss_masks": [torch.ones(2), torch.ones(1)],
    }


def _compute_advantages_and_returns(args, rollout_data):  # the host's parameter names
    return "advantages"


def _call(args, data):
    return advantage_wrapper(SINGLE)(_compute_advantages_and_returns, None, (args, data), {})


def test_hook_arms_the_rollout_result_and_changes_nothing_when_off(clean_ess):
    data = _rollout()
    assert _call(Namespace(use_ess_lr=False), data) == "advantages"
    assert ess_patch.armed() is None  # disabled: never armed
    assert _call(Namespace(use_ess_lr=True, ess_lr_weight_mode="product"), data) == "advantages"
    expected = ess_patch.compute_ess_lr(
        data["log_probs"],
        data["rollout_log_probs"],
        data["loss_masks"],
        config=ess_patch.EssLrConfig(weight_mode="product"),
    )
    assert ess_patch.armed() == expected and expected.scale < 1


def test_hook_with_missing_log_probs_stops_the_run_unless_opted_out(clean_ess, caplog, monkeypatch):
    ess_patch.arm(0.5)  # the previous rollout's scale must not carry over
    with pytest.raises(ess_patch.EssLrNotAppliedError) as error:
        _call(Namespace(use_ess_lr=True), _rollout(log_probs=False))
    assert "(single)" in str(error.value) and "Add --get-mismatch-metrics" in str(error.value)
    assert "ESS_PATCH_ALLOW_UNSCALED=1" in str(error.value)
    assert ess_patch.armed() is None  # nothing armed: the previous scale is gone too
    # the opt-out: logged as such, and the rollout is a no-op
    monkeypatch.setenv("ESS_PATCH_ALLOW_UNSCALED", "1")
    with caplog.at_level(logging.WARNING, logger="ess_patch"):
        _call(Namespace(use_ess_lr=True), _rollout(log_probs=False))
    assert ess_patch.armed().status == "missing" and ess_patch.armed().scale == 1.0
    assert "ESS_PATCH_ALLOW_UNSCALED=1 (opt-out): going on unscaled" in caplog.text
    assert "Add --get-mismatch-metrics" in caplog.text  # the warning names the fix


def test_critic_is_never_armed(clean_ess):
    ess_patch.arm(0.5)
    _call(Namespace(use_ess_lr=True, loss_type="value_loss"), _rollout())
    assert ess_patch.armed() is None
    assert ess_patch.state.STATE.role == "critic"


def test_settings_come_from_the_flags_else_from_install(clean_ess, monkeypatch):
    """Through the parser the hosts get (argparse fills in what is not given): every field a
    flag does not give comes from install()'s config (ESS_LR_* here), a flag given wins."""
    from ess_patch.integrations.rl_hooks import config_from_args

    monkeypatch.setenv("ESS_LR_WEIGHT_MODE", "product")
    monkeypatch.setenv("ESS_LR_FLOOR", "0.3")
    monkeypatch.setenv("ESS_LR_RULE", "linear")
    monkeypatch.setenv("ESS_LR_BASE_RATIO", "0.5")
    monkeypatch.setenv("ESS_LR_NONFINITE", "floor")
    ess_patch.install("megatron")  # no config given: read from ESS_LR_*
    parser = add_ess_arguments(argparse.ArgumentParser())
    from_env = ess_patch.EssLrConfig(
        floor=0.3, weight_mode="product", rule="linear", base_ratio=0.5, nonfinite="floor"
    )
    assert config_from_args(parser.parse_args(["--use-ess-lr"])) == from_env
    flags = parser.parse_args(["--use-ess-lr", "--ess-lr-weight-mode", "geometric"])
    assert config_from_args(flags) == ess_patch.EssLrConfig(
        floor=0.3, weight_mode="geometric", rule="linear", base_ratio=0.5, nonfinite="floor"
    )


def test_a_fork_with_some_ess_flags_gets_the_rest():
    """A host that defines --ess-lr-floor itself (and no --use-ess-lr): ours are added around
    it, the host's own floor option is kept, and the documented launch line parses."""
    parser = argparse.ArgumentParser(prog="train.py")
    parser.add_argument("--ess-lr-floor", type=float, default=0.25)
    add_ess_arguments(parser)
    args = parser.parse_args(["--use-ess-lr", "--ess-lr-floor", "0.3", "--ess-lr-rule", "linear"])
    assert (args.use_ess_lr, args.ess_lr_floor, args.ess_lr_rule) == (True, 0.3, "linear")
    assert parser.parse_args([]).ess_lr_floor == 0.25  # the host's default stands


def test_a_fork_with_use_ess_lr_still_gets_the_options():
    parser = argparse.ArgumentParser(prog="train.py")
    parser.add_argument("--use-ess-lr", action="store_true")
    add_ess_arguments(parser)
    args = parser.parse_args(["--use-ess-lr", "--ess-lr-floor", "0.2"])
    assert (args.use_ess_lr, args.ess_lr_floor) == (True, 0.2)


def test_a_host_flag_with_another_dest_is_refused():
    parser = argparse.ArgumentParser(prog="train.py")
    parser.add_argument("--use-ess-lr", dest="ess_enabled", action="store_true")
    with pytest.raises(ValueError, match=r"--use-ess-lr with dest='ess_enabled'.*args\.use_ess_lr"):
        add_ess_arguments(parser)
    assert "--ess-lr-floor" not in parser._option_string_actions  # nothing half-added


# --- shadow mode -------------------------------------------------------------------------------


def test_shadow_flag_parses_and_reaches_the_config(clean_ess):
    from ess_patch.integrations.rl_hooks import config_from_args

    parser = add_ess_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).ess_lr_shadow is None  # not given: the install config decides
    args = parser.parse_args(["--ess-lr-shadow"])
    assert args.ess_lr_shadow is True and args.use_ess_lr is False
    assert config_from_args(args).shadow is True
    assert config_from_args(parser.parse_args([])).shadow is False


@pytest.mark.parametrize(
    ("raw", "value"), [("1", True), ("true", True), ("TRUE", True), ("0", False), ("false", False)]
)
def test_shadow_from_env_accepts_clear_booleans(raw, value):
    assert ess_patch.EssLrConfig.from_env({"ESS_LR_SHADOW": raw}).shadow is value


@pytest.mark.parametrize("raw", ["yes", "2", "on", "tru"])
def test_shadow_from_env_rejects_anything_else(raw):
    with pytest.raises(ValueError, match=r"ESS_LR_SHADOW\) must be a bool: 1/0/true/false"):
        ess_patch.EssLrConfig.from_env({"ESS_LR_SHADOW": raw})


def test_shadow_is_in_the_fingerprint():
    from ess_patch.config import describe_fingerprint

    on = ess_patch.EssLrConfig(shadow=True).fingerprint()
    off = ess_patch.EssLrConfig().fingerprint()
    assert on != off  # ranks that disagree on shadow mode raise instead of drifting
    assert describe_fingerprint(on)["shadow"] is True
    assert describe_fingerprint(off)["shadow"] is False


@pytest.mark.parametrize("framework", [MILES_FRAMEWORK, SLIME_FRAMEWORK])
def test_shadow_and_use_ess_lr_together_are_refused(framework, clean_ess, monkeypatch):
    both = r"--use-ess-lr and --ess-lr-shadow \(or ESS_LR_SHADOW=1\) are both on"
    with pytest.raises(ValueError, match=both):
        validate(framework, Namespace(use_ess_lr=True, ess_lr_shadow=True))
    monkeypatch.setenv("ESS_LR_SHADOW", "1")
    ess_patch.install("megatron")  # no config given: shadow from ESS_LR_SHADOW
    with pytest.raises(ValueError, match=both):
        validate(framework, Namespace(use_ess_lr=True))
    validate(framework, Namespace(use_ess_lr=False))  # shadow alone is fine


def test_shadow_alone_is_validated_like_enabled():
    with pytest.raises(
        ValueError,
        match=r"--ess-lr-shadow cannot measure.*--ess-lr-granularity step.*"
        r"Drop --ess-lr-shadow",
    ):
        validate(
            MILES_FRAMEWORK,
            Namespace(ess_lr_shadow=True, skip_actor_forward_only=True, num_steps_per_rollout=2),
        )


def test_shadow_hook_computes_and_logs_but_arms_nothing(clean_ess):
    from ess_patch.integrations.rl_hooks import ess_metrics
    from ess_patch.state import STATE, reset

    data = _rollout()
    args = Namespace(use_ess_lr=False, ess_lr_shadow=True, ess_lr_weight_mode="product")
    assert _call(args, data) == "advantages"
    expected = ess_patch.compute_ess_lr(
        data["log_probs"],
        data["rollout_log_probs"],
        data["loss_masks"],
        config=ess_patch.EssLrConfig(weight_mode="product", shadow=True),
    )
    assert expected.scale < 1
    assert ess_patch.armed() is None  # the optimizer wrappers see nothing
    assert STATE.shadow == expected
    metrics = ess_metrics()
    assert "lr_scale" not in metrics
    assert metrics["ess_lr_shadow_scale"] == expected.scale
    assert (metrics["rho_ess"], metrics["ess"], metrics["ess_num_trajectories"]) == (
        expected.rho,
        expected.ess,
        2.0,
    )
    reset()
    assert STATE.shadow is None and ess_metrics() == {}


def test_shadow_from_the_install_config_runs_with_use_ess_lr_off(clean_ess, monkeypatch):
    from ess_patch.state import STATE

    _call(Namespace(use_ess_lr=False), _rollout())
    assert STATE.shadow is None  # neither on: nothing computed
    monkeypatch.setenv("ESS_LR_SHADOW", "true")
    ess_patch.install("megatron")
    _call(Namespace(use_ess_lr=False), _rollout())
    assert STATE.shadow is not None and STATE.shadow.status == "ok"
    assert ess_patch.armed() is None


def test_shadow_critic_computes_nothing(clean_ess):
    from ess_patch.state import STATE

    _call(Namespace(ess_lr_shadow=True, loss_type="value_loss"), _rollout())
    assert STATE.shadow is None and ess_patch.armed() is None


class _Actor:
    """What the wrapper reads of miles' ``MegatronTrainRayActor``: ``weight_updater``."""

    def __init__(self) -> None:
        self.weight_updater = Namespace(weight_version=0)

    def update_weights(self, info=None) -> None:  # miles: version++ then push to the engines
        self.weight_updater.weight_version += 1


def test_calibration_counts_the_samples_of_the_published_weights_only(clean_ess):
    """miles: each sample's ``weight_versions`` against the version ``update_weights`` last
    published; after a rollout trained without a new publish nothing is on-policy."""
    from ess_patch.integrations.rl_hooks import published_wrapper
    from ess_patch.state import STATE

    actor = _Actor()
    args = Namespace(use_ess_lr=True, ess_lr_weight_mode="product", ess_lr_calibrate_rollouts=3)
    lp = [torch.tensor([x], dtype=torch.float64) for x in (0.0, 1.0986122886681098, 0.0, 2.0)]
    data = {
        "log_probs": lp,
        "rollout_log_probs": [torch.zeros(1, dtype=torch.float64)] * 4,
        "loss_masks": [torch.ones(1)] * 4,
    }

    def rollout(versions):
        _call(args, {**data, "weight_versions": versions})
        return STATE.calibration

    published_wrapper(actor.update_weights, actor, (), {})  # version 1 reaches the engines
    # two samples of version 1 (weights 1 and 3: rho 0.8), two older ones: the pair counts
    assert rollout([["1"], ["1"], ["0"], ["0", "1"]]) == (1.0, pytest.approx(0.8))
    # trained since, no publish: no sample is on-policy, nothing counted (warned)
    assert rollout([["1"]] * 4) == (1.0, pytest.approx(0.8))
    assert ess_patch.armed().status == "ok"  # braked by the ratio so far, not unscaled
    published_wrapper(actor.update_weights, actor, (), {})  # version 2
    assert rollout([["2"]] * 4)[0] == 2.0
    # without recorded versions every sample counts, as before
    _call(args, data)
    assert STATE.calibration[0] == 3.0
