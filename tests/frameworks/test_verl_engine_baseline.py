"""VCPO's minimum-variance baseline on verl's engine path (``ActorRolloutRefWorker.update_actor``
-> ``TrainingWorker.train_mini_batch`` -> ``train_batch`` -> ``MegatronEngineWithLMHead``), the
only actor path from verl v0.8.0, through verl's REAL code on every engine tree users run: the
``verl-*`` snapshots from v0.7.0 and the PyPI wheel.

``verl_engine_baseline_rank.py`` runs verl's engine end to end on megatron-core's GPTModel
(local spec: RMSNorm, SwiGLU, GQA, rope, no bias, untied): the driver's own batch
(``to_tensordict``, ``left_right_2_no_padding``), verl's engine forward packed (THD,
``use_remove_padding``) and padded (bshd), ``ppo_loss`` PPO-clipped at eps 0.2, megatron-core's
schedule and optimizer. Each row verl's policy loss gets is checked against ``A - b*`` with
``b*`` from one backward per trajectory (``verl_baseline_rank.expected_probe``), and the
log-probs verl's forward computed before the first step against the brute-force ones: DP1,
DP2 (both prompt groups split over the ranks), TP2, DP2 x TP2 and PP2.

Trees that need another megatron-core (verl >= 0.9: 0.17.1) run their cases in a fresh
interpreter that imports it, as ``test_verl_engine.py`` does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: harness
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import run_ranks
from megatron_versions import child_env
from test_verl import SNAPSHOTS, has_legacy_actor
from test_verl_baseline import ACTOR, LAYOUTS, _check_applied, _expected
from test_verl_engine import (
    CORE_FOR_09,
    ENV_INNER,
    RELEASES,
    _core,
    _runs_here,
    _skip_reason,
    _tree,
)
from upstream import run_pytest

HERE = Path(__file__).resolve().parent

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason())),
]

#: the trees this interpreter runs, and those that run in a fresh one with their megatron-core
TREES = [name for name in RELEASES if _runs_here(name)]
ELSEWHERE = [name for name in RELEASES if not _runs_here(name) and not os.environ.get(ENV_INNER)]


def _engine_only(name: str) -> bool:
    """Whether a tree has the engine path alone (v0.8.0 on; the wheel is 0.9.1)."""
    tree = next((p for p in SNAPSHOTS if p.name == name), None)
    return tree is None or not has_legacy_actor(tree)


#: the newest tree of each megatron-core (an engine-only one first among equal releases:
#: @b178a3cd5 is a v0.8.0.dev0 with the legacy actor): the TP / PP matrix and the features
NEWEST = [
    max((n for n in RELEASES if _core(n) == core), key=lambda n: (RELEASES[n], _engine_only(n)))
    for core in (None, CORE_FOR_09)
]
#: the rollout's 8 rows in global mini-batches of 4 (2 optimizer steps), micro-batches of 2
HYDRA = [f"{ACTOR}.ppo_mini_batch_size=4", f"{ACTOR}.ppo_micro_batch_size_per_gpu=2"]
ON = [*HYDRA, f"+{ACTOR}.grad_baselining.enable=true"]


def _rank(src: str, scenario: dict) -> dict:
    sys.path.insert(0, str(HERE))
    import verl_engine_baseline_rank

    return verl_engine_baseline_rank.run(src, scenario)


def _run(tmp_path: Path, src: Path, scenario: dict, **layout) -> list[dict]:
    return run_ranks(_rank, args=(str(src), scenario), tmp_path=tmp_path, timeout=400, **layout)


def _cases(names: list[str], layouts: tuple[str, ...] = tuple(LAYOUTS)) -> list:
    return [
        pytest.param(name, layout, id=f"{name}-{layout}")
        for name in names
        if name in TREES
        for layout in layouts
    ]


@pytest.mark.parametrize(("name", "layout"), _cases(list(RELEASES)))
def test_the_engine_trains_on_r_minus_b_star_from_brute_force_norms(tmp_path, name, layout):
    """VCPO's key through verl's real config; verl's real engine path (update_actor,
    train_mini_batch, train_batch, the Megatron engine's own forward packed or padded, ppo_loss)
    on the driver's own batch, GRPO's advantages from compute_grpo_outcome_advantage: every
    mini-batch trains on A - b* (b* from one backward per trajectory), single process and
    DP2 (both groups split over the ranks), and DP2 with verl's shuffled mini-batches over two
    epochs; the metrics say so; the caller's batch is kept."""
    src = _tree(name)
    expect = _expected(tmp_path, src)
    hydra = [*ON, *LAYOUTS[layout]]
    shuffle = [f"{ACTOR}.shuffle=true", f"{ACTOR}.ppo_epochs=2", f"{ACTOR}.data_loader_seed=0"]
    b_star = [a - e for a, e in zip(expect["grpo"], expect["expected"], strict=True)]
    for case, dp, extra in (("dp1", 1, []), ("dp2", 2, []), ("shuffled", 2, shuffle)):
        ranks = _run(tmp_path / case, src, {"hydra": [*hydra, *extra]}, dp=dp)
        _check_applied(expect, ranks)
        epochs = 2 if extra else 1
        assert sum(len(r["seen"]) for r in ranks) == 8 * epochs
        for r in ranks:
            m = r["metrics"]
            assert m["ess_baseline_applied"] == [1.0] * 2 * epochs  # one per optimizer step
            assert m["ess_baseline_fallback_groups"][0] == 0.0
            assert m["ess_baseline_split_groups"][0] == (2.0 if dp == 2 else 0.0)
            assert m["ess_baseline_norm_pass_s"][0] > 0
            shift = (b_star[0] + b_star[4]) / 2  # b* minus the group mean (0 for GRPO's A)
            assert m["ess_baseline_shift"][0] == pytest.approx(shift, abs=1e-5)
            assert r["caller_data_kept"] and not r["params_unchanged"]


@pytest.mark.parametrize(("name", "layout"), _cases(NEWEST))
def test_the_engine_in_tp2_dp2_x_tp2_and_pp2(tmp_path, name, layout):
    """TP2 and DP2 x TP2 (vocabulary-parallel logits): A - b* with b* from one backward per
    trajectory on that sharded model, summed over TP; PP2 through megatron-core's pipeline
    schedule (the norm pass crosses the stages): the last stage's loss gets A - b* on rules,
    exact and proxy, and both stages end with the weights of the one-process run (rules,
    exact)."""
    import torch
    from pipeline_ranks import stage_weights

    src = _tree(name)
    expect = _expected(tmp_path, src)
    hydra = [*ON, *LAYOUTS[layout]]
    for world in (2, 4):
        ranks = _run(tmp_path / f"tp{world}", src, {"hydra": hydra, "tp": 2}, dp=world)
        want = ranks[0]["expected_here"]
        assert want == pytest.approx(expect["expected"], rel=1e-5, abs=1e-6)
        assert sorted((r["dp"], r["tp"]) for r in ranks) == [
            (d, t) for d in range(world // 2) for t in range(2)
        ]
        _check_applied(expect, ranks, want=want)
    (one,) = _run(tmp_path / "one", src, {"hydra": hydra})
    for path, want in (
        ("rules", expect["expected"]),
        ("exact", expect["expected"]),
        ("proxy", expect["expected_proxy"]),
    ):
        scenario = {"hydra": hydra, "pp": 2, "env": {"ESS_LR_BASELINE_PATH": path}}
        ranks = _run(tmp_path / path, src, scenario, pp=2)
        assert [r["pp"] for r in ranks] == [0, 1]
        assert "error" not in ranks[0], ranks[0]["error"]
        assert ranks[0]["seen"] == []  # the loss runs on the last stage alone
        _check_applied(expect, [ranks[1]], want=want)
        assert ranks[1]["metrics"]["ess_baseline_applied"] == [1.0, 1.0]
        for r in ranks:
            assert not r["params_unchanged"]
            if path == "proxy":  # another b*: other weights
                continue
            mine = stage_weights(one["state"], r["pp"], 2, 2)
            assert sorted(mine) == sorted(r["state"])
            for key, value in r["state"].items():
                # two Adam steps at lr 1e-2 (each moves a weight by about 1e-2), summed in
                # another order over the stages: float32 rounding, far below one step
                diff = (value - mine[key]).abs().max().item()
                assert torch.allclose(value, mine[key], rtol=1e-4, atol=1e-5), (path, key, diff)


@pytest.mark.parametrize("name", [n for n in RELEASES if n in TREES])
def test_the_engine_off_and_shadow_train_bit_identically_to_unpatched_verl(tmp_path, name):
    """DP2: unpatched verl, installed with the baseline off, and in shadow mode: the same
    advantages seen and the same parameters, bit for bit (GRPO's own advantages); shadow logs
    the shift the on run applies, with applied 0."""
    import torch

    src = _tree(name)
    expect = _expected(tmp_path, src)
    runs = {
        case: _run(tmp_path / case, src, scenario, dp=2)
        for case, scenario in {
            "plain": {"hydra": HYDRA, "no_install": True},
            "off": {"hydra": HYDRA},
            "shadow": {"hydra": HYDRA, "env": {"ESS_LR_BASELINE_SHADOW": "1"}},
        }.items()
    }
    for case in ("off", "shadow"):
        for plain, other in zip(runs["plain"], runs[case], strict=True):
            assert "error" not in other, other["error"]
            assert other["seen"] == plain["seen"]
            assert all(
                torch.equal(a, b) for a, b in zip(plain["params"], other["params"], strict=True)
            )
    _check_applied(expect, runs["plain"], want=expect["grpo"])
    b_star = [a - e for a, e in zip(expect["grpo"], expect["expected"], strict=True)]
    for r in runs["shadow"]:
        assert r["metrics"]["ess_baseline_applied"] == [0.0, 0.0]
        shift = r["metrics"]["ess_baseline_shift"][0]
        assert shift == pytest.approx((b_star[0] + b_star[4]) / 2, abs=1e-5)
    assert all(r["metrics"] == {} for r in runs["off"])


@pytest.mark.parametrize("name", [n for n in NEWEST if n in TREES])
def test_the_engine_proxy_dynamic_bsz_and_ess_lr_beside_the_baseline_dp2(tmp_path, name):
    """path=proxy: A - b* with the proxy's b* (computed by hand), not the exact one;
    use_dynamic_bsz (verl regroups each mini-batch into micro-batches of at most 12 tokens):
    A - b* on every row; with ESS-LR on beside the baseline (ESS_LR_ENABLE=1) both apply: the
    exact b* in the advantages and each step's LR scaled (lr_scale below 1)."""
    src = _tree(name)
    expect = _expected(tmp_path, src)
    proxy = [*ON, f"+{ACTOR}.grad_baselining.path=proxy"]
    _check_applied(
        expect, _run(tmp_path / "proxy", src, {"hydra": proxy}, dp=2), want=expect["expected_proxy"]
    )
    dynamic = _run(tmp_path / "dynamic", src, {"hydra": ON, "dynamic_bsz": True}, dp=2)
    _check_applied(expect, dynamic)
    rows = [n for r in dynamic for n in r["micro_batch_rows"]]
    assert 1 in rows and sum(rows) == 8, rows  # regrouped (fixed micro-batches hold 2 rows)
    assert all(r["metrics"]["ess_baseline_applied"] == [1.0, 1.0] for r in dynamic)
    both = _run(tmp_path / "both", src, {"hydra": ON, "env": {"ESS_LR_ENABLE": "1"}}, dp=2)
    _check_applied(expect, both)
    assert {n for r in both for n in r["micro_batch_rows"]} == {2}
    for r in both:
        assert r["metrics"]["ess_baseline_applied"] == [1.0, 1.0]
        scales = r["lr_scale"]
        assert len(scales) == 2 and all(0 < s < 1 for s in scales), scales


@pytest.mark.parametrize(
    ("layout", "scenario", "message"),
    [
        ({"cp": 2}, {}, "context_parallel_size is 2"),
        ({}, {"gae_like": True}, "advantage differs between its tokens"),
        ({}, {"temperature": 0.7}, "the rollout temperature is 0.7"),
        ({}, {"tamper": "drop"}, "TrainingWorker.train_mini_batch did not make"),
        ({}, {"tamper": "double"}, "are not the rewritten rewards (r - b*)"),
        ({}, {"strategy": "fsdp"}, "verl's 'fsdp' engine lends no Megatron model"),
    ],
    ids=["cp2", "gae_advantages", "temperature", "unknown_rows", "read_back", "fsdp"],
)
@pytest.mark.parametrize("name", [n for n in NEWEST if n in TREES and _core(n) is None])
def test_what_the_engine_cannot_serve_stops_every_rank_first(
    tmp_path, name, layout, scenario, message
):
    """Refused by name on every rank before any step (nothing trained, the parameters as
    they were): CP2, a critic's per-token advantages, a temperature other than 1, mini-batches
    whose rows are unknown or whose advantages changed after the rewrite, an FSDP actor."""
    src = _tree(name)
    ranks = _run(tmp_path, src, {"hydra": ON, **scenario}, dp=2, **layout)
    for r in ranks:
        assert message in r.get("error", ""), r.get("error")
        assert "baseline was requested" in r["error"]
        assert r["seen"] == [] and r["params_unchanged"]


@pytest.mark.parametrize("name", ELSEWHERE)
def test_each_tree_on_its_megatron_core(tmp_path, name):
    """The cases of a tree that needs another megatron-core (verl >= 0.9: 0.17.1), all in
    one fresh interpreter that imports it; every one must pass there."""
    _tree(name)  # installs the wheel here, once, or skips
    env = {**child_env(_core(name)), ENV_INNER: name, "OMP_NUM_THREADS": "1"}
    args = ["-k", f"{name} and not test_each_tree_on_its_megatron_core"]
    passed, skipped, tail = run_pytest(Path(__file__), env, tmp_path, timeout=3000, extra_args=args)
    assert passed and not skipped, tail
    assert all(name in case for case in passed), passed
    newest = name in NEWEST
    expected = len(LAYOUTS) + 1 + (len(LAYOUTS) + 1 if newest else 0)
    assert len(passed) == expected, (sorted(passed), tail)
