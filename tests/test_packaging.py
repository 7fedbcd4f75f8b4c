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


def _requirements() -> list[str]:
    import tomllib

    with open(TESTS.parent / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    extras = [r for reqs in project["optional-dependencies"].values() for r in reqs]
    return [*project["dependencies"], *extras]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_doctor_and_install_read_the_versions_pyproject_declares():
    from packaging.requirements import Requirement

    from ess_patch.doctor import MINIMUM_VERSIONS
    from ess_patch.install import INTEGRATIONS

    declared = {r.name: r.specifier for r in map(Requirement, _requirements())}
    for dist, minimum in MINIMUM_VERSIONS.items():
        assert str(declared[dist]) == f">={minimum}", dist
    megatron = [Requirement(r) for r in _requirements() if r.startswith("megatron-core")]
    ranges = {str(r.specifier) for r in megatron if "==" not in str(r.specifier)}
    expected = str(Requirement("megatron-core" + INTEGRATIONS["megatron"].supported).specifier)
    assert ranges == {expected}


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_the_description_names_every_supported_framework():
    """pip show / an index page tell a user which frameworks ess-patch serves: every component
    of the registry, by the name its docs page uses."""
    import tomllib

    from ess_patch.integrations.registry import COMPONENTS

    with open(TESTS.parent / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    shown = {"megatron": "megatron-core", "megatron_rl": "Megatron-RL"}
    for row in COMPONENTS:
        assert shown.get(row.name, row.name) in project["description"], row.name
    assert project["classifiers"] and project["keywords"]
