"""The one wording for each reason a test skips (stdlib only; also used by tox's runners).

Every skip for a missing upstream snapshot or a missing optional package goes through
here, so ``pytest -rs`` (on by default, see pyproject.toml) lists each cause the same way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["missing_packages", "missing_snapshot"]


def missing_snapshot(var: str, what: str, marker: str) -> str | None:
    """``None`` if ``$var`` names a folder holding ``marker``, else why the test cannot run.

    ``what``: the snapshot in words (``"miles"``); ``marker``: a path inside it
    (``"miles/__init__.py"``, ``"megatron/training"``).
    """
    value = os.environ.get(var)
    if not value:
        return f"{var} is not set: point it at the upstream {what} snapshot"
    if not (Path(value) / marker).exists():
        return f"{var}={value} has no {marker}: point it at the upstream {what} snapshot"
    return None


def missing_packages(what: str, names: Sequence[str], hint: str) -> str | None:
    """``None`` if ``names`` is empty, else why ``what`` cannot run and how to fix it."""
    if not names:
        return None
    return f"{what} needs {', '.join(names)} ({hint})"
