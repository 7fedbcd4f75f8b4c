"""Issue 42: the forward-only proxy's baseline as an arm of the collapse scenario.

At the main job's tuned LR and lag (``ess_patch.demo.scenarios.main_job``: LR 3.5e-4, every
rollout 8 updates stale, seq-TIS), on the 8 seeds of the tuned-LR table, ``ess+proxy`` (ESS-LR with
VCPO's minimum-variance baseline, ``b*`` from the forward-only proxy of ``ess_patch.proxy``,
taken in the loss from the logits it already has) beside ``ess+baseline`` (the same with the
exact per-trajectory norms of the in-step rewrite), ``product`` (ESS-LR with the group mean:
what a proxy whose norms do not vary would give) and ``sync``.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.proxy_arm --jobs 2`` (runs cached
under ``--work``; 32 runs, about 25 minutes on 2 cores). Every arm is run here, also sync,
product and ess+baseline, whose finals the tuned-LR table already has: a run's final reward
depends on torch's CPU kernels (issue 43: one flipped sampled token changes the rest of the
run), so only runs from one machine are paired.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ess_patch.demo import criterion, stats
from ess_patch.demo.scenarios import collapse, main_job

SEEDS = tuple(range(8))


def _final(records) -> float:
    return criterion.judge(records).final


def _cell(values: list[float]) -> str:
    lo, hi = stats.bootstrap_ci(values) if len(values) > 1 else (values[0], values[0])
    return f"{statistics.fmean(values):+.3f} [{lo:+.3f}, {hi:+.3f}]"


def _ratio(nums: list[float], dens: list[float]) -> str:
    ratios = [n / d for n, d in zip(nums, dens, strict=True)]
    lo, hi = stats.bootstrap_ci(ratios) if len(ratios) > 1 else (ratios[0], ratios[0])
    return f"{statistics.fmean(ratios):.2f} [{lo:.2f}, {hi:.2f}]"


ARMS = ("sync", "product", "ess+baseline", "ess+proxy")


def _paired(finals: dict[str, list[float]], a: str, b: str) -> str:
    diff = [x - y for x, y in zip(finals[a], finals[b], strict=True)]
    return f"| {a} - {b} | {_cell(diff)} | {sum(d > 0 for d in diff)}/{len(diff)} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=len(SEEDS))
    parser.add_argument("--work", default="/tmp/ess-proxy-arm")
    parser.add_argument("--out", type=Path, default=Path("docs/demo-tuned"))
    args = parser.parse_args()
    seeds = SEEDS[: args.seeds]
    cfg = main_job.main_config()
    t0 = time.monotonic()
    runs = collapse.run_arms(cfg, ARMS, seeds, args.work, jobs=args.jobs)
    finals = {a: [_final(runs[s][a]) for s in seeds] for a in ARMS}
    sync = finals["sync"]
    rows = [
        f"lr {cfg.lr:g}, lag {cfg.lag} (fixed), seq-tis, seeds {list(seeds)}, every arm run here",
        "",
        "| arm | final reward (mean) | fraction of sync (95% CI) |",
        "|---|---|---|",
        *(
            f"| {arm} | {statistics.fmean(finals[arm]):.3f} | {_ratio(finals[arm], sync)} |"
            for arm in ARMS
        ),
        "",
        "| paired (final reward) | mean [95% CI] | first ahead |",
        "|---|---|---|",
        _paired(finals, "ess+proxy", "ess+baseline"),
        _paired(finals, "ess+proxy", "product"),
        _paired(finals, "ess+baseline", "product"),
    ]
    text = "\n".join(rows)
    print(text)
    print(f"# {time.monotonic() - t0:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "proxy-arm.md").write_text(text + "\n")
    (args.out / "proxy-arm.json").write_text(
        json.dumps({"lr": cfg.lr, "lag": cfg.lag, "seeds": list(seeds), **finals}, indent=2)
    )


if __name__ == "__main__":
    main()
