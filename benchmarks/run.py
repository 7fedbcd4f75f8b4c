"""Run every benchmark and print the tables: ``python -m benchmarks [--quick]``.

Also runnable as ``python benchmarks/run.py``. ``--only`` picks sections
(``estimator``, ``collectives``, ``step``, ``baseline``); ``--threads 1,8`` times the estimator at
several torch thread counts. Full run: ~3-4 minutes on 2 cores; ``--quick``:
under a minute (smaller batches, fewer repeats, one thread count).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import sys
import time
import warnings
from importlib import metadata
from pathlib import Path

if __package__ in (None, ""):  # python benchmarks/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

import torch

SECTIONS = ("estimator", "collectives", "step", "baseline")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def header() -> str:
    return "\n".join(
        [
            "# ess-patch benchmarks",
            "",
            f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
            f"- CPU: {_cpu_model()}, {os.cpu_count()} cores; torch threads by default: "
            f"{torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')})",
            f"- python {platform.python_version()}, torch {torch.__version__}, megatron-core "
            f"{_version('megatron-core')}, ess-patch {_version('ess-patch')}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short run (under a minute)")
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}"
    )
    parser.add_argument(
        "--threads",
        default="1",
        help="comma-separated torch thread counts for the estimator timings (default 1; e.g. "
        "1,8 on a machine with idle cores: on a shared 2-core machine the second is noise)",
    )
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {sorted(unknown)}; choose from {SECTIONS}")

    # megatron's "Transformer Engine / Apex not installed", here and in the gloo ranks
    warnings.filterwarnings("ignore")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    logging.getLogger("ess_patch").setLevel(logging.ERROR)
    print(header() + (" (--quick)" if args.quick else ""), flush=True)
    targets: dict[str, bool] = {}
    started = time.perf_counter()

    if "estimator" in only:
        from . import estimator_bench

        threads = [int(t) for t in args.threads.split(",") if t.strip()]
        if args.quick:
            sizes, repeats = (64, 1024, 4096), {64: 15, 1024: 5, 4096: 3}
        else:
            sizes = (64, 1024, 4096, 16384)
            repeats = {64: 30, 1024: 9, 4096: 5, 16384: 3}
        text, ok = estimator_bench.run(sizes, repeats, threads)
        print("\n" + text, flush=True)
        targets.update(ok)

    if "collectives" in only:
        from . import collectives_bench

        text, ok = collectives_bench.run()
        print("\n" + text, flush=True)
        targets.update(ok)

    if "step" in only:
        from . import step_bench

        repeats = (
            {"tiny": (10, 50), "wide": (6, 5)}
            if args.quick
            else {
                "tiny": (40, 50),
                "wide": (30, 5),
            }
        )
        text, ok = step_bench.run(repeats)
        print("\n" + text, flush=True)
        targets.update(ok)

    if "baseline" in only:
        from . import baseline_bench

        text, ok = baseline_bench.run(3 if args.quick else 7, quick=args.quick)
        print("\n" + text, flush=True)
        targets.update(ok)

    print("\n## Targets\n")
    for name, ok in targets.items():
        print(f"- {name}: {'met' if ok else 'MISSED'}")
    print(f"\n(total {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":  # multiprocessing (forkserver) re-imports the main module
    raise SystemExit(main())
