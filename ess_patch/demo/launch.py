"""Start the demo's ranks as local processes (gloo) and collect what they recorded.

A forkserver with torch and megatron-core preloaded forks the ranks (one import instead of
one per rank). Each rank logs to ``<out>/ranks/rank<r>.log``, joins a gloo world through a
``FileStore``, runs megatron's real ``parallel_state.initialize_model_parallel`` with the
requested DP x CP x PP layout (TP = 1) and calls :func:`ess_patch.demo.train.run_rank`.
A rank that fails writes its traceback and exits at once; the launcher then stops the others
and raises :class:`DemoError` with that rank's traceback.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import multiprocessing
import os
import queue as queue_module
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .train import DemoConfig

__all__ = ["DemoError", "launch"]

logger = logging.getLogger(__name__)

PRELOAD = [
    "torch",
    "megatron.core.parallel_state",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "ess_patch.demo.train",
]
#: Seconds a gloo collective may wait for a peer that is alive but never joins.
COLLECTIVE_TIMEOUT_S = 300.0
#: Seconds the other ranks get to report their own error after the first one failed.
FAIL_GRACE_S = 3.0
_QUIET_WARNINGS = "ignore:Transformer Engine and Apex are not installed:UserWarning"


class DemoError(RuntimeError):
    """A demo rank failed; the message names it and carries its traceback."""


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    from multiprocessing import forkserver

    ctx.set_forkserver_preload(PRELOAD)  # no effect if a forkserver already runs
    # The server (and so every rank) inherits this environment: one thread per rank on a
    # laptop's few cores, and no megatron "no Transformer Engine" warnings on the console.
    warnings = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), _QUIET_WARNINGS]))
    with _env(OMP_NUM_THREADS="1", PYTHONWARNINGS=warnings):
        forkserver.ensure_running()
    return ctx


def _rank_main(rank: int, cfg: DemoConfig, rank_dir: str, store: str, progress: Any) -> None:
    """Entry point of one rank (a forkserver child)."""
    d = Path(rank_dir)
    log_fd = os.open(d / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s",
        force=True,
    )
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from .train import run_rank

    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        file_store = dist.FileStore(store, cfg.world_size)
        file_store.set_timeout(timeout)
        dist.init_process_group(
            "gloo", rank=rank, world_size=cfg.world_size, store=file_store, timeout=timeout
        )
        ps.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=cfg.pp,
            context_parallel_size=cfg.cp,
            distributed_timeout_minutes=COLLECTIVE_TIMEOUT_S / 60.0,
            create_gloo_process_groups=False,
        )
        records = run_rank(cfg, progress)
        if records is not None:
            path = d / "records.json"
            path.with_suffix(".tmp").write_text(json.dumps(records))
            os.replace(path.with_suffix(".tmp"), path)
    except BaseException:
        (d / f"rank{rank}.error.txt").write_text(traceback.format_exc())
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # peers blocked on this rank see closed sockets at once
    try:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    except Exception:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    if progress is not None:
        progress.close()
        progress.join_thread()


def launch(
    cfg: DemoConfig,
    out_dir: Path,
    *,
    on_step: Callable[[str, int], None] | None = None,
) -> list[dict[str, Any]]:
    """Run the demo's ranks; returns the per-step records of both arms.

    ``on_step(arm, step)`` is called in this process after each recorded step.

    Raises:
        DemoError: a rank raised or died (the message holds its traceback and log tail).
    """
    rank_dir = Path(out_dir) / "ranks"
    rank_dir.mkdir(parents=True, exist_ok=True)
    for stale in rank_dir.glob("*"):
        stale.unlink()
    ctx = _context()
    progress = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="ess-demo-store-")
    store = os.path.join(store_dir, "store")
    logger.info(
        "starting %d ranks (dp=%d cp=%d pp=%d), logs in %s",
        cfg.world_size,
        cfg.dp,
        cfg.cp,
        cfg.pp,
        rank_dir,
    )
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, cfg, str(rank_dir), store, progress),
            name=f"ess-demo-rank{r}",
            daemon=True,
        )
        for r in range(cfg.world_size)
    ]
    try:
        for p in procs:
            p.start()
        _wait(procs, progress, on_step)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5.0)
        progress.close()
        shutil.rmtree(store_dir, ignore_errors=True)
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise DemoError(_failure_report(failed, procs, rank_dir))
    return json.loads((rank_dir / "records.json").read_text())


def _wait(procs: list[Any], progress: Any, on_step: Callable[[str, int], None] | None) -> None:
    """Feed progress until every rank exits; stop waiting soon after one rank failed."""
    failed_at: float | None = None
    while True:
        try:
            arm_name, step = progress.get(timeout=0.2)
        except queue_module.Empty:
            pass
        else:
            if on_step is not None:
                on_step(arm_name, step)
            continue
        alive = [p for p in procs if p.is_alive()]
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if not alive or (failed_at is not None and time.monotonic() - failed_at > FAIL_GRACE_S):
            break
    while True:  # drain what was sent just before the ranks exited
        try:
            arm_name, step = progress.get_nowait()
        except (queue_module.Empty, OSError, ValueError):
            break
        if on_step is not None:
            on_step(arm_name, step)


def _failure_report(failed: list[int], procs: list[Any], rank_dir: Path) -> str:
    errors = {r: rank_dir / f"rank{r}.error.txt" for r in failed}
    with_tb = [r for r in failed if errors[r].exists()]
    # Prefer a rank whose error is its own, not a peer's closed connection.
    own = [r for r in with_tb if "connection closed" not in errors[r].read_text().lower()]
    root = (own or with_tb or failed)[0]
    lines = [
        "ess-patch demo: rank(s) "
        + ", ".join(f"{r} (exit {procs[r].exitcode})" for r in failed)
        + f" failed; logs in {rank_dir}",
    ]
    if errors[root].exists():
        lines.append(f"--- rank {root} traceback ---")
        lines.append(errors[root].read_text().rstrip())
    else:
        log = rank_dir / f"rank{root}.log"
        tail = log.read_text(errors="replace").splitlines()[-30:] if log.exists() else []
        lines.append(f"--- rank {root} log tail ---")
        lines.extend(tail)
    return "\n".join(lines)
