"""The ``ess-patch`` command line: the parser and the dispatch. ``demo``'s options are in
``cli_demo``, its scenarios' runners in ``cli_scenarios``; ``patches`` and ``analyze`` bring
their own parsers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__
from .cli_demo import DEMO_ESS_FIELDS as DEMO_ESS_FIELDS  # kept here: now cli_demo's
from .cli_demo import _add_demo


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
    from .analyze.cli import add_parser as add_analyze_parser

    add_analyze_parser(subparsers)
    subparsers.add_parser(
        "doctor",
        help="report versions, patch targets and activation; exit 1 if anything is wrong",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the usage of the (sub)command the user typed, not the top-level one
        _subparser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "demo":
        from .cli_scenarios import run_demo

        return run_demo(args)
    if args.command in ("patches", "analyze"):
        return args.func(args)
    if args.command == "doctor":
        return _run_doctor()
    return 0


def _subparser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The deepest sub-parser ``args`` went through (``demo``, ``patches check`` ...)."""
    for dest in ("command", "patches_command"):
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, dest, None)
        if not actions or name not in actions[0].choices:
            break
        parser = actions[0].choices[name]
    return parser


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
