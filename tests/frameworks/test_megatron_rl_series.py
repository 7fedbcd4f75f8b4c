"""patches/megatron_rl on every Megatron-LM release snapshot that has a series, with the tool.

For each ``megatron-lm-nvidia-core_vX.Y.Z`` folder under ``$ESS_PATCH_UPSTREAM``: a copy is
recognised by its files, its own series applies (``check`` says applicable, then already
applied), the series is the twin of ``install("megatron_rl")`` there (no gap), and the patched
tree, imported beside the megatron-core of its release, carries the call site on every target
it defines. A tree no series fits (a hand-edited hooked function, as on a newer main) is an
error naming the releases that have one, and nothing changes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_versions import child_env, core_version_for
from upstream import megatron_lm_snapshots

from ess_patch.patchset import discover, series_gaps

RELEASES = [f for f in megatron_lm_snapshots() if "core_v" in f.name]
SKIP = "no megatron-lm-*core_v* snapshot under $ESS_PATCH_UPSTREAM"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ess_patch.cli", "patches", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=300)


def _copy(folder: Path, tmp_path: Path) -> Path:
    tree = tmp_path / folder.name
    shutil.copytree(folder / "megatron", tree / "megatron")
    for path in tree.rglob("*"):
        path.chmod(path.stat().st_mode | 0o200)  # the snapshots are read-only in CI
    return tree


def _series_for(folder: Path) -> str:
    release = folder.name.split("nvidia-", 1)[-1]
    for series in discover("megatron_rl"):
        if f"(release {release})" in series.patches[0].read_text(encoding="utf-8"):
            return series.name
    raise AssertionError(f"no megatron_rl series names release {release}")


@pytest.mark.skipif(not RELEASES, reason=SKIP)
@pytest.mark.parametrize("folder", RELEASES, ids=lambda f: f.name)
def test_each_release_has_its_series_and_the_patched_tree_calls_ess_patch(
    folder, tmp_path, fresh_python
):
    tree = _copy(folder, tmp_path)
    check = _cli("check", "--target", str(tree), "--component", "megatron_rl")
    name = _series_for(folder)
    assert check.returncode == 0 and f"series: {name} " in check.stdout, check
    assert "result: applicable" in check.stdout, check.stdout
    applied = _cli("apply", "--target", str(tree), "--component", "megatron_rl")
    assert applied.returncode == 0 and "applied 1 patch" in applied.stdout, applied
    again = _cli("check", "--target", str(tree), "--component", "megatron_rl")
    assert "result: already applied" in again.stdout, again.stdout
    [series] = [s for s in discover("megatron_rl") if s.name == name]
    assert series_gaps(series, tree) == []  # the twin of install() on this release
    probe = """
import importlib, sys
from ess_patch.install import INTEGRATIONS
from ess_patch.vendored import is_vendored
seen = []
for t in INTEGRATIONS["megatron_rl"].targets:
    value = vars(importlib.import_module(t.module)).get(t.attribute)
    if value is None and not t.required:
        continue  # a site this release lacks (initialize.parse_args from core_v0.18)
    if not t.vendored:
        continue  # install()-only (VCPO's baseline): no series carries it
    assert is_vendored(value), t.path
    seen.append(t.path)
emit(len(seen))
"""
    vendored = fresh_python(probe, child_env(core_version_for(folder), tree), timeout=600)
    assert vendored.result >= 5


@pytest.mark.skipif(not RELEASES, reason=SKIP)
def test_a_tree_no_series_fits_is_refused_naming_the_releases_that_have_one(tmp_path):
    folder = RELEASES[-1]
    tree = _copy(folder, tmp_path)
    rl_utils = tree / "megatron" / "rl" / "rl_utils.py"
    text = rl_utils.read_text(encoding="utf-8")
    edited = text.replace("def prepare_data_for_update(", "def prepare_data_for_update(  # main\n")
    rl_utils.write_text(edited, encoding="utf-8")
    result = _cli("apply", "--target", str(tree), "--component", "megatron_rl")
    assert result.returncode == 1
    for release in RELEASES:
        assert release.name.split("nvidia-", 1)[-1] in result.stderr, result.stderr
    assert "no megatron_rl series fits this tree" in result.stderr
    assert rl_utils.read_text(encoding="utf-8") == edited  # nothing changed
