"""scaled_lr: scales inside the block, restores the exact LR objects afterwards, always."""

from __future__ import annotations

import pytest
import torch

from ess_patch import scaled_lr


def _optimizer(lrs=(0.1, 3e-4)):
    params = [torch.nn.Parameter(torch.ones(2)) for _ in lrs]
    return torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, lrs, strict=True)])


def test_scales_inside_and_restores_after():
    opt = _optimizer()
    originals = [g["lr"] for g in opt.param_groups]
    with scaled_lr(opt, 0.5):
        assert [g["lr"] for g in opt.param_groups] == [0.05, 1.5e-4]
    assert [g["lr"] for g in opt.param_groups] == originals


def test_restores_bit_exact_after_an_exception():
    lrs = (0.1 + 1e-17, 7.123456789e-5)  # values a multiply-then-divide would not round-trip
    opt = _optimizer(lrs)
    originals = [g["lr"] for g in opt.param_groups]
    with pytest.raises(RuntimeError, match="boom"), scaled_lr(opt, 0.3):
        raise RuntimeError("boom")
    for group, lr in zip(opt.param_groups, originals, strict=True):
        assert group["lr"] is lr


def test_scale_one_writes_nothing():
    class Spy(dict):
        writes = 0

        def __setitem__(self, key, value):
            Spy.writes += 1
            super().__setitem__(key, value)

    class FakeOpt:
        param_groups = [Spy(lr=0.1)]

    with scaled_lr(FakeOpt(), 1.0):
        pass
    assert Spy.writes == 0


def test_shared_group_is_scaled_once():
    opt = _optimizer((0.2,))

    class Chained:  # ChainedOptimizer builds a new list of the same dicts each access
        @property
        def param_groups(self):
            return [opt.param_groups[0], opt.param_groups[0]]

    with scaled_lr(Chained(), 0.5):
        assert opt.param_groups[0]["lr"] == 0.1
    assert opt.param_groups[0]["lr"] == 0.2


@pytest.mark.parametrize("scale", [0.0, -0.5, 1.0001, float("nan"), float("inf"), "x", None])
def test_scale_outside_unit_interval_is_an_error_and_changes_nothing(scale):
    opt = _optimizer()
    originals = [g["lr"] for g in opt.param_groups]
    with pytest.raises(ValueError, match=r"\(0, 1\]"), scaled_lr(opt, scale):
        pass
    assert [g["lr"] for g in opt.param_groups] == originals


def test_group_without_lr_changes_nothing():
    class Opt:
        param_groups = [{"lr": 0.1}, {"momentum": 0.9}]

    opt = Opt()
    with pytest.raises(KeyError, match=r"param_groups\[1\]"), scaled_lr(opt, 0.5):
        pass
    assert opt.param_groups[0]["lr"] == 0.1
