"""The multi-process harness itself: layouts, real collectives, failure and timeout reports."""

from __future__ import annotations

import importlib.abc
import importlib.util
import itertools
import os
import sys
import time
from pathlib import Path

import harness
import pytest
import torch
import torch.distributed as dist
from harness import DistTestFailure, _pick_root_cause, layout, rank_coords, run_dir, run_ranks

# --- rank functions (module level: the ranks import them by name) ---------------------------


def _layout_and_sums(base: float) -> dict:
    lay = layout()
    rank = dist.get_rank()
    mine = torch.tensor([base * (rank + 1)], dtype=torch.float64)
    dp_sum, cp_sum, pp_sum = mine.clone(), mine.clone(), mine.clone()
    dist.all_reduce(dp_sum, group=lay.dp_group)
    dist.all_reduce(cp_sum, group=lay.cp_group)
    dist.all_reduce(pp_sum, group=lay.pp_group)
    # The last PP stage broadcasts its rank to the others in its pipeline (what ESS does).
    last = torch.tensor([rank if lay.is_pp_last else -1])
    src = dist.get_global_rank(lay.pp_group, lay.pp_size - 1)
    dist.broadcast(last, src=src, group=lay.pp_group)
    return {
        "rank": rank,
        "world": lay.world_size,
        "coords": lay.coords,
        "sizes": (lay.dp_size, lay.cp_size, lay.pp_size),
        "dp_sum": dp_sum.item(),
        "cp_sum": cp_sum.item(),
        "pp_sum": pp_sum.item(),
        "pp_last": int(last.item()),
        "run_dir_exists": run_dir().is_dir(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
    }


def _boom_on_rank_1() -> None:
    if dist.get_rank() == 1:
        time.sleep(0.5)  # let the others block in the collective first
        raise ValueError("boom-rank-1")
    dist.all_reduce(torch.ones(1))


def _hang_on_rank_1() -> int:
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def _hang_on_rank_1_in_dp_group() -> None:
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(1), group=layout().dp_group)


def _exit_silently_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


# --- tests ----------------------------------------------------------------------------------

LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)]


@pytest.mark.dist
@pytest.mark.parametrize(("dp", "cp", "pp"), LAYOUTS, ids=lambda v: str(v))
def test_layout_and_collectives(tmp_path, dp, cp, pp):
    world = dp * cp * pp
    res = run_ranks(_layout_and_sums, dp=dp, cp=cp, pp=pp, args=(1.5,), tmp_path=tmp_path)

    assert [r["rank"] for r in res] == list(range(world))
    assert {r["world"] for r in res} == {world}
    assert {r["sizes"] for r in res} == {(dp, cp, pp)}
    # Real parallel_state getters agree with the harness's own map (used in failure reports)
    # and every grid cell is hit exactly once.
    assert [r["coords"] for r in res] == [rank_coords(i, dp=dp, cp=cp, pp=pp) for i in range(world)]
    assert sorted(r["coords"] for r in res) == list(
        itertools.product(range(dp), range(cp), range(pp))
    )

    def expected(i: int, free: int) -> float:
        # Sum of 1.5*(rank+1) over the ranks sharing every coordinate but `free`.
        ci = res[i]["coords"]
        return sum(
            1.5 * (j + 1)
            for j in range(world)
            if all(
                a == b
                for k, (a, b) in enumerate(zip(ci, res[j]["coords"], strict=True))
                if k != free
            )
        )

    for i, r in enumerate(res):
        assert r["dp_sum"] == expected(i, 0), (i, r)
        assert r["cp_sum"] == expected(i, 1), (i, r)
        assert r["pp_sum"] == expected(i, 2), (i, r)
        dp_i, cp_i, _ = r["coords"]
        assert r["pp_last"] == cp_i + cp * dp_i + cp * dp * (pp - 1)
        assert r["run_dir_exists"]
        assert r["omp"] == "1"
        assert r["threads"] == 1


@pytest.mark.dist
def test_error_on_one_rank_is_reported_as_root_cause(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(DistTestFailure) as info:
        run_ranks(_boom_on_rank_1, dp=2, cp=2, timeout=60.0, tmp_path=tmp_path)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    # Peers see closed connections at once: far below the 30 s gloo timeout and 60 s bound.
    assert elapsed < 20.0, msg
    assert "rank 1 (dp=0, cp=1, pp=0) raised builtins.ValueError: boom-rank-1" in msg
    assert "[root cause]" in msg
    traceback_part = msg.split("--- traceback of rank 1 ---")[1].split("--- all ranks ---")[0]
    assert "_boom_on_rank_1" in traceback_part
    assert 'raise ValueError("boom-rank-1")' in traceback_part
    assert "rank 0 (dp=0, cp=0, pp=0): " in msg


@pytest.mark.dist
def test_hanging_rank_is_killed_and_named(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(DistTestFailure) as info:
        # Gloo timeout above the bound: the peer stays blocked, only the overall bound fires.
        run_ranks(_hang_on_rank_1, dp=2, timeout=5.0, collective_timeout=60.0, tmp_path=tmp_path)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert 5.0 <= elapsed < 9.0, msg
    assert "TIMEOUT: did not finish within 5s (killed): " in msg
    assert "rank 1 (dp=1, cp=0, pp=0)" in msg.split("\n")[1]
    # faulthandler stack of the stuck rank shows where it hung.
    log1 = msg.split("--- log tail of rank 1")[1]
    assert "_hang_on_rank_1" in log1, msg


@pytest.mark.dist
def test_gloo_timeout_reaches_megatron_groups(tmp_path, monkeypatch):
    # The short gloo timeout applies to Megatron's DP group too (distributed_timeout_minutes),
    # so the blocked peer gives up after 2 s; the stuck rank is then killed after the grace.
    monkeypatch.setattr(harness, "FAIL_GRACE_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(DistTestFailure) as info:
        run_ranks(
            _hang_on_rank_1_in_dp_group,
            dp=2,
            timeout=30.0,
            collective_timeout=2.0,
            tmp_path=tmp_path,
        )
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert elapsed < 10.0, msg
    assert "TIMEOUT" not in msg
    assert "ROOT CAUSE (likely): still running after the others failed: rank 1" in msg
    assert "Timed out waiting 2000ms" in msg
    assert "rank 1 (dp=1, cp=0, pp=0): killed: still running 1s after another rank failed" in msg


@pytest.mark.dist
def test_rank_dying_without_error_is_reported(tmp_path):
    with pytest.raises(DistTestFailure) as info:
        run_ranks(_exit_silently_on_rank_1, dp=2, timeout=30.0, tmp_path=tmp_path)
    msg = str(info.value)
    assert "ROOT CAUSE (likely): rank 1 (dp=1, cp=0, pp=0) died with exit code 3" in msg
    assert "rank 1 (dp=1, cp=0, pp=0): died with exit code 3" in msg
    assert "rank 0 (dp=0, cp=0, pp=0): raised" in msg  # its peer error is shown, not blamed
    assert "only peer/collective errors were seen" in msg


def test_root_cause_prefers_own_error_over_earlier_peer_error():
    errors = {
        0: {"time": 1.0, "peer_error": True},
        2: {"time": 3.0, "peer_error": False},
        3: {"time": 2.0, "peer_error": False},
    }
    assert _pick_root_cause(errors) == 3
    assert _pick_root_cause({1: {"time": 5.0, "peer_error": True}, 0: errors[0]}) == 0


def test_rank_coords_megatron_order():
    # tp-cp-ep-dp-pp: CP varies fastest, PP slowest.
    assert [rank_coords(r, dp=2, cp=2, pp=2) for r in range(8)] == [
        (0, 0, 0),
        (0, 1, 0),
        (1, 0, 0),
        (1, 1, 0),
        (0, 0, 1),
        (0, 1, 1),
        (1, 0, 1),
        (1, 1, 1),
    ]
    with pytest.raises(ValueError):
        rank_coords(8, dp=2, cp=2, pp=2)


def test_unimportable_functions_are_refused():
    with pytest.raises(TypeError, match="module-level"):
        run_ranks(lambda: None)

    def local():
        return None

    with pytest.raises(TypeError, match="module-level"):
        run_ranks(local)
    with pytest.raises(ValueError, match="dp must be"):
        run_ranks(_hang_on_rank_1, dp=0)


class _EditableFinder(importlib.abc.MetaPathFinder):
    """What pip's editable install registers from a .pth: a package found by a meta-path
    finder, its directory not on sys.path."""

    def __init__(self, name: str, init: Path):
        self.name, self.init = name, init

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        return importlib.util.spec_from_file_location(
            fullname, self.init, submodule_search_locations=[str(self.init.parent)]
        )


def test_a_package_found_only_by_a_meta_path_finder_is_accepted(tmp_path, monkeypatch):
    import gloo_ranks as _launch

    package = tmp_path / "hidden_pkg_for_launch"
    package.mkdir()
    (package / "__init__.py").write_text("def fn():\n    return 1\n")
    assert not _launch._findable("hidden_pkg_for_launch")  # neither on sys.path nor found
    monkeypatch.setattr(
        sys, "meta_path", [*sys.meta_path, _EditableFinder(package.name, package / "__init__.py")]
    )
    monkeypatch.delitem(sys.modules, "hidden_pkg_for_launch", raising=False)
    import hidden_pkg_for_launch

    assert _launch._check_target(hidden_pkg_for_launch.fn) == ("hidden_pkg_for_launch", "fn")
    monkeypatch.delitem(sys.modules, "hidden_pkg_for_launch")
