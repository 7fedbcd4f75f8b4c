"""GPU readiness benchmark: ``python -m benchmarks.gpu [--out FILE] [--device cuda] [--quick]``.

On a machine with one CUDA GPU (sized to finish well within 5 minutes: an estimate, never
measured), four sections:

1. ``compute_ess_lr`` at 1 M / 8 M / 33 M tokens with fp32 and bf16 log-probs: best wall
   time, aten ops dispatched, CUDA kernels (device activities seen by ``torch.profiler``)
   and host synchronisations (``torch.cuda.set_sync_debug_mode("warn")`` warnings, and the
   host reads the dispatch modes of ``benchmarks.common`` see, on any device).
2. The collectives a rollout issues, on the 1-rank groups of a one-GPU NCCL world (megatron
   ``parallel_state``): CP envelope all-gather, CP all-reduce of the ``[B, 3]`` float64
   trajectory table, DP all-gather of the summary + envelope row, PP all-gather of the
   envelope + result row. ess_patch skips every one of them on a 1-rank group, so each is
   timed twice: the ess_patch call as it runs there (expected: no copy, kernel or
   collective; a reshape at most), and
   the transfers + collective it issues on a group of more than one rank, run on the
   1-rank group (the NCCL launch and copies, no network).
3. ``optimizer.step()`` of a real megatron-core ``DistributedOptimizer`` (bf16 params, fp32
   main params, Adam, grad clipping): unpatched, unpatched again (control: the noise floor),
   ess_patch installed but disarmed, armed with scale 0.5. Time per step, and the aten
   ops / kernels / host syncs each variant adds over unpatched (expected: zero).
4. VCPO's baseline on Transformer Engine layers (``benchmarks/gpu_baseline.py``): the norm
   pass's rules and exact paths on a TE-spec ``GPTModel`` against one backward per trajectory
   (float32, relative error under 1e-4), with the time of each.

Prints the tables as one text and writes it to ``--out`` (default ``gpu_bench.md``). Without
a GPU (``--device cuda``, the default) it prints one line and exits 0. ``--device cpu`` runs
every section's code path on the CPU (gloo world of one, megatron-core through the CPU shim
of ``ess_patch.demo.cpu``); kernels are then top-level aten ops seen by the profiler, and
host syncs are not measured. tests/test_gpu_bench.py runs that dry run with ``--quick``.
A section that raises is reported as FAILED with its traceback (the others still run, the
process group is torn down) and the exit status is 1.

NEVER RUN ON A GPU so far: no device was available while it was written. The CUDA-only
parts (the profiler's CUDA activity, the sync debug mode, the NCCL world, the model on
``cuda``) are written defensively but untested; a number that looks wrong (e.g. zero kernels
everywhere: the profiler saw no CUDA activity) says so in the notes under the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import ess_patch
from ess_patch import compute_ess_lr

from . import gpu_baseline
from .common import OpCounter, dispatch_report, table, verdict

TOKENS = (1 << 20, 8 << 20, 33 << 20)
QUICK_TOKENS = (1 << 14, 1 << 16)
DTYPES = (torch.float32, torch.bfloat16)
MAX_ESTIMATOR_OPS = 100  # issue 25's bound on the estimator's ops (launches) per call
TABLE_ROWS = (1024, 32768)  # B of the CP table: about the 1 M and 33 M token batches
STEP_VARIANTS = ("unpatched", "control", "disabled", "enabled")  # step_bench's names
STEP_LABELS = {
    "unpatched": "unpatched",
    "control": "control (unpatched)",
    "disabled": "installed, disarmed",
    "enabled": "armed (scale 0.5)",
}
ESTIMATOR_TITLE = "## GPU 1. compute_ess_lr (one rank)"
COLLECTIVES_TITLE = "## GPU 2. Collectives of one rollout, one rank"
STEP_TITLE = "## GPU 3. Megatron DistributedOptimizer.step(): unpatched vs disarmed vs armed (0.5)"
SKIP_MESSAGE = "benchmarks.gpu: skipped, no CUDA GPU available (torch.cuda.is_available() is False)"


class Section(NamedTuple):
    """One table of the report."""

    title: str
    headers: list[str]
    rows: list[list[Any]]
    notes: list[str]


# --- measuring ------------------------------------------------------------------------------


def _sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


# aten ops that only make a view: no kernel, no copy
VIEW_OPS = frozenset({"view", "reshape", "_reshape_alias", "_unsafe_view", "alias", "as_strided"})


def op_counts(fn: Callable[[], object]) -> Counter[str]:
    """aten ops dispatched by one call, by name (each one a kernel launch at most)."""
    with OpCounter() as counter:
        fn()
    return counter.ops


def count_ops(fn: Callable[[], object]) -> int:
    """aten ops dispatched by one call, in all."""
    return sum(op_counts(fn).values())


def _has_aten_ancestor(event: Any) -> bool:
    """Whether a profiler event runs inside an aten op (so that op already counts it)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def count_kernels(fn: Callable[[], object], device: str) -> int | str:
    """CUDA device activities (kernels, memcpy, memset) of one call, via ``torch.profiler``;
    on CPU the top-level aten ops it sees (an op inside another one is not counted, an op
    inside a ``record_function`` range, e.g. torch.optim's, is)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _sync(device)
    try:
        with torch.profiler.profile(activities=activities) as prof:
            fn()
            _sync(device)  # the kernels must have run before the profiler stops collecting
        events = prof.events()
    except Exception as exc:  # a profiler without CUPTI must not sink the other numbers
        return f"error: {type(exc).__name__}"
    if device == "cuda":
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(
        1
        for e in events
        if e.device_type == torch.autograd.DeviceType.CPU
        and e.name.startswith("aten::")
        and not _has_aten_ancestor(e)
    )


def count_syncs(fn: Callable[[], object], device: str) -> int | str:
    """Host synchronisations of one call (CUDA's sync debug mode warns on each; it sees the
    ones that go through c10's sync points: ``.item()``, ``.tolist()``, blocking copies,
    ``nonzero``, stream/device synchronize). ``n/a`` on CPU."""
    if device != "cuda":
        return "n/a"
    _sync(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # torch warns from one place: no dedup per location
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())


def time_ms(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Best-of-``repeats`` wall time of one call, in milliseconds (device work included)."""
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _diff(value: int | str, base: int | str) -> str:
    """``value - base`` signed, or ``n/a`` where either was not measured."""
    if isinstance(value, int) and isinstance(base, int):
        return f"{value - base:+d}"
    return "n/a"


# --- 1. the estimator ------------------------------------------------------------------------


def make_batch(
    tokens: int, dtype: torch.dtype, device: str, seed: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Trajectories of 100-2000 tokens summing to ``tokens``, built on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(100, 2001, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - tokens
    lengths = [n for n in lengths if n > 0]
    rollout = torch.rand(tokens, generator=gen).mul_(-3.0)
    train = torch.randn(tokens, generator=gen).mul_(0.05).add_(rollout)
    mask = (torch.rand(tokens, generator=gen) > 0.1).to(torch.int32)
    cols = [
        x.to(device=device, dtype=d) for x, d in ((train, dtype), (rollout, dtype), (mask, None))
    ]
    return tuple(list(c.split(lengths)) for c in cols)


def estimator_section(
    device: str,
    tokens: tuple[int, ...] = TOKENS,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    repeats: int = 5,
) -> Section:
    """``compute_ess_lr`` on one rank at each size and dtype."""
    rows = []
    for n in tokens:
        for dtype in dtypes:
            batch = make_batch(n, dtype, device)

            def call(b=batch):
                return compute_ess_lr(*b)

            call()  # warm-up (allocator, lazy init, pinned-memory pool)
            rows.append(
                [
                    f"{n / 1e6:.3g}M",
                    str(dtype).removeprefix("torch."),
                    len(batch[0]),
                    f"{time_ms(call, device, repeats):.3g}",
                    count_ops(call),
                    count_kernels(call, device),
                    count_syncs(call, device),
                    len(dispatch_report(call).syncs),
                ]
            )
            del batch
    ops = {r[4] for r in rows}
    reads = {r[7] for r in rows}
    notes = [
        f"- aten ops the same at every size and dtype, at most {MAX_ESTIMATOR_OPS} (a fixed "
        f"number of launches whatever B; {sorted(ops)}): "
        f"{verdict(len(ops) == 1 and max(ops) <= MAX_ESTIMATOR_OPS)}",
        f"- at most one host read per call by dispatch ({sorted(reads)}; int32 masks): "
        f"{verdict(max(reads) <= 1)}",
        "- host reads (dispatch) = aten::_local_scalar_dense / nonzero / ... and .tolist() seen "
        "by dispatch modes (any device); host syncs = CUDA sync-debug warnings (cuda only)",
    ]
    return Section(
        ESTIMATOR_TITLE,
        [
            "tokens",
            "dtype",
            "B",
            "best ms",
            "aten ops",
            "kernels",
            "host syncs",
            "host reads (dispatch)",
        ],
        rows,
        notes,
    )


# --- the one-rank world ----------------------------------------------------------------------


@contextlib.contextmanager
def one_rank_world(device: str) -> Iterator[None]:
    """A process group of one rank (NCCL on ``cuda``, gloo on ``cpu``) and megatron
    ``parallel_state`` (tp = pp = cp = 1) on it; on CPU also the CPU shim megatron-core's
    optimizer needs. Everything is torn down on exit, also after an error.

    A FileStore in a temporary directory rendezvouses the rank: no MASTER_ADDR / MASTER_PORT
    (nothing to collide with another job's port).
    """
    from megatron.core import parallel_state

    from ess_patch.demo.cpu import megatron_on_cpu

    if dist.is_initialized():
        raise RuntimeError(
            "benchmarks.gpu needs a process without torch.distributed initialized (it builds "
            "its own world of one rank); do not run it under torchrun"
        )
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="ess-gpu-bench-"))
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        timeout = datetime.timedelta(seconds=120)
        if device == "cuda":
            torch.cuda.set_device(0)  # NCCL and megatron's buffers use the current device
            try:  # device_id binds the communicator to the GPU eagerly (torch >= 2.3)
                dist.init_process_group(
                    "nccl",
                    store=store,
                    rank=0,
                    world_size=1,
                    timeout=timeout,
                    device_id=torch.device("cuda", 0),
                )
            except TypeError:
                dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timeout)
        else:
            stack.enter_context(megatron_on_cpu())
            dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
        stack.callback(dist.destroy_process_group)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            context_parallel_size=1,
            create_gloo_process_groups=False,
        )
        stack.callback(parallel_state.destroy_model_parallel)
        yield


# --- 2. the collectives ----------------------------------------------------------------------


def all_reduce_as_issued(stats: torch.Tensor, group: object) -> torch.Tensor:
    """``all_reduce_trajectory_stats`` past its one-rank early return (what a group of more
    than one rank runs)."""
    from ess_patch.reduction import all_reduce_sum

    return all_reduce_sum(stats, group)


def all_gather_as_issued(row: torch.Tensor, group: object) -> torch.Tensor:
    """``all_gather_rows`` (and so ``exchange_envelopes``) past its one-rank early return."""
    from ess_patch.reduction import gather_rows

    return gather_rows(row, group, dist.get_world_size(group))


def collective_section(
    device: str, table_rows: tuple[int, ...] | None = None, repeats: int = 50
) -> Section:
    """Call inside :func:`one_rank_world`. ``table_rows``: the heights B of the CP table
    (default :data:`TABLE_ROWS`)."""
    from megatron.core import parallel_state

    from ess_patch.estimator import SUMMARY_SIZE
    from ess_patch.reduction import (
        ENVELOPE_SIZE,
        all_gather_rows,
        all_reduce_trajectory_stats,
        envelope,
        exchange_envelopes,
    )
    from ess_patch.result import ENCODED_SIZE

    table_rows = TABLE_ROWS if table_rows is None else table_rows
    cp = parallel_state.get_context_parallel_group()
    dp = parallel_state.get_data_parallel_group()
    pp = parallel_state.get_pipeline_model_parallel_group()
    backend = dist.get_backend(cp)
    gen = torch.Generator().manual_seed(0)
    # where compute.py / broadcast_from_last_stage hold each payload: the trajectory table and
    # the DP row on the log-probs' device, the CP envelope and the PP row on the CPU
    cases = [
        (
            "CP envelopes (exchange_envelopes)",
            envelope(failed=False, rows=table_rows[0], config=ess_patch.EssLrConfig()),
            lambda x: exchange_envelopes(x, cp, "CP"),
            lambda x: all_gather_as_issued(x, cp),
        )
    ]
    for b in table_rows:
        stats = torch.rand(b, 3, generator=gen, dtype=torch.float64).to(device)
        cases.append(
            (
                f"CP trajectory table (all_reduce_trajectory_stats), B={b}",
                stats,
                lambda x: all_reduce_trajectory_stats(x, cp),
                lambda x: all_reduce_as_issued(x, cp),
            )
        )
    dp_row = torch.rand(SUMMARY_SIZE + ENVELOPE_SIZE, generator=gen, dtype=torch.float64)
    pp_row = torch.rand(ENVELOPE_SIZE + ENCODED_SIZE, generator=gen, dtype=torch.float64)
    cases += [
        (
            "DP summary + envelope (all_gather_rows)",
            dp_row.to(device),
            lambda x: all_gather_rows(x, dp, "DP"),
            lambda x: all_gather_as_issued(x, dp),
        ),
        (
            "PP envelope + result (all_gather_rows)",
            pp_row,
            lambda x: all_gather_rows(x, pp, "PP"),
            lambda x: all_gather_as_issued(x, pp),
        ),
    ]
    rows = []
    skipped_free = True
    for name, payload, ours, issued in cases:
        # before timing: all_reduce works in place when the payload already is on the comm
        # device (a 1-rank sum leaves it unchanged, but compare a copy all the same)
        same = torch.equal(ours(payload.clone()), issued(payload.clone()))
        where = f"{tuple(payload.shape)} {str(payload.dtype).removeprefix('torch.')} "
        where += payload.device.type
        for path, fn in (("ess_patch, 1 rank (skips)", ours), ("as issued at >1 rank", issued)):

            def call(f=fn, x=payload):
                return f(x)

            call()  # warm-up: a subgroup's communicator is created at its first collective
            names = op_counts(call)
            ops = sum(names.values())
            if path.startswith("ess_patch"):
                skipped_free &= set(names) <= VIEW_OPS
            rows.append(
                [
                    name,
                    where,
                    path,
                    f"{time_ms(call, device, repeats) * 1e3:.3g}",
                    ops,
                    count_kernels(call, device),
                    count_syncs(call, device),
                    "yes" if same else "NO",
                ]
            )
    floor = time_ms(lambda: None, device, repeats) * 1e3
    notes = [
        f"- timing floor (an empty call timed the same way): {floor:.3g} us",
        f"- groups: megatron parallel_state's CP / DP / PP groups of a {backend} world of one "
        "rank; 'as issued': the copies to the comm device, the collective and the copies back "
        "that ess_patch.reduction runs on a group of more than one rank (no network here)",
        "- the ess_patch calls on a 1-rank group dispatch no copy, no kernel, no collective "
        f"(a reshape, a view, at most): {verdict(skipped_free)}",
    ]
    return Section(
        COLLECTIVES_TITLE,
        [
            "collective",
            "payload",
            "path",
            "best us",
            "aten ops",
            "kernels",
            "host syncs",
            "same result",
        ],
        rows,
        notes,
    )


# --- 3. the wrapped optimizer.step() ---------------------------------------------------------


def step_section(device: str, hidden: int, rounds: int, steps: int) -> Section:
    """Call inside :func:`one_rank_world`."""
    from .common import use_test_helpers

    use_test_helpers()
    from megatron_cpu import batch, forward_backward

    from .step_bench import build, set_variant

    if ess_patch.is_installed():
        raise RuntimeError("benchmarks.gpu: ess_patch is already installed in this process")
    setup = build("dist_bf16", hidden, device=device)
    opt = setup.optimizer
    leaves = [type(c).__name__ for c in getattr(opt, "chained_optimizers", [opt])]
    params = list(setup.models[0].parameters())
    n_params = sum(p.numel() for p in params)
    x, y = (t.to(device) for t in batch(0, 0, size=64))
    forward_backward(setup, x, y)  # the grads stay in the DDP buffers: every step is full
    for _ in range(3):  # optimizer state, first-step paths
        opt.step()
    counts: dict[str, tuple[int, int | str, int | str]] = {}
    times: dict[str, list[float]] = {v: [] for v in STEP_VARIANTS}
    warm = max(2, steps // 5)
    try:
        for variant in STEP_VARIANTS:
            set_variant(variant)
            for _ in range(warm):  # the first calls after (un)patching a class run cold
                opt.step()
            counts[variant] = (
                count_ops(opt.step),
                count_kernels(opt.step, device),
                count_syncs(opt.step, device),
            )
        for rnd in range(rounds):
            k = rnd % len(STEP_VARIANTS)
            for variant in STEP_VARIANTS[k:] + STEP_VARIANTS[:k]:
                set_variant("unpatched")  # every block starts from the same state change
                set_variant(variant)
                for _ in range(warm):
                    opt.step()
                _sync(device)
                start = time.perf_counter()
                for _ in range(steps):
                    opt.step()
                _sync(device)
                times[variant].append((time.perf_counter() - start) / steps)
    finally:
        set_variant("unpatched")
    base = counts["unpatched"]
    rows, zero_extra = [], True
    for variant in STEP_VARIANTS:
        ops, kernels, syncs = counts[variant]
        extra = [_diff(v, b) for v, b in zip(counts[variant], base, strict=True)]
        zero_extra &= all(e in ("+0", "n/a") for e in extra)
        paired = statistics.median(
            v / u for v, u in zip(times[variant], times["unpatched"], strict=True)
        )
        rows.append(
            [
                STEP_LABELS[variant],
                f"{min(times[variant]) * 1e3:.3g}",
                f"{statistics.median(times[variant]) * 1e3:.3g}",
                f"{paired:.3f}",
                ops,
                kernels,
                syncs,
                " / ".join(extra),
            ]
        )
    dtype = str(params[0].dtype).removeprefix("torch.")
    notes = [
        f"- model: {n_params / 1e6:.3g}M {dtype} params on {device}; optimizer: "
        f"{type(opt).__name__}[{', '.join(leaves)}] (Adam, clip_grad 1.0, loss scale 1.0); "
        f"{rounds} rounds x {steps} timed steps per variant, block order rotating per round",
        "- paired: median over rounds of (variant / unpatched) block times; control = "
        "unpatched again, the noise floor",
        f"- disarmed and armed add zero aten ops, kernels and host syncs: {verdict(zero_extra)}",
    ]
    return Section(
        STEP_TITLE,
        [
            "variant",
            "best ms/step",
            "median ms/step",
            "paired / unpatched",
            "aten ops",
            "kernels",
            "host syncs",
            "extra ops / kernels / syncs",
        ],
        rows,
        notes,
    )


# --- 4. VCPO's baseline on Transformer Engine layers -------------------------------------------


def baseline_section(device: str, quick: bool) -> Section:
    """Call inside :func:`one_rank_world` (``benchmarks.gpu_baseline``)."""
    return Section(gpu_baseline.TITLE, *gpu_baseline.baseline_section(device, quick))


# --- the report ------------------------------------------------------------------------------


def render(sections: list[Section], device: str, device_name: str) -> str:
    """The report: every section's table and notes, then what the columns mean."""
    parts = [f"# ess-patch GPU benchmark on {device_name}"]
    for s in sections:
        parts.append(table(s.headers, s.rows, title=s.title) + "\n\n" + "\n".join(s.notes))
    legend = (
        "aten ops: operators dispatched (TorchDispatchMode; an upper bound on launches); "
        "kernels: CUDA device activities per call (torch.profiler: kernels, memcpy, memset; on "
        "CPU: top-level aten ops); host syncs: torch.cuda.set_sync_debug_mode warnings per call "
        "(n/a on CPU); times include the torch.cuda.synchronize that waits for the device"
    )
    kernels = [
        r[s.headers.index("kernels")] for s in sections if "kernels" in s.headers for r in s.rows
    ]
    if device == "cuda" and kernels and not any(isinstance(k, int) and k > 0 for k in kernels):
        legend += (
            "\nWARNING: the profiler saw no CUDA activity (CUPTI unavailable?): the kernel "
            "counts are meaningless"
        )
    parts.append(legend)
    return "\n\n".join(parts) + "\n"


def _failed(title: str) -> Section:
    """The section that stands for one that raised: its traceback, for whoever runs this on a
    GPU and sends the text back."""
    trace = traceback.format_exc().rstrip().replace("\n", "\n    ")
    return Section(title, ["FAILED"], [], [f"FAILED:\n\n    {trace}"])


def run(device: str, quick: bool) -> list[Section]:
    """Every section, in order (the estimator's before the world exists). A section that
    raises becomes a FAILED one; the others still run."""
    titles = (ESTIMATOR_TITLE, COLLECTIVES_TITLE, STEP_TITLE, gpu_baseline.TITLE)
    sections = []
    try:
        sections.append(
            estimator_section(device, QUICK_TOKENS if quick else TOKENS, repeats=2 if quick else 5)
        )
    except Exception:
        sections.append(_failed(ESTIMATOR_TITLE))
    hidden, rounds, steps = (32, 2, 3) if quick else (8192, 10, 20)
    try:
        with one_rank_world(device):
            for title, fn in (
                (COLLECTIVES_TITLE, lambda: collective_section(device, repeats=5 if quick else 50)),
                (STEP_TITLE, lambda: step_section(device, hidden, rounds, steps)),
                (gpu_baseline.TITLE, lambda: baseline_section(device, quick)),
            ):
                try:
                    sections.append(fn())
                except Exception:
                    sections.append(_failed(title))
    except Exception:  # the world itself: whatever did not run fails with it
        sections += [_failed(t) for t in titles[len(sections) :]] or [
            _failed("## GPU: tearing the one-rank world down")
        ]
    return sections


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="gpu_bench.md", help="file the tables are written to")
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: a dry run of every code path",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (a dry run)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(SKIP_MESSAGE)
        return 0
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    sections = run(args.device, args.quick)
    text = render(sections, args.device, name)
    print(text, end="")
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.write(text)
    return 1 if any(s.headers == ["FAILED"] for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
