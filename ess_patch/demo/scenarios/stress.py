"""The stress scenario: a harsh async regime chosen from the off arm alone, paired seeds.

The settings (:data:`STRESS`) were chosen from the ESS-LR-off arm alone, on seeds that this
scenario does not report, by the rule written in ``benchmarks/stress_select.py`` (mildest
first: LR, then token-level TIS before untruncated sequence-level IS, then max lag; the first
setting whose off run collapses in most selection seeds; its log is
``docs/demo-stress/selection.txt``). No setting of that grid made the off run collapse, so
the rule's fallback, fixed before the runs, chose the harshest one: LR 1e-2, untruncated
sequence-level IS, max lag 32, 60 steps. The ESS-LR arms were not looked at. Every seed runs
five arms with the same model, task and rollout seeds: "off", "geometric", "product",
"constant" (armed every step with the mean scale of the same seed's "product" run: a smaller
LR that does not look at staleness) and "vcpo" (VCPO's rule: product weights, one scale per
optimizer step, no floor). Paired differences against "off" (and of "product" against
"constant") get a 95% bootstrap interval over seeds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...config import EssLrConfig
from ...errors import EssPatchValueError
from .. import report, stats
from ..trainer.config import DemoConfig

__all__ = ["STRESS", "STRESS_ARMS", "StressResult", "run_stress", "stress_config"]

logger = logging.getLogger(__name__)

STRESS_ARMS = ("off", "geometric", "product", "constant", "vcpo")
#: Chosen with ``benchmarks/stress_select.py`` from the off arm alone (see the module docstring).
STRESS: dict[str, Any] = {
    "dp": 2,
    "steps": 60,
    "lr": 1e-2,
    "loss": "sequence",
    "lag": 32,
    "ess": EssLrConfig(weight_mode="product"),
    "arms": STRESS_ARMS,
    "control_of": "product",
}
#: ``--quick --scenario stress``: the same settings, few steps.
QUICK_STEPS = 12
STEPS_FILE = "stress_steps.jsonl"
SUMMARY_FILE = "stress_summary.json"
TABLE_FILE = "stress_table.md"
FIGURE_FILE = "stress.png"


def stress_config(**overrides: Any) -> DemoConfig:
    """The stress scenario's config (``overrides`` win)."""
    return DemoConfig(**{**STRESS, **overrides})


@dataclass
class StressResult:
    out_dir: Path
    table: str
    figure: Path
    summary_path: Path
    table_path: Path
    steps_path: Path
    summary: dict[str, Any]
    wall_s: float


def _arm_stats(runs: dict[int, dict[str, report.ArmSummary]], arms: Sequence[str]) -> dict:
    seeds = sorted(runs)
    out: dict[str, Any] = {"arms": {}, "paired": []}
    for arm in arms:
        rows = [runs[s][arm] for s in seeds]
        out["arms"][arm] = {
            "final_mean": sum(r.final_reward for r in rows) / len(rows),
            "best_mean": sum(r.best_reward for r in rows) / len(rows),
            "collapsed": sum(r.collapsed for r in rows),
            "mean_lr_scale": sum(r.mean_lr_scale for r in rows) / len(rows),
            "n": len(rows),
            "final_ci": stats.bootstrap_ci([r.final_reward for r in rows]),
        }
    pairs = [(a, "off") for a in arms if a != "off"]
    if "constant" in arms and "product" in arms:
        pairs.append(("product", "constant"))
    out["paired"] += stats.paired_pairs(pairs, seeds, lambda s, arm: runs[s][arm].final_reward)
    return out


def format_tables(summary: dict[str, Any]) -> str:
    """Markdown: per arm (main lag), paired differences, and the lag sweep if there is one."""
    main = summary["by_lag"][str(summary["config"]["lag"])]
    n = next(iter(main["arms"].values()))["n"]
    lines = [
        "| arm | final reward (mean, 95% CI) | best (mean) | collapsed | mean scale |",
        "|---|---|---|---|---|",
    ]
    for arm, a in main["arms"].items():
        lo, hi = a["final_ci"]
        lines.append(
            f"| {arm} | {a['final_mean']:.3f} [{lo:.3f}, {hi:.3f}] | {a['best_mean']:.3f} | "
            f"{a['collapsed']}/{n} | {a['mean_lr_scale']:.3f} |"
        )
    lines += [
        "",
        "| paired difference of final reward | mean | 95% CI | wins |",
        "|---|---|---|---|",
    ]
    for p in main["paired"]:
        lines.append(
            f"| {p['arm']} - {p['base']} | {p['mean']:+.3f} | "
            f"[{p['ci_low']:+.3f}, {p['ci_high']:+.3f}] | {p['wins']}/{p['n']} |"
        )
    if len(summary["by_lag"]) > 1:
        arms = list(main["arms"])
        lines += ["", "| max lag | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
        for lag, by in summary["by_lag"].items():
            cells = [
                f"{by['arms'][a]['final_mean']:.3f} ({by['arms'][a]['collapsed']}/{n})"
                for a in arms
            ]
            lines.append(f"| {lag} | " + " | ".join(cells) + " |")
        lines.append("")
        lines.append("(lag sweep: mean final reward over seeds, collapsed runs in brackets)")
    return "\n".join(lines)


def write_figure(summary: dict[str, Any], records: Sequence[dict[str, Any]], path: Path) -> None:
    """Mean reward curve per arm (main lag), per-seed final rewards, final reward vs lag."""
    cfg = summary["config"]
    arms = list(cfg["arms"])
    sweep = len(summary["by_lag"]) > 1
    with report.figure(
        path,
        1,
        3 if sweep else 2,
        figsize=(14 if sweep else 10, 4),
        constrained_layout=True,
        dpi=110,
    ) as (fig, axes):
        main = [r for r in records if r["lag_max"] == cfg["lag"]]
        seeds = sorted({r["seed"] for r in main})
        for i, arm in enumerate(arms):
            color = report.COLORS.get(arm)
            curves = []
            for seed in seeds:
                rows = sorted(
                    (r for r in main if r["arm"] == arm and r["seed"] == seed),
                    key=lambda r: r["step"],
                )
                curves.append(report.smooth([r["reward"] for r in rows], report.window(len(rows))))
            mean = [sum(c[t] for c in curves) / len(curves) for t in range(len(curves[0]))]
            axes[0].plot(range(len(mean)), mean, color=color, label=arm)
            finals = [c[-1] for c in curves]
            axes[1].scatter([i] * len(finals), finals, color=color, alpha=0.7)
            mean_final = sum(finals) / len(finals)
            lo, hi = summary["by_lag"][str(cfg["lag"])]["arms"][arm]["final_ci"]
            axes[1].plot([i - 0.2, i + 0.2], [mean_final] * 2, color=color)
            axes[1].errorbar(
                [i + 0.25],
                [mean_final],
                yerr=[[mean_final - lo], [hi - mean_final]],
                color=color,
                capsize=4,
                linewidth=1.5,
            )
        axes[0].set_xlabel("optimizer step")
        axes[0].set_ylabel(f"smoothed reward, mean of {len(seeds)} seeds")
        axes[0].legend(fontsize=8)
        axes[1].set_xticks(range(len(arms)), arms)
        axes[1].set_ylabel("final reward per seed (bar: mean, whiskers: 95% CI)")
        if sweep:
            lags = [int(k) for k in summary["by_lag"]]
            for arm in arms:
                axes[2].plot(
                    lags,
                    [summary["by_lag"][str(g)]["arms"][arm]["final_mean"] for g in lags],
                    marker="o",
                    color=report.COLORS.get(arm),
                    label=arm,
                )
            axes[2].set_xscale("symlog", linthresh=4)
            axes[2].set_xticks(lags, [str(g) for g in lags])
            axes[2].set_xlabel("max lag")
            axes[2].set_ylabel("final reward, mean over seeds")
            axes[2].legend(fontsize=8)
        for ax in axes:
            ax.grid(alpha=0.3)
        fig.suptitle(
            f"ess-patch demo --scenario stress: {cfg['loss']} loss, lr {cfg['lr']:g}, "
            f"max lag {cfg['lag']}, {cfg['steps']} steps, {len(seeds)} paired seeds",
            fontsize=10,
        )


def run_stress(
    cfg: DemoConfig,
    out_dir: str | Path,
    *,
    seeds: int = 8,
    lags: Sequence[int] | None = None,
    on_step: Callable[[int, int, str, int], None] | None = None,
) -> StressResult:
    """Run every arm of ``cfg`` on seeds ``0..seeds-1`` (and each max lag of ``lags``).

    ``on_step(lag, seed, arm, step)`` is called after each recorded step.
    """
    from ..launch import launch

    if seeds < 2:
        raise EssPatchValueError(f"seeds={seeds}: paired statistics need at least 2 seeds")
    lags = sorted({cfg.lag, *(lags or ())})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    records: list[dict[str, Any]] = []
    by_lag: dict[str, Any] = {}
    for lag in lags:
        runs: dict[int, dict[str, report.ArmSummary]] = {}
        for seed in range(seeds):
            run_cfg = dataclasses.replace(cfg, lag=lag, seed=seed)

            def step_cb(arm: str, step: int, _lag: int = lag, _seed: int = seed) -> None:
                if on_step is not None:
                    on_step(_lag, _seed, arm, step)

            rows = launch(run_cfg, out, on_step=step_cb)
            runs[seed] = {s.arm: s for s in report.summarize(rows, cfg.arms)}
            records += [{**r, "seed": seed, "lag_max": lag} for r in rows]
        by_lag[str(lag)] = _arm_stats(runs, cfg.arms)
        by_lag[str(lag)]["runs"] = {
            str(s): {a: v.to_dict() for a, v in arms.items()} for s, arms in runs.items()
        }
    wall = time.monotonic() - start
    summary = {
        "config": cfg.to_dict(),
        "seeds": list(range(seeds)),
        "wall_s": wall,
        "collapse_criterion": (
            f"smoothed reward ends more than {report.COLLAPSE_GIVEBACK:.0%} of its peak "
            f"gain below the peak (gain >= {report.MIN_GAIN}), or a non-finite reward"
        ),
        "by_lag": by_lag,
    }
    table = format_tables(summary)
    steps_path = out / STEPS_FILE
    report.write_jsonl(records, steps_path)
    summary_path = out / SUMMARY_FILE
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    table_path = out / TABLE_FILE
    table_path.write_text(table + "\n")
    figure = out / FIGURE_FILE
    write_figure(summary, records, figure)
    logger.info("stress scenario finished in %.1fs; outputs in %s", wall, out)
    return StressResult(out, table, figure, summary_path, table_path, steps_path, summary, wall)
