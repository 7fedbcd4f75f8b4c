"""attach(torch optimizer): a step that raises leaves the LR, parameters and state as they were.

torch runs no post-step hook when ``step`` raises, so the scaled LR must be put back by
other means: a closure that raises restores it before the error leaves ``step``; a raise in
the step body is undone by the next ``step()`` or by ``state_dict()``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ess_patch


class Boom(RuntimeError):
    pass


def _closure_raising():
    raise Boom("loss could not be computed")


def _optimizer(kind: str):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))]
    if kind == "sgd":
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    elif kind == "adam":
        opt = torch.optim.Adam(params, lr=0.01)
    else:
        opt = torch.optim.LBFGS(params, lr=0.5)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step() if kind != "lbfgs" else opt.step(lambda: sum((p * p).sum() for p in params))
    return opt, params


@pytest.mark.parametrize("kind", ["sgd", "adam", "lbfgs"])
@pytest.mark.parametrize("as_keyword", [False, True])
def test_a_raising_closure_leaves_lr_params_and_state_unchanged(clean_ess, kind, as_keyword):
    opt, params = _optimizer(kind)
    ess_patch.attach(opt)
    ess_patch.arm(0.5)
    lrs = [g["lr"] for g in opt.param_groups]
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict())
    with pytest.raises(Boom):
        if as_keyword:
            opt.step(closure=_closure_raising)
        else:
            opt.step(_closure_raising)
    # read straight from the groups: nothing (no later step, no state_dict) restored it
    assert [g["lr"] for g in opt.param_groups] == lrs
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
    after = opt.state_dict()
    assert after["param_groups"] == state["param_groups"]
    assert after["state"].keys() == state["state"].keys()
    for key, value in state["state"].items():
        for name, t in value.items():
            got = after["state"][key][name]
            assert torch.equal(got, t) if isinstance(t, torch.Tensor) else got == t


def test_the_next_step_after_a_raise_is_scaled_once_and_restored(clean_ess):
    param = torch.nn.Parameter(torch.ones(2))
    opt = ess_patch.attach(torch.optim.SGD([param], lr=0.1))
    ess_patch.arm(0.5)
    with pytest.raises(Boom):
        opt.step(_closure_raising)
    param.grad = torch.ones(2)
    opt.step(lambda: torch.tensor(0.0))
    # scaled exactly once: 0.1 * 0.5, not 0.1 * 0.5 * 0.5
    assert torch.equal(param.detach(), torch.ones(2).add(torch.ones(2), alpha=-0.05))
    assert opt.param_groups[0]["lr"] == 0.1


def test_a_raise_in_the_step_body_is_undone_before_a_checkpoint(clean_ess):
    # Adam refuses sparse gradients inside step(): outside any closure
    param = torch.nn.Parameter(torch.ones(3))
    opt = ess_patch.attach(torch.optim.Adam([param], lr=0.01))
    ess_patch.arm(0.5)
    param.grad = torch.ones(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.01
    assert opt.param_groups[0]["lr"] == 0.01
    assert torch.equal(param.detach(), torch.ones(3))
