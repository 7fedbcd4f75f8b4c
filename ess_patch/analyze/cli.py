"""The ``ess-patch analyze`` subcommand (argument parsing and console output only)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import DEFAULT_PATIENCE, DEFAULT_THRESHOLD, RULES, WEIGHT_MODES, check_rule

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="what ESS-LR would have done: replay it over a run's --save-debug-train-data dumps",
        description=(
            "Reads the train-data dumps of miles or slime (--save-debug-train-data), rebuilds "
            "each rollout across ranks and CP slices, and computes per rollout rho, ESS and the "
            "LR scale of each setting. Writes per_rollout.csv, summary.md, summary.json and "
            "analyze.png into --out."
        ),
    )
    p.add_argument("paths", nargs="+", type=Path, help="dump files or folders (searched for *.pt)")
    p.add_argument("--out", type=Path, required=True, help="output folder (only it is written)")
    p.add_argument("--weight-mode", nargs="+", choices=WEIGHT_MODES, default=list(WEIGHT_MODES))
    p.add_argument("--rule", nargs="+", choices=RULES, default=list(RULES))
    p.add_argument("--floor", nargs="+", type=float, default=[0.1, 0.3])
    p.add_argument(
        "--warn-threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help="early warning: rho below this for --warn-patience rollouts in a row "
        f"(default {DEFAULT_THRESHOLD}, VCPO's product-weight band; 0: off)",
    )
    p.add_argument(
        "--warn-patience",
        type=int,
        default=DEFAULT_PATIENCE,
        help="early warning: rollouts in a row below --warn-threshold "
        f"(default {DEFAULT_PATIENCE})",
    )
    p.add_argument("--no-figure", action="store_true", help="skip analyze.png (no matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .read import DumpError
    from .report import analyze, default_settings

    try:
        settings = default_settings(args.weight_mode, args.rule, args.floor)
        check_rule(args.warn_threshold, args.warn_patience)
    except ValueError as exc:
        print(f"ess-patch analyze: {exc}", file=sys.stderr)
        return 2
    bar = None

    def progress(total: int):
        nonlocal bar
        try:
            from tqdm import tqdm
        except ImportError:
            return lambda: None
        bar = tqdm(total=total, unit="rollout", disable=args.no_progress, dynamic_ncols=True)
        return lambda: bar.update(1)

    try:
        result = analyze(
            args.paths,
            args.out,
            settings,
            progress=progress,
            figure=not args.no_figure,
            warn_threshold=args.warn_threshold,
            warn_patience=args.warn_patience,
        )
    except DumpError as exc:
        if bar is not None:
            bar.close()
        print(f"ess-patch analyze: {exc}", file=sys.stderr)
        return 1
    except (TypeError, ValueError, IndexError, KeyError, RuntimeError) as exc:
        # the reader names the file and field of every malformed dump it knows; a shape it
        # does not know still ends in one line, not a traceback
        if bar is not None:
            bar.close()
        print(
            f"ess-patch analyze: a dump could not be read ({type(exc).__name__}: {exc})",
            file=sys.stderr,
        )
        return 1
    if bar is not None:
        bar.close()
    print(f"{result.num_rollouts} rollouts; scale < 1 = ESS-LR would brake that rollout's LR")
    print(result.table)
    if result.advice is not None:
        print("\nWhich weights for this run (docs/which-weights.md):")
        print("\n".join(f"  {line}" for line in result.advice.lines))
    if result.warnings:
        print("\nEarly warning (ESS collapse precedes training collapse, VCPO):")
        print("\n".join(f"  {w.text()}" for w in result.warnings))
    print(f"outputs in {result.out_dir.resolve()}")
    return 0
