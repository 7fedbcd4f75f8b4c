"""Synthetic rollouts for the framework tests (CP=2 x DP=2): full-length samples, and one
rank's ``rollout_data`` sliced the way miles and slime slice it."""

from __future__ import annotations

from argparse import Namespace

import torch

DP, CP = 2, 2

# (prompt_length, response_length): the last ones are prompt-heavy, so with CP=2 one CP rank
# holds none of their response tokens (C_i == 0), which the upstream code must tolerate.
SHAPES = [(3, 9), (5, 4), (2, 13), (7, 6), (4, 1), (6, 11), (18, 2), (17, 3)]


def rollout(seed: int = 0) -> list[dict]:
    """Full-length synthetic samples, identical in every process."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, (prompt, response) in enumerate(SHAPES):
        mask = (torch.rand(response, generator=gen) > 0.25).int()
        mask[0] = 1
        rollout_lp = -torch.rand(response, generator=gen, dtype=torch.float32) * 2
        train_lp = rollout_lp + 0.05 * torch.randn(response, generator=gen)
        samples.append(
            {
                "total_length": prompt + response,
                "response_length": response,
                "loss_mask": mask,
                "rollout_log_probs": rollout_lp,
                "log_probs": train_lp,
                "reward": float(i % 3) - 0.7 * (i % 2),
            }
        )
    return samples


def local_batch(slice_log_prob, dp_rank: int, dp_size: int) -> tuple[list[int], dict]:
    """This rank's rollout_data: its DP share, log-probs CP-sliced, masks full length."""
    mine = [i for i in range(len(SHAPES)) if i % dp_size == dp_rank]
    full = rollout()
    batch = {
        "log_probs": [],
        "rollout_log_probs": [],
        "loss_masks": [],
        "response_lengths": [],
        "total_lengths": [],
        "rewards": [],
    }
    for i in mine:
        s = full[i]
        for key in ("log_probs", "rollout_log_probs"):
            batch[key].append(slice_log_prob(s[key], s["total_length"], s["response_length"]))
        batch["loss_masks"].append(s["loss_mask"])
        batch["response_lengths"].append(s["response_length"])
        batch["total_lengths"].append(s["total_length"])
        batch["rewards"].append(s["reward"])
    return mine, batch


def host_args(fw: str, use_ess_lr: bool = True) -> Namespace:
    """The args ``compute_advantages_and_returns`` reads (grpo, whitening on: miles/slime
    whiten over DP, so their own collective runs too), with ESS-LR on or off."""
    common = dict(
        advantage_estimator="grpo",
        kl_coef=0.0,
        kl_loss_type="low_var_kl",
        normalize_advantages=True,
        use_rollout_logprobs=False,
        use_opd=False,
        loss_type="policy_loss",
        use_ess_lr=use_ess_lr,
        ess_lr_floor=0.1,
        ess_lr_weight_mode="product",
        ess_lr_rule="sqrt",
        ess_lr_base_ratio=1.0,
        ess_lr_nonfinite="raise",
    )
    if fw == "miles":
        return Namespace(**common, skip_actor_forward_only=False, qkv_format="thd")
    # qkv_format: read by slime v0.2.2 to v0.3.0 (bshd support), ignored by the others
    return Namespace(**common, custom_advantage_function_path=None, qkv_format="thd")
