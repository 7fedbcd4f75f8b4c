"""install() on real megatron-core optimizers: bit-exact when off, exactly-once when armed.

Every kind from tests/megatron_cpu.py is a real object from get_megatron_optimizer (a
ChainedOptimizer over FP32Optimizer / Float16OptimizerWithFloat16Params /
DistributedOptimizer children, or a LayerWiseDistributedOptimizer), stepped through
Megatron's DDP grad buffers, with the real OptimizerParamScheduler.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cpu import (
    KINDS,
    batch,
    build_megatron_optimizer,
    forward_backward,
    inner_optimizers,
    param_triples,
    snapshot,
    snapshots_equal,
    train_steps,
)

import ess_patch

pytestmark = pytest.mark.usefixtures("world", "clean_ess")

SGD_KINDS = [k for k in KINDS if "dist" not in k]  # DistributedOptimizer asserts Adam
SCALE = 0.37
STEPS = 3

# tests/test_patches.py runs this module in a subprocess against a megatron-core copy patched
# with patches/megatron-core (first on PYTHONPATH) and ESS_PATCH_TEST_MODE=vendored: then
# nothing is monkeypatched, and _install() only checks that the diff's call sites are there.
VENDORED = os.environ.get("ESS_PATCH_TEST_MODE") == "vendored"


def _install():
    if not VENDORED:
        ess_patch.install("megatron")
        return
    from ess_patch import patching
    from ess_patch.install import INTEGRATIONS

    for target in INTEGRATIONS["megatron"].targets:
        if not target.vendored:  # install()-only (the checkpoint's calibration)
            continue
        importlib.import_module(target.module)
        status = patching.target_status(target)
        assert status in (patching.MISSING, patching.VENDORED), f"{target.path} is not patched"
    assert not ess_patch.is_installed()


def _run(kind, *, install=False, scale=None, optimizer="adam", n=STEPS, **kw):
    setup = build_megatron_optimizer(kind, optimizer=optimizer, clip_grad=1.0, **kw)
    if install:
        _install()
    if scale is not None:
        ess_patch.arm(scale)
    try:
        records = train_steps(setup, n)
    finally:
        if install:
            ess_patch.uninstall()
        ess_patch.disarm()
    return records, snapshot(setup)


def _run_manual(kind, scale, *, optimizer="adam", n=STEPS, **kw):
    """Unpatched, with every group's LR multiplied by ``scale`` by hand around each step."""
    setup = build_megatron_optimizer(kind, optimizer=optimizer, clip_grad=1.0, **kw)
    for i in range(n):
        x, y = batch(0, i)
        forward_backward(setup, x, y)
        groups = setup.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * scale
        setup.optimizer.step()
        for g, lr in zip(groups, saved):
            g["lr"] = lr
        setup.scheduler.step(increment=1)
    return snapshot(setup)


@pytest.mark.parametrize("kind", KINDS)
def test_installed_but_disarmed_and_scale_one_are_bit_exact(kind):
    _, plain = _run(kind)
    _, disarmed = _run(kind, install=True)
    _, one = _run(kind, install=True, scale=1.0)
    assert snapshots_equal(disarmed, plain)
    assert snapshots_equal(one, plain)


@pytest.mark.parametrize("kind", KINDS)
def test_adam_equals_a_run_with_the_lr_scaled_by_hand(kind):
    records_plain, plain = _run(kind)
    records, scaled = _run(kind, install=True, scale=SCALE)
    manual = _run_manual(kind, SCALE)
    assert snapshots_equal(scaled, manual)
    assert not snapshots_equal(scaled["main"], plain["main"])  # the scale did something
    # the scheduler's view of the LR is untouched after every step
    assert [r.lrs for r in records] == [r.lrs for r in records_plain]


@pytest.mark.parametrize("kind", SGD_KINDS)
def test_sgd_update_is_scaled_exactly_once(kind):
    setup = build_megatron_optimizer(kind, optimizer="sgd")
    _install()
    ess_patch.arm(SCALE)
    x, y = batch(0, 0)
    forward_backward(setup, x, y)
    before = [(g, p.detach().clone()) for g, p, _ in param_triples(setup.optimizer)]
    lrs = [g["lr"] for g, _ in before]
    setup.optimizer.step()
    checked = 0
    for (group, p0), (_, p1, _), lr in zip(before, param_triples(setup.optimizer), lrs):
        assert group["lr"] == lr  # restored
        grad = p1.grad
        assert grad is not None and grad.abs().sum() > 0
        once = p0.add(grad, alpha=-(lr * SCALE))
        assert torch.equal(p1, once), "update is not lr * scale * grad (scaled 0 or 2 times?)"
        assert not torch.equal(p1, p0.add(grad, alpha=-lr))
        checked += 1
    assert checked >= 4


def test_every_inner_update_sees_the_scaled_lr_once(monkeypatch):
    """The LR that each inner torch optimizer reads during its step, for a multi-child chain."""
    setup = build_megatron_optimizer("multi_bf16", optimizer="sgd")
    seen = []
    for leaf in inner_optimizers(setup.optimizer):
        inner = leaf.optimizer
        original = inner.step

        def spy(*a, _inner=inner, _orig=original, **k):
            seen.append([g["lr"] for g in _inner.param_groups])
            return _orig(*a, **k)

        monkeypatch.setattr(inner, "step", spy)
    scheduled = [g["lr"] for g in setup.optimizer.param_groups]
    _install()
    ess_patch.arm(0.5)
    x, y = batch(0, 0)
    forward_backward(setup, x, y)
    setup.optimizer.step()
    assert [lr for lrs in seen for lr in lrs] == [lr * 0.5 for lr in scheduled]


def test_lr_restored_when_the_step_raises(monkeypatch):
    setup = build_megatron_optimizer("multi_fp32", optimizer="sgd")
    _install()
    ess_patch.arm(0.5)
    x, y = batch(0, 0)
    forward_backward(setup, x, y)
    before = [g["lr"] for g in setup.optimizer.param_groups]
    params = [(g["lr"], p.detach().clone()) for g, p, _ in param_triples(setup.optimizer)]
    leaf = inner_optimizers(setup.optimizer)[1]
    failing = {id(p) for g in leaf.optimizer.param_groups for p in g["params"]}

    def boom(*a, **k):
        raise RuntimeError("inner step failed")

    monkeypatch.setattr(leaf.optimizer, "step", boom)
    with pytest.raises(RuntimeError, match="inner step failed"):
        setup.optimizer.step()
    after = [g["lr"] for g in setup.optimizer.param_groups]
    assert all(a is b for a, b in zip(after, before))
    # the failing leaf updated nothing; the leaf stepped before it did, at the scaled LR
    assert failing and len(failing) < len(params)
    for (lr, p0), (_, p1, _) in zip(params, param_triples(setup.optimizer)):
        expected = p0 if id(p1) in failing else p0.add(p1.grad, alpha=-(lr * 0.5))
        assert torch.equal(p1, expected)
    # and the next step (scheduler, then a working optimizer) continues from the true LR
    monkeypatch.undo()
    setup.scheduler.step(increment=1)
    plain = build_megatron_optimizer("multi_fp32", optimizer="sgd")
    plain.scheduler.step(increment=1)
    assert [g["lr"] for g in setup.optimizer.param_groups] == [
        g["lr"] for g in plain.optimizer.param_groups
    ]
    assert len(params) >= 4


def test_skipped_step_restores_lr_and_updates_nothing():
    # a ConstantGradScaler makes megatron check for inf/nan and return (False, None, None)
    setup = build_megatron_optimizer("bf16", optimizer="adam", loss_scale=1.0)
    plain = build_megatron_optimizer("bf16", optimizer="adam", loss_scale=1.0)
    _install()
    ess_patch.arm(0.5)
    before = snapshot(setup)
    records = train_steps(setup, 2, poison_steps=(0,))
    ess_patch.disarm()
    records_plain = train_steps(plain, 2, poison_steps=(0,))
    assert records[0].update_successful is False and records[0].grad_norm is None
    assert [r.lrs for r in records] == [r.lrs for r in records_plain]
    assert records[1].update_successful
    assert not snapshots_equal(snapshot(setup)["main"], before["main"])


@pytest.mark.parametrize("kind", ["fp32", "multi_bf16"])
def test_state_dict_after_a_step_holds_the_unscaled_lr(kind):
    setup = build_megatron_optimizer(kind, optimizer="adam")
    _install()
    ess_patch.arm(0.25)
    x, y = batch(0, 0)
    forward_backward(setup, x, y)
    setup.optimizer.step()
    state = setup.optimizer.state_dict()
    states = state if isinstance(state, list) else [state]
    saved = [g["lr"] for s in states for g in s.get("optimizer", s)["param_groups"]]
    assert saved == [g["lr"] for g in setup.optimizer.param_groups]
    assert all(lr > 0 for lr in saved)


def test_critic_role_and_excluded_optimizer_are_never_scaled():
    _, plain = _run("fp32", optimizer="sgd")
    ess_patch.set_role("critic")
    _, critic = _run("fp32", optimizer="sgd", install=True, scale=0.5)
    ess_patch.set_role("policy")
    assert snapshots_equal(critic, plain)

    setup = build_megatron_optimizer("fp32", optimizer="sgd", clip_grad=1.0)
    ess_patch.exclude(setup.optimizer)
    _install()
    ess_patch.arm(0.5)
    train_steps(setup, STEPS)
    assert snapshots_equal(snapshot(setup), plain)


def test_attach_on_an_existing_megatron_optimizer_without_install():
    manual = _run_manual("multi_fp32", SCALE, optimizer="sgd")
    setup = build_megatron_optimizer("multi_fp32", optimizer="sgd", clip_grad=1.0)
    ess_patch.attach(setup.optimizer)
    ess_patch.attach(setup.optimizer)  # idempotent
    _install()  # and together with install(): still exactly once
    ess_patch.arm(SCALE)
    train_steps(setup, STEPS)
    assert snapshots_equal(snapshot(setup), manual)
    ess_patch.detach(setup.optimizer)
    assert "step" not in vars(setup.optimizer)


def test_attach_plain_torch_optimizer_with_its_scheduler():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(
        [{"params": [model.weight], "lr": 0.1}, {"params": [model.bias], "lr": 0.05}]
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ess_patch.attach(opt)
    ess_patch.arm(0.5)
    for _ in range(2):
        before = [p.detach().clone() for p in model.parameters()]
        lrs = [g["lr"] for g in opt.param_groups]
        opt.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
        for p0, p, lr in zip(before, model.parameters(), lrs):
            assert torch.equal(p.detach(), p0.add(p.grad, alpha=-(lr * 0.5)))
        assert [g["lr"] for g in opt.param_groups] == lrs
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.025, 0.0125]


def test_attach_rejects_objects_without_param_groups():
    with pytest.raises(TypeError, match="needs an optimizer with step\\(\\) and param_groups"):
        ess_patch.attach(object())


def _sgd_with_scheduler(first: str):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if first == "scheduler":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        ess_patch.attach(opt)
    else:
        ess_patch.attach(opt)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


@pytest.mark.parametrize("first", ["scheduler", "attach"])
def test_attach_and_a_torch_scheduler_in_either_order(first):
    """StepLR re-wraps opt.step; the scale must still apply (not silently 1.0), exactly once."""
    model, opt, sched = _sgd_with_scheduler(first)
    ess_patch.arm(0.5)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    for p0, p in zip(before, model.parameters()):
        assert torch.equal(p.detach(), p0.add(p.grad, alpha=-(0.1 * 0.5)))
    assert opt.param_groups[0]["lr"] == 0.1  # restored before the scheduler
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.05
    ess_patch.detach(opt)
    assert getattr(vars(opt).get("step"), "_wrapped_by_lr_sched", False)  # the scheduler's stays
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    # detached with a scale still armed: the step refuses to run unscaled (fail closed)
    with pytest.raises(ess_patch.EssLrNotAppliedError, match=r"SGD\.step\(\) runs outside"):
        opt.step()
    assert all(torch.equal(p0, p.detach()) for p0, p in zip(before, model.parameters()))
    # detached and disarmed: the next step uses the scheduled LR, the scheduler still counts
    ess_patch.disarm()
    opt.step()
    for p0, p in zip(before, model.parameters()):
        assert torch.equal(p.detach(), p0.add(p.grad, alpha=-0.05))
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.025


def test_a_raising_torch_step_leaves_the_lr_restored_by_the_next_step():
    model, opt, _ = _sgd_with_scheduler("attach")
    ess_patch.arm(0.5)

    def boom(_opt, _args, _kwargs):
        raise RuntimeError("boom")

    handle = opt.register_step_pre_hook(boom)  # runs after ours: the step raises mid-way
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    handle.remove()
    ess_patch.disarm()
    opt.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    assert opt.param_groups[0]["lr"] == 0.1
