"""The collapse scenario: VCPO's fully-async regime at the demo's scale, with a synchronous
reference, every arm on paired seeds.

As VCPO's runs (``docs/vcpo.md``; DESIGN.md section 3): the policy starts from a short
supervised warm start (:mod:`ess_patch.demo.warm_start`: competent and sharp, as an instruct
model), every rollout is exactly ``lag`` updates stale (``staleness="fixed"``), the loss is
VCPO's sequence-level truncated IS (``"seq-tis"``, threshold 8, no PPO clip) or miles/slime's
token-level TIS, a constant LR with gradient clipping 1.0, hundreds of steps. The settings
(:data:`COLLAPSE`) were chosen from the "off" and "sync" arms alone on seeds the report does
not use, by the grid and rule of ``benchmarks/collapse_select.py`` (its log:
``docs/demo-collapse/selection.txt``).

Every run is judged against the "sync" run of its seed by :mod:`ess_patch.demo.criterion`.
Each (arm, seed) run is one launch of one rank, cached as JSON lines under the output folder
by a hash of its exact config, so an interrupted scenario resumes, and two processes
(``jobs=2``) share the work. The "constant" arm of a seed copies the mean LR scale of that
seed's "product" run; the adaptivity sweep (:func:`run_adaptivity`) instead fixes one constant
scale for every lag, as a user with one config would.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import json
import logging
import math
import multiprocessing
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...config import EssLrConfig
from ...errors import EssPatchValueError
from .. import criterion, report, stats
from ..trainer.config import DemoConfig
from ..warm_start import WarmStart

__all__ = [
    "COLLAPSE",
    "COLLAPSE_ARMS",
    "CollapseResult",
    "collapse_config",
    "run_adaptivity",
    "run_arms",
    "run_collapse",
    "warm_start_of",
]

logger = logging.getLogger(__name__)

COLLAPSE_ARMS = (
    "sync",
    "off",
    "product",
    "constant",
    "baseline",
    "ess+baseline",
    "geometric",
    "calibrated",
)
#: Arms that scale the LR by ESS (paired against the constant-LR control too).
ESS_ARMS = ("product", "geometric", "calibrated", "vcpo", "on")
#: Chosen with ``benchmarks/collapse_select.py`` (see the module docstring): the first grid
#: point (LR 1e-3, sort, seq-tis, k = 2) where the off run collapsed in both selection seeds
#: (100, 101) and the sync run in neither.
COLLAPSE: dict[str, Any] = {
    "dp": 1,
    "steps": 400,
    "staleness": "fixed",
    "rollout_workers": 1,
    "task": "sort",
    "loss": "seq-tis",
    "lag": 2,
    "lr": 1e-3,
    "warmup": 10,
    "ess": EssLrConfig(weight_mode="product"),
    "arms": COLLAPSE_ARMS,
    "control_of": "product",
}
#: Supervised warm-start steps per task: reward about 0.5 from 0.06 at the start, entropy
#: 1-2 nats / token (measured on seed 100 / 101 before the selection: sort 70 steps 0.50,
#: entropy 1.11; reverse 80 steps 0.52 / 0.67, entropy 1.81 / 1.34).
WARM_STEPS = {"sort": 70, "reverse": 80, "add": 150}
#: The tables' descriptive "ended below its start" count: final < start - this.
BELOW_START = 0.05
QUICK = {"steps": 16, "lag": 2, "warmup": 2}
RUNS_DIR = "runs"


def collapse_config(**overrides: Any) -> DemoConfig:
    """The scenario's config (``overrides`` win); ``init_weights`` is set per seed later."""
    return DemoConfig(**{**COLLAPSE, **overrides})


def warm_start_of(cfg: DemoConfig) -> WarmStart:
    """The warm start of ``cfg``'s task, model and seed."""
    return WarmStart(
        task=cfg.task,
        response_len=cfg.response_len,
        num_layers=cfg.num_layers,
        hidden=cfg.hidden,
        seed=cfg.seed,
        steps=WARM_STEPS[cfg.task],
    )


def _run_key(cfg: DemoConfig) -> str:
    text = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _arm_config(cfg: DemoConfig, arm: str, seed: int, cache_dir: str | None) -> DemoConfig:
    from ..warm_start import ensure

    seeded = dataclasses.replace(cfg, seed=seed, arms=(arm,))
    if arm == "sync":  # lag 0 whatever the scenario's lag: one sync run serves every lag
        seeded = dataclasses.replace(seeded, lag=0)
    if arm != "constant":
        seeded = dataclasses.replace(seeded, constant_scale=None)
    path, meta = ensure(warm_start_of(seeded), cache_dir)
    logger.info("seed %d warm start %s (reward %.3f)", seed, path.name, meta["reward"])
    return dataclasses.replace(seeded, init_weights=str(path))


def _run_one(
    cfg: DemoConfig,
    arm: str,
    seed: int,
    root: str,
    cache_dir: str | None,
    on_step: Callable[[str, int], None] | None = None,
) -> list[dict[str, Any]]:
    """One (arm, seed) run, from its cache file if the same config ran before."""
    from ..launch import launch

    run_cfg = _arm_config(cfg, arm, seed, cache_dir)
    runs = Path(root) / RUNS_DIR
    runs.mkdir(parents=True, exist_ok=True)
    path = runs / f"{arm}-seed{seed}-{_run_key(run_cfg)}.jsonl"
    if path.is_file():
        return [json.loads(line) for line in path.read_text().splitlines() if line]
    t0 = time.monotonic()
    records = launch(run_cfg, runs / f"launch-{arm}-seed{seed}", on_step=on_step)
    wall = time.monotonic() - t0
    records = [{**r, "seed": seed, "wall_s": wall} for r in records]
    tmp = path.with_suffix(".tmp")
    report.write_jsonl(records, tmp)
    tmp.replace(path)
    return records


def _job(args: tuple) -> tuple[int, str, list[dict[str, Any]]]:
    cfg, arm, seed, root, cache_dir = args
    return seed, arm, _run_one(cfg, arm, seed, root, cache_dir)


def _mean_scale(records: Sequence[dict[str, Any]]) -> float:
    return sum(r["lr_scale"] for r in records) / len(records)


def run_arms(
    cfg: DemoConfig,
    arms: Sequence[str],
    seeds: Sequence[int],
    root: str | Path,
    *,
    jobs: int = 1,
    cache_dir: str | Path | None = None,
    on_run: Callable[[int, str], None] | None = None,
    on_step: Callable[[str, int], None] | None = None,
) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """Every (arm, seed) run, ``jobs`` at a time (spawned processes; 1: in this process).

    A "constant" arm without ``cfg.constant_scale`` waits for its seed's "product" run and
    copies its mean scale. ``on_run(seed, arm)`` is called as each run ends; ``on_step``
    only with ``jobs=1``.
    """
    root, cache = str(root), None if cache_dir is None else str(cache_dir)
    out: dict[int, dict[str, list[dict[str, Any]]]] = {s: {} for s in seeds}
    copies = "constant" in arms and cfg.constant_scale is None
    if copies and cfg.control_of not in arms:
        raise EssPatchValueError(f"the constant arm copies {cfg.control_of!r}: add it to the arms")
    ready = [(a, s) for s in seeds for a in arms if not (copies and a == "constant")]
    waiting = [s for s in seeds if copies]

    def job_cfg(arm: str, seed: int) -> DemoConfig:
        if arm == "constant" and copies:
            return dataclasses.replace(cfg, constant_scale=_mean_scale(out[seed][cfg.control_of]))
        return cfg

    def finish(seed: int, arm: str, records: list[dict[str, Any]]) -> None:
        out[seed][arm] = records
        if on_run is not None:
            on_run(seed, arm)
        if arm == cfg.control_of and seed in waiting:
            waiting.remove(seed)
            ready.append(("constant", seed))

    if jobs <= 1:
        while ready:
            arm, seed = ready.pop(0)
            finish(seed, arm, _run_one(job_cfg(arm, seed), arm, seed, root, cache, on_step))
        return out
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        running: set[cf.Future] = set()
        while ready or running:
            while ready and len(running) < jobs:
                arm, seed = ready.pop(0)
                running.add(pool.submit(_job, (job_cfg(arm, seed), arm, seed, root, cache)))
            done, running = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                finish(*fut.result())
    return out


def _final(records: Sequence[dict[str, Any]]) -> float:
    return criterion.judge(records).final


def summarize(
    runs: dict[int, dict[str, list[dict[str, Any]]]], arms: Sequence[str]
) -> dict[str, Any]:
    """Verdicts (against each seed's "sync" run), per-arm statistics, paired differences of
    the final smoothed reward with 95% bootstrap CIs, and the early warning over the runs."""
    seeds = sorted(runs)
    verdicts = {
        s: {a: criterion.judge(runs[s][a], runs[s].get("sync")) for a in arms} for s in seeds
    }
    arm_stats: dict[str, Any] = {}
    for arm in arms:
        vs = [verdicts[s][arm] for s in seeds]
        finals = [v.final for v in vs]
        onsets = [v.onset for v in vs if v.collapsed and v.onset is not None]
        recs = [runs[s][arm] for s in seeds]
        arm_stats[arm] = {
            "n": len(seeds),
            "start_mean": statistics.fmean(v.start for v in vs),
            "peak_mean": statistics.fmean(v.peak for v in vs),
            "final_mean": statistics.fmean(finals),
            "final_ci": stats.bootstrap_ci(finals) if len(finals) > 1 else (finals[0],) * 2,
            "collapsed": sum(v.collapsed for v in vs),
            # descriptive, not the criterion: ended below where RL started it
            "below_start": sum(v.final < v.start - BELOW_START for v in vs),
            "reasons": sorted({x for v in vs for x in v.reasons}),
            "median_onset": statistics.median(onsets) if onsets else None,
            "mean_lr_scale": statistics.fmean(_mean_scale(r) for r in recs),
            "mean_rho": statistics.fmean(
                statistics.fmean(x["rho"] for x in r if math.isfinite(x["rho"])) for r in recs
            ),
            "final_entropy": statistics.fmean(r[-1]["entropy"] for r in recs),
            "max_grad_norm_median": statistics.median(max(x["grad_norm"] for x in r) for r in recs),
            "wall_s": sum(r[0].get("wall_s", 0.0) for r in recs),
        }
    pairs = [(a, "off") for a in arms if a != "off" and "off" in arms]
    if "constant" in arms:
        pairs += [(a, "constant") for a in arms if a in ESS_ARMS or "baseline" in a]
    if "ess+baseline" in arms and "baseline" in arms:
        pairs.append(("ess+baseline", "baseline"))
    paired = []
    if len(seeds) > 1:
        paired = stats.paired_pairs(pairs, seeds, lambda s, arm: verdicts[s][arm].final)
    warnings = {}
    for arm in ("off", "sync"):
        if arm in arms:
            data = [([x["rho"] for x in runs[s][arm]], verdicts[s][arm]) for s in seeds]
            # the first stale rollout: step 1 (step 0 samples the initial weights); sync: none
            stale = None if arm == "sync" else 1
            warnings[arm] = [
                criterion.early_warning(data, t, stale) for t in criterion.WARN_THRESHOLDS
            ]
    return {
        "seeds": seeds,
        "arms": arm_stats,
        "paired": paired,
        "early_warning": warnings,
        "verdicts": {str(s): {a: v.to_dict() for a, v in verdicts[s].items()} for s in seeds},
    }


def format_tables(summary: dict[str, Any]) -> str:
    """Markdown tables: per arm, paired differences, early warning."""
    lines = [
        "| arm | start | peak | final reward (mean, 95% CI) | collapsed | median onset | "
        f"ended below start - {BELOW_START:g} | mean LR scale | mean rho | final entropy | "
        "max grad norm (median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, a in summary["arms"].items():
        lo, hi = a["final_ci"]
        onset = "-" if a["median_onset"] is None else f"{a['median_onset']:.0f}"
        why = f" ({', '.join(a['reasons'])})" if a["collapsed"] else ""
        lines.append(
            f"| {arm} | {a['start_mean']:.3f} | {a['peak_mean']:.3f} | {a['final_mean']:.3f} "
            f"[{lo:.3f}, {hi:.3f}] | {a['collapsed']}/{a['n']}{why} | {onset} | "
            f"{a['below_start']}/{a['n']} | "
            f"{a['mean_lr_scale']:.3f} | {a['mean_rho']:.3f} | {a['final_entropy']:.3f} | "
            f"{a['max_grad_norm_median']:.3g} |"
        )
    if summary["paired"]:
        lines += [
            "",
            "| paired difference of final reward | mean | 95% CI | wins |",
            "|---|---|---|---|",
        ]
        for p in summary["paired"]:
            lines.append(
                f"| {p['arm']} - {p['base']} | {p['mean']:+.3f} | "
                f"[{p['ci_low']:+.3f}, {p['ci_high']:+.3f}] | {p['wins']}/{p['n']} |"
            )
    for arm, scores in summary["early_warning"].items():
        lines += [
            "",
            f"| early warning over the {arm} runs: rho below (3 steps in a row; the shipped "
            "rule is 0.2) | collapses | hits | median lead (steps before the onset) | misses | "
            "runs without collapse | false alarms | runs that fired only as staleness began |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for w in scores:
            lead = statistics.median(w["lead_steps"]) if w["lead_steps"] else None
            lines.append(
                f"| {w['threshold']:g} | {w['collapses']} | {w['hits']} | "
                f"{'-' if lead is None else f'{lead:.0f}'} | {w['misses']} | "
                f"{w['quiet_runs']} | {w['false_alarms']} | {w['only_at_staleness_start']} |"
            )
    return "\n".join(lines)


def write_figure(
    runs: dict[int, dict[str, list[dict[str, Any]]]],
    arms: Sequence[str],
    path: Path,
    title: str,
    seed: int | None = None,
) -> None:
    """One seed's reward, rho, LR scale, grad norm, entropy and KL vs step for every arm,
    and every seed's smoothed reward (PNG)."""
    seeds = sorted(runs)
    seed = seeds[0] if seed is None else seed
    with report.figure(path, 4, 2, figsize=(12, 12), constrained_layout=True, dpi=100) as (
        fig,
        axes,
    ):
        ax = axes.flatten()
        panels = [
            ("reward", f"reward (smoothed), seed {seed}", False),
            ("rho", "rho = ESS / B (product weights)", False),
            ("lr_scale", "LR scale (applied / scheduled)", False),
            ("grad_norm", "gradient norm (before clipping)", True),
            ("entropy", "policy entropy (nats / token)", False),
            ("kl", "KL(rollout || policy), k3, per token", True),
        ]
        for arm in arms:
            color = report.COLORS.get(arm)
            rows = runs[seed].get(arm, [])
            steps = [r["step"] for r in rows]
            for i, (key, _, _) in enumerate(panels):
                values = [r[key] for r in rows]
                if key == "reward":
                    values = criterion.smooth(values)
                ax[i].plot(steps, values, color=color, label=arm, linewidth=1)
            for s in seeds:
                rec = runs[s].get(arm, [])
                ax[6].plot(
                    [r["step"] for r in rec],
                    criterion.smooth([r["reward"] for r in rec]),
                    color=color,
                    linewidth=0.7,
                    alpha=0.6,
                    label=arm if s == seeds[0] else None,
                )
        for i, (_, label, log) in enumerate(panels):
            ax[i].set_ylabel(label, fontsize=8)
            if log:
                ax[i].set_yscale("log")
        ax[6].set_ylabel(f"smoothed reward, every seed ({len(seeds)})", fontsize=8)
        finals = {a: [criterion.judge(runs[s][a]).final for s in seeds] for a in arms}
        for j, arm in enumerate(arms):
            ax[7].scatter([j] * len(seeds), finals[arm], color=report.COLORS.get(arm), alpha=0.7)
        ax[7].set_xticks(range(len(arms)), arms, rotation=30, fontsize=8)
        ax[7].set_ylabel("final smoothed reward per seed", fontsize=8)
        for a in ax:
            a.grid(alpha=0.3)
        ax[0].legend(fontsize=7)
        ax[6].legend(fontsize=7)
        fig.suptitle(title, fontsize=10)


@dataclass
class CollapseResult:
    out_dir: Path
    table: str
    summary: dict[str, Any]
    files: tuple[Path, ...]
    wall_s: float


def _title(cfg: DemoConfig, seeds: Sequence[int]) -> str:
    return (
        f"ess-patch demo --scenario collapse: {cfg.task} x{cfg.response_len}, {cfg.loss} loss, "
        f"lr {cfg.lr:g}, every rollout {cfg.lag} updates stale ({cfg.staleness}), "
        f"{cfg.steps} steps, seeds {seeds[0]}..{seeds[-1]}"
    )


def run_collapse(
    cfg: DemoConfig,
    out_dir: str | Path,
    *,
    seeds: Sequence[int],
    jobs: int = 1,
    cache_dir: str | Path | None = None,
    on_run: Callable[[int, str], None] | None = None,
    on_step: Callable[[str, int], None] | None = None,
) -> CollapseResult:
    """Every arm of ``cfg.arms`` on ``seeds``; tables, summary and figure in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    runs = run_arms(
        cfg, cfg.arms, seeds, out, jobs=jobs, cache_dir=cache_dir, on_run=on_run, on_step=on_step
    )
    summary = {"config": cfg.to_dict(), **summarize(runs, cfg.arms)}
    summary["wall_s"] = time.monotonic() - t0
    table = format_tables(summary)
    files = (out / "collapse_table.md", out / "collapse_summary.json", out / "collapse.png")
    files[0].write_text(table + "\n")
    files[1].write_text(json.dumps(summary, indent=2, default=str) + "\n")
    write_figure(runs, cfg.arms, files[2], _title(cfg, list(seeds)))
    return CollapseResult(out, table, summary, files, summary["wall_s"])


def run_adaptivity(
    cfg: DemoConfig,
    out_dir: str | Path,
    *,
    seeds: Sequence[int],
    lags: Sequence[int],
    constant_scale: float,
    jobs: int = 1,
    cache_dir: str | Path | None = None,
    on_run: Callable[[int, str], None] | None = None,
) -> CollapseResult:
    """One ESS-LR setting ("product") and one fixed constant scale across ``lags``, judged
    against the seed's "sync" run; a table of final reward per lag with paired CIs."""
    out = Path(out_dir)
    fixed = dataclasses.replace(cfg, constant_scale=constant_scale)
    t0 = time.monotonic()
    sync = run_arms(fixed, ("sync",), seeds, out, jobs=jobs, cache_dir=cache_dir, on_run=on_run)
    rows = [
        "| lag | product final (95% CI) | collapsed | constant "
        f"{constant_scale:.3f} final (95% CI) | collapsed | product - constant (95% CI) | wins |",
        "|---|---|---|---|---|---|---|",
    ]
    by_lag: dict[str, Any] = {}
    for lag in lags:
        lag_cfg = dataclasses.replace(fixed, lag=lag)
        runs = run_arms(
            lag_cfg,
            ("product", "constant"),
            seeds,
            out,
            jobs=jobs,
            cache_dir=cache_dir,
            on_run=on_run,
        )
        for s in seeds:
            runs[s]["sync"] = sync[s]["sync"]
        summ = summarize(runs, ("sync", "product", "constant"))
        by_lag[str(lag)] = summ
        p = next(x for x in summ["paired"] if x["arm"] == "product" and x["base"] == "constant")
        a, c = summ["arms"]["product"], summ["arms"]["constant"]
        rows.append(
            f"| {lag} | {a['final_mean']:.3f} [{a['final_ci'][0]:.3f}, {a['final_ci'][1]:.3f}] "
            f"| {a['collapsed']}/{a['n']} | {c['final_mean']:.3f} [{c['final_ci'][0]:.3f}, "
            f"{c['final_ci'][1]:.3f}] | {c['collapsed']}/{c['n']} | {p['mean']:+.3f} "
            f"[{p['ci_low']:+.3f}, {p['ci_high']:+.3f}] | {p['wins']}/{p['n']} |"
        )
    s_arm = summarize({s: {"sync": sync[s]["sync"]} for s in seeds}, ("sync",))["arms"]["sync"]
    rows.append(
        f"| (sync reference) | {s_arm['final_mean']:.3f} [{s_arm['final_ci'][0]:.3f}, "
        f"{s_arm['final_ci'][1]:.3f}] | {s_arm['collapsed']}/{s_arm['n']} | | | | |"
    )
    table = "\n".join(rows)
    files = (out / "adaptivity_table.md", out / "adaptivity_summary.json")
    files[0].write_text(table + "\n")
    wall = time.monotonic() - t0
    files[1].write_text(
        json.dumps(
            {"config": fixed.to_dict(), "lags": list(lags), "by_lag": by_lag, "wall_s": wall},
            indent=2,
            default=str,
        )
        + "\n"
    )
    return CollapseResult(out, table, {"by_lag": by_lag}, files, wall)
