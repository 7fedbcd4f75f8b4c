"""ESS-LR on verl's engine path through verl's REAL Megatron engine, on every verl tree users
run: each ``verl-*`` snapshot folder and the PyPI wheel (``verl_wheel.py``).

``verl_engine_rank.py`` runs, on fresh gloo ranks with real megatron process groups, verl's
``update_actor`` -> ``train_mini_batch`` -> ``train_batch`` -> ``MegatronEngine.train_batch``
-> megatron-core's schedule and ``optimizer_step`` around a real megatron-core optimizer
(only the model is a stand-in). The parent recomputes, in float64 from the whole rollout
(``tests/reference.py``), the ESS scale of each optimizer step over the samples that step
trained on (read back from what the schedule fed the model on every DP rank) and checks the
LR each inner update applied: scheduled LR x that scale, exactly once; the critic, stepped
next in the same process, unscaled; the LRs the scheduler's own afterwards; ESS-LR off: the
same parameters bit for bit as an unpatched run.

Each tree runs with a megatron-core it supports: verl >= 0.9 wraps its DDP with a name that
exists only in megatron-core >= 0.17, so those trees run on 0.17.1 (installed once into the
cache of ``tests/megatron_versions.py``), each case re-running itself in a fresh interpreter
that imports it; the others on the environment's own megatron-core. The full layout matrix
runs on the newest snapshot and on the wheel; the other trees run DP2 (the rest is ``slow``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: harness, reference
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import run_ranks
from megatron_versions import child_env, installed_core
from reference import reference_ess
from test_verl import NEWEST, SKIP, SNAPSHOTS, _batch, _expected_scales, has_engine_path, release
from upstream import run_pytest
from verl_wheel import WHEEL_VERSION, wheel_skip_reason, wheel_tree

HERE = Path(__file__).resolve().parent
#: set in the fresh interpreter a case re-runs itself in (it then runs in-process)
ENV_INNER = "ESS_PATCH_VERL_INNER"
#: the megatron-core that verl >= 0.9 needs (its DDP wrap imports tag_params_for_buffer_routing)
CORE_FOR_09 = "0.17.1"

WHEEL = f"verl-{WHEEL_VERSION}-wheel"
#: every tree with the engine path (from verl v0.7.0; v0.6.x's legacy actor is test_verl.py's)
#: and the verl release it is
RELEASES = {p.name: release(p) for p in SNAPSHOTS if has_engine_path(p)} | {
    WHEEL: Version(WHEEL_VERSION)
}
FULL = [p.name for p in NEWEST] + [WHEEL]  # the full layout matrix (DP2, CP2, PP2)
FEATURES = [p.name for p in NEWEST]  # VCPO keys, rollout, shadow, off, refusals


def _core(name: str) -> str | None:
    """The megatron-core a tree runs with (None: the environment's own)."""
    return CORE_FOR_09 if RELEASES[name] >= Version("0.9.0.dev0") else None


def _runs_here(name: str) -> bool:
    if os.environ.get(ENV_INNER):  # the fresh interpreter of one tree
        return name == os.environ[ENV_INNER]
    return _core(name) in (None, installed_core())


#: the trees this interpreter runs; each other one runs this whole file in a fresh
#: interpreter with its megatron-core (test_each_tree_on_its_megatron_core)
TREES = [name for name in RELEASES if _runs_here(name)]
ELSEWHERE = [name for name in RELEASES if not _runs_here(name) and not os.environ.get(ENV_INNER)]


def _skip_reason() -> str | None:
    if SKIP is not None:
        return SKIP
    from importlib.util import find_spec

    if find_spec("peft") is None:  # verl's Megatron engine module imports it
        return "verl's Megatron engine needs peft and accelerate: pip install -r " + (
            "tests/frameworks/requirements-verl.txt (with torch pinned)"
        )
    return None


pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason())),
]


def _tree(name: str) -> Path:
    if name == WHEEL:
        reason = wheel_skip_reason()
        if reason:
            pytest.skip(reason)
        return wheel_tree()
    return next(p for p in SNAPSHOTS if p.name == name)


@pytest.mark.parametrize("name", ELSEWHERE)
def test_each_tree_on_its_megatron_core(tmp_path, name):
    """The cases of a tree that needs another megatron-core (verl >= 0.9: 0.17.1), all in
    one fresh interpreter that imports that megatron-core; every one must pass there."""
    _tree(name)  # installs the wheel here, once, or skips
    env = {**child_env(_core(name)), ENV_INNER: name, "OMP_NUM_THREADS": "1"}
    args = ["-m", "not slow", "-k", f"{name} and not test_each_tree_on_its_megatron_core"]
    passed, skipped, tail = run_pytest(Path(__file__), env, tmp_path, timeout=3000, extra_args=args)
    assert passed and not skipped, tail
    assert all(name in case for case in passed), passed
    expected = 1 + (2 if name in FULL else 0) + (1 + 1 + 3 if name in FEATURES else 0)
    assert len(passed) == expected, (sorted(passed), tail)


def _rank(src: str, scenario: dict) -> dict:
    sys.path.insert(0, str(HERE))
    import verl_engine_rank

    return verl_engine_rank.run(src, scenario)


def _run(tmp_path: Path, tree: Path, scenario: dict, *, dp=2, cp=1, pp=1) -> list[dict]:
    results = run_ranks(
        _rank,
        dp=dp,
        cp=cp,
        pp=pp,
        args=(str(tree), scenario),
        tmp_path=tmp_path / "ranks",
        # each rank imports verl's engine (datasets, ray, transformers, peft): minutes on a
        # loaded 2-core machine
        timeout=600,
        collective_timeout=300,
    )
    if os.environ.get(ENV_INNER):  # the fresh interpreter really runs the core it was given
        from megatron.core import package_info

        assert Version(package_info.__version__).public == _core(os.environ[ENV_INNER])
    return results


def _check(results: list[dict], expected: list[dict], *, applied: bool = True) -> None:
    """Every rank: one inner update per mini-batch at scheduled LR x that step's reference
    scale (or unscaled in shadow mode), nothing armed after, the scheduler's LRs after, the
    critic unscaled; on the ranks verl gathers metrics from, one value per step."""
    for r in results:
        assert "error" not in r, r["error"]
        assert len(r["applied"]) == len(expected), "one inner update per mini-batch"
        for lrs, ref in zip(r["applied"], expected, strict=True):
            scale = ref["scale"] if applied else 1.0
            for lr, scheduled in zip(lrs, r["scheduled"], strict=True):
                assert lr == pytest.approx(scheduled * scale, rel=1e-9)
        assert r["armed_after"] is None
        assert r["after"] == r["scheduler_after"]  # what the scheduler set, never a scaled LR
        assert r["critic_applied"] and all(
            lrs == r["critic_scheduled"] for lrs in r["critic_applied"]
        )
    with_metrics = [r for r in results if r["metrics"] is not None]
    assert with_metrics, "verl returns the metrics on some rank"
    key = "lr_scale" if applied else "ess_lr_shadow_scale"
    for r in with_metrics:
        assert r["metrics"][key] == pytest.approx([e["scale"] for e in expected], rel=1e-9)
        assert r["metrics"]["rho_ess"] == pytest.approx([e["rho"] for e in expected], rel=1e-9)


ON = {"ESS_LR_ENABLE": "1", "ESS_LR_FLOOR": "0.05"}


@pytest.mark.parametrize("name", TREES)
def test_each_engine_step_uses_its_mini_batch_scale_dp2(tmp_path, name):
    """Shuffled mini-batches: each engine optimizer step at its own mini-batch's scale."""
    tree = _tree(name)
    results = _run(tmp_path, tree, {"env": ON, "shuffle": True})
    expected = _expected_scales(results, floor=0.05)
    assert len(expected) == 2 and expected[0]["scale"] != expected[1]["scale"]
    assert all(e["scale"] < 1 for e in expected)
    _check(results, expected)
    shapes = results[0]["shapes"]["verl"]
    assert "engine update_actor(data) -> TrainingWorker.train_mini_batch" in shapes
    legacy = (tree / "verl" / "workers" / "actor" / "megatron_actor.py").is_file()
    path = "the legacy Megatron actor and the engine path" if legacy else "the engine path"
    assert f"actor through {path}" in shapes


def _here(names: list[str]) -> list:
    """``names`` as parameters: a tree this interpreter does not run says where it runs
    (no empty parameter set, no silent skip)."""
    return [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                name not in TREES,
                reason=f"{name} runs with megatron-core {_core(name)}: in the fresh interpreter "
                f"of test_each_tree_on_its_megatron_core[{name}]",
            ),
        )
        for name in names
    ]


def _layouts() -> list:
    cases = []
    for name in TREES:
        for cp, pp in ((2, 1), (1, 2)):
            marks = () if name in FULL else (pytest.mark.slow,)
            cases.append(pytest.param(name, cp, pp, id=f"{name}-cp{cp}-pp{pp}", marks=marks))
    return cases


@pytest.mark.parametrize(("name", "cp", "pp"), _layouts())
def test_cp_and_pp_ranks_apply_the_dp_scale(tmp_path, name, cp, pp):
    """DP2 x CP2 and DP2 x PP2: CP ranks hold the same sequences, every stage the batch; the
    scale is the one over DP alone on every rank; metrics on TP0 / CP0 / last stage only."""
    tree = _tree(name)
    results = _run(tmp_path, tree, {"env": ON, "cp": cp}, dp=2, cp=cp, pp=pp)
    assert len(results) == 4
    _check(results, _expected_scales(results, floor=0.05))
    holders = {r["coords"] for r in results if r["metrics"] is not None}
    assert holders == {(d, 0, pp - 1) for d in (0, 1)}


@pytest.mark.parametrize("name", _here(FEATURES))
def test_vcpo_keys_two_epochs_and_rollout_granularity(tmp_path, name):
    """VCPO's actor.ess_scaling keys (product weights, linear rule, base ratio, clipped
    weights) over two shuffled epochs of verl's mini-batches with dynamic batch size; then
    granularity "rollout": one ESS for every step."""
    tree = _tree(name)
    scaling = {"enable": True, "scaling_rule": "linear", "base_ess_ratio": 0.8}
    clipped = {**scaling, "use_clipped": True, "rollout_is_threshold": 1.5}
    vcpo = {"strategy": "megatron", "ess_scaling": clipped}
    scenario = {
        "env": {"ESS_LR_FLOOR": "0.01"},
        "actor_config": vcpo,
        "epochs": 2,
        "shuffle": True,
        "dynamic_bsz": True,  # verl regroups micro-batches by tokens; the steps stay the same
    }
    results = _run(tmp_path / "vcpo", tree, scenario)
    rule = {"mode": "product", "rule": "linear", "base_ratio": 0.8, "floor": 0.01}
    expected = _expected_scales(results, weight_clip=1.5, **rule)
    assert len(expected) == 4
    unclipped = _expected_scales(results, **rule)
    assert any(e["scale"] != u["scale"] for e, u in zip(expected, unclipped, strict=True))
    _check(results, expected)

    env = {**ON, "ESS_LR_GRANULARITY": "rollout"}
    results = _run(tmp_path / "rollout", tree, {"env": env})
    batch = _batch()
    whole = reference_ess(
        [x.double() for x in batch["old_log_probs"]],
        [x.double() for x in batch["rollout_log_probs"]],
        list(batch["mask"]),
        floor=0.05,
    )
    _check(results, [whole, whole])


@pytest.mark.parametrize("name", _here(FEATURES))
def test_shadow_logs_and_off_is_bit_exact(tmp_path, name):
    """Shadow mode: each step's scale logged as ess_lr_shadow_scale, LRs unscaled. Off
    (installed, not enabled): the same parameters, bit for bit, as without install()."""
    tree = _tree(name)
    results = _run(
        tmp_path / "shadow", tree, {"env": {"ESS_LR_SHADOW": "1", "ESS_LR_FLOOR": "0.05"}}
    )
    _check(results, _expected_scales(results, floor=0.05), applied=False)
    off = _run(tmp_path / "off", tree, {"env": {}})
    plain = _run(tmp_path / "plain", tree, {"env": {}, "no_install": True})
    for a, b in zip(off, plain, strict=True):
        assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
        assert a["applied"] == b["applied"] == [a["scheduled"]] * 2  # two mini-batches
        assert all(torch_equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
        assert not any("lr_scale" in k or "rho_ess" in k for k in a["metrics"] or {})


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ({"bypass": True}, "old_log_probs equal rollout_log_probs"),
        ({"no_rollout_log_probs": True}, "rollout.calculate_log_probs=True"),
        ({"actor_config": {"strategy": "fsdp"}}, "strategy 'fsdp' is not supported"),
    ],
    ids=["bypass_mode", "no_rollout_log_probs", "fsdp_engine"],
)
@pytest.mark.parametrize("name", _here(FEATURES))
def test_bad_input_one_error_on_every_rank_nothing_changed(tmp_path, name, scenario, message):
    tree = _tree(name)
    results = _run(tmp_path, tree, {**scenario, "env": {"ESS_LR_ENABLE": "1"}})
    for r in results:
        assert message in r.get("error", ""), r.get("error")
        assert r["applied"] == [] and r["after"] == r["scheduled"] and r["armed_after"] is None
