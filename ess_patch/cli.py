"""The ``ess-patch`` command line."""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from . import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ess-patch",
        description="ESS-guided learning-rate scaling for off-policy RL on Megatron.",
    )
    parser.add_argument("--version", action="version", version=f"ess-patch {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(subparsers)
    from .patchset.cli import add_parser as add_patches_parser

    add_patches_parser(subparsers)
    subparsers.add_parser(
        "doctor",
        help="report versions, patch targets and activation; exit 1 if anything is wrong",
    )
    return parser


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="run a small async-RL training on CPU with ESS-LR off and on (needs ess-patch[demo])",
        description=(
            "Trains a tiny policy with off-policy policy gradient over local gloo ranks, using "
            "megatron-core's real optimizer and LR scheduler patched by ess_patch.install(). "
            "Rollouts come from stale copies of the policy (up to --lag updates old). Two arms "
            "with the same seeds: ESS-LR off and on. Writes steps.jsonl, summary.json and "
            "ess_demo.png to the output folder."
        ),
    )
    demo.add_argument("--steps", type=int, help="optimizer steps (= rollouts) per arm [400]")
    demo.add_argument("--lag", type=int, help="maximum staleness of a rollout, in updates [8]")
    demo.add_argument("--seed", type=int, help="seed of the model, the task and the rollouts [0]")
    demo.add_argument("--dp", type=int, help="data-parallel size [2]")
    demo.add_argument("--cp", type=int, help="context-parallel size (zigzag split) [2]")
    demo.add_argument("--pp", type=int, help="pipeline-parallel size, at most 4 [1]")
    demo.add_argument("--floor", type=float, help="smallest LR scale [0.1]")
    demo.add_argument(
        "--weight-mode",
        choices=("geometric", "product"),
        help="per-trajectory weight: exp(mean) or exp(sum) of log-ratios [geometric]",
    )
    demo.add_argument("--out", type=Path, help="output folder [./ess-demo-out/<date>-<time>]")
    demo.add_argument(
        "--quick", action="store_true", help="a smoke run of a few seconds (12 steps, lag 4)"
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("-v", "--verbose", action="store_true", help="log progress details")


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # the parent package is missing
        return False


def _run_demo(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    missing = [m for m in ("megatron.core", "matplotlib", "tqdm") if not _importable(m)]
    if missing:
        print(
            f"ess-patch demo: {', '.join(missing)} not installed; install the demo extra: "
            "pip install 'ess-patch[demo]'",
            file=sys.stderr,
        )
        return 2
    from tqdm import tqdm

    from .demo import DemoConfig, quick_config, run
    from .demo.launch import DemoError

    options = {
        name: getattr(args, name)
        for name in ("steps", "lag", "seed", "dp", "cp", "pp", "floor", "weight_mode")
        if getattr(args, name) is not None
    }
    try:
        cfg = quick_config(**options) if args.quick else DemoConfig(**options)
    except ValueError as exc:
        print(f"ess-patch demo: {exc}", file=sys.stderr)
        return 2
    out = args.out
    if out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = Path("ess-demo-out") / stamp
    print(
        f"ess-patch demo: {cfg.world_size} ranks (dp={cfg.dp} cp={cfg.cp} pp={cfg.pp}), "
        f"{cfg.steps} steps per arm, max lag {cfg.lag}, {cfg.weight_mode} weights, "
        f"floor {cfg.floor}"
    )
    bar = tqdm(
        total=cfg.steps * len(cfg.arms),
        unit="step",
        disable=args.no_progress,
        dynamic_ncols=True,
    )

    def on_step(arm: str, step: int) -> None:
        bar.set_description(f"ESS-LR {arm}", refresh=False)
        bar.update(1)

    try:
        result = run(cfg, out, on_step=on_step)
    except DemoError as exc:
        bar.close()
        print(str(exc), file=sys.stderr)
        return 1
    bar.close()
    print()
    print(result.table)
    print()
    print(
        "collapsed = the smoothed reward ends more than half of its peak gain below the peak; "
        "LR scaled = steps whose applied LR was below the scheduled LR"
    )
    print(f"finished in {result.wall_s:.0f}s; outputs in {result.out_dir.resolve()}:")
    for path in (result.figure, result.records_path, result.summary_path):
        print(f"  {path.name}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "demo":
        return _run_demo(args)
    if args.command == "patches":
        return args.func(args)
    if args.command == "doctor":
        return _run_doctor()
    return 0


def _run_doctor() -> int:
    import warnings

    from .doctor import collect, render

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron's import-time notices are not problems
        report = collect()
    print(render(report))
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
