"""``ess-patch demo``'s main job: one seed of the question users ask of a fully-async run.

"I tuned my LR synchronously; I now run fully-async, every rollout k updates stale. Do I have
to retune?" The collapse scenario (:mod:`ess_patch.demo.scenarios.collapse`: the supervised
warm start, VCPO's sequence-level truncated IS, 400 steps, one rank) at the LR the synchronous
arm chose on tuning seeds (``benchmarks/tune_lr.py``, :data:`TUNED_LR`) and at lag :data:`MAIN_LAG`,
with four arms: sync (k = 0), off, product (ESS-LR) and ess+baseline (ESS-LR with VCPO's
minimum-variance baseline). One seed (:data:`MAIN_SEED`), two runs at a time; the 8-seed
version of the same runs is :data:`EIGHT_SEEDS` (``docs/demo.md``), whose numbers at this lag
are :data:`HEADLINE`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import criterion
from ..trainer.config import DemoConfig
from . import collapse

__all__ = ["EIGHT_SEEDS", "HEADLINE", "MAIN_ARMS", "MainResult", "main_config", "run_main"]

#: The sync arm's choice over the grid of ``benchmarks/tune_lr.py`` (seeds 300, 301).
TUNED_LR = 3.5e-4
MAIN_LAG = 8
MAIN_SEED = 0
MAIN_ARMS = ("sync", "off", "product", "ess+baseline")
QUICK = {"steps": 16, "warmup": 2}
#: Shorter than this, a run's final reward is not a reading (the criterion's window is 20).
SMOKE_STEPS = 100
EIGHT_SEEDS = (
    "ess-patch demo --scenario collapse --lr 3.5e-4 --lag 8 "
    "--arms sync,off,product,ess+baseline --seeds 8 --jobs 2"
)
#: The 8 paired seeds at this LR and lag (``python -m benchmarks.tuned_protocol``,
#: ``docs/demo-tuned/protocol-fixed.md``): final reward as a fraction of sync, 95% CI.
HEADLINE = {
    "off": "0.67 [0.62, 0.72]",
    "product": "0.82 [0.79, 0.84]",
    "ess+baseline": "0.84 [0.82, 0.86]",
}
NAMES = {
    "sync": "synchronous (k = 0)",
    "off": "off (ESS-LR never applied)",
    "product": "ESS-LR (product weights)",
    "ess+baseline": "ESS-LR + VCPO's baseline",
}


def main_config(**overrides: Any) -> DemoConfig:
    """The main job's config (``overrides`` win, e.g. ``--quick``'s sizes)."""
    values = {"lr": TUNED_LR, "lag": MAIN_LAG, "arms": MAIN_ARMS, **overrides}
    return collapse.collapse_config(**values)


@dataclass(frozen=True)
class MainResult:
    out_dir: Path
    table: str
    reading: str
    summary: dict[str, Any]
    files: tuple[Path, ...]
    wall_s: float


def _table(cfg: DemoConfig, runs: dict[str, list[dict[str, Any]]]) -> tuple[str, dict]:
    sync = criterion.judge(runs["sync"])
    rows = [
        "| arm | final reward | fraction of sync | 8 seeds: fraction of sync (95% CI) | "
        "collapsed | mean LR scale | mean rho |",
        "|---|---|---|---|---|---|---|",
    ]
    out: dict[str, Any] = {}
    for arm in cfg.arms:
        v = criterion.judge(runs[arm], runs["sync"] if arm != "sync" else None)
        recs = runs[arm]
        scale = sum(r["lr_scale"] for r in recs) / len(recs)
        rho = sum(r["rho"] for r in recs) / len(recs)
        frac = v.final / sync.final if sync.final else float("nan")
        out[arm] = {"final": v.final, "fraction_of_sync": frac, "collapsed": v.collapsed}
        out[arm].update({"mean_lr_scale": scale, "mean_rho": rho})
        ref = "1" if arm == "sync" else HEADLINE.get(arm, "-")
        rows.append(
            f"| {NAMES.get(arm, arm)} | {v.final:.3f} | {frac:.2f} | {ref} | "
            f"{'yes' if v.collapsed else 'no'} | {scale:.3f} | {rho:.3f} |"
        )
    return "\n".join(rows), out


def _reading(arms: dict[str, Any], seed: int) -> str:
    f = {a: arms[a]["fraction_of_sync"] for a in arms}
    order = sorted((a for a in f if a != "sync"), key=f.get, reverse=True)
    agrees = order[0] != "off" and f.get("off", 1.0) < min(
        f.get(a, 0.0) for a in ("product", "ess+baseline") if a in f
    )
    verdict = (
        "as in the 8-seed headline: both ESS-LR arms keep more of the synchronous reward than off"
        if agrees
        else "unlike the 8-seed headline on this seed: read the 8-seed table in docs/demo.md"
    )
    return (
        f"seed {seed}: "
        + ", ".join(f"{NAMES.get(a, a)} {f[a]:.2f}" for a in order)
        + f" of the synchronous reward; {verdict}"
    )


def run_main(
    cfg: DemoConfig,
    out_dir: str | Path,
    *,
    seed: int = MAIN_SEED,
    jobs: int = 2,
    cache_dir: str | Path | None = None,
    on_run: Callable[[int, str], None] | None = None,
) -> MainResult:
    """The main job's runs (cached under ``out_dir``), its table, reading and figure."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    runs = collapse.run_arms(
        cfg, cfg.arms, [seed], out, jobs=jobs, cache_dir=cache_dir, on_run=on_run
    )
    table, arms = _table(cfg, runs[seed])
    reading = _reading(arms, seed)
    if cfg.steps < SMOKE_STEPS:
        reading = f"a smoke run of {cfg.steps} steps (--quick): its numbers say nothing. " + reading
    wall = time.monotonic() - t0
    summary = {"config": cfg.to_dict(), "seed": seed, "arms": arms, "reading": reading}
    summary.update({"wall_s": wall, "eight_seeds": EIGHT_SEEDS})
    files = (out / "main_table.md", out / "main_summary.json", out / "main.png")
    files[0].write_text(table + "\n\n" + reading + "\n")
    files[1].write_text(json.dumps(summary, indent=2, default=str) + "\n")
    title = (
        f"ess-patch demo: LR {cfg.lr:g} tuned synchronously, every rollout {cfg.lag} updates "
        f"stale, {cfg.steps} steps, seed {seed}"
    )
    collapse.write_figure(runs, cfg.arms, files[2], title)
    return MainResult(out, table, reading, summary, files, wall)
