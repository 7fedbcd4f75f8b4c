"""Which weights suit a run: ``ess-patch analyze``'s recommendation on synthetic dumps.

Each rollout's train - rollout differences are ``c_i +/- s`` alternating token by token, so
that the per-token mean |d|, the variance ``v`` and the response length L are exact, and the
expected on-policy product rho ``max(1/B, exp(-L v))`` is computed here by hand.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ess_patch.analyze import analyze
from ess_patch.analyze.advice import Evidence, advise
from ess_patch.cli import main

B = 8


def _dump(
    folder: Path, length: int, s: float, offset: float = 0.0, rollouts: int = 3, mask: int = 1
) -> Path:
    folder.mkdir(parents=True)
    signs = torch.tensor([1.0 if t % 2 == 0 else -1.0 for t in range(length)], dtype=torch.float64)
    for rid in range(rollouts):
        rlp = [torch.full((length,), -1.0, dtype=torch.float64) for _ in range(B)]
        lp = [r + s * signs + (offset if i % 2 == 0 else -offset) for i, r in enumerate(rlp)]
        data = {
            "log_probs": [t.float() for t in lp],
            "rollout_log_probs": [t.float() for t in rlp],
            "loss_masks": [torch.full((length,), mask, dtype=torch.int64) for _ in range(B)],
            "total_lengths": [length + 5] * B,
            "response_lengths": [length] * B,
        }
        payload = {"rollout_id": rid, "rank": 0, "rollout_data": data}
        torch.save(
            payload | {"cp_rank": 0, "cp_size": 1, "qkv_format": "thd"}, folder / f"{rid}_0.pt"
        )
    return folder


@pytest.mark.parametrize(
    ("length", "s", "offset", "weights", "rho", "geometric_quiet"),
    [
        # trajectories +/-0.05: v = 0.17^2 + 0.05^2, 200 v = 6.28 > 3 (exp(-6.28) < 1/8):
        # nothing left to calibrate; product observed: sums +/-10, rho 1/2, scale 0.71
        (200, 0.17, 0.05, "geometric", 1 / B, True),
        # v = 0.01 + 0.0025, 40 v = 0.5 <= 3: rho 0.607, scale 0.779 < 0.9; observed: sums
        # +/-2, rho cosh(2)^2 / cosh(4) = 0.518, scale 0.72: it brakes here too
        (40, 0.1, 0.05, "product+calibration", math.exp(-0.5), True),
        # the same spread with no trajectory offsets: every sum is 0, product weights never
        # brake on these rollouts although independent tokens would (40 v = 0.4)
        (40, 0.1, 0.0, "product", math.exp(-0.4), True),
        # 16 x 0.0025 = 0.04: rho 0.961, scale 0.980: product brakes on lag only
        (16, 0.05, 0.0, "product", math.exp(-0.04), True),
        # lagged trajectories +/-0.5: v = 0.0025 + 0.25, 16 v = 4.04 > 3 -> 1/8; geometric
        # rho = cosh(0.5)^2 / cosh(1) = 0.824, scale 0.908 < 0.99: geometric acts here
        (16, 0.05, 0.5, "geometric", 1 / B, False),
    ],
    ids=["long-noisy", "medium", "medium-anticorrelated", "short-quiet", "lagged"],
)
def test_analyze_recommends_the_weights_by_hand(
    tmp_path, length, s, offset, weights, rho, geometric_quiet
):
    d = _dump(tmp_path / "dumps", length, s, offset)
    result = analyze([d], tmp_path / "out", figure=False)
    advice = result.advice
    assert advice.weights == weights
    assert advice.product_on_policy_rho == pytest.approx(rho, rel=1e-5)
    assert advice.geometric_never_acts is geometric_quiet
    assert advice.product_brakes_on_policy is (weights != "product")
    assert (advice.product_on_policy_scale < 0.9) is (length * (s * s + offset**2) > 0.2107)
    text = advice.text()
    assert f"responses of {length} tokens" in text
    assert f"mean |train - rollout| {max(s, offset):.3g}" in text  # |c +/- s|
    if geometric_quiet:
        assert "never act" in text
    if offset:  # weights exp(+/-offset) in equal numbers: rho = cosh(c)^2 / cosh(2c)
        geometric = math.sqrt(math.cosh(offset) ** 2 / math.cosh(2 * offset))
        assert f"min {geometric:.3g}" in text
    assert "## Which weights for this run" in (tmp_path / "out" / "summary.md").read_text()


def test_the_cli_prints_the_recommendation(tmp_path, capsys):
    d = _dump(tmp_path / "dumps", 40, 0.1, 0.05)
    assert (
        main(["analyze", str(d), "--out", str(tmp_path / "out"), "--no-progress", "--no-figure"])
        == 0
    )
    out = capsys.readouterr().out
    assert "Which weights for this run" in out
    assert "--ess-lr-calibrate-rollouts 4" in out


@pytest.mark.parametrize(
    ("length", "variance", "weights"),
    [
        # scale sqrt(exp(-L v)) = 0.9 at L v = -2 ln 0.9 = 0.2107
        (100, 0.00210, "product"),
        (100, 0.00212, "product+calibration"),
        # calibration while rho >= exp(-3), i.e. L v <= 3
        (100, 0.02999, "product+calibration"),
        (100, 0.03001, "geometric"),
    ],
)
def test_thresholds_at_their_boundaries(length, variance, weights):
    evidence = Evidence(
        response_length=length, mismatch=0.1, token_variance=variance, trajectories=64
    )
    assert advise(evidence).weights == weights


def test_nothing_measured_gives_no_advice_rather_than_product(tmp_path):
    """Dumps whose every loss mask is 0: no trajectory was measured, and the advice says so
    instead of reading "product" from an on-policy rho of exp(0) = 1."""
    d = _dump(tmp_path / "dumps", 40, 0.1, 0.05, mask=0)
    advice = analyze([d], tmp_path / "out", figure=False).advice
    assert advice.weights == "none"
    assert "nothing was measured" in advice.text()
    assert "product" not in advice.lines[-1].split("check")[0]
    assert not advice.product_brakes_on_policy and math.isnan(advice.product_on_policy_rho)
    assert advise(Evidence(0.0, 0.0, 0.0, 0.0)).weights == "none"
