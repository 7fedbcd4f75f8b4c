"""What every demo scenario's outputs share: the per-step JSON lines, the arms' summaries and
the collapse criterion, the smoothing window, one colour per arm and one figure frame.

The mixed scenario's own tables, figure and TensorBoard events moved to
:mod:`ess_patch.demo.scenarios.mixed` (0.5, issue 40); their names here (``format_table``,
``format_timing``, ``timing``, ``write_figure``, ``write_tensorboard``, ``TIME_FIELDS``) stay
as aliases, looked up there on first use (this module imports no scenario).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["COLORS", "ArmSummary", "collapsed", "figure", "smooth", "summarize", "write_jsonl"]

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


#: The names that moved to the mixed scenario's module (``_scale_to_data`` for the tests):
#: aliases, resolved there on first use.
_MOVED = frozenset(
    (
        "TIME_FIELDS",
        "_scale_to_data",
        "format_table",
        "format_timing",
        "timing",
        "write_figure",
        "write_tensorboard",
    )
)


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module("ess_patch.demo.scenarios.mixed"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
