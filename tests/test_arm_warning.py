"""arm() with nothing that applies the scale warns once per process (issue 13, item 11)."""

from __future__ import annotations

import logging

import pytest
import torch

import ess_patch
from ess_patch.state import STATE, reset

NO_EFFECT = "nothing in this process applies the armed scale"


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and NO_EFFECT in r.getMessage()
    ]


@pytest.fixture
def nothing_applies(clean_ess, monkeypatch):
    # optimizers attached, or vendored steps decorated, by earlier tests in this process
    monkeypatch.setattr(STATE, "applied_elsewhere", False)
    yield


def test_arm_without_install_or_attach_warns_once_and_reset_rearms_it(nothing_applies, caplog):
    with caplog.at_level(logging.WARNING, logger="ess_patch"):
        ess_patch.arm(0.5)
        ess_patch.arm(0.25)
        ess_patch.arm(ess_patch.EssLrResult.from_scale(0.5))
    assert len(_warnings(caplog)) == 1
    message = _warnings(caplog)[0]
    assert "ess_patch.install()" in message and "ess_patch.attach(optimizer)" in message
    assert ess_patch.armed().scale == 0.5  # armed all the same: a warning, not a refusal
    reset()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ess_patch"):
        ess_patch.arm(0.5)
    assert len(_warnings(caplog)) == 1


def test_arm_after_attach_says_nothing_and_scales(nothing_applies, caplog):
    param = torch.nn.Parameter(torch.ones(2))
    opt = ess_patch.attach(torch.optim.SGD([param], lr=0.1))
    with caplog.at_level(logging.WARNING, logger="ess_patch"):
        ess_patch.arm(0.5)
    assert _warnings(caplog) == []
    param.grad = torch.ones(2)
    opt.step()
    assert torch.equal(param.detach(), torch.ones(2).add(torch.ones(2), alpha=-0.05))


def test_arm_after_install_says_nothing(nothing_applies, caplog):
    ess_patch.install("megatron")
    with caplog.at_level(logging.WARNING, logger="ess_patch"):
        ess_patch.arm(0.5)
    assert _warnings(caplog) == []
