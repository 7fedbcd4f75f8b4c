"""Packaging: every subpackage ships (pyproject lists them by hand to map patches/)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _listed_packages() -> list[str]:
    import tomllib

    with open(TESTS.parent / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["packages"]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_every_subpackage_is_listed_in_pyproject():
    # pyproject lists packages by hand (to map patches/ to ess_patch.patches): a new
    # subpackage missing from the list would silently not ship.
    package = TESTS.parent / "ess_patch"
    found = {
        ".".join(p.parent.relative_to(package.parent).parts)
        for p in package.rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    listed = set(_listed_packages())
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages"
    assert "ess_patch.patches" in listed
