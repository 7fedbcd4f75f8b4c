"""Issue 42: the forward-only proxy's baseline as an arm of the collapse scenario.

At the main job's tuned LR and lag (``ess_patch.demo.main_job``: LR 3.5e-4, every rollout 8
updates stale, seq-TIS), on the 8 seeds of the tuned-LR table, ``ess+proxy`` (ESS-LR with
VCPO's minimum-variance baseline, ``b*`` from the forward-only proxy of ``ess_patch.proxy``,
taken in the loss from the logits it already has) beside ``ess+baseline`` (the same with the
exact per-trajectory norms of the in-step rewrite) and ``sync``.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.proxy_arm --jobs 2`` (runs cached
under ``--work``). By default the sync and ess+baseline finals are read from
``docs/demo-tuned/protocol-fixed.json`` (the tuned-LR table's own runs) and seed 0 of each is
rerun to check that they reproduce exactly on this machine; ``--rerun-all`` runs all of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from ess_patch.demo import collapse, criterion, main_job, stats

SEEDS = tuple(range(8))
TABLE = Path("docs/demo-tuned/protocol-fixed.json")


def _final(records) -> float:
    return criterion.judge(records).final


def _cell(values: list[float]) -> str:
    lo, hi = stats.bootstrap_ci(values) if len(values) > 1 else (values[0], values[0])
    return f"{statistics.fmean(values):+.3f} [{lo:+.3f}, {hi:+.3f}]"


def _ratio(nums: list[float], dens: list[float]) -> str:
    ratios = [n / d for n, d in zip(nums, dens, strict=True)]
    lo, hi = stats.bootstrap_ci(ratios) if len(ratios) > 1 else (ratios[0], ratios[0])
    return f"{statistics.fmean(ratios):.2f} [{lo:.2f}, {hi:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=len(SEEDS))
    parser.add_argument("--rerun-all", action="store_true")
    parser.add_argument("--work", default="/tmp/ess-proxy-arm")
    parser.add_argument("--out", type=Path, default=Path("docs/demo-tuned"))
    args = parser.parse_args()
    seeds = SEEDS[: args.seeds]
    cfg = main_job.main_config()
    lag = str(cfg.lag)
    t0 = time.monotonic()
    finals: dict[str, list[float]] = {}
    runs = collapse.run_arms(cfg, ("ess+proxy",), seeds, args.work, jobs=args.jobs)
    finals["ess+proxy"] = [_final(runs[s]["ess+proxy"]) for s in seeds]
    stored = json.loads(TABLE.read_text())
    if (
        args.rerun_all
        or stored["lr"] != cfg.lr
        or list(stored["seeds"][: len(seeds)]) != list(seeds)
    ):
        runs = collapse.run_arms(cfg, ("sync", "ess+baseline"), seeds, args.work, jobs=args.jobs)
        finals["sync"] = [_final(runs[s]["sync"]) for s in seeds]
        finals["ess+baseline"] = [_final(runs[s]["ess+baseline"]) for s in seeds]
        check = "all rerun"
    else:
        finals["sync"] = stored["sync"][: len(seeds)]
        finals["ess+baseline"] = stored["by_lag"][lag]["ess+baseline"][: len(seeds)]
        one = dataclasses.replace(cfg)
        again = collapse.run_arms(one, ("sync", "ess+baseline"), seeds[:1], args.work, jobs=2)
        got = (_final(again[seeds[0]]["sync"]), _final(again[seeds[0]]["ess+baseline"]))
        want = (finals["sync"][0], finals["ess+baseline"][0])
        check = f"seed {seeds[0]} rerun: sync {got[0]} (stored {want[0]}), ess+baseline {got[1]} "
        check += f"(stored {want[1]}): {'reproduced' if got == want else 'DIFFERS'}"
    sync = finals["sync"]
    diff = [p - e for p, e in zip(finals["ess+proxy"], finals["ess+baseline"], strict=True)]
    rows = [
        f"lr {cfg.lr:g}, lag {cfg.lag} (fixed), seeds {list(seeds)}; {check}",
        "",
        "| arm | final reward (mean) | fraction of sync (95% CI) |",
        "|---|---|---|",
        *(
            f"| {arm} | {statistics.fmean(finals[arm]):.3f} | {_ratio(finals[arm], sync)} |"
            for arm in ("ess+baseline", "ess+proxy", "sync")
        ),
        "",
        f"ess+proxy - ess+baseline (final reward, paired): {_cell(diff)}, "
        f"proxy ahead on {sum(d > 0 for d in diff)}/{len(diff)} seeds",
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
