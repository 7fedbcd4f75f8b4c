"""The early warning in a run: the advantage hook (miles/slime's path, shadow mode and on),
the per-step ledger, and real gloo ranks (one warning, from global rank 0).

Each rollout has 8 one-token trajectories, 7 with log-ratio 0 and one with ``x``, so that
rho = (7 + e^x)^2 / (8 (7 + e^2x)) (checked against ``reference.reference_ess``): x = 0 gives 1,
x = 1.5 about 0.61, x = 4, 5, 6 about 0.159, 0.137, 0.129.
"""

from __future__ import annotations

import logging
import math
from argparse import Namespace

import pytest
import torch
from harness import layout, run_ranks
from reference import reference_ess

import ess_patch
from ess_patch import EssLrConfig
from ess_patch.estimator import trajectory_stats
from ess_patch.integrations.rl_hooks import Framework, Groups, advantage_wrapper
from ess_patch.ledger import LedgerRun, add, start
from ess_patch.lr import step_wrapper
from ess_patch.state import STATE

LOGGER = "ess_patch.collapse_warning"
# VCPO's shapes: a steady run holds rho ~0.6-0.8, a collapsing one falls to ~0.13
STEADY = [0.0, 1.0, 1.5, 1.0, 1.5, 1.0, 1.5, 1.0]
COLLAPSING = [0.0, 0.0, 1.0, 2.0, 4.0, 5.0, 6.0, 6.0]  # below 0.2 at 4, 5, 6: fires at 6

SINGLE = Framework(
    name="single",
    groups=lambda: Groups(None, 0, 1, None, None, True),
    no_input_reason=lambda args: None,
    unsupported_reason=lambda args: None,
)


def _rollout(x: float, keep: slice = slice(None)) -> dict:
    lp = [torch.tensor([0.0], dtype=torch.float64)] * 7 + [torch.tensor([x], dtype=torch.float64)]
    return {
        "log_probs": lp[keep],
        "rollout_log_probs": [torch.zeros(1, dtype=torch.float64)] * 8,
        "loss_masks": [torch.ones(1)] * 8,
    }


def _rho(x: float) -> float:
    data = _rollout(x)
    return reference_ess(data["log_probs"], data["rollout_log_probs"], data["loss_masks"])["rho"]


def _advantages(args, rollout_data):  # the host's parameter names
    return "advantages"


def _run(args: Namespace, series: list[float], framework: Framework = SINGLE) -> None:
    for x in series:
        data = _rollout(x)
        assert advantage_wrapper(framework)(_advantages, None, (args, data), {}) == "advantages"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_the_series_are_what_the_docstring_says():
    assert [round(_rho(x), 3) for x in (0.0, 1.5, 4.0, 5.0, 6.0)] == [
        1.0,
        0.608,
        0.159,
        0.137,
        0.129,
    ]
    assert min(_rho(x) for x in STEADY) > 0.5


def test_shadow_mode_warns_once_on_a_collapsing_run_and_changes_nothing(clean_ess, caplog):
    args = Namespace(use_ess_lr=False, ess_lr_shadow=True)
    with caplog.at_level(logging.WARNING, logger="ess_patch"):
        _run(args, COLLAPSING)
    [message] = _warnings(caplog)
    assert [r.levelname for r in caplog.records if r.name == LOGGER] == ["WARNING"]
    rhos = ", ".join(f"{_rho(x):.3g}" for x in (4.0, 5.0, 6.0))
    assert "ESS early warning at rollout 6 " in message
    assert f"rho {rhos} over rollouts 4-6, below 0.2 for 3 in a row" in message
    assert "ESS collapses before training does" in message  # what it means (VCPO)
    assert "shadow mode" in message and "--use-ess-lr" in message  # what to do
    assert "lower the staleness" in message
    assert STATE.early_warning.fired == [6]
    # shadow mode still arms nothing: the optimizer wrappers see no scale
    assert ess_patch.armed() is None and STATE.shadow.rho == pytest.approx(_rho(6.0))


def test_shadow_mode_is_quiet_on_a_steady_run(clean_ess, caplog):
    with caplog.at_level(logging.DEBUG, logger="ess_patch"):
        _run(Namespace(use_ess_lr=False, ess_lr_shadow=True), STEADY * 3)
    assert _warnings(caplog) == []
    assert STATE.early_warning.fired == [] and STATE.early_warning.armed


def test_with_ess_lr_on_it_warns_and_says_the_scale(clean_ess, caplog):
    with caplog.at_level(logging.WARNING, logger="ess_patch"):
        _run(Namespace(use_ess_lr=True), COLLAPSING)
    [message] = _warnings(caplog)
    scale = math.sqrt(_rho(6.0))  # sqrt rule, floor 0.1: above the floor
    assert f"ESS-LR is on and scales this rollout's LR by {scale:.3g}" in message
    assert ess_patch.armed().scale == pytest.approx(scale)


def test_the_options_set_the_rule(clean_ess, caplog):
    with caplog.at_level(logging.WARNING, logger="ess_patch"):
        _run(Namespace(use_ess_lr=False, ess_lr_shadow=True, ess_lr_warn_threshold=0.0), COLLAPSING)
        assert _warnings(caplog) == []  # 0: off
        _run(Namespace(use_ess_lr=False, ess_lr_shadow=True, ess_lr_warn_patience=2), COLLAPSING)
    # a new rule (another patience): counted from the first result it saw, index 0
    [message] = _warnings(caplog)
    assert "at rollout 5 " in message and "below 0.2 for 2 in a row" in message


def test_ess_lr_warn_variables_reach_the_rule(clean_ess, caplog, monkeypatch):
    monkeypatch.setenv("ESS_LR_WARN_THRESHOLD", "0.7")
    monkeypatch.setenv("ESS_LR_WARN_PATIENCE", "1")
    with caplog.at_level(logging.WARNING, logger="ess_patch"):
        _run(Namespace(use_ess_lr=False, ess_lr_shadow=True), [0.0, 1.5])  # rho 1, then 0.61 < 0.7
    [message] = _warnings(caplog)
    assert "at rollout 1 " in message and "below 0.7 for 1 in a row" in message


@pytest.mark.parametrize(
    ("variable", "value", "allowed"),
    [("ESS_LR_WARN_THRESHOLD", "2", "in \\[0, 1\\]"), ("ESS_LR_WARN_PATIENCE", "0", ">= 1")],
)
def test_a_bad_variable_is_named(variable, value, allowed, monkeypatch):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"{variable}='{value}'.*{allowed}"):
        EssLrConfig.from_env()


def test_the_critic_and_unmeasured_rollouts_feed_nothing(clean_ess, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _run(Namespace(use_ess_lr=False, ess_lr_shadow=True, loss_type="value_loss"), COLLAPSING)
        data = _rollout(6.0)
        data["log_probs"] = None  # unmeasured: rho 1 would read as "no staleness"
        for _ in range(4):
            advantage_wrapper(SINGLE)(
                _advantages, None, (Namespace(use_ess_lr=False, ess_lr_shadow=True), data), {}
            )
    assert _warnings(caplog) == [] and STATE.early_warning is None


class _Optimizer:
    def __init__(self):
        self.param_groups = [{"lr": 0.1}]


def test_the_per_step_ledger_warns_per_optimizer_step(clean_ess, caplog):
    """Measured inside the loss (granularity "step", shadow): each step's result is fed."""
    config = EssLrConfig(granularity="step")
    start(LedgerRun(framework="slime", reason="x", config=config, shadow=True))
    optimizer, lrs = _Optimizer(), []
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for x in COLLAPSING:
            data = _rollout(x)
            add(trajectory_stats(data["log_probs"], data["rollout_log_probs"], data["loss_masks"]))
            step_wrapper(lambda: lrs.append(optimizer.param_groups[0]["lr"]), optimizer, (), {})
    [message] = _warnings(caplog)
    assert message.startswith("ess-patch (slime): ESS early warning at optimizer step 6 ")
    assert "over optimizer steps 4-6" in message
    assert lrs == [0.1] * len(COLLAPSING)  # shadow: no LR changed


def _ranks_run(series: list[float]) -> tuple[int, list[int], list[str]]:
    """One rank: DP splits the 8 trajectories, PP stages take the last stage's result."""
    lay = layout()
    groups = Groups(
        lay.cp_group, lay.cp_rank, lay.cp_size, lay.dp_group, lay.pp_group, lay.is_pp_last
    )
    framework = Framework(
        name="gloo",
        groups=lambda: groups,
        no_input_reason=lambda args: None,
        unsupported_reason=lambda args: None,
    )
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(LOGGER).addHandler(handler)
    keep = slice(lay.dp_rank * 4, lay.dp_rank * 4 + 4)
    for x in series:
        data = _rollout(x)
        data = {k: v[keep] for k, v in data.items()}
        advantage_wrapper(framework)(
            _advantages, None, (Namespace(use_ess_lr=False, ess_lr_shadow=True), data), {}
        )
    return lay.rank, list(STATE.early_warning.fired), messages


@pytest.mark.dist
def test_gloo_ranks_all_fire_and_only_global_rank_0_logs(tmp_path):
    results = run_ranks(_ranks_run, dp=2, pp=2, args=(COLLAPSING,), tmp_path=tmp_path)
    assert [fired for _, fired, _ in results] == [[6]] * 4  # the same rule state everywhere
    assert [len(messages) for _, _, messages in results] == [1, 0, 0, 0]
    assert "ESS early warning at rollout 6 " in results[0][2][0]
    steady = run_ranks(_ranks_run, dp=2, pp=2, args=(STEADY,), tmp_path=tmp_path / "steady")
    assert all(fired == [] and messages == [] for _, fired, messages in steady)
