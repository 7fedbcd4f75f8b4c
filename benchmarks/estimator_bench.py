"""Benchmark 1: the estimator as a GPU runs it, measured by what it dispatches.

``compute_ess_lr`` in one process (validation, per-trajectory table, summary, the final
``.tolist()``) runs the same torch operations on every device, so this CPU run measures
the path a GPU takes:

- ``ops``: aten operators dispatched per call (``TorchDispatchMode``): at most one kernel
  launch each on a GPU. Target: the same at every B, at most about 100.
- ``in ops``: the share of the call's time spent inside those operators (each op's own
  call, timed); the rest is Python: the per-sample metadata checks and the fixed cost of
  issuing the ops. No Python or numpy side path does per-token work.
- ``syncs``: host synchronisations a GPU would make (``.item()``/``bool()`` =
  ``aten::_local_scalar_dense``, ``nonzero``, ``.tolist()`` ...). Target: at most one.
- ``loop``: the obvious implementation, a Python loop over the trajectories (masked float64
  sum and count per sample, then the ESS formula on the stacked sums; ~8 ops and one
  ``.item()`` pair per call). Sanity bound: ``compute_ess_lr`` within 3x its CPU time (on a
  GPU the loop launches ~8 kernels per trajectory).

Times are CPU time of the calling thread (``time.thread_time``) with one torch thread: on a
shared machine the time the process waits for a core is left out; with more threads,
wall-clock time. Min and median over interleaved repeats.
"""

from __future__ import annotations

import math
import time

import torch

from ess_patch import compute_ess_lr

from .common import count_ops, dispatch_report, fmt_ms, interleaved_times, min_med, table, verdict

# trajectory length ranges (tokens, uniform) of the three workloads
PROFILES = {"short": (10, 100), "mixed": (100, 2000), "long": (4000, 16000)}
# large-B runs are bounded: a (profile, B) pair above this many tokens is left out
MAX_TOKENS = 45_000_000
MAX_OPS = 100
MAX_SYNCS = 1
MAX_VS_LOOP = 3.0


def make_batch(num: int, seed: int = 0, profile: str = "mixed"):
    """``num`` trajectories with lengths uniform in the profile's range: fp32 log-probs,
    int32 masks (~10% of tokens masked out), off-policy enough that rho < 1."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = PROFILES[profile]
    lengths = torch.randint(lo, hi + 1, (num,), generator=gen).tolist()
    total = sum(lengths)
    rollout = torch.rand(total, generator=gen).mul_(-3.0)
    lag = torch.randn(num, generator=gen).mul_(0.02).repeat_interleave(torch.tensor(lengths))
    train = torch.randn(total, generator=gen).mul_(0.05).add_(rollout).add_(lag)
    mask = (torch.rand(total, generator=gen) > 0.1).to(torch.int32)
    return (
        list(train.split(lengths)),
        list(rollout.split(lengths)),
        list(mask.split(lengths)),
    )


def loop_ess(log_probs, rollout_log_probs, loss_masks) -> float:
    """The straightforward per-trajectory implementation (geometric mode); returns rho."""
    sums, counts = [], []
    for lp, rlp, mask in zip(log_probs, rollout_log_probs, loss_masks, strict=True):
        keep = mask != 0
        d = lp.double() - rlp.double()
        sums.append(torch.where(keep, d, 0.0).sum())
        counts.append(keep.sum())
    total, count = torch.stack(sums), torch.stack(counts)
    valid = count > 0
    m = torch.where(valid, total / count.clamp_min(1), -math.inf)
    w = torch.exp(m - m.max())
    ess, n = (w.sum() ** 2 / (w * w).sum()).item(), valid.sum().item()
    return min(1.0, max(1.0 / n, ess / n))


def run(sizes, repeats, thread_counts) -> tuple[str, dict[str, bool]]:
    default_threads = torch.get_num_threads()
    rows, ok_loop = [], True
    ess_ops, ess_syncs = set(), set()
    cases = [
        (p, n) for p, (lo, hi) in PROFILES.items() for n in sizes if n * (lo + hi) / 2 <= MAX_TOKENS
    ]
    for profile, num in cases:
        batch = make_batch(num, profile=profile)
        tokens = sum(t.shape[0] for t in batch[0])
        fns = {
            "ess": lambda b=batch: compute_ess_lr(*b),
            "loop": lambda b=batch: loop_ess(*b),
        }
        fns["ess"]()  # warm-up outside the counts
        report = dispatch_report(fns["ess"])
        ess_ops.add(report.ops)
        ess_syncs.add(len(report.syncs))
        loop_ops = count_ops(fns["loop"])
        rho_ess, rho_loop = compute_ess_lr(*batch).rho, loop_ess(*batch)
        agree = abs(rho_ess - rho_loop) / rho_loop
        for threads in thread_counts:
            torch.set_num_threads(threads)
            clock = time.thread_time if threads == 1 else time.perf_counter
            times = interleaved_times(fns, repeats[num], clock=clock)
            (e_min, e_med), (l_min, l_med) = (min_med(times[k]) for k in ("ess", "loop"))
            # share of the call's best time spent inside its ops (each op timed by the
            # counting mode, best of three calls, same clock)
            op_seconds = min(dispatch_report(fns["ess"], clock).op_seconds for _ in range(3))
            in_ops = min(1.0, op_seconds / e_min)
            vs_loop = e_med / l_med
            ok_loop &= vs_loop <= MAX_VS_LOOP
            rows.append(
                [
                    profile,
                    num,
                    f"{tokens / 1e6:.2g}M",
                    threads,
                    f"{fmt_ms(e_min)} / {fmt_ms(e_med)}",
                    f"{fmt_ms(l_min)} / {fmt_ms(l_med)}",
                    f"{vs_loop:.2f}",
                    report.ops,
                    f"{in_ops:.0%}",
                    len(report.syncs),
                    loop_ops,
                    f"{agree:.0e}",
                ]
            )
        del batch
    torch.set_num_threads(default_threads)
    ok_ops = len(ess_ops) == 1 and max(ess_ops) <= MAX_OPS
    ok_syncs = max(ess_syncs) <= MAX_SYNCS
    text = table(
        [
            "lengths",
            "B",
            "tokens",
            "threads",
            "ess_patch ms (min / med)",
            "loop ms",
            "ess/loop",
            "ops",
            "in ops",
            "syncs",
            "ops loop",
            "rho rel. diff",
        ],
        rows,
        title="## 1. Estimator: compute_ess_lr (one torch path) vs a per-trajectory loop",
    )
    text += (
        "\n\nops = aten operators dispatched per call (a GPU's kernel launches, at most); in "
        "ops = time inside them / the call's best time; syncs = host synchronisations a GPU "
        "would make (int32 masks); ess/loop: ratio of medians; times: CPU time of the calling "
        "thread at 1 thread, wall clock at more; rho rel. diff: against the loop\n"
        f"- ops per call the same at every B and at most {MAX_OPS} ({sorted(ess_ops)}): "
        f"{verdict(ok_ops)}\n"
        f"- at most {MAX_SYNCS} host sync per call ({sorted(ess_syncs)}): {verdict(ok_syncs)}\n"
        f"- within {MAX_VS_LOOP:g}x the per-trajectory loop's CPU time at every B: "
        f"{verdict(ok_loop)}\n"
        f"- lengths: {PROFILES}; (profile, B) pairs above {MAX_TOKENS / 1e6:.0f}M tokens "
        "left out (bounded run time)"
    )
    return text, {
        f"estimator ops constant in B, <= {MAX_OPS}": ok_ops,
        f"estimator <= {MAX_SYNCS} host sync": ok_syncs,
        f"estimator <= {MAX_VS_LOOP:g}x loop (CPU)": ok_loop,
    }
