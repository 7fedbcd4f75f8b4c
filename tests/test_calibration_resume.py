"""A calibration survives a checkpoint resume through the optimizer's own state dict.

Real megatron-core optimizers on CPU (tests/megatron_cpu.py), saved and loaded through
megatron's distributed checkpointing (``dist_checkpointing.save`` / ``load`` of the optimizer's
``sharded_state_dict``, as ``megatron.training.checkpointing`` does) and through the torch
format (``state_dict`` / ``torch.save`` / ``torch.load(weights_only=True)``). The resumed job,
in a fresh ess-patch state, continues from the saved ratio instead of calibrating again.
"""

from __future__ import annotations

import math

import pytest
import torch

import ess_patch
from ess_patch import EssLrConfig, compute_ess_lr
from ess_patch.calibration import CHECKPOINT_KEY
from ess_patch.state import STATE, reset

pytestmark = [pytest.mark.usefixtures("clean_ess", "world")]

CONFIG = EssLrConfig(weight_mode="product", calibrate_rollouts=2)


def _two(a: float):
    """Two one-token trajectories with weights 1 and ``a``: rho = (1 + a)^2 / (2 (1 + a^2))."""
    lp = [torch.zeros(1, dtype=torch.float64), torch.tensor([math.log(a)], dtype=torch.float64)]
    return lp, [torch.zeros(1, dtype=torch.float64)] * 2, [torch.ones(1)] * 2


def _train(setup, step: int) -> None:
    from megatron_cpu import batch, forward_backward

    x, y = batch(0, step)
    forward_backward(setup, x, y)
    setup.optimizer.step()


def _calibrated_job(kind: str):
    """A job that calibrated on rho 1 and 0.8 (base 0.9) and trained a step after each."""
    from megatron_cpu import build_megatron_optimizer

    setup = build_megatron_optimizer(kind, optimizer="adam")
    ess_patch.install("megatron")
    for step, a in enumerate((1.0, 3.0)):
        ess_patch.arm(compute_ess_lr(*_two(a), config=CONFIG))
        _train(setup, step)
    assert STATE.calibration == (2.0, pytest.approx(1.8))
    return setup


def _model_sharded_state_dict(setup) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {
        f"model{i}.{name}": ShardedTensor.from_rank_offsets(
            f"model{i}.{name}",
            p,
            replica_id=(0, 0, 0),  # (PP, TP, DP)
        )
        for i, chunk in enumerate(setup.models)
        for name, p in chunk.module.named_parameters()
    }


def _fresh_process() -> None:
    """What a restarted job starts from: nothing held, nothing installed."""
    ess_patch.uninstall()
    reset()


def _resumed_rollout():
    """The first rollout after the resume: rho 0.64 under the saved base 0.9."""
    return compute_ess_lr(*_two(7.0), config=CONFIG)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "multi_fp32"])
def test_resume_through_megatron_dist_checkpointing_keeps_the_ratio(tmp_path, monkeypatch, kind):
    from megatron.core import dist_checkpointing
    from megatron_cpu import build_megatron_optimizer

    # test-only CPU shim: the torch_dist writer synchronises CUDA before it copies tensors
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    setup = _calibrated_job(kind)
    saved = {"optimizer": setup.optimizer.sharded_state_dict(_model_sharded_state_dict(setup))}
    (tmp_path / "ckpt").mkdir()
    dist_checkpointing.save(saved, str(tmp_path / "ckpt"))

    _fresh_process()
    resumed = build_megatron_optimizer(kind, optimizer="adam")
    ess_patch.install("megatron")
    request = {
        "optimizer": resumed.optimizer.sharded_state_dict(
            _model_sharded_state_dict(resumed), is_loading=True
        )
    }
    loaded = dist_checkpointing.load(request, str(tmp_path / "ckpt"))
    resumed.optimizer.load_state_dict(loaded["optimizer"])
    result = _resumed_rollout()
    assert (result.status, result.calibrated_ratio) == ("ok", pytest.approx(0.9, rel=1e-12))
    assert result.scale == pytest.approx(math.sqrt(0.64 / 0.9), rel=1e-12)
    ess_patch.arm(result)
    _train(resumed, 2)  # the resumed optimizer trains as usual


@pytest.mark.parametrize("kind", ["fp32", "dist_fp32"])
def test_resume_through_the_torch_format_keeps_the_ratio(tmp_path, kind):
    from megatron_cpu import build_megatron_optimizer

    setup = _calibrated_job(kind)
    torch.save(setup.optimizer.state_dict(), tmp_path / "optim.pt")
    _fresh_process()
    resumed = build_megatron_optimizer(kind, optimizer="adam")
    ess_patch.install("megatron")
    resumed.optimizer.load_state_dict(torch.load(tmp_path / "optim.pt", weights_only=True))
    result = _resumed_rollout()
    assert (result.status, result.calibrated_ratio) == ("ok", pytest.approx(0.9, rel=1e-12))
    # a resumed run under another config calibrates anew, as any change of config does
    other = EssLrConfig(weight_mode="product", calibrate_rollouts=3)
    assert compute_ess_lr(*_two(7.0), config=other).status == "calibrating"


def test_without_calibration_the_state_dict_is_the_hosts():
    from megatron_cpu import build_megatron_optimizer

    setup = build_megatron_optimizer("fp32", optimizer="adam")
    plain = setup.optimizer.state_dict()
    ess_patch.install("megatron")
    compute_ess_lr(*_two(3.0), config=EssLrConfig(weight_mode="product"))  # no calibration
    assert CHECKPOINT_KEY not in setup.optimizer.state_dict()
    assert setup.optimizer.state_dict().keys() == plain.keys()


def test_a_bad_calibration_entry_is_refused_and_nothing_is_loaded():
    from megatron_cpu import build_megatron_optimizer

    setup = _calibrated_job("fp32")
    state = setup.optimizer.state_dict()
    state[CHECKPOINT_KEY] = {"count": "two"}
    before = STATE.calibration
    with pytest.raises(ValueError, match=f"{CHECKPOINT_KEY}.*remove that key"):
        setup.optimizer.load_state_dict(state)
    assert STATE.calibration == before
    fresh = build_megatron_optimizer("fp32", optimizer="adam")
    with pytest.raises(ValueError, match="not an ESS-LR calibration"):
        fresh.optimizer.load_state_dict(state)
