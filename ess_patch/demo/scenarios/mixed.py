"""``ess-patch demo --scenario mixed``: one run of the arms, DP2, each rank's rollout workers
pulling the weights at different periods (up to ``lag`` updates behind, see
:func:`~ess_patch.demo.trainer.sampling.worker_lags`): its config (:func:`quick_config` for
``--quick``), its run (:func:`run_mixed`), its tables (:func:`format_table`, where the time went:
:func:`timing`, :func:`format_timing`), its figure (:func:`write_figure`) and TensorBoard events.

The old names stay: ``ess_patch.demo.run`` (this ``run_mixed``), ``ess_patch.demo.DemoResult``
and ``quick_config``, and ``ess_patch.demo.report``'s tables and figure.

The ranks are forked from a forkserver, which re-imports the caller's main script: call
:func:`run_mixed` from under ``if __name__ == "__main__":`` in a script.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import report
from ..trainer.config import DemoConfig

__all__ = [
    "DemoResult",
    "format_table",
    "format_timing",
    "quick_config",
    "run_mixed",
    "timing",
    "write_figure",
    "write_tensorboard",
]

logger = logging.getLogger(__name__)

RECORDS_FILE = "steps.jsonl"
FIGURE_FILE = "ess_demo.png"
SUMMARY_FILE = "summary.json"
TENSORBOARD_DIR = "tb"
#: Per-step time fields the ranks record (the writer rank's own clock).
TIME_FIELDS = ("time_sample_s", "time_train_s", "time_ess_s", "time_publish_s")


@dataclass(frozen=True)
class DemoResult:
    out_dir: Path
    records: list[dict[str, Any]]
    summaries: list[Any]  # report.ArmSummary, one per arm
    table: str
    timing: str  # where the time went (sampling, training, ess-patch)
    figure: Path
    figures: tuple[Path, ...]
    records_path: Path
    summary_path: Path
    wall_s: float


def quick_config(**overrides: Any) -> DemoConfig:
    """The ``--quick`` smoke run: a few steps, same layout."""
    values: dict[str, Any] = {"steps": 12, "lag": 4, "warmup": 2, "arms": ("off", "product")}
    values.update(overrides)
    return DemoConfig(**values)


def run_mixed(
    cfg: DemoConfig,
    out_dir: str | Path,
    *,
    on_step: Callable[[str, int], None] | None = None,
) -> DemoResult:
    """Run both arms over ``cfg.world_size`` local ranks; write the outputs to ``out_dir``.

    Raises:
        launch.DemoError: a rank failed (the message carries its traceback).
        ImportError: megatron-core or matplotlib is missing (install ``ess-patch[demo]``).
    """
    from ..launch import launch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    start = time.monotonic()
    records = launch(cfg, out, on_step=on_step)
    wall = time.monotonic() - start
    summaries = report.summarize(records, cfg.arms)
    records_path = out / RECORDS_FILE
    report.write_jsonl(records, records_path)
    figure = out / FIGURE_FILE
    title = (
        f"ess-patch demo: dp={cfg.dp} tp={cfg.tp} pp={cfg.pp}, {cfg.task} x{cfg.response_len}, "
        f"{cfg.loss} loss, max lag {cfg.lag}, "
        f"{cfg.steps} steps, seed {cfg.seed}, floor {cfg.ess.floor}\n"
        f"(off arm: rho with {cfg.ess.weight_mode} weights, computed but never applied)"
    )
    write_figure(records, cfg.arms, figure, title)
    times = timing(records, cfg.arms)
    tensorboard = write_tensorboard(records, cfg.arms, out / TENSORBOARD_DIR)
    summary_path = out / SUMMARY_FILE
    summary_path.write_text(
        json.dumps(
            {
                "config": cfg.to_dict(),
                "wall_s": wall,
                "time_s": times,
                "tensorboard": str(out / TENSORBOARD_DIR) if tensorboard else None,
                "collapse_criterion": (
                    f"smoothed reward ends more than {report.COLLAPSE_GIVEBACK:.0%} of its peak "
                    f"gain below the peak (gain >= {report.MIN_GAIN}), or a non-finite reward"
                ),
                "arms": [s.to_dict() for s in summaries],
            },
            indent=2,
        )
        + "\n"
    )
    logger.info("demo finished in %.1fs; outputs in %s", wall, out)
    return DemoResult(
        out_dir=out,
        records=records,
        summaries=summaries,
        table=format_table(summaries),
        timing=format_timing(times),
        figure=figure,
        figures=(figure,),
        records_path=records_path,
        summary_path=summary_path,
        wall_s=wall,
    )


# --- tables and figure ---------------------------------------------------------------------------


def format_table(summaries: Sequence[report.ArmSummary]) -> str:
    """A plain-text table, one row per arm."""
    header = (
        "arm",
        "steps",
        "start reward",
        "final reward",
        "best reward",
        "min rho",
        "LR scaled",
        "mean scale",
        "collapsed",
    )
    rows = [
        (
            f"ESS-LR {s.arm}",
            str(s.steps),
            f"{s.start_reward:.3f}",
            f"{s.final_reward:.3f}",
            f"{s.best_reward:.3f}",
            f"{s.min_rho:.3f}",
            f"{s.scaled_steps}/{s.steps} steps",  # a count: 399/400 is not "100%"
            f"{s.mean_lr_scale:.3f}",
            "YES" if s.collapsed else "no",
        )
        for s in summaries
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def timing(records: Sequence[dict[str, Any]], arms: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per arm: seconds spent sampling, training (forward, backward, optimizer step), in
    ess-patch (``compute_ess_lr`` + ``arm``) and publishing weights, over all its steps, and
    ess-patch's share of an optimizer step (ess / (train + ess)), in wall time and in the
    rank's own CPU time (without the time spent waiting for peers in collectives)."""
    out = {}
    for arm in arms:
        rows = [r for r in records if r["arm"] == arm and "time_ess_s" in r]
        if not rows:
            continue
        sums = {
            k.removeprefix("time_").removesuffix("_s"): sum(r[k] for r in rows) for k in TIME_FIELDS
        }
        cpu_train = sum(r["cpu_train_s"] for r in rows)
        cpu_ess = sum(r["cpu_ess_s"] for r in rows)
        step, cpu_step = sums["train"] + sums["ess"], cpu_train + cpu_ess
        out[arm] = {
            **sums,
            "steps": len(rows),
            "ess_ms_per_step": 1e3 * sums["ess"] / len(rows),
            "step_ms": 1e3 * step / len(rows),
            "ess_share_of_step": sums["ess"] / step if step > 0 else math.nan,
            "cpu_ess_ms_per_step": 1e3 * cpu_ess / len(rows),
            "cpu_step_ms": 1e3 * cpu_step / len(rows),
            "cpu_ess_share_of_step": cpu_ess / cpu_step if cpu_step > 0 else math.nan,
        }
    return out


def format_timing(times: dict[str, dict[str, float]]) -> str:
    """Where the time went, one line per arm (the writer rank's clock)."""
    lines = [
        "where the time went (writer rank, wall): sampling / training (fwd+bwd+optimizer) / "
        "ess-patch (compute_ess_lr + arm) / weight publish",
        "ess-patch per optimizer step: wall (with waiting for peers) | CPU (this rank's work)",
    ]
    for arm, t in times.items():
        lines.append(
            f"  {arm:<10} {t['sample']:7.1f}s / {t['train']:6.1f}s / {t['ess']:5.2f}s / "
            f"{t['publish']:5.2f}s;  ess-patch {t['ess_ms_per_step']:.2f} ms of a "
            f"{t['step_ms']:.1f} ms step ({100 * t['ess_share_of_step']:.1f}%) | "
            f"{t['cpu_ess_ms_per_step']:.2f} ms of {t['cpu_step_ms']:.1f} ms "
            f"({100 * t['cpu_ess_share_of_step']:.1f}%)"
        )
    return "\n".join(lines)


def _scale_to_data(ax: Any, values: Sequence[float]) -> None:
    """A y-axis that shows how far ``values`` (all <= 1) dip, with a reference line at 1.0.

    With geometric weights rho stays above ~0.95: on a 0-1 axis it is a flat line at the top.
    """
    finite = [v for v in values if math.isfinite(v)]
    low = min(finite, default=0.0)
    pad = max(0.08 * (1.0 - low), 1e-3)
    ax.set_ylim(low - pad, 1.0 + pad)
    ax.axhline(1.0, color="0.4", linestyle="--", linewidth=0.8, label="1.0 (no scaling)")


def write_figure(
    records: Sequence[dict[str, Any]], arms: Sequence[str], path: Path, title: str
) -> None:
    """Reward, rho, lr_scale and train/rollout mismatch against step, both arms (PNG)."""
    with report.figure(
        path, 4, 1, figsize=(9, 10), sharex=True, constrained_layout=True, dpi=110
    ) as (
        fig,
        axes,
    ):
        for arm in arms:
            rows = sorted((r for r in records if r["arm"] == arm), key=lambda r: r["step"])
            if not rows:
                continue
            steps = [r["step"] for r in rows]
            color = report.COLORS.get(arm)
            label = f"ESS-LR {arm}"
            rewards = [r["reward"] for r in rows]
            axes[0].plot(steps, rewards, color=color, alpha=0.25, linewidth=0.8)
            axes[0].plot(
                steps, report.smooth(rewards, report.window(len(rows))), color=color, label=label
            )
            axes[1].plot(steps, [r["rho"] for r in rows], color=color, label=label, linewidth=1)
            axes[2].plot(
                steps, [r["lr_scale"] for r in rows], color=color, label=label, linewidth=1
            )
            axes[3].plot(
                steps, [r["mismatch"] for r in rows], color=color, label=label, linewidth=1
            )
        axes[0].set_ylabel("reward\n(rollout mean)")
        axes[1].set_ylabel("rho = ESS / B")
        axes[2].set_ylabel("lr_scale\n(applied / scheduled)")
        axes[3].set_ylabel("mismatch\nmean |Δ logp|")
        axes[3].set_title("train/rollout mismatch: mean |logp_train - logp_rollout|", fontsize=9)
        for ax, key in ((axes[1], "rho"), (axes[2], "lr_scale")):
            _scale_to_data(ax, [r[key] for r in records if r["arm"] in arms])
        axes[3].set_xlabel("optimizer step (= rollout)")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend(loc="best", fontsize=8)
        fig.suptitle(title, fontsize=10)


def write_tensorboard(
    records: Sequence[dict[str, Any]], arms: Sequence[str], directory: Path
) -> bool:
    """TensorBoard event files, one run per arm (``<directory>/<arm>``), with the metric names
    the frameworks log: ``train/lr_scale``, ``train/rho_ess``, ``reward`` (and
    ``train/ess``, ``train/mismatch``, ``train/lr``). False if tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's writer needs the tensorboard package
        return False
    for arm in arms:
        rows = sorted((r for r in records if r["arm"] == arm), key=lambda r: r["step"])
        writer = SummaryWriter(log_dir=str(directory / arm))
        try:
            for r in rows:
                step = r["step"]
                writer.add_scalar("reward", r["reward"], step)
                writer.add_scalar("train/lr_scale", r["lr_scale"], step)
                writer.add_scalar("train/rho_ess", r["rho"], step)
                writer.add_scalar("train/ess", r["ess"], step)
                writer.add_scalar("train/mismatch", r["mismatch"], step)
                writer.add_scalar("train/lr", r["applied_lr"], step)
        finally:
            writer.close()
    return True
