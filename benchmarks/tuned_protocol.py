"""Issue 41's protocol: an LR tuned synchronously, then the same LR under staleness.

Run (after ``benchmarks.tune_lr``, whose log's last line is the LR):
``OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.tuned_protocol --lr 5e-4 --jobs 2``
(every run cached under ``--work``; a second call resumes).

Written and committed before any of its runs. No hindsight: the LR comes from the sync arm
on the tuning seeds (``benchmarks/tune_lr.py``), and at that LR, on the table's seeds
:data:`SEEDS`, every lag of :data:`LAGS` runs the arms off, product (ESS-LR) and ess+baseline
(ESS-LR with VCPO's minimum-variance baseline), each judged against the seed's sync run.
The oracle is the best constant LR for each lag, taken from the same grid
(``tune_lr.LRS``) with the "off" arm on the tuning seeds (hindsight, by design: it is the
reference a user who retuned for every lag would reach), then run on :data:`SEEDS`.

Each cell is an arm's final reward as a fraction of the seed's sync final (and of the
oracle's), paired over seeds, with a 95% bootstrap CI. ``--staleness`` runs the same arms
under a varying lag instead (``drift`` / ``longtail``, where one LR cannot suit every step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from benchmarks import tune_lr
from ess_patch.demo import criterion, stats
from ess_patch.demo.scenarios import collapse

SEEDS = tuple(range(8))
LAGS = (0, 2, 8, 32)
ARMS = ("off", "product", "ess+baseline")


def _final(records) -> float:
    return criterion.judge(records).final


def _ratio_cell(nums: list[float], dens: list[float]) -> str:
    ratios = [n / d for n, d in zip(nums, dens, strict=True)]
    lo, hi = stats.bootstrap_ci(ratios) if len(ratios) > 1 else (ratios[0], ratios[0])
    return f"{statistics.fmean(ratios):.2f} [{lo:.2f}, {hi:.2f}]"


def oracle_lr(base, lag: int, work: str, jobs: int, say) -> float:
    """The grid LR with the best mean final of the off arm at ``lag`` on the tuning seeds."""
    means = {}
    for lr in tune_lr.LRS:
        cfg = dataclasses.replace(base, lr=lr, lag=lag)
        runs = collapse.run_arms(cfg, ("off",), tune_lr.TUNING_SEEDS, f"{work}/oracle", jobs=jobs)
        means[lr] = statistics.fmean(_final(runs[s]["off"]) for s in tune_lr.TUNING_SEEDS)
    best = max(means, key=means.get)
    say(f"k={lag}: oracle grid " + " ".join(f"{lr:g}:{m:.3f}" for lr, m in means.items()))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, required=True, help="the LR tune_lr chose")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=len(SEEDS))
    parser.add_argument("--lags", default=",".join(map(str, LAGS)))
    parser.add_argument("--staleness", default="fixed", help="fixed, drift or longtail")
    parser.add_argument("--no-oracle", action="store_true")
    parser.add_argument("--work", default="/tmp/ess-tuned-protocol")
    parser.add_argument("--out", type=Path, default=Path("docs/demo-tuned"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / f"protocol-{args.staleness}.txt").open("a")

    def say(line: str) -> None:
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    seeds = SEEDS[: args.seeds]
    lags = [int(x) for x in args.lags.split(",")]
    base = collapse.collapse_config(lr=args.lr, staleness=args.staleness)
    t0 = time.monotonic()
    say(f"# protocol at lr {args.lr:g}, staleness {args.staleness}, lags {lags}, seeds {seeds}")
    sync = collapse.run_arms(base, ("sync",), seeds, args.work, jobs=args.jobs)
    sync_final = [_final(sync[s]["sync"]) for s in seeds]
    rows = [
        "| k | arm | final reward (mean) | fraction of sync (95% CI) "
        "| fraction of oracle (95% CI) |",
        "|---|---|---|---|---|",
    ]
    data: dict[str, dict] = {}
    for lag in lags:
        cfg = dataclasses.replace(base, lag=lag)
        runs = collapse.run_arms(cfg, ARMS, seeds, args.work, jobs=args.jobs)
        finals = {a: [_final(runs[s][a]) for s in seeds] for a in ARMS}
        if not args.no_oracle:
            lr = oracle_lr(base, lag, args.work, args.jobs, say)
            o = collapse.run_arms(
                dataclasses.replace(cfg, lr=lr), ("off",), seeds, args.work, jobs=args.jobs
            )
            finals[f"oracle (lr {lr:g})"] = [_final(o[s]["off"]) for s in seeds]
        oracle = next((v for k, v in finals.items() if k.startswith("oracle")), None)
        for arm, fs in finals.items():
            of_oracle = _ratio_cell(fs, oracle) if oracle else "-"
            rows.append(
                f"| {lag} | {arm} | {statistics.fmean(fs):.3f} | {_ratio_cell(fs, sync_final)} "
                f"| {of_oracle} |"
            )
        data[str(lag)] = finals
        say("\n".join(rows[-len(finals) :]))
    rows.append(f"| - | sync (lr {args.lr:g}) | {statistics.fmean(sync_final):.3f} | 1 | |")
    table = "\n".join(rows)
    say(table)
    say(f"# {time.monotonic() - t0:.0f} s")
    name = f"protocol-{args.staleness}"
    (args.out / f"{name}.md").write_text(table + "\n")
    (args.out / f"{name}.json").write_text(
        json.dumps({"lr": args.lr, "seeds": seeds, "sync": sync_final, "by_lag": data}, indent=2)
    )


if __name__ == "__main__":
    main()
