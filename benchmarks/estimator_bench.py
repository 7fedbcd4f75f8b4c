"""Benchmark 1: the estimator's cost against the batch size, with two baselines.

- ``ess_patch``: ``ess_patch.compute_ess_lr`` in one process (validation, per-trajectory
  table, summary, the final ``.tolist()``), as a training loop calls it.
- ``loop``: the obvious implementation: a Python loop over the trajectories (masked float64
  sum and count per sample), then the ESS formula on the stacked sums. Each of its ops is
  vectorised over one trajectory, so on a CPU it is hard to beat; on a GPU it launches
  ~7 kernels per trajectory.
- ``floor``: reading the inputs once: concatenate each of the three lists and sum it
  (no dtype conversion). No estimator can be cheaper than this.

Times are seconds of the whole call (min and median over interleaved repeats): with one
torch thread, CPU time of the calling thread (``time.thread_time``: on a shared machine the
time the process waits for a core is left out, which wall time would add to whichever
variant happened to be descheduled); with more threads, wall-clock time.

Op counts are aten operators dispatched (``TorchDispatchMode``), i.e. kernel launches on a
GPU. ``ess_patch`` on CPU processes the tokens in groups of ``CPU_CHUNK_TOKENS`` (its count
grows by ~20 per group, ~1 us each against ~0.5 ms of work per group, and numpy's segment
sums are not aten ops); the "one group" count is the path other devices take (one group,
``torch.segment_reduce``), run here on CPU: that one must not depend on B.
"""

from __future__ import annotations

import math
import time

import torch

from ess_patch import EssLrConfig, compute_ess_lr, estimator

from .common import count_ops, fmt_ms, interleaved_times, min_med, table, verdict

# trajectory length ranges (tokens, uniform) of the three workloads
PROFILES = {"short": (10, 100), "mixed": (100, 2000), "long": (4000, 16000)}
# large-B runs are bounded: a (profile, B) pair above this many tokens is left out
MAX_TOKENS = 45_000_000


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


def one_group(log_probs, rollout_log_probs, loss_masks) -> float:
    """``compute_ess_lr``'s single-process path as a GPU runs it: one group of tokens,
    ``torch.segment_reduce``; returns rho."""
    config = EssLrConfig()
    stats = estimator.trajectory_stats(
        log_probs, rollout_log_probs, loss_masks, chunk_tokens=None, backend="torch"
    )
    summary = estimator.summarize(stats, config, backend="torch")
    return estimator.finalize(estimator.combine(summary), config).rho


def read_once(log_probs, rollout_log_probs, loss_masks) -> list:
    """The floor: every input byte read once (concatenate, then sum without conversion)."""
    sums = [
        torch.cat(list(seq)).sum(dtype=seq[0].dtype)
        for seq in (log_probs, rollout_log_probs, loss_masks)
    ]
    return [s.item() for s in sums]


def run(sizes, repeats, thread_counts) -> tuple[str, dict[str, bool]]:
    default_threads = torch.get_num_threads()
    rows, ok_ops, ok_loop, ok_floor = [], True, True, True
    ess_ops = set()
    cases = [
        (p, n) for p, (lo, hi) in PROFILES.items() for n in sizes if n * (lo + hi) / 2 <= MAX_TOKENS
    ]
    for profile, num in cases:
        batch = make_batch(num, profile=profile)
        tokens = sum(t.shape[0] for t in batch[0])
        fns = {
            "ess": lambda b=batch: compute_ess_lr(*b),
            "loop": lambda b=batch: loop_ess(*b),
            "floor": lambda b=batch: read_once(*b),
        }
        ops = {name: count_ops(fn) for name, fn in fns.items()}
        ops["one group"] = count_ops(lambda b=batch: one_group(*b))
        ess_ops.add(ops["one group"])
        rho_ess, rho_loop = compute_ess_lr(*batch).rho, loop_ess(*batch)
        rho_one = one_group(*batch)
        agree = max(abs(rho_ess - rho_loop), abs(rho_one - rho_loop)) / rho_loop
        for threads in thread_counts:
            torch.set_num_threads(threads)
            clock = time.thread_time if threads == 1 else time.perf_counter
            times = interleaved_times(fns, repeats[num], clock=clock)
            (e_min, e_med), (l_min, l_med), (f_min, f_med) = (
                min_med(times[k]) for k in ("ess", "loop", "floor")
            )
            vs_loop, vs_floor = e_med / l_med, e_med / f_med
            ok_loop &= vs_loop <= 1.5
            if num >= 1024:
                ok_floor &= vs_floor <= 2.0
            rows.append(
                [
                    profile,
                    num,
                    f"{tokens / 1e6:.2g}M",
                    threads,
                    f"{fmt_ms(e_min)} / {fmt_ms(e_med)}",
                    f"{fmt_ms(l_min)} / {fmt_ms(l_med)}",
                    f"{fmt_ms(f_min)} / {fmt_ms(f_med)}",
                    f"{vs_loop:.2f}",
                    f"{vs_floor:.2f}" + ("" if num >= 1024 else " (n/a)"),
                    f"{ops['ess']} / {ops['one group']}",
                    ops["loop"],
                    ops["floor"],
                    f"{agree:.0e}",
                ]
            )
        del batch
    torch.set_num_threads(default_threads)
    ok_ops = len(ess_ops) == 1
    text = table(
        [
            "lengths",
            "B",
            "tokens",
            "threads",
            "ess_patch ms (min / med)",
            "loop ms",
            "floor ms",
            "ess/loop",
            "ess/floor",
            "ops ess (CPU / one group)",
            "ops loop",
            "ops floor",
            "rho rel. diff",
        ],
        rows,
        title="## 1. Estimator: compute_ess_lr vs per-trajectory loop vs read-once floor",
    )
    text += (
        "\n\nratios are of medians; times: CPU time of the calling thread at 1 thread, wall "
        "clock at more; ops = aten operators dispatched (= GPU kernel launches); rho rel. diff: "
        "largest of the CPU path's and the one-group path's against the loop\n"
        f"- op count of the one-group (device) path constant in B ({sorted(ess_ops)}): "
        f"{verdict(ok_ops)}\n"
        f"- within 1.5x of the per-trajectory loop at every B: {verdict(ok_loop)}\n"
        f"- within 2x of the read-once floor for B >= 1024: {verdict(ok_floor)}\n"
        f"- lengths: {PROFILES}; (profile, B) pairs above {MAX_TOKENS / 1e6:.0f}M tokens "
        "left out (bounded run time)"
    )
    return text, {
        "estimator ops constant": ok_ops,
        "estimator <= 1.5x loop": ok_loop,
        "estimator <= 2x floor": ok_floor,
    }
