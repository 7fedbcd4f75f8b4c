"""Choose the demo's collapse scenario from the "off" and "sync" arms alone.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.collapse_select [--jobs 2]``
(every run is cached under ``--work``: a second call resumes where the first stopped).

Written and committed before any selection run. The grid is tried mildest first: the smaller
LR before the larger, then task sort before reverse, then miles/slime's token-level TIS
before VCPO's sequence-level truncated IS, then a smaller fixed staleness k before a larger
one. Everything else is the scenario's (:data:`ess_patch.demo.scenarios.collapse.COLLAPSE`: a
supervised warm start, every rollout exactly k updates stale, 400 steps, one rank). At each
grid point the "off" arm (ESS-LR never applied) and the "sync" arm (k = 0, all else equal)
run on the selection seeds :data:`SELECTION_SEEDS` (never used by the report, whose seeds are
0..7), and each off run is judged against its seed's sync run by
``ess_patch.demo.criterion.judge``.

The rule: the scenario is the first grid point where the off run collapses in both selection
seeds and the sync run collapses in neither. If no grid point qualifies, the fallback (fixed
here before the runs): among the points whose sync runs do not collapse, the one with the
most off collapses (the mildest of those); if no off run collapsed at all, the one with the
largest mean sync - off final reward. No ESS-LR arm runs here, so nothing is tuned on them.
Every run is logged (``--log``, default ``docs/demo-collapse/selection.txt``), the collapsing
grid points named.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import time
from pathlib import Path

from ess_patch.demo import criterion
from ess_patch.demo.scenarios import collapse

LRS = (1e-3, 3e-3)
TASKS = ("sort", "reverse")
LOSSES = ("tis", "seq-tis")
LAGS = (2, 8, 32)
SELECTION_SEEDS = (100, 101)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--work", default="/tmp/ess-collapse-select")
    parser.add_argument("--log", type=Path, default=Path("docs/demo-collapse/selection.txt"))
    args = parser.parse_args()
    log = args.log.open("a")

    def say(line: str) -> None:
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    base = collapse.collapse_config(arms=("sync", "off"))
    t0 = time.monotonic()
    say(f"# collapse selection started {time.strftime('%Y-%m-%d %H:%M:%S')}")
    say(f"# seeds {SELECTION_SEEDS}; grid lr {LRS} x task {TASKS} x loss {LOSSES} x k {LAGS}")
    say(
        f"# base: steps {base.steps}, staleness {base.staleness}, dp {base.dp}, warm start "
        f"{collapse.WARM_STEPS}, is_threshold {base.is_threshold}, tis_clip {base.tis_clip}"
    )
    say(
        "lr      task     loss     k   arm   seed  start  peak   final  collapsed         "
        "onset  max|g|    min rho  end entropy  wall"
    )
    points = []
    chosen = None
    for lr, task, loss, lag in itertools.product(LRS, TASKS, LOSSES, LAGS):
        cfg = dataclasses.replace(base, lr=lr, task=task, loss=loss, lag=lag)
        runs = collapse.run_arms(cfg, ("sync", "off"), SELECTION_SEEDS, args.work, jobs=args.jobs)
        verdicts = {}
        for seed in SELECTION_SEEDS:
            for arm in ("sync", "off"):
                rec = runs[seed][arm]
                v = criterion.judge(rec, runs[seed]["sync"])
                verdicts[seed, arm] = v
                why = ",".join(v.reasons) if v.collapsed else "no"
                onset = "-" if v.onset is None else str(v.onset)
                say(
                    f"{lr:<7g} {task:<8} {loss:<8} {lag:<3} {arm:<5} {seed:<5} {v.start:.3f}  "
                    f"{v.peak:.3f}  {v.final:.3f}  {why:<17} {onset:<6} "
                    f"{max(r['grad_norm'] for r in rec):<9.3g} {min(r['rho'] for r in rec):<8.3g} "
                    f"{rec[-1]['entropy']:<12.3f} {rec[0].get('wall_s', 0):.0f}s"
                )
        off = sum(verdicts[s, "off"].collapsed for s in SELECTION_SEEDS)
        sync = sum(verdicts[s, "sync"].collapsed for s in SELECTION_SEEDS)
        gap = statistics.fmean(
            verdicts[s, "sync"].final - verdicts[s, "off"].final for s in SELECTION_SEEDS
        )
        points.append(((lr, task, loss, lag), off, sync, gap))
        say(
            f"== lr {lr:g} {task} {loss} k {lag}: off collapsed {off}/{len(SELECTION_SEEDS)}, "
            f"sync collapsed {sync}/{len(SELECTION_SEEDS)}, sync - off final {gap:+.3f}"
            + ("  <- COLLAPSING GRID POINT" if off == len(SELECTION_SEEDS) and not sync else "")
        )
        if off == len(SELECTION_SEEDS) and not sync:
            chosen = (lr, task, loss, lag)
            say(f"CHOSEN (first grid point that meets the rule): {chosen}")
            break
    if chosen is None:
        clean = [p for p in points if p[2] == 0]
        most = max((p[1] for p in clean), default=0)
        if most > 0:
            pick = next(p for p in clean if p[1] == most)
            why = f"most off collapses ({most}), mildest of those"
        else:
            pick = max(clean or points, key=lambda p: p[3])
            why = "no off collapse anywhere: largest mean sync - off final reward"
        chosen = pick[0]
        say(f"no grid point met the rule; FALLBACK ({why}): {chosen}")
    say(f"# total {time.monotonic() - t0:.0f}s")
    log.close()


if __name__ == "__main__":
    main()
