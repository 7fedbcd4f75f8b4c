"""The shipped early-warning rule scored over the tuned protocol's runs (issue 41).

Run (after ``benchmarks.tuned_protocol``, whose cached runs it reads; nothing is retrained
when its cache is there): ``OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.warning_rates
--lr 3.5e-4``. Every off run at each lag is judged against its seed's sync run
(``criterion.judge``); the rule is the one users get (rho below the threshold for 3
consecutive steps, :func:`ess_patch.early_warning.firings`), scored by
``criterion.early_warning``: the lead is measured from the firing to the collapse's onset
(the step after which the smoothed reward stays below its give-back line), and a firing
within ``criterion.STALE_GRACE`` steps of the first stale rollout is not counted (it
answers the staleness beginning, not the collapse coming). The sync runs (never stale) are
the false-alarm control.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

from benchmarks import tuned_protocol
from ess_patch.demo import criterion
from ess_patch.demo.scenarios import collapse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--work", default="/tmp/ess-tuned-protocol")
    parser.add_argument("--out", type=Path, default=Path("docs/demo-tuned/warning.md"))
    args = parser.parse_args()
    seeds = tuned_protocol.SEEDS
    base = collapse.collapse_config(lr=args.lr)
    sync = collapse.run_arms(base, ("sync",), seeds, args.work)
    rows = [
        "| runs | threshold | collapses | hits | median lead (steps) | misses | "
        "runs without collapse | false alarms | fired only as staleness began |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def add(name: str, data: list, stale: int | None) -> None:
        for t in criterion.WARN_THRESHOLDS:
            w = criterion.early_warning(data, t, stale)
            lead = statistics.median(w["lead_steps"]) if w["lead_steps"] else None
            mark = " (shipped)" if t == criterion.WARN_THRESHOLD else ""
            rows.append(
                f"| {name} | {t:g}{mark} | {w['collapses']} | {w['hits']} | "
                f"{'-' if lead is None else f'{lead:.0f}'} | {w['misses']} | {w['quiet_runs']} "
                f"| {w['false_alarms']} | {w['only_at_staleness_start']} |"
            )

    sync_data = [
        ([r["rho"] for r in sync[s]["sync"]], criterion.judge(sync[s]["sync"])) for s in seeds
    ]
    add("sync, 8 seeds", sync_data, None)
    for lag in tuned_protocol.LAGS[1:]:
        runs = collapse.run_arms(dataclasses.replace(base, lag=lag), ("off",), seeds, args.work)
        data = [
            ([r["rho"] for r in runs[s]["off"]], criterion.judge(runs[s]["off"], sync[s]["sync"]))
            for s in seeds
        ]
        add(f"off, k = {lag}, 8 seeds", data, 1)
    table = "\n".join(rows)
    print(table)
    args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
