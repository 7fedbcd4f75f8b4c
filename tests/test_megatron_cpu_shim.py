"""The test-only CPU shim drives the real megatron-core optimizers (tests/megatron_cpu.py).

Later tests rely on three properties checked here: the builders give the real classes,
runs are bitwise deterministic, and each real update is exactly ``-lr * grad`` (SGD) or
what torch's AdamW computes from the same grads and LR (DistributedOptimizer, Adam only).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cpu import (
    KINDS,
    TinyNet,
    batch,
    build_megatron_optimizer,
    forward_backward,
    inner_optimizers,
    param_triples,
    snapshot,
    snapshots_equal,
    train_steps,
)

F16 = "Float16OptimizerWithFloat16Params"
EXPECTED_CLASSES = {
    "fp32": ("ChainedOptimizer", ["FP32Optimizer"]),
    "bf16": ("ChainedOptimizer", [F16]),
    "dist_fp32": ("ChainedOptimizer", ["DistributedOptimizer"]),
    "dist_bf16": ("ChainedOptimizer", ["DistributedOptimizer"]),
    "multi_fp32": ("ChainedOptimizer", ["FP32Optimizer", "FP32Optimizer"]),
    "multi_bf16": ("ChainedOptimizer", [F16, F16]),
    "multi_dist_bf16": ("ChainedOptimizer", ["DistributedOptimizer", "DistributedOptimizer"]),
    "layerwise_fp32": ("LayerWiseDistributedOptimizer", ["FP32Optimizer", "FP32Optimizer"]),
    "layerwise_bf16": ("LayerWiseDistributedOptimizer", [F16, F16]),
}


def _optimizer_for(kind: str) -> str:
    # megatron's DistributedOptimizer asserts Adam (distrib_optimizer.py, __init__).
    return "adam" if "dist" in kind else "sgd"


def test_kinds_cover_expected_classes():
    assert set(EXPECTED_CLASSES) == set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_builds_real_megatron_classes_and_trains(world, kind):
    setup = build_megatron_optimizer(kind, optimizer=_optimizer_for(kind), clip_grad=1.0)
    outer, leaves = EXPECTED_CLASSES[kind]
    assert type(setup.optimizer).__name__ == outer
    assert [type(leaf).__name__ for leaf in inner_optimizers(setup.optimizer)] == leaves
    assert all(type(m).__name__ == "DistributedDataParallel" for m in setup.models)

    records = train_steps(setup, 4, data_seed=0)

    assert all(r.update_successful and r.grad_norm > 0 for r in records)
    lrs = [r.lrs for r in records]
    assert len({tuple(x) for x in lrs}) == len(lrs), "LR must change every step"
    assert len(set(lrs[0])) == 2, "weights and biases have different LRs"


def _run(kind, data_seed):
    setup = build_megatron_optimizer(kind, optimizer="adam", clip_grad=0.5, n_models=2)
    records = train_steps(setup, 3, data_seed=data_seed)
    return records, snapshot(setup)


@pytest.mark.parametrize("kind", KINDS)
def test_two_identical_runs_are_bitwise_identical(world, kind):
    records_a, snap_a = _run(kind, data_seed=7)
    records_b, snap_b = _run(kind, data_seed=7)
    _, snap_other = _run(kind, data_seed=8)

    assert records_a == records_b
    assert snapshots_equal(snap_a, snap_b)
    assert not snapshots_equal(snap_a["main"], snap_other["main"])


def _reference_grads(setup, kind, x, y, seed=1234):
    """Plain-torch autograd on an identically initialised TinyNet: the hand-made grads."""
    module = setup.models[0].module
    dtype = next(module.parameters()).dtype
    torch.manual_seed(seed)
    ref = TinyNet(expert=module.expert is not None).to(dtype)
    loss = torch.nn.functional.mse_loss(ref(x.to(dtype)).float(), y)
    loss.backward()
    by_name = dict(ref.named_parameters())
    return {id(p): by_name[name].grad.float() for name, p in module.named_parameters()}


@pytest.mark.parametrize("kind", KINDS)
def test_update_is_minus_lr_times_grad(world, kind):
    setup = build_megatron_optimizer(kind, optimizer=_optimizer_for(kind), clip_grad=0.0)
    x, y = batch(data_seed=3, step=0)
    ref_grads = _reference_grads(setup, kind, x, y)
    triples = param_triples(setup.optimizer)
    assert len(triples) == len(ref_grads)
    before = [main.detach().clone() for _, main, _ in triples]
    lrs = [group["lr"] for group, _, _ in triples]
    assert all(lr > 0 for lr in lrs)

    forward_backward(setup, x, y)
    ok, _, _ = setup.optimizer.step()
    assert ok

    if _optimizer_for(kind) == "sgd":
        for (_, main, model_param), old, lr in zip(triples, before, lrs):
            grad = ref_grads[id(model_param)].reshape(main.shape)
            assert torch.equal(main.grad, grad)
            assert torch.equal(main, old.add(grad, alpha=-lr))
            torch.testing.assert_close(main, old - lr * grad, rtol=0, atol=1e-7)
    else:
        # Same update computed by torch's AdamW (what megatron wraps without TE/Apex).
        clones = [old.clone() for old in before]
        groups = []
        for (group, main, model_param), clone in zip(triples, clones):
            clone.grad = ref_grads[id(model_param)].reshape(main.shape)
            assert torch.equal(main.grad, clone.grad)
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({**hyper, "params": [clone]})
        torch.optim.AdamW(groups).step()
        for (_, main, _), clone in zip(triples, clones):
            assert torch.equal(main, clone)
    for _, main, model_param in triples:
        assert torch.equal(model_param.detach().reshape(-1), main.to(model_param.dtype).reshape(-1))


@pytest.mark.parametrize(
    ("kind", "loss_scale", "skipped"),
    [
        ("bf16", 1.0, True),
        ("dist_fp32", 1.0, True),
        ("multi_dist_bf16", 1.0, True),
        # No grad scaler, so megatron does not look for inf/nan: the NaN update goes through.
        ("bf16", None, False),
        ("fp32", 1.0, False),
        ("layerwise_bf16", 1.0, False),  # LayerWise re-wraps with grad_scaler=None
    ],
)
def test_nan_grads(world, kind, loss_scale, skipped):
    setup = build_megatron_optimizer(kind, optimizer="adam", loss_scale=loss_scale)
    train_steps(setup, 1, data_seed=0)
    before = snapshot(setup)

    [record] = train_steps(setup, 1, data_seed=1, poison_steps=(0,))

    after = snapshot(setup)
    if skipped:
        assert (record.update_successful, record.grad_norm) == (False, None)
        assert snapshots_equal(before["model"], after["model"])
        assert snapshots_equal(before["main"], after["main"])
        assert snapshots_equal(before["state"], after["state"])
    else:
        assert record.update_successful
        assert record.grad_norm != record.grad_norm  # NaN
        assert all(torch.isnan(p).all() for p in after["main"])
