"""Choose the demo's stress scenario from the ESS-LR-off arm alone (issue 15).

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.stress_select [--start C,LR,IS,LAG]``.

Settings are tried mildest first: the demo's gradient clipping (1.0) before none (0: VCPO's
collapse follows a gradient-norm spike, which clipping hides), then the default LR before
larger ones, token-level IS before sequence-level IS, smaller max lags before larger. For
each, the "off" arm alone is trained on the selection seeds (disjoint from the seeds the
stress scenario reports); the first setting whose off run collapses
(``ess_patch.demo.report.collapsed``) in most selection seeds is the stress scenario. A
setting is dropped as soon as a majority is out of reach. ``--start`` resumes the grid at a
setting (e.g. skip no-clipping settings whose clipped runs never reached a gradient norm of
1, so clipping never acted and they are the same runs). No ESS-LR arm is run here, so
nothing is tuned on them. Prints every run and the choice.
"""

from __future__ import annotations

import argparse
import itertools
import time

from ess_patch import EssLrConfig
from ess_patch.demo import DemoConfig, report
from ess_patch.demo.launch import launch

CLIPS = (1.0, 0.0)  # 0: no gradient clipping
LRS = (1e-2, 3e-2, 1e-1)
IS_LEVELS = ("token", "sequence")
LAGS = (4, 16, 64)
SELECTION_SEEDS = (100, 101, 102, 103)
BASE = {"dp": 2, "cp": 1, "pp": 1, "steps": 150, "ess": EssLrConfig(weight_mode="product")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", help="resume at this setting: clip,lr,is_level,lag")
    start = parser.parse_args().start
    need = len(SELECTION_SEEDS) // 2 + 1
    t0 = time.monotonic()
    print(f"selection seeds {SELECTION_SEEDS}; collapse needed in >= {need}; base {BASE}")
    print("clip lr       IS        lag  seed  start  best   final  max|g|   collapsed  wall")
    grid = list(itertools.product(CLIPS, LRS, IS_LEVELS, LAGS))
    if start:
        c, lr_, level_, lag_ = start.split(",")
        grid = grid[grid.index((float(c), float(lr_), level_, int(lag_))) :]
    for clip, lr, level, lag in grid:
        hits = misses = 0
        for seed in SELECTION_SEEDS:
            cfg = DemoConfig(
                **BASE, clip_grad=clip, lr=lr, is_level=level, lag=lag, seed=seed, arms=("off",)
            )
            t = time.monotonic()
            records = launch(cfg, "/tmp/ess-stress-select")
            s = report.summarize(records, ["off"])[0]
            gmax = max(r["grad_norm"] for r in records)
            print(
                f"{clip:<4g} {lr:<8g} {level:<9} {lag:<4} {seed:<5} {s.start_reward:.3f}  "
                f"{s.best_reward:.3f}  {s.final_reward:.3f}  {gmax:<8.3g} "
                f"{'YES' if s.collapsed else 'no':<10} {time.monotonic() - t:.0f}s",
                flush=True,
            )
            hits += s.collapsed
            misses += not s.collapsed
            if hits >= need or misses > len(SELECTION_SEEDS) - need:
                break
        if hits >= need:
            print(
                f"CHOSEN: clip_grad={clip:g} lr={lr:g} is_level={level} lag={lag} "
                f"({hits} collapses)"
            )
            break
    print(f"total {time.monotonic() - t0:.0f}s")


if __name__ == "__main__":
    main()
