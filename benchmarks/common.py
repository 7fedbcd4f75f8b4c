"""Shared helpers: timing, aten-op counting, tables, the path to the test helpers."""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def use_test_helpers() -> None:
    """Make ``tests/`` importable (``megatron_cpu``, ``dist_helpers``)."""
    for path in (str(TESTS), str(ROOT)):
        if path not in sys.path:
            sys.path.insert(0, path)


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched inside the block (each one is a kernel launch
    on a GPU; ops that only make views or metadata are counted too, so this is an upper
    bound on launches)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing is compiled here; True would import torch._dynamo (~5 s)

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


# aten ops whose result a GPU must hand to the host (a stream synchronisation each) ...
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2"})
# ... and tensor methods that read data on the host without an aten op on CPU tensors
HOST_READS = frozenset({"tolist", "numpy", "__array__"})


class Dispatched(TorchDispatchMode):
    """aten ops dispatched inside the block: how many, the time spent inside them (each
    op's own call, ``time.perf_counter``), and the host synchronisations a GPU would make
    (:data:`SYNC_OPS`, plus the :data:`HOST_READS` seen by :class:`HostReads`). No
    ``torch.cuda`` call: it measures on CPU what a GPU would launch and wait for."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing is compiled here; True would import torch._dynamo (~5 s)

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        super().__init__()
        self.clock = clock
        self.ops = 0
        self.op_seconds = 0.0
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.syncs.append(name)
        start = self.clock()
        out = func(*args, **(kwargs or {}))
        self.op_seconds += self.clock() - start
        return out


class HostReads(TorchFunctionMode):
    """Calls of :data:`HOST_READS` methods (on a GPU a copy to the host that waits)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


class DispatchReport(NamedTuple):
    ops: int
    op_seconds: float  # inside the ops
    seconds: float  # the whole call, under the counting modes (their overhead included)
    syncs: list[str]


def dispatch_report(
    fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter
) -> DispatchReport:
    """What one call of ``fn`` dispatches: aten ops, time inside them and in all (by
    ``clock``), host syncs."""
    with HostReads() as host, Dispatched(clock) as aten:
        start = clock()
        fn()
        seconds = clock() - start
    return DispatchReport(aten.ops, aten.op_seconds, seconds, aten.syncs + host.reads)


def count_ops(fn: Callable[[], object]) -> int:
    with OpCounter() as counter:
        fn()
    return counter.total


def interleaved_times(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    *,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Times (s, wall clock unless ``clock`` says otherwise) of each function, run
    round-robin ``repeats`` times after ``warmup`` rounds, so that drift (frequency, other
    load) hits every variant alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rnd in range(warmup + repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            elapsed = clock() - start
            if rnd >= warmup:
                times[name].append(elapsed)
    return times


def min_med(values: Sequence[float]) -> tuple[float, float]:
    return min(values), statistics.median(values)


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    return f"{ms:.2f}" if ms >= 1 else f"{ms:.3f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> str:
    """A GitHub-markdown table (readable as plain text too)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    if title:
        lines += [title, ""]
    for k, row in enumerate(cells):
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")
        if k == 0:
            lines.append("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"
