"""What a demo run leaves behind: per-step JSON lines, a summary, figures, TensorBoard events,
and where the time went."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "COLORS",
    "ArmSummary",
    "collapsed",
    "format_table",
    "format_timing",
    "smooth",
    "summarize",
    "timing",
    "write_figure",
    "write_jsonl",
    "write_tensorboard",
]

#: Collapse criterion: at the end, the smoothed reward has given back more than this
#: fraction of its peak gain over the start (or a value went non-finite).
COLLAPSE_GIVEBACK = 0.5
#: Peak gains below this are noise: a run that never learned cannot collapse.
MIN_GAIN = 0.05


@dataclass(frozen=True)
class ArmSummary:
    arm: str
    steps: int
    start_reward: float  # smoothed, first window
    final_reward: float  # smoothed, last window
    best_reward: float  # best smoothed value
    min_rho: float
    scaled_steps: int  # steps whose applied LR was below the scheduled one
    scaled_fraction: float  # scaled_steps / steps
    mean_lr_scale: float
    collapsed: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def window(steps: int) -> int:
    """Moving-average window for rewards: 5% of the run, at least 1, at most 20 steps."""
    return max(1, min(20, steps // 20))


def smooth(values: Sequence[float], w: int) -> list[float]:
    """Trailing moving average (shorter at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= w:
            acc -= values[i - w]
        out.append(acc / min(i + 1, w))
    return out


def collapsed(rewards: Sequence[float]) -> bool:
    """The stated collapse criterion (see :data:`COLLAPSE_GIVEBACK`)."""
    if not rewards or not all(math.isfinite(r) for r in rewards):
        return bool(rewards)
    s = smooth(rewards, window(len(rewards)))
    start, peak, end = s[min(len(s), window(len(s))) - 1], max(s), s[-1]
    gain = peak - start
    return gain >= MIN_GAIN and end < peak - COLLAPSE_GIVEBACK * gain


def summarize(records: Sequence[dict[str, Any]], arms: Sequence[str]) -> list[ArmSummary]:
    out = []
    for arm in arms:
        rows = sorted((r for r in records if r["arm"] == arm), key=lambda r: r["step"])
        rewards = [r["reward"] for r in rows]
        s = smooth(rewards, window(len(rows))) if rows else [math.nan]
        scales = [r["lr_scale"] for r in rows]
        scaled = [r for r in rows if r["applied_lr"] < r["scheduled_lr"] * (1 - 1e-9)]
        out.append(
            ArmSummary(
                arm=arm,
                steps=len(rows),
                start_reward=s[min(len(s), window(len(s))) - 1],
                final_reward=s[-1],
                best_reward=max(s),
                min_rho=min((r["rho"] for r in rows), default=math.nan),
                scaled_steps=len(scaled),
                scaled_fraction=len(scaled) / len(rows) if rows else math.nan,
                mean_lr_scale=sum(scales) / len(scales) if scales else math.nan,
                collapsed=collapsed(rewards),
            )
        )
    return out


def format_table(summaries: Sequence[ArmSummary]) -> str:
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


def write_jsonl(records: Sequence[dict[str, Any]], path: Path) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


#: One colour per arm, for every scenario's figures.
COLORS = {
    "sync": "black",
    "off": "tab:red",
    "on": "tab:pink",
    "product": "tab:blue",
    "geometric": "tab:green",
    "calibrated": "tab:cyan",
    "constant": "0.5",
    "baseline": "tab:purple",
    "ess+baseline": "tab:orange",
    "proxy": "tab:olive",
    "ess+proxy": "gold",
    "vcpo": "tab:brown",
}
#: Per-step time fields the ranks record (the writer rank's own clock).
TIME_FIELDS = ("time_sample_s", "time_train_s", "time_ess_s", "time_publish_s")


@contextlib.contextmanager
def figure(path: Path, *args: Any, dpi: int = 110, **kwargs: Any) -> Iterator[tuple[Any, Any]]:
    """Every demo figure's frame: matplotlib without a display, ``plt.subplots(*args,
    **kwargs)``, saved to ``path`` as PNG at ``dpi`` when the block ends, closed always."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*args, **kwargs)
    try:
        yield fig, axes
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


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
    with figure(path, 4, 1, figsize=(9, 10), sharex=True, constrained_layout=True, dpi=110) as (
        fig,
        axes,
    ):
        for arm in arms:
            rows = sorted((r for r in records if r["arm"] == arm), key=lambda r: r["step"])
            if not rows:
                continue
            steps = [r["step"] for r in rows]
            color = COLORS.get(arm)
            label = f"ESS-LR {arm}"
            rewards = [r["reward"] for r in rows]
            axes[0].plot(steps, rewards, color=color, alpha=0.25, linewidth=0.8)
            axes[0].plot(steps, smooth(rewards, window(len(rows))), color=color, label=label)
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
