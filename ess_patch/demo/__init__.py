"""``ess-patch demo``: fully-async RL of a tiny megatron-core GPTModel, ESS-LR off and on.

Needs the ``demo`` extra (megatron-core, matplotlib, tqdm; tensorboard for event files).
Nothing here is imported by ``import ess_patch``. See :mod:`ess_patch.demo.train` for what
one rank does, :mod:`ess_patch.demo.policy` for the model and its bf16 rollout engine,
:mod:`ess_patch.demo.task` for the task and the reward, and :mod:`ess_patch.demo.cpu` for the
demo-only shim that lets megatron-core run on a CPU.

Python use::

    from ess_patch.demo import DemoConfig, run
    result = run(DemoConfig(steps=50), "ess-demo-out/mine")
    print(result.table)

The ranks are forked from a forkserver, which re-imports the caller's main script: call
``run`` from under ``if __name__ == "__main__":`` in a script.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .train import ARMS, DemoConfig

__all__ = ["ARMS", "DemoConfig", "DemoResult", "quick_config", "run"]

logger = logging.getLogger(__name__)

RECORDS_FILE = "steps.jsonl"
FIGURE_FILE = "ess_demo.png"
SUMMARY_FILE = "summary.json"
TENSORBOARD_DIR = "tb"


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


def run(
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
    from . import report
    from .launch import launch

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
    report.write_figure(records, cfg.arms, figure, title)
    times = report.timing(records, cfg.arms)
    tensorboard = report.write_tensorboard(records, cfg.arms, out / TENSORBOARD_DIR)
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
        table=report.format_table(summaries),
        timing=report.format_timing(times),
        figure=figure,
        figures=(figure,),
        records_path=records_path,
        summary_path=summary_path,
        wall_s=wall,
    )
