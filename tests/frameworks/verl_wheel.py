"""The verl wheel users install (``pip install verl==0.9.1``), as a tree the verl tests run on.

Installed once, ``--no-deps``, into the cache folder of ``tests/megatron_versions.py``
(``$ESS_PATCH_MCORE_CACHE/verl-0.9.1``): the wheel is pure Python, and its Requires-Dist
(ray, transformers, tensordict, datasets, wandb...) is what the frameworks tier already
installs with torch pinned, so nothing here resolves torch. The folder then holds ``verl/``
like a snapshot folder does, and is tested the same way.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from megatron_versions import pip_target

__all__ = ["WHEEL_VERSION", "wheel_skip_reason", "wheel_tree"]

WHEEL_VERSION = "0.9.1"


@cache
def _install() -> tuple[Path | None, str | None]:
    try:
        return pip_target(
            f"verl-{WHEEL_VERSION}", [f"verl=={WHEEL_VERSION}"], "verl/__init__.py"
        ), None
    except RuntimeError as exc:  # no index reachable: the other trees still run
        return None, f"verl=={WHEEL_VERSION} could not be installed from the index: {exc}"


def wheel_tree() -> Path:
    """The folder holding the wheel's ``verl/`` (installed on first use)."""
    tree, reason = _install()
    if tree is None:
        raise RuntimeError(reason)
    return tree


def wheel_skip_reason() -> str | None:
    """None when the wheel is installed (or installs now), else why not."""
    return _install()[1]
