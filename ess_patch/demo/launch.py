"""Start the demo's ranks as local processes (gloo) and collect what they recorded.

The package's one launcher (:mod:`ess_patch._launch`: forkserver with torch and megatron-core
preloaded, gloo world, megatron's real ``parallel_state.initialize_model_parallel`` with the
requested DP x CP x PP layout, TP = 1) runs :func:`ess_patch.demo.train.run_rank` on every
rank. Each rank logs to ``<out>/ranks/rank<r>.log``. A rank that fails exits at once; the
others are stopped and :class:`DemoError` carries the root-cause rank's traceback.
"""

from __future__ import annotations

import logging
import queue as queue_module
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import _launch
from .train import DemoConfig

__all__ = ["DemoError", "launch"]

logger = logging.getLogger(__name__)

PRELOAD = (
    *_launch.PRELOAD,
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "ess_patch.demo.train",
)
#: Seconds a gloo collective may wait for a peer that is alive but never joins.
COLLECTIVE_TIMEOUT_S = 300.0
#: Seconds the other ranks get to report their own error after the first one failed.
FAIL_GRACE_S = 3.0


class DemoError(RuntimeError):
    """A demo rank failed; the message names it and carries its traceback."""


def _demo_rank(cfg: DemoConfig, progress: Any) -> list[dict[str, Any]] | None:
    """Entry point of one rank: train, then flush the progress queue before exiting."""
    from .train import run_rank

    records = run_rank(cfg, progress)
    progress.close()
    progress.join_thread()
    return records


def launch(
    cfg: DemoConfig,
    out_dir: Path,
    *,
    on_step: Callable[[str, int], None] | None = None,
) -> list[dict[str, Any]]:
    """Run the demo's ranks; returns the per-step records of all arms.

    ``on_step(arm, step)`` is called in this process after each recorded step.

    Raises:
        DemoError: a rank raised or died (the message holds its traceback and log tail).
    """
    rank_dir = Path(out_dir) / "ranks"
    rank_dir.mkdir(parents=True, exist_ok=True)
    for stale in rank_dir.glob("*"):
        stale.unlink()
    ctx = _launch.context(PRELOAD)
    progress = ctx.Queue()

    def drain() -> None:
        while True:
            try:
                arm_name, step = progress.get_nowait()
            except (queue_module.Empty, OSError, ValueError):
                return
            if on_step is not None:
                on_step(arm_name, step)

    logger.info(
        "starting %d ranks (dp=%d cp=%d pp=%d), logs in %s",
        cfg.world_size,
        cfg.dp,
        cfg.cp,
        cfg.pp,
        rank_dir,
    )
    try:
        results = _launch.launch_ranks(
            _demo_rank,
            dp=cfg.dp,
            cp=cfg.cp,
            pp=cfg.pp,
            args=(cfg,),
            inherit=(progress,),
            directory=rank_dir,
            timeout=None,
            collective_timeout=COLLECTIVE_TIMEOUT_S,
            fail_grace=FAIL_GRACE_S,
            preload=PRELOAD,
            log_level=logging.INFO,
            poll=drain,
            label=f"ess-patch demo (dp={cfg.dp} cp={cfg.cp} pp={cfg.pp})",
        )
    except _launch.RankFailure as exc:
        raise DemoError(str(exc)) from None
    finally:
        progress.close()
    for r in range(cfg.world_size):  # plain data, now in the returned records
        (rank_dir / f"rank{r}.result.pt").unlink(missing_ok=True)
    (rank_dir / "args.pt").unlink(missing_ok=True)
    return next(r for r in results if r is not None)
