"""Start local gloo ranks with real Megatron ``parallel_state`` and collect what they return.

The tests' launcher (used through ``tests/harness.py``; the collectives benchmark imports it
too). It is not part of the package: the demo has a small launcher of its own
(:mod:`ess_patch.demo.launch`).

``launch_ranks(fn, dp=, cp=, pp=)`` starts ``dp*cp*pp`` fresh processes. Each one joins a gloo
world through a ``FileStore`` in a private run directory, calls the real
``megatron.core.parallel_state.initialize_model_parallel`` (TP=1), runs
``fn(*args, **kwargs)`` and writes its return value (``torch.save``) or its
traceback (JSON) to a per-rank file. The parent joins (with an optional overall bound) and
returns the results in global-rank order, or raises :class:`RankFailure` naming the
root-cause rank, its (dp, cp, pp) coordinates and its own traceback, preferring a rank whose
error is not just a peer's ``Connection closed by peer`` / gloo timeout. On timeout the stuck
ranks dump their Python stacks (``faulthandler`` on SIGUSR1) before being killed, and the
report names them and shows where they were.

Why forkserver: ``spawn`` re-imports torch and megatron.core in every rank (~10-20 s per launch
on 2 cores); plain ``fork`` would copy the caller (its threads, its already-initialised torch
state). A forkserver with ``torch`` and ``megatron.core.parallel_state`` preloaded forks clean
children in milliseconds. Measured on 2 cores: the first launch of a process ~3 s (it starts
the forkserver and imports torch + megatron.core once); later launches ~0.3 s for 2 ranks and
~1.4 s for 8 ranks (gloo meshes and Megatron's subgroups). The forkserver is shared by every
launch of the process.

Children get the parent's ``sys.path`` and working directory (multiprocessing's preparation
data), so ``fn`` must be a module-level function of a module importable from ``sys.path``.
``launch_ranks`` checks this up front; lambdas, closures and ``__main__`` functions are refused
with a clear error. ``args``/``kwargs`` and results travel through ``torch.save`` files in the
run directory (tensors are fine, process groups are not: return plain data). Each rank's
stdout/stderr goes to ``rank<r>.log`` in the run directory; the tail of a failed rank's log
is part of the report.

Gloo timeouts: a rank that raises exits at once (``os._exit``), so peers blocked in a collective
with it get ``Connection closed by peer`` within milliseconds. The gloo timeout
(``collective_timeout``) only matters for a peer that is alive but never joins; it is passed
both to ``init_process_group`` and to Megatron's subgroups (its ``distributed_timeout_minutes``
is turned into a ``timedelta`` and accepts fractions). After the first rank fails, the others
get ``fail_grace`` seconds to report their own error, then are killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import importlib
import importlib.machinery
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = [
    "RankFailure",
    "RankLayout",
    "launch_ranks",
    "layout",
    "rank_coords",
    "run_dir",
]

PRELOAD = ("torch", "megatron.core", "megatron.core.parallel_state")

# Default seconds the surviving ranks get to write their own error after the first one failed.
FAIL_GRACE_S = 5.0
# Seconds a stuck rank gets to dump its stack (SIGUSR1 -> faulthandler) before SIGKILL.
STACK_DUMP_S = 0.5
_LOG_TAIL_LINES = 40

# Substrings of errors that a rank gets because a *peer* died or hung, not because its own
# code is wrong. Matched case-insensitively against "<type>: <message>".
_PEER_ERROR_MARKERS = (
    "connection closed by peer",
    "connection reset",
    "connection refused",
    "broken pipe",
    "timed out",
    "timeout",
    "gloo",
    "distbackenderror",
    "distnetworkerror",
    "diststoreerror",
    "socket",
)

_ENV_RUN_DIR = "ESS_HARNESS_RUN_DIR"
# Megatron warns once per rank that it runs without Transformer Engine / Apex (always, on CPU).
_QUIET_WARNINGS = "ignore:Transformer Engine and Apex are not installed:UserWarning"


class RankFailure(RuntimeError):
    """A rank raised, died or did not finish in time. The message carries the root cause."""


# --------------------------------------------------------------------------------------------
# Layout helpers (usable in the parent and, for ``layout()``, inside a rank)
# --------------------------------------------------------------------------------------------


def rank_coords(rank: int, *, dp: int, cp: int, pp: int) -> tuple[int, int, int]:
    """``(dp_rank, cp_rank, pp_rank)`` of a global rank for TP=1.

    Megatron's default order ``tp-cp-ep-dp-pp`` makes CP the fastest-varying dimension and PP
    the slowest: ``rank = cp_rank + cp * (dp_rank + dp * pp_rank)``. ``test_harness`` checks this
    against the real ``parallel_state`` getters.
    """
    if not 0 <= rank < dp * cp * pp:
        raise ValueError(f"rank {rank} outside world of {dp * cp * pp}")
    return (rank // cp) % dp, rank % cp, rank // (cp * dp)


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """This rank's place in the Megatron layout and its process groups (not picklable)."""

    rank: int
    world_size: int
    dp_rank: int
    cp_rank: int
    pp_rank: int
    dp_size: int
    cp_size: int
    pp_size: int
    dp_group: Any  # DP without CP: get_data_parallel_group(with_context_parallel=False)
    cp_group: Any
    pp_group: Any

    @property
    def coords(self) -> tuple[int, int, int]:
        """``(dp_rank, cp_rank, pp_rank)``: plain data, safe to return from a rank."""
        return (self.dp_rank, self.cp_rank, self.pp_rank)

    @property
    def is_pp_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def layout() -> RankLayout:
    """Inside a rank: coordinates and groups, read through the real ``parallel_state`` getters."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return RankLayout(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        dp_rank=ps.get_data_parallel_rank(with_context_parallel=False),
        cp_rank=ps.get_context_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(with_context_parallel=False),
        cp_size=ps.get_context_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_group=ps.get_data_parallel_group(with_context_parallel=False),
        cp_group=ps.get_context_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
    )


def run_dir() -> Path:
    """Inside a rank: the run's private directory (shared by all ranks of this launch)."""
    return Path(os.environ[_ENV_RUN_DIR])


# --------------------------------------------------------------------------------------------
# Child side
# --------------------------------------------------------------------------------------------


def _resolve(module: str, qualname: str) -> Callable[..., Any]:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _is_peer_error(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(marker in text for marker in _PEER_ERROR_MARKERS)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _rank_main(
    rank: int,
    dp: int,
    cp: int,
    pp: int,
    directory: str,
    target: tuple[str, str],
    collective_timeout: float,
    gloo_groups: bool,
) -> None:
    """Entry point of one rank (runs in a forkserver child)."""
    d = Path(directory)
    world = dp * cp * pp
    # Own log file for stdout/stderr: the forkserver's fds belong to whichever pytest capture
    # was active when it started. faulthandler on SIGUSR1 lets the parent ask a stuck rank
    # where it is before killing it.
    log_fd = os.open(d / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ[_ENV_RUN_DIR] = directory

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    try:
        fn = _resolve(*target)
        args, kwargs = torch.load(d / "args.pt", weights_only=False)
        timeout = timedelta(seconds=collective_timeout)
        store = dist.FileStore(str(d / "store"), world)
        store.set_timeout(timeout)
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store, timeout=timeout)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            distributed_timeout_minutes=collective_timeout / 60.0,
            create_gloo_process_groups=gloo_groups,
        )
        result = fn(*args, **kwargs)
        buf = d / f"rank{rank}.result.pt"
        torch.save(result, buf.with_name(buf.name + ".tmp"))
        os.replace(buf.with_name(buf.name + ".tmp"), buf)
    except BaseException as exc:
        report = {
            "rank": rank,
            "time": time.time(),
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": str(exc),
            "peer_error": _is_peer_error(exc),
            "traceback": traceback.format_exc(),
        }
        _atomic_write_bytes(d / f"rank{rank}.error.json", json.dumps(report).encode())
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # Exit now, without tearing groups down: peers blocked in a collective with this rank
        # see the closed sockets at once instead of waiting for the gloo timeout.
        os._exit(1)
    # Success: the result is on disk; teardown problems must not turn it into a failure.
    try:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    except Exception:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


def _check_target(fn: Callable[..., Any]) -> tuple[str, str]:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        raise TypeError(
            f"run_ranks needs a module-level function the ranks can import by name, got {fn!r}"
        )
    try:
        resolved = _resolve(module, qualname)
    except (ImportError, AttributeError) as exc:
        raise TypeError(f"{module}.{qualname} is not importable by name: {exc}") from exc
    if resolved is not fn:
        raise TypeError(f"{module}.{qualname} does not resolve to {fn!r}")
    # The children import it afresh (not from sys.modules): make sure the import system can
    # find the top-level package (pytest's importlib import mode would hide it). The finders
    # on sys.meta_path are the children's too: sys.path, and the finder pip's editable
    # install registers from a .pth (a `pip install -e .` checkout is not on sys.path).
    top = module.partition(".")[0]
    if top not in sys.builtin_module_names and not _findable(top):
        raise TypeError(
            f"module {top!r} (of {module}.{qualname}) is not on sys.path, so ranks cannot import"
            " it; run pytest with the default 'prepend' import mode or add its directory"
        )
    return module, qualname


def _findable(top: str) -> bool:
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            if find_spec(top, None) is not None:
                return True
        except (ImportError, ValueError, TypeError):  # a finder that cannot answer: next
            continue
    return False


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
    """The forkserver context, with the server running (started once per process).

    The server, and so every rank, inherits the environment it was started with: one thread
    per rank (a few cores are shared by all ranks) and no megatron "no Transformer Engine"
    warnings.
    """
    ctx = multiprocessing.get_context("forkserver")
    from multiprocessing import forkserver

    ctx.set_forkserver_preload(list(PRELOAD))  # no effect once the server runs
    warnings = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), _QUIET_WARNINGS]))
    with _env(OMP_NUM_THREADS="1", PYTHONWARNINGS=warnings):
        forkserver.ensure_running()
    return ctx


def _tail(path: Path, n: int = _LOG_TAIL_LINES) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def _pick_root_cause(errors: dict[int, dict[str, Any]]) -> int:
    """The rank to blame: earliest own error, else earliest peer-caused error."""
    own = [r for r, e in errors.items() if not e["peer_error"]]
    pool = own or list(errors)
    return min(pool, key=lambda r: (errors[r]["time"], r))


def _report(
    *,
    dp: int,
    cp: int,
    pp: int,
    d: Path,
    exitcodes: dict[int, int | None],
    errors: dict[int, dict[str, Any]],
    killed: list[int],
    timed_out: bool,
    elapsed: float,
    timeout: float | None,
    fail_grace: float,
    label: str,
) -> str:
    world = dp * cp * pp

    def who(r: int) -> str:
        c = rank_coords(r, dp=dp, cp=cp, pp=pp)
        return f"rank {r} (dp={c[0]}, cp={c[1]}, pp={c[2]})"

    lines = [f"{label} failed after {elapsed:.1f}s; logs in {d}"]
    if timed_out:
        lines.append(
            f"TIMEOUT: did not finish within {timeout:g}s (killed): "
            + ", ".join(who(r) for r in killed)
        )
    silent = [
        r
        for r in range(world)
        if r not in errors
        and r not in killed
        and not (exitcodes.get(r) == 0 and (d / f"rank{r}.result.pt").exists())
    ]
    root = _pick_root_cause(errors) if errors else None
    if root is not None and not errors[root]["peer_error"]:
        pass  # a rank's own exception: the root cause, shown below
    elif silent:
        lines.append(
            "ROOT CAUSE (likely): "
            + ", ".join(f"{who(r)} died with exit code {exitcodes.get(r)}" for r in silent)
            + " without a Python exception (os._exit, signal, OOM kill, or it failed before"
            " the launcher's entry point: see its log tail below)"
        )
    elif killed and not timed_out:
        lines.append(
            "ROOT CAUSE (likely): still running after the others failed: "
            + ", ".join(who(r) for r in killed)
            + " (see where it was stuck in its log tail below)"
        )
    if root is not None:
        e = errors[root]
        kind = "only peer/collective errors were seen" if e["peer_error"] else "root cause"
        lines.append(f"{who(root)} raised {e['type']}: {e['message']}   [{kind}]")
        lines.append(f"--- traceback of rank {root} ---")
        lines.append(e["traceback"].rstrip())
    lines.append("--- all ranks ---")
    for r in range(world):
        if r in errors:
            status = f"raised {errors[r]['type']}: {errors[r]['message'][:300]}"
        elif r in killed:
            status = (
                "killed: still running at the timeout"
                if timed_out
                else f"killed: still running {fail_grace:g}s after another rank failed"
            )
        elif r in silent:
            status = f"died with exit code {exitcodes.get(r)} and no result or error file"
        else:
            status = "ok"
        lines.append(f"{who(r)}: {status}")
    for r in sorted({*killed, *silent}):
        lines.append(f"--- log tail of rank {r} ({d / f'rank{r}.log'}) ---")
        lines.append(
            _tail(d / f"rank{r}.log")
            or "(empty: if it died before the launcher's entry point, e.g. unpickling its target"
            " failed, the traceback went to the forkserver's stderr, i.e. the test's output)"
        )
    return "\n".join(lines)


def launch_ranks(
    fn: Callable[..., Any],
    *,
    dp: int = 1,
    cp: int = 1,
    pp: int = 1,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    directory: Path | str | None = None,
    timeout: float | None = 60.0,
    collective_timeout: float | None = None,
    fail_grace: float = FAIL_GRACE_S,
    gloo_groups: bool = False,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``dp*cp*pp`` fresh gloo ranks (TP=1).

    Returns each rank's return value, in global-rank order. Raises :class:`RankFailure` if
    any rank raised, died, or was still running ``timeout`` seconds after the launch (None: no
    bound); the message names the root-cause rank with its (dp, cp, pp) coordinates and its
    traceback.

    ``directory``: the run directory (created; kept for inspection); default a temporary one,
    removed afterwards. ``collective_timeout``: gloo timeout in seconds (default
    ``timeout / 2``, or 300 s without a bound). ``gloo_groups``: forwarded as Megatron's
    ``create_gloo_process_groups`` (off: the world is gloo already, the duplicates only slow
    the launch).
    """
    for name, size in (("dp", dp), ("cp", cp), ("pp", pp)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    target = _check_target(fn)
    world = dp * cp * pp
    if collective_timeout is None:
        collective_timeout = 300.0 if timeout is None else max(timeout / 2.0, 1.0)
    label = f"run_ranks({'.'.join(target)}, dp={dp}, cp={cp}, pp={pp})"

    import torch

    with contextlib.ExitStack() as stack:
        if directory is None:
            d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="run_ranks-")))
        else:
            d = Path(directory)
            d.mkdir(parents=True, exist_ok=True)
        torch.save((tuple(args), dict(kwargs or {})), d / "args.pt")

        ctx = _context()
        start = time.monotonic()
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    r,
                    dp,
                    cp,
                    pp,
                    str(d),
                    target,
                    collective_timeout,
                    gloo_groups,
                ),
                name=f"rank{r}",
                # Not daemonic: rank code may start its own worker processes (torch.compile
                # pools); the finally below kills every rank on any way out of the join.
                daemon=False,
            )
            for r in range(world)
        ]
        deadline = None if timeout is None else start + timeout
        try:
            for p in procs:
                p.start()
            killed, timed_out = _join(procs, deadline, fail_grace)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5.0)
        elapsed = time.monotonic() - start
        with contextlib.suppress(OSError):
            (d / "store").unlink()

        exitcodes = {r: procs[r].exitcode for r in range(world)}
        errors: dict[int, dict[str, Any]] = {}
        for r in range(world):
            path = d / f"rank{r}.error.json"
            if path.exists():
                errors[r] = json.loads(path.read_text())
        missing = [r for r in range(world) if not (d / f"rank{r}.result.pt").exists()]
        bad_exit = [r for r in range(world) if exitcodes[r] != 0]
        if errors or killed or missing or bad_exit:
            raise RankFailure(
                _report(
                    dp=dp,
                    cp=cp,
                    pp=pp,
                    d=d,
                    exitcodes=exitcodes,
                    errors=errors,
                    killed=killed,
                    timed_out=timed_out,
                    elapsed=elapsed,
                    timeout=timeout,
                    fail_grace=fail_grace,
                    label=label,
                )
            )
        # Our own files, written by our own ranks in this run (results may be any picklable).
        return [torch.load(d / f"rank{r}.result.pt", weights_only=False) for r in range(world)]


def _join(
    procs: list[Any],
    deadline: float | None,
    fail_grace: float,
) -> tuple[list[int], bool]:
    """Wait for all ranks; returns ``(killed ranks, whether the overall bound ran out)``.

    Once a rank has failed, the rest get ``fail_grace`` seconds to finish or report their own
    error, then are killed (they are normally already dying of closed connections).
    """
    alive = {p.sentinel: r for r, p in enumerate(procs)}
    first_failure: float | None = None
    while alive:
        now = time.monotonic()
        limits = [] if deadline is None else [deadline]
        if first_failure is not None:
            limits.append(first_failure + fail_grace)
        limit = min(limits, default=None)
        if limit is not None and now >= limit:
            break
        wait_s = None if limit is None else limit - now
        ready = multiprocessing.connection.wait(list(alive), timeout=wait_s)
        for sentinel in ready:
            r = alive.pop(sentinel)
            procs[r].join()
            if procs[r].exitcode != 0 and first_failure is None:
                first_failure = time.monotonic()
    remaining = sorted(alive.values())
    timed_out = bool(remaining) and deadline is not None and time.monotonic() >= deadline
    for r in remaining:  # ask for a stack dump (faulthandler), then kill
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    if remaining:
        time.sleep(STACK_DUMP_S)
    for r in remaining:
        procs[r].kill()
    return remaining, timed_out
