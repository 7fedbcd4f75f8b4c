"""Stub of ``sglang.srt.server_args`` (GPU-only inference server; see stubs/README.md).

miles' and slime's ``sglang_utils/arguments.py`` call ``ServerArgs.add_cli_args(parser)`` while
building their parser and then read a few ``--sglang-*`` values in their validate functions.
This stub registers only those few server options, with sglang's own flag spellings and
defaults; the rest of ``ServerArgs`` raises if used.
"""

from __future__ import annotations

import argparse

from _import_stub import stub_class

__all__ = ["ServerArgs"]


def _add_cli_args(parser: argparse.ArgumentParser) -> None:
    # Long name first, short alias second, no dest: as in sglang, so that the frameworks'
    # prefixing wrapper derives the same ``sglang_<x>_size`` dests it does with the real one.
    parser.add_argument("--tensor-parallel-size", "--tp-size", type=int, default=1)
    parser.add_argument("--data-parallel-size", "--dp-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "--pp-size", type=int, default=1)
    parser.add_argument("--expert-parallel-size", "--ep-size", type=int, default=1)
    parser.add_argument("--enable-dp-attention", action="store_true")
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--chat-template", type=str, default=None)
    parser.add_argument("--cuda-graph-backend-prefill", type=str, default=None)


ServerArgs = stub_class(__name__, "ServerArgs", add_cli_args=staticmethod(_add_cli_args))
