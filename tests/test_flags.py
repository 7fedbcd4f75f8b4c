"""The --ess-lr-* options: generated from EssLrConfig's fields, "not given" by default, and one
precedence everywhere: a flag given > install(config=...) / ESS_LR_* > EssLrConfig's default.

Everything goes through a real argparse parser (the one the hosts get from
``add_ess_arguments``), never a hand-built Namespace: argparse filling in a default is exactly
what hid the environment before. The real miles / slime parsers: tests/frameworks/test_launch.py.
"""

from __future__ import annotations

import argparse
import logging
from argparse import Namespace
from dataclasses import fields

import pytest
import torch

import ess_patch
from ess_patch import EssLrConfig, EssLrResult
from ess_patch.integrations.flags import add_ess_arguments, config_from_args, shadow_requested
from ess_patch.integrations.miles import MILES_FRAMEWORK
from ess_patch.integrations.rl_hooks import (
    Framework,
    Groups,
    advantage_wrapper,
    critic_wrapper,
    ess_metrics,
    validate,
)
from ess_patch.integrations.slime import SLIME_FRAMEWORK
from ess_patch.state import STATE

# Every field away from its default: a value that falls back wrongly cannot hide.
FLAGS = EssLrConfig(
    floor=0.2,
    weight_mode="product",
    rule="linear",
    base_ratio=0.5,
    nonfinite="floor",
    granularity="step",
    weight_clip=3.0,
    calibrate_rollouts=3,
    warn_threshold=0.5,
    warn_patience=2,
)
FLAG_ARGV = [
    "--ess-lr-floor=0.2",
    "--ess-lr-weight-mode=product",
    "--ess-lr-rule=linear",
    "--ess-lr-base-ratio=0.5",
    "--ess-lr-nonfinite=floor",
    "--ess-lr-granularity=step",
    "--ess-lr-weight-clip=3",
    "--ess-lr-calibrate-rollouts=3",
    "--ess-lr-warn-threshold=0.5",
    "--ess-lr-warn-patience=2",
]
ENV = {
    "ESS_LR_FLOOR": "0.4",
    "ESS_LR_WEIGHT_MODE": "product",
    "ESS_LR_RULE": "linear",
    "ESS_LR_BASE_RATIO": "0.25",
    "ESS_LR_NONFINITE": "floor",
    "ESS_LR_GRANULARITY": "step",
    "ESS_LR_WEIGHT_CLIP": "5",
    "ESS_LR_CALIBRATE_ROLLOUTS": "5",
    "ESS_LR_WARN_THRESHOLD": "0.4",
    "ESS_LR_WARN_PATIENCE": "4",
}
FROM_ENV = EssLrConfig(
    floor=0.4,
    weight_mode="product",
    rule="linear",
    base_ratio=0.25,
    nonfinite="floor",
    granularity="step",
    weight_clip=5.0,
    calibrate_rollouts=5,
    warn_threshold=0.4,
    warn_patience=4,
)


def _parse(argv):
    return add_ess_arguments(argparse.ArgumentParser(prog="train.py")).parse_args(argv)


@pytest.fixture
def no_ess_env(monkeypatch):
    for f in fields(EssLrConfig):
        monkeypatch.delenv("ESS_LR_" + f.name.upper(), raising=False)
    return monkeypatch


def test_one_option_per_field_not_given_by_default():
    parser = add_ess_arguments(argparse.ArgumentParser())
    actions = {a.dest: a for a in parser._actions}
    for f in fields(EssLrConfig):
        action = actions[f"ess_lr_{f.name}"]
        assert action.option_strings[0] == "--ess-lr-" + f.name.replace("_", "-")
        assert action.default is None  # "not given": the fallback decides
        assert f.metadata["help"] in action.help  # the help lives on the field
    assert actions["use_ess_lr"].default is False  # the switch stays a store_true
    args = parser.parse_args([])
    assert all(getattr(args, f"ess_lr_{f.name}") is None for f in fields(EssLrConfig))


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (FLAG_ARGV, {}, FLAGS),  # flags only
        ([], ENV, FROM_ENV),  # ESS_LR_* only
        (FLAG_ARGV, ENV, FLAGS),  # both: the flags win, field by field
        (["--ess-lr-floor=0.2"], ENV, EssLrConfig(**{**vars(FROM_ENV), "floor": 0.2})),
        ([], {}, EssLrConfig()),  # neither: the defaults
    ],
    ids=["flags", "env", "both", "one-flag-over-env", "neither"],
)
def test_precedence_through_install(argv, env, expected, clean_ess, no_ess_env):
    for key, value in env.items():
        no_ess_env.setenv(key, value)
    ess_patch.install("megatron")  # the documented path: install() reads ESS_LR_*
    assert config_from_args(_parse(["--use-ess-lr", *argv])) == expected


def test_install_config_is_the_fallback_and_a_flag_beats_it(clean_ess, no_ess_env):
    no_ess_env.setenv("ESS_LR_FLOOR", "0.9")  # install(config=...) replaces the environment
    ess_patch.install("megatron", config=EssLrConfig(floor=0.3, rule="linear"))
    assert config_from_args(_parse(["--use-ess-lr"])) == EssLrConfig(floor=0.3, rule="linear")
    given = config_from_args(_parse(["--use-ess-lr", "--ess-lr-floor", "0.5"]))
    assert given == EssLrConfig(floor=0.5, rule="linear")


def test_without_install_the_environment_still_counts(clean_ess, no_ess_env):
    """A tree patched with the patches/ diffs may never call install()."""
    no_ess_env.setenv("ESS_LR_FLOOR", "0.3")
    assert config_from_args(_parse(["--use-ess-lr"])) == EssLrConfig(floor=0.3)


def test_explicit_off_values_beat_the_environment(clean_ess, no_ess_env):
    no_ess_env.setenv("ESS_LR_WEIGHT_CLIP", "2")
    no_ess_env.setenv("ESS_LR_SHADOW", "1")
    ess_patch.install("megatron")
    args = _parse(["--ess-lr-weight-clip", "none", "--no-ess-lr-shadow"])
    config = config_from_args(args)
    assert (config.weight_clip, config.shadow) == (None, False)
    assert shadow_requested(args) is False
    assert shadow_requested(_parse([])) is True  # not given: ESS_LR_SHADOW


def test_a_bad_environment_is_refused_when_the_flags_are_read(clean_ess, no_ess_env):
    no_ess_env.setenv("ESS_LR_FLOOR", "2")
    with pytest.raises(ValueError, match=r"floor='2' must be in \(0, 1\]"):
        config_from_args(_parse(["--use-ess-lr"]))
    no_ess_env.setenv("ESS_LR_SHADOW", "0")  # a run without ESS-LR is not stopped by it
    assert shadow_requested(_parse([])) is False


# --- refused at parse time ---------------------------------------------------------------------


@pytest.mark.parametrize("framework", [MILES_FRAMEWORK, SLIME_FRAMEWORK])
@pytest.mark.parametrize("flag", ["--use-ess-lr", "--ess-lr-shadow"])
def test_disabled_advantages_are_refused_naming_the_flag(framework, flag, clean_ess):
    parser = add_ess_arguments(argparse.ArgumentParser())
    # the hosts' own definition (miles and slime utils/arguments.py)
    parser.add_argument(
        "--disable-compute-advantages-and-returns",
        action="store_false",
        dest="compute_advantages_and_returns",
    )
    args = parser.parse_args([flag, "--disable-compute-advantages-and-returns"])
    with pytest.raises(ValueError) as info:
        validate(framework, args)
    message = str(info.value)
    assert message.startswith(f"{flag} cannot act with --disable-compute-advantages-and-returns")
    assert f"Drop {flag} or --disable-compute-advantages-and-returns" in message
    validate(framework, parser.parse_args([flag]))  # the advantages on: accepted
    validate(framework, parser.parse_args(["--disable-compute-advantages-and-returns"]))  # SFT


# --- metrics of an unmeasured rollout ----------------------------------------------------------


@pytest.mark.parametrize("status", ["missing", "no_valid"])
def test_an_unmeasured_rollout_says_so_and_logs_no_rho(status, clean_ess):
    ess_patch.install("megatron")
    ess_patch.arm(EssLrResult.noop(status))
    assert ess_metrics() == {"ess_lr_measured": 0.0}


def test_a_measured_rollout_logs_what_its_step_applied(clean_ess):
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = ess_patch.attach(torch.optim.SGD([param], lr=0.1))
    result = EssLrResult(scale=0.5, rho=0.25, ess=2.0, num_trajectories=8)
    ess_patch.arm(result)
    values = {"rho_ess": 0.25, "ess": 2.0, "ess_num_trajectories": 8.0, "ess_num_nonfinite": 0.0}
    # before any step: the armed scale is not reported as applied
    assert ess_metrics() == {**values, "ess_lr_armed_scale": 0.5}
    seen = []
    optimizer.register_step_pre_hook(lambda opt, a, k: seen.append(opt.param_groups[0]["lr"]))
    param.grad = torch.ones(2)
    optimizer.step()
    # read back from the step: the LR inside it over the scheduled LR (0.05 / 0.1)
    assert seen == [pytest.approx(0.05)] and optimizer.param_groups[0]["lr"] == 0.1
    assert ess_metrics() == {**values, "lr_scale": pytest.approx(0.05 / 0.1)}
    ess_patch.detach(optimizer)


def test_shadow_mode_of_an_unmeasured_rollout_says_so(clean_ess):
    STATE.shadow = EssLrResult.noop("missing")
    assert ess_metrics() == {"ess_lr_measured": 0.0}  # no would-be scale of 1 either


# --- the critic --------------------------------------------------------------------------------

SINGLE = Framework(
    name="single",
    groups=lambda: Groups(None, 0, 1, None, None, True),
    no_input_reason=lambda args: None,
    unsupported_reason=lambda args: None,
)


def _critic_rollout():
    # what train_critic has at its advantage call: values, no train log-probs
    return {
        "log_probs": None,
        "rollout_log_probs": [torch.zeros(2)],
        "loss_masks": [torch.ones(2)],
        "values": [torch.zeros(2)],
    }


class _Critic:
    """miles' and slime's order in ``train_critic``: advantages first, then the loss type."""

    def __init__(self, args):
        self.args = args
        self.advantages = advantage_wrapper(SINGLE)

    def train_critic(self, rollout_id, rollout_data):
        def compute_advantages_and_returns(args, rollout_data):
            return None

        self.advantages(compute_advantages_and_returns, None, (self.args, rollout_data), {})
        self.args.loss_type = "value_loss"


@pytest.mark.parametrize("flag", ["--use-ess-lr", "--ess-lr-shadow"])
def test_the_critic_is_the_critic_from_rollout_zero(flag, clean_ess, caplog):
    ess_patch.install("megatron")
    args = _parse([flag])
    args.loss_type = "policy_loss"  # the host's default until train_critic changes it
    critic = _Critic(args)
    with caplog.at_level(logging.WARNING, logger="ess_patch"):
        critic_wrapper(critic.train_critic, critic, (0, _critic_rollout()), {})
    assert caplog.records == []  # no "not measured" warning from the critic
    assert STATE.role == "critic"
    assert ess_patch.armed() is None and STATE.shadow is None
    assert ess_metrics() == {}  # never logs policy metrics
    ess_patch.arm(0.5)  # even if something arms a result
    assert ess_metrics() == {}


def test_without_the_critic_entry_rollout_zero_was_taken_for_the_policy(clean_ess, caplog):
    """The bug the critic entry fixes: the advantage hook alone sees loss_type policy_loss."""
    ess_patch.install("megatron")
    args = _parse(["--use-ess-lr"])
    args.loss_type = "policy_loss"
    # taken for the policy: its rollout (no log-probs) stops the run as a policy's would
    with pytest.raises(ess_patch.EssLrNotAppliedError, match="cannot be measured"):
        _Critic(args).train_critic(0, _critic_rollout())
    assert STATE.role == "policy"


def test_the_critic_role_comes_from_the_args_too(clean_ess):
    ess_patch.install("megatron")
    args = Namespace(use_ess_lr=True, loss_type="value_loss")
    _Critic(args).train_critic(1, _critic_rollout())
    assert STATE.role == "critic" and ess_metrics() == {}


# --- the demo's command line -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--floor", "0.2", "--rule", "linear"], {}, EssLrConfig(floor=0.2, rule="linear")),
        ([], {"ESS_LR_FLOOR": "0.4", "ESS_LR_WEIGHT_MODE": "product"}, None),
        (["--floor", "0.2"], {"ESS_LR_FLOOR": "0.4"}, EssLrConfig(floor=0.2)),
        (["--weight-clip", "none"], {"ESS_LR_WEIGHT_CLIP": "2"}, EssLrConfig()),
    ],
    ids=["flags", "env", "flag-over-env", "explicit-none-over-env"],
)
def test_demo_settings_follow_the_same_precedence(argv, env, expected, no_ess_env):
    from ess_patch import cli, cli_demo

    for key, value in env.items():
        no_ess_env.setenv(key, value)
    args = cli.build_parser().parse_args(["demo", *argv])
    expected = expected or EssLrConfig(floor=0.4, weight_mode="product")
    assert cli_demo._ess_settings(args) == expected


def test_demo_settings_have_no_defaults_of_their_own():
    from ess_patch import cli, cli_demo

    args = cli.build_parser().parse_args(["demo"])
    assert all(getattr(args, name) is None for name in cli_demo.DEMO_ESS_FIELDS)
