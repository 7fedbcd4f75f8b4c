"""patches/verl on copies of every verl snapshot: apply / check / revert with ess-patch's own
CLI, the series the exact twin of ``install("verl")``, and verl's real actor on the patched
copy with NO ``install()``: each optimizer step at its mini-batch's float64 reference scale,
legacy actor and engine path alike (the same checks as test_verl.py)."""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import run_ranks
from test_verl import (
    SKIP,
    SNAPSHOTS,
    _check_applied,
    _expected_scales,
    _rank,
    has_engine_path,
    has_legacy_actor,
)

from ess_patch import patchset
from ess_patch.patchset.cli import main as patches_main

pytestmark = [pytest.mark.dist, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

#: the upstream commit each snapshot folder is (../shared/upstream/README.md)
COMMITS = {
    "verl-v0.6.0": "ddd86f527",
    "verl-b178a3cd5": "b178a3cd5",
    "verl-v0.7.0": "f9c855f7c",
    "verl-v0.8.0": "7aed6b230",
    "verl-1dda039b9": "1dda039b9",
}
#: what the series touch, each file where the tree has it: the legacy actors (verl < 0.8),
#: the engine path (verl >= 0.7), main's Tinker worker, and the config and the driver's Ray
#: runtime environment in every release
SERIES_FILES = {
    "verl/utils/config.py",
    "verl/trainer/constants_ppo.py",
    "verl/workers/engine_workers.py",
    "verl/workers/engine_workers_tinker.py",
    "verl/workers/actor/megatron_actor.py",
    "verl/workers/actor/dp_actor.py",
}


def _hashes(tree: Path) -> dict[str, str]:
    return {
        str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(tree.rglob("*.py"))
    }


@pytest.fixture(params=SNAPSHOTS, ids=[p.name for p in SNAPSHOTS])
def patched(request, tmp_path) -> Path:
    tree = tmp_path / request.param.name
    shutil.copytree(request.param, tree, ignore=shutil.ignore_patterns("__pycache__"))
    before = _hashes(tree)
    found = patchset.detect(tree)
    assert (found.component, found.version) == ("verl", COMMITS[request.param.name])
    series, _ = patchset.select_series(found)
    assert patchset.series_gaps(series, tree) == []  # decorates exactly what install() wraps
    assert patches_main(["apply", "--target", str(tree)]) == 0
    assert patches_main(["check", "--target", str(tree)]) == 0
    after = _hashes(tree)
    touched = {f for f in SERIES_FILES if (request.param / f).is_file()}
    assert {k for k in before if before[k] != after[k]} == touched
    assert {"verl/utils/config.py", "verl/trainer/constants_ppo.py"} < touched  # + an actor path
    return tree


def test_revert_restores_the_snapshot_byte_for_byte(patched):
    assert patches_main(["revert", "--target", str(patched)]) == 0
    original = next(p for p in SNAPSHOTS if p.name == patched.name)
    assert _hashes(patched) == _hashes(original)


@pytest.mark.parametrize(
    "patched",
    [
        pytest.param(
            p,
            id=p.name,
            marks=pytest.mark.skipif(
                not has_legacy_actor(p),
                reason=f"{p.name} has no legacy Megatron actor (removed in verl v0.8.0): runs "
                "on the trees that have it (v0.6.0, v0.7.x, b178a3cd5)",
            ),
        )
        for p in SNAPSHOTS
    ],
    indirect=True,
)
def test_patched_legacy_actor_scales_each_step_without_install(patched, tmp_path):
    scenario = {"env": {"ESS_LR_ENABLE": "1", "ESS_LR_FLOOR": "0.05"}, "vendored": True}
    results = run_ranks(
        _rank, dp=2, args=(str(patched), scenario), tmp_path=tmp_path / "run", timeout=240
    )
    assert not any(r["installed"] for r in results)
    _check_applied(results, _expected_scales(results, floor=0.05))


def _engine_rank(src: str, scenario: dict) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import verl_engine_rank

    return verl_engine_rank.run(src, scenario)


@pytest.mark.parametrize(
    "patched",
    [
        pytest.param(
            p,
            id=p.name,
            marks=pytest.mark.skipif(
                not has_engine_path(p),
                reason=f"{p.name} has no engine path (added in verl v0.7.0): runs on the "
                "trees that have it (v0.7.x, b178a3cd5, v0.8.0, main)",
            ),
        )
        for p in SNAPSHOTS
    ],
    indirect=True,
)
def test_patched_engine_path_scales_each_step_without_install(patched, tmp_path):
    """verl's real Megatron engine path (verl_engine_rank.py) on the patched copy, with the
    environment's megatron-core."""
    pytest.importorskip("peft", reason="verl's Megatron engine module imports peft")
    scenario = {"env": {"ESS_LR_ENABLE": "1", "ESS_LR_FLOOR": "0.05"}, "vendored": True}
    results = run_ranks(
        _engine_rank, dp=2, args=(str(patched), scenario), tmp_path=tmp_path / "run", timeout=300
    )
    expected = _expected_scales(results, floor=0.05)
    assert len(expected) == 2 and all(e["scale"] < 1 for e in expected)
    for r in results:
        for lrs, e in zip(r["applied"], expected, strict=True):
            assert lrs == pytest.approx([lr * e["scale"] for lr in r["scheduled"]], rel=1e-9)
        assert r["armed_after"] is None and r["after"] == r["scheduler_after"]
        assert all(lrs == r["critic_scheduled"] for lrs in r["critic_applied"])
