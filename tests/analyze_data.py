"""Synthetic rollouts for the analyze tests (per-rank dumps are written from them), and the
check of analyze's rows against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from reference import reference_ess

from ess_patch.analyze import default_settings

SHAPES = [(3, 9), (5, 4), (2, 13), (7, 6), (4, 1), (6, 11), (18, 2), (17, 3)]


def make_rollout(rid: int, sigma: float) -> list[dict]:
    gen = torch.Generator().manual_seed(100 + rid)
    out = []
    for prompt, response in SHAPES:
        mask = (torch.rand(response, generator=gen) > 0.25).int()
        mask[0] = 1
        rlp = -torch.rand(response, generator=gen) * 2
        lp = rlp + sigma * torch.randn(response, generator=gen)
        out.append(
            {"total": prompt + response, "resp": response, "mask": mask, "rlp": rlp, "lp": lp}
        )
    return out


SIGMAS = [0.01, 0.1, 0.3, 0.6, 0.15, 1.2]


def save_slime_dump(path, rid: int, samples: list[dict]) -> None:
    """One rank's slime train-data dump (format 2, gathered) of a rollout from make_rollout."""
    torch.save(
        {
            "format_version": 2,
            "rollout_id": rid,
            "rank": 0,
            "samples": [
                {
                    "log_probs": s["lp"],
                    "rollout_log_probs": s["rlp"],
                    "loss_masks": s["mask"],
                    "total_lengths": s["total"],
                    "response_lengths": s["resp"],
                    "rollout_position": i,
                }
                for i, s in enumerate(samples)
            ],
            "dp_shards": [{"rank": 0, "data_parallel_rank": 0}],
        },
        path,
    )


def check_against_reference(rows, rollouts):
    settings = default_settings()
    assert len(rows) == len(rollouts) * len(settings)
    for row in rows:
        samples = rollouts[int(row["rollout_id"])]
        ref = reference_ess(
            [s["lp"] for s in samples],
            [s["rlp"] for s in samples],
            [s["mask"] for s in samples],
            mode=row["weight_mode"],
            rule=row["rule"],
            floor=float(row["floor"]),
        )
        for key in ("rho", "ess", "scale"):
            assert float(row[key]) == pytest.approx(ref[key], rel=1e-9, abs=1e-12), (row, key)
        assert int(row["num_trajectories"]) == ref["num_trajectories"] == len(SHAPES)
