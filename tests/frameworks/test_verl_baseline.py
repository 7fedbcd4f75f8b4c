"""VCPO's minimum-variance baseline in verl (``ESS_LR_BASELINE*``, VCPO's
``actor.grad_baselining``), through verl's REAL code on the snapshots the verl tests use.

Here: the legacy Megatron actor (v0.6.0 to v0.7.x) through its real train step; the engine
path (v0.7.0 to main) is ``test_verl_engine_baseline.py``. Every verl path that cannot apply
the baseline refuses it by name, before anything runs: the legacy FSDP actor, main's Tinker
worker. The settings themselves (which keys, which values) are checked without verl.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: harness
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import run_ranks
from test_verl import (
    LEGACY,
    NEWEST,
    ONE_OF_EACH,
    SKIP,
    has_legacy_actor,
)

from ess_patch.errors import EssPatchValueError
from ess_patch.integrations.verl.baseline_config import baseline_settings

HERE = Path(__file__).resolve().parent
needs_verl = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


# --- the settings (no verl) -------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    for key in ("ESS_LR_BASELINE", "ESS_LR_BASELINE_SHADOW", "ESS_LR_BASELINE_PATH"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_off_unless_asked(clean_env):
    assert baseline_settings({}) is None
    assert baseline_settings({"grad_baselining": {"enable": False}}) is None
    assert baseline_settings(None) is None


def test_each_way_to_ask(clean_env):
    on = baseline_settings({"grad_baselining": {"enable": True, "path": "exact"}})
    assert (on.mode, on.path, on.use_is_weights, on.source) == (
        "on",
        "exact",
        True,
        "actor.grad_baselining.enable",
    )
    clean_env.setenv("ESS_LR_BASELINE_SHADOW", "1")
    clean_env.setenv("ESS_LR_BASELINE_PATH", "proxy")
    shadow = baseline_settings({"grad_baselining": {"use_is_weights": False}})
    assert (shadow.mode, shadow.path, shadow.use_is_weights, shadow.source) == (
        "shadow",
        "proxy",
        False,
        "ESS_LR_BASELINE_SHADOW=1",
    )


def test_vcpos_own_dataclass_node_is_read(clean_env):
    """VCPO's fork builds actor.grad_baselining as its GradBaselineConfig dataclass: read
    field by field. Every field is given there, norm_by_std too, and that one is refused by
    name (the std is verl's algorithm.norm_adv_by_std_in_grpo, which the actor cannot see)."""
    from dataclasses import dataclass

    @dataclass
    class GradBaselineConfig:  # mit-han-lab/vcpo verl/workers/config/actor.py, verbatim fields
        enable: bool = False
        scope: str = "group"
        agg_mode: str = "mean"
        use_is_weights: bool = True
        use_clipped_is_ratios: bool = False
        normalize_by_length: bool = False
        norm_by_std: bool = False

    class Actor:
        grad_baselining = GradBaselineConfig()

    assert baseline_settings(Actor()) is None  # enable false: off
    Actor.grad_baselining = GradBaselineConfig(enable=True)
    with pytest.raises(EssPatchValueError, match="norm_by_std"):
        baseline_settings(Actor())


@pytest.mark.parametrize(
    ("node", "env", "match"),
    [
        ({"enable": True, "shadow": True}, {}, "both on"),
        ({"shadow": True}, {"ESS_LR_BASELINE": "1"}, "both on"),
        ({"enable": True, "scope": "minibatch"}, {}, "scope='minibatch'"),
        ({"enable": True, "agg_mode": "median"}, {}, "agg_mode='median'"),
        ({"enable": True, "use_clipped_is_ratios": True}, {}, "use_clipped_is_ratios=true"),
        ({"enable": True, "normalize_by_length": True}, {}, "normalize_by_length=true"),
        ({"enable": True, "norm_by_std": True}, {}, "norm_adv_by_std_in_grpo"),
        ({"enable": True, "path": "fast"}, {}, "path='fast'"),
        ({"enabled": True}, {}, "unknown key"),
        ({"enable": "maybe"}, {}, "must be a bool"),
        ({}, {"ESS_LR_BASELINE": "maybe"}, "ESS_LR_BASELINE='maybe'"),
    ],
)
def test_what_it_does_not_do_is_refused_by_name(clean_env, node, env, match):
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises(EssPatchValueError, match=match):
        baseline_settings({"grad_baselining": node})


def test_the_baseline_variables_are_known_to_install(clean_env):
    """install() refuses unknown ESS_LR_* variables: the baseline's three are known."""
    from ess_patch.config import ENV_NAMES, check_env_names
    from ess_patch.integrations.baseline_flags import ENV_ON, ENV_PATH, ENV_SHADOW

    assert {ENV_ON, ENV_SHADOW, ENV_PATH} <= set(ENV_NAMES)
    check_env_names({ENV_ON: "1", ENV_PATH: "exact"})
    with pytest.raises(EssPatchValueError, match="ESS_LR_BASELIN is not an ESS-LR setting"):
        check_env_names({"ESS_LR_BASELIN": "1"})


# --- the paths that cannot apply it -----------------------------------------------------------


def _probe(name: str, *args):
    sys.path.insert(0, str(HERE))
    import verl_baseline_rank

    return getattr(verl_baseline_rank, name)(*args)


def _has_tinker(src: Path) -> bool:
    return (src / "verl" / "workers" / "engine_workers_tinker.py").is_file()


#: the trees with a path that refuses the baseline (the legacy FSDP actor, the Tinker worker)
REFUSING = [
    p for p in dict.fromkeys([*ONE_OF_EACH, *NEWEST]) if has_legacy_actor(p) or _has_tinker(p)
]


@needs_verl
@pytest.mark.dist
@pytest.mark.parametrize("src", REFUSING, ids=lambda p: p.name)
def test_fsdp_and_tinker_refuse_the_baseline_by_name(tmp_path, src):
    """Asked for by ESS_LR_BASELINE=1, ESS_LR_BASELINE_SHADOW=1 or VCPO's key (ESS-LR off):
    the legacy FSDP actor and main's Tinker worker each refuse with the fail-closed type
    naming verl, the setting and what is supported; off, verl's own code runs (and fails on
    its own on a batch of None). The engine path serves it (test_verl_engine_baseline.py)."""
    (r,) = run_ranks(_probe, args=("refusal_probe", str(src)), tmp_path=tmp_path, timeout=240)
    names = ["fsdp"] if has_legacy_actor(src) else []
    if _has_tinker(src):
        names.append("tinker")
    sources = {
        "env_on": "ESS_LR_BASELINE=1",
        "env_shadow": "ESS_LR_BASELINE_SHADOW=1",
        "vcpo_key": "actor.grad_baselining.enable",
    }
    for name in names:
        for request, source in sources.items():
            error = r[f"{name}_{request}"]
            assert error.startswith(
                f"FailClosedNotImplementedError: ess-patch (verl): VCPO's baseline was "
                f"requested ({source}) but verl's FSDP actor"
                if name == "fsdp"
                else "FailClosedNotImplementedError: ess-patch (verl): VCPO's baseline was "
                f"requested ({source}) but the Tinker worker"
            ), error
            assert "Supported: " in error and "turn the baseline off" in error
        assert "baseline" not in r[f"{name}_off"]  # verl's own error


def _baseline_rank(src: str, scenario: dict) -> dict:
    sys.path.insert(0, str(HERE))
    import verl_baseline_rank

    return verl_baseline_rank.run_baseline(src, scenario)


_EXPECTED: dict = {}


def _expected(tmp_path, src) -> dict:
    """The brute-force expectation (``expected_probe``, one backward per trajectory), once
    per snapshot."""
    if src.name not in _EXPECTED:
        (_EXPECTED[src.name],) = run_ranks(
            _probe, args=("expected_probe", str(src)), tmp_path=tmp_path / "expected", timeout=240
        )
    return _EXPECTED[src.name]


ACTOR = "actor_rollout_ref.actor"
#: verl's own config (McoreActorConfig through the wrapped omega_conf_to_dataclass): PPO
#: clipping at verl's default eps 0.2, mini-batches of 2, micro-batches of 2
HYDRA = [f"{ACTOR}.ppo_mini_batch_size=2", f"{ACTOR}.ppo_micro_batch_size_per_gpu=2"]
ON_KEY = [*HYDRA, f"+{ACTOR}.grad_baselining.enable=true"]
#: the two forms of verl's Megatron forward (its own ``forward_backward_batch``): every
#: micro-batch packed into one THD row with ``cu_seqlens`` (``megatron.use_remove_padding``,
#: verl's default), or padded rows (bshd)
LAYOUTS = {"packed": [], "padded": [f"{ACTOR}.megatron.use_remove_padding=false"]}


def has_padded_forward(src: Path) -> bool:
    """Whether the legacy actor offers the padded form (v0.7.0 on; v0.6.x always packs)."""
    text = (src / "verl" / "workers" / "actor" / "megatron_actor.py").read_text()
    return "use_remove_padding" in text


def layouts(snapshots: list[Path]) -> list:
    """``(src, layout)`` for each snapshot and each form of :data:`LAYOUTS` it has."""
    return [
        pytest.param(src, layout, id=f"{src.name}-{layout}")
        for src in snapshots
        for layout in LAYOUTS
        if layout == "packed" or has_padded_forward(src)
    ]


def _by_sample(expect: dict, r: dict) -> dict[int, list[list[float]]]:
    """Each sample's advantage rows as verl's loss saw them on this rank."""
    out: dict[int, list[list[float]]] = {}
    for old, adv, _, _ in r["seen"]:
        out.setdefault(expect["rows"][tuple(old)], []).append(adv)
    return out


def _check_applied(expect: dict, ranks: list[dict], want: list[float] | None = None) -> None:
    """Every sample trained once per epoch, with ``A - b*`` on its counted tokens (float32
    tolerance of the brute-force expectation) and 0 elsewhere."""
    want = expect["expected"] if want is None else want
    seen: dict[int, list] = {}
    for r in ranks:
        assert "error" not in r, r["error"]
        for i, rows in _by_sample(expect, r).items():
            seen.setdefault(i, []).extend(rows)
    assert sorted(seen) == list(range(len(want)))
    before_any_step = 0
    for r in ranks:  # verl's own forward (packed or padded) on the weights not yet stepped
        for old, _, log_prob, steps in r["seen"]:
            if steps == 0:
                i, before_any_step = expect["rows"][tuple(old)], before_any_step + 1
                lp = expect["log_probs"][i]
                assert log_prob[: len(lp)] == pytest.approx(lp, rel=1e-4, abs=1e-5), i
    assert before_any_step > 0
    for i, rows in seen.items():
        mask = expect["masks"][i]
        for row in rows:
            for t, value in enumerate(row):
                target = want[i] if t < len(mask) and mask[t] else 0.0
                assert value == pytest.approx(target, rel=1e-5, abs=1e-6), (i, t, row)


@needs_verl
@pytest.mark.dist
@pytest.mark.parametrize(("src", "layout"), layouts(LEGACY))
def test_the_legacy_actor_trains_on_r_minus_b_star_from_brute_force_norms(tmp_path, src, layout):
    """VCPO's key through verl's real config; verl's real MegatronPPOActor
    (make_minibatch_iterator, update_policy, forward_backward_batch: its own forward, packed
    or padded, through megatron-core's schedule) on megatron-core's GPTModel (local spec)
    with verl's own PPO-clipped loss; GRPO's advantages from verl's
    compute_grpo_outcome_advantage, both prompt groups split over the two DP ranks: every
    mini-batch trains on A - b* (b* from one backward per trajectory), single process and
    DP2; the exact path agrees; the caller's batch is kept."""
    expect = _expected(tmp_path, src)
    moved = max(abs(a - b) for a, b in zip(expect["expected"], expect["grpo"], strict=True))
    assert moved > 1e-3  # b* is not the group mean: the check can tell them apart
    on = [*ON_KEY, *LAYOUTS[layout]]
    for dp in (1, 2):
        ranks = run_ranks(
            _baseline_rank,
            dp=dp,
            args=(str(src), {"hydra": on}),
            tmp_path=tmp_path / f"dp{dp}",
            timeout=300,
        )
        _check_applied(expect, ranks)
        for r in ranks:
            m = r["metrics"]
            assert m["actor/ess_baseline_applied"] == [1.0]
            assert m["actor/ess_baseline_fallback_groups"] == [0.0]
            assert m["actor/ess_baseline_split_groups"] == [2.0 if dp == 2 else 0.0]
            assert m["actor/ess_baseline_norm_pass_s"][0] > 0
            # b* - the group mean (0 for GRPO's A), averaged over the two groups
            b_star = [a - e for a, e in zip(expect["grpo"], expect["expected"], strict=True)]
            shift = (b_star[0] + b_star[4]) / 2
            assert m["actor/ess_baseline_shift"][0] == pytest.approx(shift, abs=1e-5)
            assert r["caller_data_kept"] and not r["params_unchanged"] and r["pg_loss"]
    exact = run_ranks(
        _baseline_rank,
        dp=2,
        args=(str(src), {"hydra": on, "env": {"ESS_LR_BASELINE_PATH": "exact"}}),
        tmp_path=tmp_path / "exact",
        timeout=300,
    )
    _check_applied(expect, exact)
    # verl's shuffled mini-batches over two epochs: each row read back wherever it lands
    # (verl's actor asks for a seed when it shuffles)
    shuffle = [f"{ACTOR}.shuffle=true", f"{ACTOR}.ppo_epochs=2", f"{ACTOR}.data_loader_seed=0"]
    shuffled = [*on, *shuffle]
    ranks = run_ranks(
        _baseline_rank,
        dp=2,
        args=(str(src), {"hydra": shuffled}),
        tmp_path=tmp_path / "shuffled",
        timeout=300,
    )
    _check_applied(expect, ranks)
    assert all(len(r["seen"]) == 8 for r in ranks)  # 4 rows per rank, twice


@needs_verl
@pytest.mark.dist
@pytest.mark.parametrize(("src", "layout"), layouts(ONE_OF_EACH[:1]))
def test_tp2_and_dp2_x_tp2_train_on_r_minus_b_star(tmp_path, src, layout):
    """The GPTModel TP-sharded over two ranks (vocabulary-parallel logits: the norm pass's
    TP-reduced log-softmax, norms summed over TP): every mini-batch on every rank trains on
    A - b*, b* from one backward per trajectory on that same sharded model (summed over TP),
    in TP2 and in DP2 x TP2 (both groups split over DP)."""
    expect = _expected(tmp_path, src)
    for world in (2, 4):
        ranks = run_ranks(
            _baseline_rank,
            dp=world,
            args=(str(src), {"hydra": [*ON_KEY, *LAYOUTS[layout]], "tp": 2}),
            tmp_path=tmp_path / f"world{world}",
            timeout=400,
        )
        want = ranks[0]["expected_here"]
        assert all(r["expected_here"] == pytest.approx(want, rel=1e-9) for r in ranks)
        assert max(abs(a - b) for a, b in zip(want, expect["grpo"], strict=True)) > 1e-3
        # megatron's CPU initialisation shards the TP1 model's weights: the same b* as TP1
        assert want == pytest.approx(expect["expected"], rel=1e-5, abs=1e-6)
        assert sorted((r["dp"], r["tp"]) for r in ranks) == [
            (d, t) for d in range(world // 2) for t in range(2)
        ]
        _check_applied(expect, ranks, want=want)
        for r in ranks:
            assert r["metrics"]["actor/ess_baseline_applied"] == [1.0]
            split = 2.0 if world == 4 else 0.0
            assert r["metrics"]["actor/ess_baseline_split_groups"] == [split]


@needs_verl
@pytest.mark.dist
@pytest.mark.parametrize(("src", "layout"), layouts(ONE_OF_EACH[:1]))
def test_pp2_both_stages_train_on_r_minus_b_star(tmp_path, src, layout):
    """Two pipeline stages of the one-process weights, through megatron-core's pipeline
    schedule (verl's own forward_backward_batch): the norm pass crosses the stages
    (activations down, gradients back); every mini-batch the last stage's loss gets carries
    A - b* with b* from one backward per trajectory on the whole model, on rules, exact and
    proxy; and both stages end with the weights of the one-process run (rules, exact)."""
    from pipeline_ranks import stage_weights

    expect = _expected(tmp_path, src)
    hydra = [*ON_KEY, *LAYOUTS[layout]]
    (one,) = run_ranks(
        _baseline_rank, args=(str(src), {"hydra": hydra}), tmp_path=tmp_path / "one", timeout=300
    )
    _check_applied(expect, [one])
    for path, want in (
        ("rules", expect["expected"]),
        ("exact", expect["expected"]),
        ("proxy", expect["expected_proxy"]),
    ):
        env = {"ESS_LR_BASELINE_PATH": path}
        ranks = run_ranks(
            _baseline_rank,
            pp=2,
            args=(str(src), {"hydra": hydra, "pp": 2, "env": env}),
            tmp_path=tmp_path / path,
            timeout=300,
        )
        assert [r["pp"] for r in ranks] == [0, 1]
        assert "error" not in ranks[0], ranks[0]["error"]
        assert ranks[0]["seen"] == []  # the loss runs on the last stage alone
        _check_applied(expect, [ranks[1]], want=want)
        for r in ranks:
            assert r["metrics"]["actor/ess_baseline_applied"] == [1.0]
            assert not r["params_unchanged"]
            if path == "proxy":  # another b*: other weights
                continue
            mine = stage_weights(one["state"], r["pp"], 2, 2)
            assert sorted(mine) == sorted(r["state"])
            for name, value in r["state"].items():
                assert torch.allclose(value, mine[name], rtol=1e-4, atol=1e-6), (path, name)


@needs_verl
@pytest.mark.dist
@pytest.mark.parametrize("src", ONE_OF_EACH, ids=lambda p: p.name)
def test_the_proxy_path_and_ess_lr_beside_it_dp2(tmp_path, src):
    """actor.grad_baselining.path=proxy (the forward-only proxy of verl's Optimal Token
    Baseline): A - b* with b* from the proxy computed by hand (autograd of each token's
    log-prob with respect to its logits), not the exact one; use_is_weights=false: b* from
    the unweighted norms; and with ESS-LR on beside the
    baseline (ESS_LR_ENABLE=1), both apply: the exact b* in the advantages, each step's LR
    scaled (actor/lr_scale below 1)."""
    expect = _expected(tmp_path, src)
    gap = max(abs(a - b) for a, b in zip(expect["expected"], expect["expected_proxy"], strict=True))
    assert gap > 1e-4  # the proxy's b* is its own: the check can tell them apart
    proxy = run_ranks(
        _baseline_rank,
        dp=2,
        args=(str(src), {"hydra": [*ON_KEY, f"+{ACTOR}.grad_baselining.path=proxy"]}),
        tmp_path=tmp_path / "proxy",
        timeout=300,
    )
    _check_applied(expect, proxy, want=expect["expected_proxy"])
    assert all(r["metrics"]["actor/ess_baseline_applied"] == [1.0] for r in proxy)
    # VCPO's use_is_weights: false: the norms of sum_t log p(y_t), no IS weight
    plain = run_ranks(
        _baseline_rank,
        dp=2,
        args=(str(src), {"hydra": [*ON_KEY, f"+{ACTOR}.grad_baselining.use_is_weights=false"]}),
        tmp_path=tmp_path / "no_weights",
        timeout=300,
    )
    gap = max(
        abs(a - b) for a, b in zip(expect["expected"], expect["expected_no_weights"], strict=True)
    )
    assert gap > 1e-4
    _check_applied(expect, plain, want=expect["expected_no_weights"])
    both = run_ranks(
        _baseline_rank,
        dp=2,
        args=(str(src), {"hydra": ON_KEY, "env": {"ESS_LR_ENABLE": "1"}}),
        tmp_path=tmp_path / "both",
        timeout=300,
    )
    _check_applied(expect, both)
    for r in both:
        assert r["metrics"]["actor/ess_baseline_applied"] == [1.0]
        scales = r["lr_scale"]
        assert len(scales) == 2 and all(0 < s < 1 for s in scales), scales


@needs_verl
@pytest.mark.dist
@pytest.mark.parametrize("src", ONE_OF_EACH, ids=lambda p: p.name)
def test_off_and_shadow_train_bit_identically_to_unpatched_verl(tmp_path, src):
    """DP2: unpatched verl, installed with the baseline off, and in shadow mode
    (ESS_LR_BASELINE_SHADOW=1): the same advantages seen and the same parameters, bit for
    bit; shadow logs b*'s shift (the one the on run applies) with applied 0."""
    expect = _expected(tmp_path, src)
    runs = {}
    for name, scenario in {
        "plain": {"hydra": HYDRA, "no_install": True},
        "off": {"hydra": HYDRA},
        "shadow": {"hydra": HYDRA, "env": {"ESS_LR_BASELINE_SHADOW": "1"}},
    }.items():
        runs[name] = run_ranks(
            _baseline_rank, dp=2, args=(str(src), scenario), tmp_path=tmp_path / name, timeout=300
        )

    for name in ("off", "shadow"):
        for plain, other in zip(runs["plain"], runs[name], strict=True):
            assert "error" not in other, other["error"]
            assert other["seen"] == plain["seen"]
            assert all(
                torch.equal(a, b) for a, b in zip(plain["params"], other["params"], strict=True)
            )
    _check_applied(expect, runs["plain"], want=expect["grpo"])  # GRPO's own advantages
    b_star = [a - e for a, e in zip(expect["grpo"], expect["expected"], strict=True)]
    for r in runs["shadow"]:
        assert r["metrics"]["actor/ess_baseline_applied"] == [0.0]
        shift = r["metrics"]["actor/ess_baseline_shift"][0]
        assert shift == pytest.approx((b_star[0] + b_star[4]) / 2, abs=1e-5)
    assert runs["off"][0]["metrics"] == {}


@needs_verl
@pytest.mark.dist
@pytest.mark.parametrize(
    ("layout", "scenario", "message"),
    [
        ({"cp": 2}, {"env": {"ESS_LR_BASELINE": "1"}}, "context_parallel_size is 2"),
        (
            {},
            {"env": {"ESS_LR_BASELINE": "1"}, "gae_like": True},
            "advantage differs between its tokens",
        ),
        (
            {},
            {"env": {"ESS_LR_BASELINE": "1"}, "temperature": 0.7},
            "the rollout temperature is 0.7",
        ),
        (
            {},
            {"env": {"ESS_LR_BASELINE": "1"}, "own_loader": True},
            "make_minibatch_iterator did not make",
        ),
        (
            {},
            {"env": {"ESS_LR_BASELINE": "1"}, "tamper": True},
            "are not the rewritten rewards (r - b*)",
        ),
    ],
    ids=["cp2", "gae_advantages", "temperature", "own_dataloader", "read_back"],
)
@pytest.mark.parametrize("src", ONE_OF_EACH[:1], ids=lambda p: p.name)
def test_what_the_legacy_actor_cannot_serve_stops_every_rank_first(
    tmp_path, src, layout, scenario, message
):
    """Refused by name on every rank before any step: CP2 (the norm pass runs whole
    sequences), per-token advantages (a critic's GAE: no group mean to replace), a
    sampling temperature other than 1, an update_policy dataloader that verl's
    make_minibatch_iterator did not make (nothing was rewritten); and the read-back: mini-batches
    whose advantages changed after the rewrite stop every rank before their step."""
    ranks = run_ranks(
        _baseline_rank,
        dp=2,
        **layout,
        args=(str(src), {"hydra": HYDRA, **scenario}),
        tmp_path=tmp_path,
        timeout=300,
    )
    for r in ranks:
        assert message in r.get("error", ""), r.get("error")
        assert "ESS_LR_BASELINE=1" in r["error"] or "baseline was requested" in r["error"]
        assert r["seen"] == [] and r["params_unchanged"]


def _verl_probe(name: str, *args):
    sys.path.insert(0, str(HERE))
    import verl_rank

    return getattr(verl_rank, name)(*args)


@needs_verl
@pytest.mark.dist
@pytest.mark.parametrize("src", NEWEST, ids=lambda p: p.name)
def test_a_verl_with_neither_actor_path_stops_a_run_that_requests_the_baseline(tmp_path, src):
    """A verl with neither the legacy actor nor the engine path, ESS_LR_BASELINE=1 (ESS-LR
    off): importing verl.workers fails with the refusal, naming the baseline's variables."""
    from test_verl import _without_actor_paths

    tree = _without_actor_paths(src, tmp_path)
    (r,) = run_ranks(
        _verl_probe, args=("neither_probe", str(tree), "", "1"), tmp_path=tmp_path / "run"
    )
    assert r["import_error"].startswith("FailClosedError: ess-patch (verl)"), r["import_error"]
    assert "VCPO's baseline is requested in this process (ESS_LR_BASELINE" in r["import_error"]
    assert "module verl.workers.engine_workers does not exist" in r["import_error"]
    assert r["targets"] == []
