"""A rollout-to-step cycle across pipeline stages (gloo, pp=2, real megatron optimizers).

Only the last stage has log-probs: it computes the ESS result, broadcasts it to the other
stage, both arm it, and both stages' real optimizer steps apply the same scale once.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import CollectiveCounter
from harness import layout, run_ranks
from megatron_cpu import batch, build_megatron_optimizer, forward_backward, param_triples

import ess_patch
from ess_patch.demo.cpu import megatron_on_cpu

pytestmark = pytest.mark.dist


def _skewed_batch():
    # weights 1 and 5: rho = 36/52, scale = sqrt(36/52)
    lp = [torch.tensor([0.0]), torch.tensor([float(torch.log(torch.tensor(5.0)))])]
    return lp, [torch.zeros(1), torch.zeros(1)], [torch.ones(1), torch.ones(1)]


def rank_pp_cycle():
    lay = layout()
    with megatron_on_cpu():
        # the control: the same step of an unpatched optimizer, and the collectives it issues
        plain = build_megatron_optimizer("multi_fp32", optimizer="sgd")
        forward_backward(plain, *batch(lay.pp_rank, 0))
        with CollectiveCounter() as counter:
            plain.optimizer.step()
        plain_collectives = [name for name, _ in counter.calls]
        ess_patch.install("megatron")
        setup = build_megatron_optimizer("multi_fp32", optimizer="sgd")
        result = None
        if lay.is_pp_last:
            result = ess_patch.compute_ess_lr(*_skewed_batch(), dp_group=lay.dp_group)
        result = ess_patch.broadcast_from_last_stage(result, lay.pp_group)
        ess_patch.arm(result)
        x, y = batch(lay.pp_rank, 0)
        forward_backward(setup, x, y)
        before = [(g["lr"], p.detach().clone()) for g, p, _ in param_triples(setup.optimizer)]
        with CollectiveCounter() as counter:
            setup.optimizer.step()
        ratios, exact = [], True
        for (lr, p0), (group, p1, _) in zip(before, param_triples(setup.optimizer)):
            exact &= torch.equal(p1, p0.add(p1.grad, alpha=-(lr * result.scale)))
            exact &= group["lr"] == lr
            ratios.append(float(((p0 - p1).sum() / (lr * p1.grad.sum())).item()))
        step_collectives = [name for name, _ in counter.calls]
        ess_patch.uninstall()
    return {
        "scale": result.scale,
        "exact": exact,
        "ratios": ratios,
        "step_collectives": step_collectives,
        "plain_collectives": plain_collectives,
    }


def test_both_pipeline_stages_apply_the_last_stages_scale(tmp_path):
    results = run_ranks(rank_pp_cycle, pp=2, tmp_path=tmp_path, timeout=90)
    expected = (36 / 52) ** 0.5
    assert [r["scale"] for r in results] == [results[1]["scale"]] * 2
    assert results[0]["scale"] == pytest.approx(expected, rel=1e-6)
    for r in results:
        assert r["exact"]
        # float32 sums: a loose check that reads well; "exact" above is the bitwise one
        assert r["ratios"] == pytest.approx([expected] * len(r["ratios"]), rel=1e-3)
    # the wrapper adds no collective to the step: megatron's own (grad-norm) ones only
    for r in results:
        assert r["step_collectives"] == r["plain_collectives"]
    assert results[0]["step_collectives"] == results[1]["step_collectives"]
    assert "broadcast" not in results[0]["step_collectives"]
