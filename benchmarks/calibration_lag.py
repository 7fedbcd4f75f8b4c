"""Calibration in a fully asynchronous run: with and without the on-policy filter, against
the lag-0 truth.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.calibration_lag [--out FILE]``.
One process, the demo's public pieces (:mod:`ess_patch.demo.policy`, :mod:`ess_patch.demo.task`
and the demo's worker schedule ``worker_lags``): an fp32 megatron-core ``GPTModel`` trainer
(Adam, LR 1e-3, gradient clipping 1.0, group-relative policy gradient on the "sort" task) and
its bf16 rollout engine. At each trainer step the rollout's prompts are split over 4 rollout
workers whose weights are ``worker_lags(step, 4, 8)`` updates old (worker 0 always fresh, the
others up to 8 behind: the demo's fully-async schedule), so from step 1 on three quarters of
each rollout are stale. The engine's mismatch is the bf16 engine's plus per-token noise of mean
|noise| 0.139 nats (miles #2722's MoE-with-routing-replay level): product weights brake even
on-policy there, which is what calibration divides out.

Per step, product weights (sqrt rule, floor 0.1), ``calibrate_rollouts = K``:

- ``filtered``: ``compute_ess_lr(..., policy_versions=, current_version=)``: only the lag-0
  trajectories count;
- ``unfiltered``: the same call without versions: every trajectory of the first K rollouts counts;
- ``truth``: a second rollout of the same prompts sampled with the trainer's current weights
  (lag 0 for every trajectory), its rho averaged over the same K steps: the on-policy rho the
  ratio should be.

Printed (and written as JSON with ``--out``): the three ratios, and the mean scale each ratio
gives the measured (lagged) rollouts after calibration.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import deque
from dataclasses import replace

import torch

from ess_patch import EssLrConfig, calibration, compute_ess_lr
from ess_patch.demo import task
from ess_patch.demo.policy import (
    PolicySpec,
    RolloutEngine,
    build_policy,
    global_weights,
    single_process,
    train_logprobs,
)
from ess_patch.demo.train import worker_lags
from ess_patch.estimator import scale_of

TASK = "sort"


def _rollout(engine, versions, prompts, lags, n, gen, noise_gen, sigma):
    """Each trajectory sampled by the weights ``lags[i]`` updates old; noisy engine log-probs."""
    tokens = torch.empty(len(prompts), n, dtype=torch.long)
    logp = torch.empty(len(prompts), n)
    for lag in sorted(set(lags)):
        idx = torch.tensor([i for i, x in enumerate(lags) if x == lag])
        engine.load(versions[-1 - lag])
        out = engine.sample(prompts[idx], n, gen)
        tokens[idx], logp[idx] = out.tokens, out.logp
    return tokens, logp + sigma * torch.randn(logp.shape, generator=noise_gen)


def _inputs(model, prompts, tokens, logp):
    with torch.no_grad():
        train = train_logprobs(model, prompts, tokens).double()
    ones = torch.ones(tokens.shape[1])
    return list(train), list(logp.double()), [ones] * len(train)


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    spec = PolicySpec(max_len=task.prompt_length(TASK, args.length) + args.length)
    model = build_policy(spec)
    engine = RolloutEngine(spec)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    versions: deque = deque([global_weights(model)], maxlen=args.max_lag + 1)
    sigma = args.noise * math.sqrt(math.pi / 2)  # E|N(0, s^2)| = s sqrt(2 / pi)
    gen = torch.Generator().manual_seed(args.seed)
    noise_gen = torch.Generator().manual_seed(args.seed + 1)
    prompt_gen = torch.Generator().manual_seed(args.seed + 2)
    product = EssLrConfig(weight_mode="product")
    calibrated = replace(product, calibrate_rollouts=args.calibrate)
    arms = {"filtered": [], "unfiltered": []}
    ratios: dict[str, float] = {}
    truth_rhos, rows = [], []
    held = {name: calibration.snapshot() for name in arms}
    for step in range(args.steps):
        groups = args.batch // args.group
        prompts = task.make_prompts(TASK, args.length, groups, prompt_gen)
        prompts = prompts.repeat_interleave(args.group, dim=0)
        owner = torch.arange(groups).repeat_interleave(args.group) % args.workers
        by_worker = worker_lags(step, args.workers, args.max_lag)
        lags = [min(by_worker[w], len(versions) - 1) for w in owner.tolist()]
        tokens, logp = _rollout(engine, versions, prompts, lags, args.length, gen, noise_gen, sigma)
        inputs = _inputs(model, prompts, tokens, logp)
        row = {"step": step, "on_policy_share": lags.count(0) / len(lags)}
        for name in arms:
            calibration.restore(held[name])  # each arm its own calibration, on the same data
            kw = {}
            if name == "filtered":
                kw = {"policy_versions": [step - x for x in lags], "current_version": step}
            r = compute_ess_lr(*inputs, config=calibrated, **kw)
            held[name] = calibration.snapshot()
            row[f"{name}_scale"], row[f"{name}_ratio"] = r.scale, r.calibrated_ratio
            arms[name].append(r)
        row["rho"] = arms["filtered"][-1].rho
        if step < args.calibrate:
            fresh_tokens, fresh_logp = _rollout(
                engine, versions, prompts, [0] * len(lags), args.length, gen, noise_gen, sigma
            )
            truth = compute_ess_lr(
                *_inputs(model, prompts, fresh_tokens, fresh_logp), config=product
            )
            truth_rhos.append(truth.rho)
            row["truth_rho"] = truth.rho
        rows.append(row)
        # the trainer's update: group-relative policy gradient, IS-corrected per token
        reward = task.rewards(tokens, task.targets(TASK, prompts, args.length)).float()
        grouped = reward.view(-1, args.group)
        adv = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
        lp = train_logprobs(model, prompts, tokens)
        ratio = torch.exp(lp - logp.to(lp.dtype)).detach()
        loss = -(adv[:, None] * ratio * lp).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        versions.append(global_weights(model))
    ratios["truth"] = sum(truth_rhos) / len(truth_rhos)
    for name, results in arms.items():
        ratios[name] = results[-1].calibrated_ratio
    measured = [r.rho for r in arms["filtered"][args.calibrate :]]
    scales = {
        name: sum(scale_of(rho, product, ratio) for rho in measured) / len(measured)
        for name, ratio in ratios.items()
    }
    mean_lag = sum(1 - row["on_policy_share"] for row in rows) / len(rows)
    return {
        "config": vars(args),
        "ratios": ratios,
        "mean_scale_after_calibration": scales,
        "uncalibrated_mean_scale": sum(scale_of(r, product) for r in measured) / len(measured),
        "stale_share": mean_lag,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--calibrate", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--length", type=int, default=16)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--max-lag", type=int, default=8)
    p.add_argument("--noise", type=float, default=0.139)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    with single_process():
        out = run(args)
    for name, ratio in out["ratios"].items():
        scale = out["mean_scale_after_calibration"][name]
        print(f"{name:>10}: ratio {ratio:.4f}, mean scale after calibration {scale:.3f}")
    print(f"uncalibrated mean scale {out['uncalibrated_mean_scale']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
