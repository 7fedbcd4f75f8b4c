"""Start the demo's ranks as local processes and collect what they recorded.

Each rank is a forkserver child (torch and megatron-core preloaded once: a launch costs
milliseconds, not a fresh import per rank) that joins a gloo world (NCCL with
``device="cuda"``: one GPU per rank) through a ``FileStore``, sets up megatron's real
``parallel_state.initialize_model_parallel`` with the requested DP x TP x PP layout and runs
:func:`ess_patch.demo.trainer.loop.run_rank`. Each rank logs to ``<out>/ranks/rank<r>.log``.
A rank that raises writes its traceback next to its log and exits at once (its peers then
fail fast on the closed connections); the others get :data:`FAIL_GRACE_S` seconds, then are stopped,
and :class:`DemoError` carries the traceback of the rank that failed first.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue as queue_module
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..errors import EssPatchError
from .trainer.config import DemoConfig

__all__ = ["DemoError", "launch"]

logger = logging.getLogger(__name__)

PRELOAD = (
    "torch",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel",
    "ess_patch.demo.trainer.loop",
)
#: Seconds a gloo collective may wait for a peer that is alive but never joins.
COLLECTIVE_TIMEOUT_S = 300.0
#: Seconds the other ranks get to report their own error after the first one failed.
FAIL_GRACE_S = 3.0
_LOG_TAIL_LINES = 40
# Megatron warns once per process that it runs without Transformer Engine / Apex (always, on
# CPU); the forkserver's preload writes to this terminal.
_QUIET_WARNINGS = ",".join(
    f"ignore:{message}:UserWarning"
    for message in ("Transformer Engine and Apex are not installed", "Apex is not installed")
)


class DemoError(EssPatchError, RuntimeError):
    """A demo rank failed; the message names it and carries its traceback."""


def _rank_main(rank: int, cfg: DemoConfig, directory: str, progress: Any) -> None:
    """Entry point of one rank (a forkserver child): train, write the records or the error."""
    d = Path(directory)
    # the forkserver's fds are whatever its starter had: each rank writes its own log
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
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from .trainer.loop import run_rank

    torch.set_num_threads(1)
    try:
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store = dist.FileStore(str(d / "store"), cfg.world_size)
        store.set_timeout(timeout)
        backend = "gloo"
        if cfg.device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            backend = "nccl"
        dist.init_process_group(
            backend, rank=rank, world_size=cfg.world_size, store=store, timeout=timeout
        )
        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tp,
            pipeline_model_parallel_size=cfg.pp,
            distributed_timeout_minutes=COLLECTIVE_TIMEOUT_S / 60.0,
            create_gloo_process_groups=False,
        )
        records = run_rank(cfg, progress)
        progress.close()
        progress.join_thread()  # the last steps reach the parent before this rank exits
        _write(d / f"rank{rank}.result.pkl", pickle.dumps(records))
    except BaseException:
        _write(d / f"rank{rank}.error.txt", traceback.format_exc().encode())
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # exit now, without tearing the groups down: peers blocked in a collective with
        # this rank see the closed sockets at once instead of waiting for the gloo timeout
        os._exit(1)
    try:  # the records are on disk: teardown problems must not turn them into a failure
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    except Exception:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _context() -> Any:
    """The forkserver context, its server started once per process with one thread per
    rank and megatron's "no Transformer Engine" warning silenced (the ranks inherit its
    environment)."""
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # no effect once the server runs
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONWARNINGS")}
    warnings = ",".join(filter(None, [saved["PYTHONWARNINGS"], _QUIET_WARNINGS]))
    os.environ.update(OMP_NUM_THREADS="1", PYTHONWARNINGS=warnings)
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ctx


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
    ctx = _context()
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
        "starting %d ranks (dp=%d tp=%d pp=%d), logs in %s",
        cfg.world_size,
        cfg.dp,
        cfg.tp,
        cfg.pp,
        rank_dir,
    )
    procs = [
        ctx.Process(target=_rank_main, args=(r, cfg, str(rank_dir), progress), name=f"rank{r}")
        for r in range(cfg.world_size)
    ]
    try:
        for p in procs:
            p.start()
        _join(procs, drain)
    finally:
        for p in procs:  # on any way out (an error, Ctrl-C): no rank outlives the launch
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5.0)
        drain()
        progress.close()
        with contextlib.suppress(OSError):
            (rank_dir / "store").unlink()
    failed = _failure(procs, rank_dir, cfg)
    if failed:
        raise DemoError(failed)
    results = []
    for r in range(cfg.world_size):
        path = rank_dir / f"rank{r}.result.pkl"
        results.append(pickle.loads(path.read_bytes()))  # our ranks' own files, this run
        path.unlink()
    return next(r for r in results if r is not None)


def _join(procs: list[Any], poll: Callable[[], None]) -> None:
    """Wait for every rank, calling ``poll`` every 0.2 s; once one has failed, the rest get
    :data:`FAIL_GRACE_S` seconds (the caller kills what is left)."""
    alive = {p.sentinel: p for p in procs}
    first_failure: float | None = None
    while alive:
        if first_failure is not None and time.monotonic() >= first_failure + FAIL_GRACE_S:
            return
        for sentinel in multiprocessing.connection.wait(list(alive), timeout=0.2):
            p = alive.pop(sentinel)
            p.join()
            if p.exitcode != 0 and first_failure is None:
                first_failure = time.monotonic()
        poll()


def _failure(procs: list[Any], rank_dir: Path, cfg: DemoConfig) -> str:
    """The report of a failed launch ("" if every rank finished with its records): the
    traceback of the rank whose error was written first (its peers' errors come after:
    they fail on its closed connections), else the log of a rank that died without one."""
    errors = sorted(rank_dir.glob("rank*.error.txt"), key=lambda p: p.stat().st_mtime)
    unfinished = [
        r
        for r, p in enumerate(procs)
        if p.exitcode != 0 or not (rank_dir / f"rank{r}.result.pkl").exists()
    ]
    if not errors and not unfinished:
        return ""
    label = f"ess-patch demo (dp={cfg.dp} tp={cfg.tp} pp={cfg.pp}) failed; logs in {rank_dir}"
    if errors:
        rank = errors[0].name.removeprefix("rank").removesuffix(".error.txt")
        return f"{label}\n--- rank {rank} failed first ---\n{errors[0].read_text()}"
    r = unfinished[0]
    try:
        log = (rank_dir / f"rank{r}.log").read_text(errors="replace")
    except OSError:  # it died before its entry point: the forkserver's stderr has the reason
        log = "(no log: it died before the demo's entry point; see this process's stderr)"
    tail = "\n".join(log.splitlines()[-_LOG_TAIL_LINES:])
    return (
        f"{label}\n--- rank {r} exited with code {procs[r].exitcode} and no records "
        f"(killed, or it died without a Python exception); log tail ---\n{tail}"
    )
