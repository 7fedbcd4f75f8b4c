"""VCPO's baseline (``--use-ess-baseline``) through the REAL slime and miles train path.

``tests/frameworks/ledger_run.py`` drives each framework's real ``parse_args`` (ess-patch
installed), its actor's ``train_actor`` (which lends the model to the advantage hook), its
advantage routine, ``train`` / ``train_one_step``, the loss (``loss_function`` ->
``policy_loss_function``, PPO-clipped at the framework's default eps 0.2; miles packs the
micro-batches as THD with ``--qkv-format thd``), megatron-core's schedule, DDP and optimizer.
The loss function the train loop calls is wrapped to record what each sample's policy-gradient
term was handed; the loss itself runs unchanged.

Independent expectation: each sample's squared gradient norm of ``sum_t m_t w_t log p(y_t)``
in float64 from the actor's weights at the hook (``w_t = exp(log_probs - rollout_log_probs)``,
the log-probs the hook saw), then ``b*`` per prompt group: every token of every sample must be
trained with ``r_i - b*`` (float32 tolerance), and the run must differ from the group mean.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from upstream import skip_reason

import ess_patch

N_PER_PROMPT = 2  # ledger_run's argv: --n-samples-per-prompt 2


def _expected(rollout: dict, n: int = N_PER_PROMPT) -> dict[tuple, float]:
    """tokens -> the advantage ``r - b*`` that sample must train with."""
    from ledger_run import reference_log_probs

    from ess_patch.baseline import min_variance_baseline

    weights = {k: v.double().requires_grad_() for k, v in rollout["weights"].items()}
    hook = rollout["hook_log_probs"]
    sq, rewards, ids, keys = [], [], [], []
    for k, i in enumerate(rollout["local"]):
        s = rollout["samples"][i]
        lp = reference_log_probs(weights, s["tokens"], s["response_length"])
        w = 1.0 if hook is None else torch.exp(hook[k].double() - s["rollout_log_probs"].double())
        term = (s["loss_mask"].double() * w * lp).sum()
        grads = torch.autograd.grad(term, list(weights.values()))
        sq.append(sum(g.square().sum() for g in grads))
        rewards.append(s["reward"])
        ids.append(i // n)
        keys.append(tuple(s["tokens"].tolist()))
    res = min_variance_baseline(
        None, torch.tensor(rewards, dtype=torch.float64), torch.stack(sq), torch.tensor(ids)
    )
    plain = torch.tensor(rewards, dtype=torch.float64).reshape(-1, n)
    moved = (res.advantages - (plain - plain.mean(1, keepdim=True)).flatten()).abs().max()
    assert moved > 1e-3  # b* is not the group mean here: the check can tell them apart
    return dict(zip(keys, res.advantages.tolist(), strict=True))


def _check(run: dict) -> None:
    assert run["records"], "no optimizer step ran"
    for rollout in run["rollouts"]:
        want = _expected(rollout)
        seen = rollout["loss_saw"]
        assert sorted({tuple(t) for t, _ in seen}) == sorted(want)  # every sample trained
        for tokens, adv in seen:
            target = want[tuple(tokens)]
            assert adv == pytest.approx([target] * len(adv), rel=1e-5, abs=1e-6), (tokens, adv)


@pytest.fixture
def world(tmp_path, clean_ess):
    from ledger_run import megatron_groups

    from ess_patch.demo.cpu import megatron_on_cpu

    with megatron_on_cpu(), megatron_groups(tmp_path):
        yield


@pytest.mark.skipif(skip_reason("slime", "full") is not None, reason="slime snapshot")
@pytest.mark.parametrize("path", ["rules", "exact"])
def test_slime_trains_on_r_minus_b_star(world, path):
    from ledger_run import slime_train

    ess_patch.install(["megatron", "slime"])
    flags = ["--use-ess-baseline", "--ess-baseline-path", path, "--global-batch-size", "8"]
    _check(slime_train(flags, rollouts=1, steps=1, spy=True))


@pytest.mark.skipif(skip_reason("miles", "full") is not None, reason="miles snapshot")
@pytest.mark.parametrize("path", ["rules", "exact"])
def test_miles_trains_packed_thd_on_r_minus_b_star(world, path):
    from ledger_run import miles_train

    ess_patch.install(["megatron", "miles"])
    flags = ["--use-ess-baseline", "--ess-baseline-path", path, "--global-batch-size", "8"]
    _check(miles_train(flags, rollouts=1, spy=True))
