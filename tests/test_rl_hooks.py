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
        (MILES_FRAMEWORK, {"skip_actor_forward_only": True}, r"--skip-actor-forward-only skips"),
        (MILES_FRAMEWORK, {"use_rollout_logprobs": True}, r"--use-rollout-logprobs without"),
        (SLIME_FRAMEWORK, {"use_rollout_logprobs": True}, r"--use-rollout-logprobs without"),
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
    assert "0.0 is outside (0, 1]" in err and "must be a finite number > 0" in err
    assert "invalid choice: 'x'" in err


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


def _call(args, data):
    return advantage_wrapper(SINGLE)(lambda a, d: "advantages", None, (args, data), {})


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


def test_hook_with_missing_log_probs_is_a_logged_noop(clean_ess, caplog):
    ess_patch.arm(0.5)  # the previous rollout's scale must not carry over
    with caplog.at_level(logging.WARNING, logger="ess_patch"):
        _call(Namespace(use_ess_lr=True), _rollout(log_probs=False))
    assert ess_patch.armed().status == "missing" and ess_patch.armed().scale == 1.0
    assert "no train log-probs on some rank; ESS-LR is a no-op" in caplog.text


def test_critic_is_never_armed(clean_ess):
    ess_patch.arm(0.5)
    _call(Namespace(use_ess_lr=True, loss_type="value_loss"), _rollout())
    assert ess_patch.armed() is None
    assert ess_patch.state.STATE.role == "critic"


def test_settings_come_from_the_flags_else_from_install(clean_ess, monkeypatch):
    from ess_patch.integrations.rl_hooks import config_from_args

    monkeypatch.setenv("ESS_LR_WEIGHT_MODE", "product")
    ess_patch.install("megatron")  # no config given: read from ESS_LR_*
    assert config_from_args(Namespace(use_ess_lr=True)).weight_mode == "product"
    flags = Namespace(use_ess_lr=True, ess_lr_weight_mode="geometric", ess_lr_floor=0.3)
    assert (config_from_args(flags).weight_mode, config_from_args(flags).floor) == (
        "geometric",
        0.3,
    )


def test_a_fork_with_some_ess_flags_gets_the_rest():
    """A host that defines --ess-lr-floor itself (and no --use-ess-lr): ours are added around
    it, the host's own floor option is kept, and the README's launch line parses."""
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
