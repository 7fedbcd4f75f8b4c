"""The demo's own launcher: a failing rank becomes a :class:`DemoError` with its traceback,
and no rank outlives the launch."""

from __future__ import annotations

import multiprocessing

import pytest

pytest.importorskip("megatron.core")

from ess_patch.demo.launch import DemoError, launch
from ess_patch.demo.train import DemoConfig

pytestmark = pytest.mark.dist


def test_a_failing_rank_is_reported_with_its_traceback(tmp_path):
    cfg = DemoConfig(steps=2, dp=2, pp=1, prompts_per_rank=1, group_size=2)
    # past the config's checks: every rank fails when it builds its optimizer
    object.__setattr__(cfg, "lr", "not-a-number")
    steps = []
    with pytest.raises(DemoError) as info:
        launch(cfg, tmp_path, on_step=lambda arm, step: steps.append((arm, step)))
    message = str(info.value)
    assert "ess-patch demo (dp=2 tp=1 pp=1) failed" in message
    assert "failed first" in message and "Traceback (most recent call last)" in message
    assert "TypeError" in message  # the rank's own error (Adam compares lr with 0.0)
    assert steps == []  # no step was recorded
    assert multiprocessing.active_children() == []  # every rank was joined
    assert not list((tmp_path / "ranks").glob("*.result.pkl"))
