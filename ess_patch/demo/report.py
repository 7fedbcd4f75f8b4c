"""What a demo run leaves behind: per-step JSON lines, a summary, a PNG figure."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ArmSummary",
    "collapsed",
    "format_table",
    "smooth",
    "summarize",
    "write_figure",
    "write_jsonl",
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


_COLORS = {"off": "tab:red", "on": "tab:blue"}


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
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True, constrained_layout=True)
    for arm in arms:
        rows = sorted((r for r in records if r["arm"] == arm), key=lambda r: r["step"])
        if not rows:
            continue
        steps = [r["step"] for r in rows]
        color = _COLORS.get(arm)
        label = f"ESS-LR {arm}"
        rewards = [r["reward"] for r in rows]
        axes[0].plot(steps, rewards, color=color, alpha=0.25, linewidth=0.8)
        axes[0].plot(steps, smooth(rewards, window(len(rows))), color=color, label=label)
        axes[1].plot(steps, [r["rho"] for r in rows], color=color, label=label, linewidth=1)
        axes[2].plot(steps, [r["lr_scale"] for r in rows], color=color, label=label, linewidth=1)
        axes[3].plot(steps, [r["mismatch"] for r in rows], color=color, label=label, linewidth=1)
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
