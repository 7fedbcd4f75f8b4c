"""The component registry is the one table: every other listing of components agrees with it,
and no module outside it writes a table of component names of its own."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import ess_patch.vendored as vendored
from ess_patch.doctor import Report, _versions
from ess_patch.integrations.registry import (
    COMMIT,
    COMPONENTS,
    DECORATORS,
    RELEASE,
    by_folder,
    component,
)
from ess_patch.patchset.series import discover, matches, patches_dir
from ess_patch.patchset.trees import DETECTORS, detect
from ess_patch.patchset.twin import INTEGRATION_OF
from ess_patch.state import STATE, reset

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "ess_patch"
REGISTRY = PACKAGE / "integrations" / "registry.py"

install_module = sys.modules["ess_patch.install"]  # ess_patch.install is the function


def test_install_integrations_are_the_registry_rows_in_order():
    assert list(install_module.INTEGRATIONS) == [c.name for c in COMPONENTS]
    for row in COMPONENTS:
        assert install_module.INTEGRATIONS[row.name] is row.integration


def test_names_aliases_and_folders_are_unique_and_resolve_to_their_row():
    spellings = [s for c in COMPONENTS for s in {c.name, c.folder, *c.aliases} if s]
    assert len(spellings) == len(set(spellings)), "two rows share a name"
    for row in COMPONENTS:
        for spelling in {row.name, row.folder, *row.aliases} - {None}:
            assert component(spelling) is row
    assert component("megatron-core").name == "megatron"
    assert component("megatron.rl").name == "megatron_rl"
    with pytest.raises(KeyError, match="known: megatron, miles"):
        component("megatron-lm")


def test_every_declared_patch_folder_holds_series_and_every_folder_is_a_row():
    root = patches_dir()
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert folders == sorted(c.folder for c in COMPONENTS if c.folder)
    for row in COMPONENTS:
        if row.folder is None:
            continue
        assert by_folder(row.folder) is row
        versions = [s.version for s in discover(row.folder)]
        assert versions, f"patches/{row.folder}/ holds no series"
        if row.series == COMMIT:
            # the snapshot the newest series and the framework tests are cut from has one
            snapshot = row.integration.snapshot
            assert snapshot is not None and len(snapshot) == 40
            assert any(matches(v, snapshot) for v in versions), (row.folder, versions)
        else:
            assert row.series == RELEASE and row.integration.snapshot is None


def test_patches_readme_names_each_snapshot_commit():
    readme = (TESTS.parent / "patches" / "README.md").read_text(encoding="utf-8")
    for row in COMPONENTS:
        if row.integration.snapshot is not None:
            assert f"@{row.integration.snapshot}" in readme, row.name


def test_the_patch_tools_tables_are_the_registry_folders():
    assert list(DETECTORS) == [c.folder for c in COMPONENTS if c.folder]
    assert {c.folder: c.name for c in COMPONENTS if c.folder} == INTEGRATION_OF


@pytest.mark.parametrize("row", COMPONENTS, ids=lambda c: c.name)
def test_each_detector_recognises_a_bare_tree_of_its_component(row, tmp_path):
    package = tmp_path / row.tree_package
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    tree = detect(tmp_path)
    assert tree.component == row.folder
    assert tree.root == tmp_path


def test_doctor_lists_every_source_tree_component_and_the_core_distribution():
    report = Report()
    _versions(report)
    lines = report.sections["versions"]
    for row in COMPONENTS:
        if row.integration.distribution is None:
            assert any(line.startswith(f"{row.detector} ") for line in lines), row.name
    core = component("megatron")
    assert any(line.startswith(f"{core.integration.distribution} ") for line in lines)


def test_the_vendored_decorators_are_the_registry_names():
    helpers = {"CALL_SITES", "CallSite", "call_sites", "is_vendored"}
    assert set(vendored.__all__) - helpers == set(DECORATORS)
    for name in DECORATORS:
        assert callable(getattr(vendored, name)), name
    # ... and no decorator is defined in vendored.py that the registry does not know
    defined = {
        node.targets[0].id
        for node in ast.parse(Path(vendored.__file__).read_text(encoding="utf-8")).body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "id", "") in ("_function_hook", "_method_hook")
        and not node.targets[0].id.startswith("_")
    }
    assert defined <= set(DECORATORS), defined - set(DECORATORS)


def test_call_sites_are_the_commit_keyed_rows():
    assert list(vendored.CALL_SITES) == [c.name for c in COMPONENTS if c.series == COMMIT]
    for name, sites in vendored.CALL_SITES.items():
        assert {s.decorator for s in sites} == set(component(name).decorators)


# No second table of component names.


def _spellings() -> dict[str, str]:
    """Every way a component is written -> its row's name."""
    return {
        s: c.name
        for c in COMPONENTS
        for s in (c.name, c.folder, c.detector, c.tree_package, *c.aliases)
        if s
    }


def _constants() -> dict[str, str]:
    """The module-level names the integrations' objects are bound to (``MILES``) -> row."""
    return {
        attribute: c.name
        for c in COMPONENTS
        for module in list(sys.modules.values())
        if getattr(module, "__name__", "").startswith("ess_patch.integrations.")
        for attribute, value in vars(module).items()
        if value is c.integration
    }


def _tables(source: str) -> list[tuple[int, list[str]]]:
    """(line, components) of each dict / list / tuple / set literal in ``source`` naming
    two or more different components (by a name string or an integration's constant)."""
    spellings = _spellings()
    constants = _constants()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            items = [*node.keys, *node.values]
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = node.elts
        else:
            continue
        named = {
            spellings[i.value]
            for i in items
            if isinstance(i, ast.Constant) and isinstance(i.value, str) and i.value in spellings
        } | {constants[i.id] for i in items if isinstance(i, ast.Name) and i.id in constants}
        if len(named) >= 2:
            found.append((node.lineno, sorted(named)))
    return found


def test_the_table_check_finds_a_table_of_component_names():
    assert _tables('DETECTORS = {"megatron-core": a, "miles": b}') == [(1, ["megatron", "miles"])]
    assert _tables('for name in ("miles", "slime", "megatron.rl"): pass')
    assert _tables("INTEGRATIONS = {i.name: i for i in (MEGATRON, MILES, VERL)}")
    assert _tables('ok = name in ("megatron", "fsdp")') == []  # one component: not a table


def test_no_module_but_the_registry_writes_a_table_of_component_names():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == REGISTRY:
            continue
        for line, named in _tables(path.read_text(encoding="utf-8")):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {', '.join(named)}")
    assert offenders == [], "derive these from ess_patch.integrations.registry:\n" + "\n".join(
        offenders
    )


# The integrations' caches live with them; state.reset() still clears them.


def test_reset_forgets_the_shapes_and_signatures_the_integrations_cached():
    from ess_patch.integrations.binding import _SIGNATURES, parameters
    from ess_patch.integrations.shapes import Aspect, Feature, History, Shape

    history = History(
        "fakefw", "1.0", (Aspect("a", (Shape("s", "1.0", (Feature("sys", "path"),)),)),)
    )

    def host(x, y):
        return x

    assert history.choose("a").label == "s" and history.describe() == "fakefw: s"
    assert parameters(host) == ("x", "y") and _SIGNATURES.get(host) is not None
    assert history in STATE.caches and _SIGNATURES in STATE.caches
    reset()
    assert history.describe() == "fakefw: not decided yet"
    assert _SIGNATURES.get(host) is None
    assert history in STATE.caches  # still registered: the next reset clears it too


def test_state_holds_no_integration_cache_itself():
    assert not hasattr(STATE, "shapes") and not hasattr(STATE, "signatures")


def test_the_compat_table_covers_the_registry_range_of_megatron_core():
    from packaging.specifiers import SpecifierSet

    from ess_patch.patchset import cli

    core = component("megatron")
    assert core.integration.distribution == cli.DISTRIBUTION and cli.MEGATRON is core.integration
    assert cli.MINIMUM in SpecifierSet(core.integration.supported)
    assert f">={cli.MINIMUM}" in core.integration.supported.split(",")


def test_the_supported_range_of_megatron_core_is_written_once():
    core = component("megatron")
    holders = [
        path.relative_to(PACKAGE.parent).as_posix()
        for path in sorted(PACKAGE.rglob("*.py"))
        if core.integration.supported in path.read_text(encoding="utf-8")
    ]
    assert holders == ["ess_patch/integrations/megatron.py"]
