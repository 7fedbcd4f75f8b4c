"""Smoke test: the REAL miles / slime ``compute_advantages_and_returns`` on CPU, CP=2 x DP=2.

No ess-patch code is involved: this pins down how the upstream routine behaves in the gloo
harness (the inputs the ESS hook will see, and the outputs it must leave bit-identical).
Synthetic rollout data is sliced per rank the way each framework slices it
(``slice_log_prob_with_cp`` on the response-length log-probs; ``loss_masks`` stay full
length), samples are dealt to DP ranks round-robin, and the parent checks every rank against
values computed by hand.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for ``harness``
from harness import run_ranks
from rollouts import CP, DP, SHAPES, local_batch, rollout
from upstream import miles_parallel_state, skip_reason

MILES = skip_reason("miles", "loss")
SLIME = skip_reason("slime", "loss")


def _run(compute, args: Namespace, batch: dict) -> dict:
    data = {k: list(v) for k, v in batch.items()}
    compute(args, data)
    return {
        "advantages": [a.clone() for a in data["advantages"]],
        "returns": [r.clone() for r in data["returns"]],
    }


# --- rank functions (module level: the ranks import them by name) ---------------------------


def _miles_rank() -> dict:
    from megatron.core import parallel_state as mpu
    from miles.backends.training_utils.cp_utils import slice_log_prob_with_cp
    from miles.backends.training_utils.loss import compute_advantages_and_returns

    state = miles_parallel_state()
    dp = state.effective_dp
    mine, batch = local_batch(slice_log_prob_with_cp, dp.rank, dp.size)
    args = Namespace(
        advantage_estimator="grpo",
        kl_coef=0.0,
        kl_loss_type="low_var_kl",
        normalize_advantages=False,
        use_rollout_logprobs=False,
        skip_actor_forward_only=False,
        use_opd=False,
        qkv_format="thd",
    )
    plain = _run(compute_advantages_and_returns, args, batch)
    args.normalize_advantages = True
    whitened = _run(compute_advantages_and_returns, args, batch)
    return {
        "coords": (mpu.get_data_parallel_rank(), mpu.get_context_parallel_rank()),
        "effective_dp": (state.effective_dp.rank, state.effective_dp.size),
        "samples": mine,
        "local_lengths": [len(x) for x in batch["log_probs"]],
        "plain": plain,
        "whitened": whitened,
    }


def _slime_rank() -> dict:
    from megatron.core import parallel_state as mpu
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns

    mine, batch = local_batch(
        slice_log_prob_with_cp,
        mpu.get_data_parallel_rank(with_context_parallel=False),
        mpu.get_data_parallel_world_size(with_context_parallel=False),
    )
    args = Namespace(
        advantage_estimator="grpo",
        kl_coef=0.0,
        kl_loss_type="low_var_kl",
        normalize_advantages=False,
        use_rollout_logprobs=False,
        custom_advantage_function_path=None,
        use_opd=False,
    )
    plain = _run(compute_advantages_and_returns, args, batch)
    args.normalize_advantages = True
    whitened = _run(compute_advantages_and_returns, args, batch)
    return {
        "coords": (mpu.get_data_parallel_rank(), mpu.get_context_parallel_rank()),
        "samples": mine,
        "local_lengths": [len(x) for x in batch["log_probs"]],
        "plain": plain,
        "whitened": whitened,
    }


# --- parent-side references -----------------------------------------------------------------


def _response_slices(total: int, response: int, cp_rank: int) -> list[slice]:
    """Response-space positions CP rank ``cp_rank`` holds (zigzag, logits shifted by one)."""
    from miles.backends.training_utils.cp_utils import get_logits_and_tokens_offset_with_cp

    _, _, logits, _ = get_logits_and_tokens_offset_with_cp(
        total, response, "thd", cp_rank=cp_rank, cp_size=CP
    )
    prompt = total - response
    return [slice(lo - (prompt - 1), hi - (prompt - 1)) for lo, hi in logits if hi > lo]


def _whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked whitening with Bessel's correction (miles/slime ``distributed_masked_whiten``)."""
    mask = mask.float()
    n = mask.sum()
    mean = (values * mask).sum() / n
    var = ((values**2) * mask).sum() / n - mean**2
    var = var * n / (n - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _check_plain_and_layout(results: list[dict]) -> None:
    """GRPO without normalisation: every local token of sample i carries reward_i, the local
    lengths are the zigzag slice lengths, and the CP ranks' slices tile the whole response."""
    full = rollout()
    assert sorted(r["coords"] for r in results) == [(d, c) for d in range(DP) for c in range(CP)]
    covered: dict[int, list[int]] = {}
    for r in results:
        dp_rank, cp_rank = r["coords"]
        assert r["samples"] == [i for i in range(len(SHAPES)) if i % DP == dp_rank]
        for k, i in enumerate(r["samples"]):
            s = full[i]
            slices = _response_slices(s["total_length"], s["response_length"], cp_rank)
            local = sum(sl.stop - sl.start for sl in slices)
            adv = r["plain"]["advantages"][k]
            assert r["local_lengths"][k] == local == adv.numel()
            assert adv.dtype == torch.float32
            assert torch.equal(adv, torch.full((local,), s["reward"], dtype=torch.float32))
            assert torch.equal(r["plain"]["returns"][k], adv)
            covered.setdefault(i, []).extend(p for sl in slices for p in range(sl.start, sl.stop))
    for i, s in enumerate(full):
        assert sorted(covered[i]) == list(range(s["response_length"])), f"sample {i}"
    # At least one sample has an empty slice on some CP rank (the prompt-heavy ones).
    assert any(0 in r["local_lengths"] for r in results)


def _local_masks(cp_rank: int, samples: list[int]) -> list[torch.Tensor]:
    full = rollout()
    out = []
    for i in samples:
        s = full[i]
        slices = _response_slices(s["total_length"], s["response_length"], cp_rank)
        parts = [s["loss_mask"][sl] for sl in slices]
        out.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32))
    return out


def _global_whitened_reference(full: list[dict]) -> list[torch.Tensor]:
    """CP=1 answer: GRPO advantages whitened with one set of statistics over all tokens."""
    all_adv = torch.cat(
        [torch.full((s["response_length"],), s["reward"], dtype=torch.float32) for s in full]
    )
    all_mask = torch.cat([s["loss_mask"] for s in full])
    return list(torch.split(_whiten(all_adv, all_mask), [s["response_length"] for s in full]))


def _cp_slice(values: torch.Tensor, sample: dict, cp_rank: int) -> torch.Tensor:
    slices = _response_slices(sample["total_length"], sample["response_length"], cp_rank)
    parts = [values[sl] for sl in slices]
    return torch.cat(parts) if parts else torch.zeros(0)


@pytest.mark.dist
@pytest.mark.skipif(MILES is not None, reason=MILES or "")
def test_miles_grpo_cp2_dp2(tmp_path):
    results = run_ranks(_miles_rank, dp=DP, cp=CP, tmp_path=tmp_path, timeout=120)
    _check_plain_and_layout(results)
    full = rollout()
    for r in results:
        # effective_dp is DP without CP (indep_dp trivial).
        assert r["effective_dp"] == (r["coords"][0], DP)
    # miles whitens over effective_dp = DP *without* CP: each CP rank uses the statistics of
    # its own zigzag slices across the DP ranks (so the two halves of one response get
    # different affine maps). Reproduce that per CP rank.
    for cp_rank in range(CP):
        group = sorted((r for r in results if r["coords"][1] == cp_rank), key=lambda r: r["coords"])
        advs = [a for r in group for a in r["plain"]["advantages"]]
        masks = [m for r in group for m in _local_masks(cp_rank, r["samples"])]
        expected = _whiten(torch.cat(advs), torch.cat(masks))
        got = torch.cat([a for r in group for a in r["whitened"]["advantages"]])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        # returns are not whitened
        assert torch.equal(
            torch.cat([x for r in group for x in r["whitened"]["returns"]]), torch.cat(advs)
        )
    # ... which is not the CP=1 answer (slime's, below): the upstream behaviour DESIGN.md notes.
    ref = _global_whitened_reference(full)
    got = [
        (r["coords"][1], i, r["whitened"]["advantages"][k])
        for r in results
        for k, i in enumerate(r["samples"])
    ]
    assert any(
        not torch.allclose(adv, _cp_slice(ref[i], full[i], cp_rank), atol=1e-4)
        for cp_rank, i, adv in got
    )


@pytest.mark.dist
@pytest.mark.skipif(SLIME is not None, reason=SLIME or "")
@pytest.mark.skipif(MILES is not None, reason=f"reference offsets come from miles: {MILES}")
def test_slime_grpo_cp2_dp2(tmp_path):
    results = run_ranks(_slime_rank, dp=DP, cp=CP, tmp_path=tmp_path, timeout=120)
    _check_plain_and_layout(results)
    # slime whitens over DP *with* CP: one set of statistics over every token of the rollout,
    # i.e. the CP=1 answer, sliced.
    full = rollout()
    ref = _global_whitened_reference(full)
    for r in results:
        cp_rank = r["coords"][1]
        for k, i in enumerate(r["samples"]):
            expected = _cp_slice(ref[i], full[i], cp_rank)
            torch.testing.assert_close(
                r["whitened"]["advantages"][k], expected, rtol=1e-5, atol=1e-6
            )
