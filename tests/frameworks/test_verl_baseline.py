"""VCPO's minimum-variance baseline in verl (``ESS_LR_BASELINE*``, VCPO's
``actor.grad_baselining``), through verl's REAL code on the snapshots the verl tests use.

Every verl path that cannot apply the baseline refuses it by name, before anything runs: the
engine path's ``update_actor`` (v0.7.0 and later), the legacy FSDP actor, main's Tinker
worker; a refused update changes no parameter and no LR. The settings themselves (which keys,
which values) are checked without verl.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: harness
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import run_ranks
from test_verl import (
    LEGACY,
    NEWEST,
    ONE_OF_EACH,
    SKIP,
    SNAPSHOTS,
    has_engine_path,
    has_legacy_actor,
)

from ess_patch.errors import EssPatchValueError
from ess_patch.integrations.verl_baseline_settings import baseline_settings

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


@needs_verl
@pytest.mark.dist
@pytest.mark.parametrize("src", [*ONE_OF_EACH, *NEWEST], ids=lambda p: p.name)
def test_engine_fsdp_and_tinker_refuse_the_baseline_by_name(tmp_path, src):
    """Asked for by ESS_LR_BASELINE=1, ESS_LR_BASELINE_SHADOW=1 or VCPO's key (ESS-LR off):
    each path refuses with the fail-closed type naming verl, the setting and what is
    supported; off, verl's own code runs (and fails on its own on a batch of None)."""
    (r,) = run_ranks(_probe, args=("refusal_probe", str(src)), tmp_path=tmp_path, timeout=240)
    names = [n for n, has in (("engine", has_engine_path), ("fsdp", has_legacy_actor)) if has(src)]
    if (src / "verl" / "workers" / "engine_workers_tinker.py").is_file():
        names.append("tinker")
    assert names
    sources = {
        "env_on": "ESS_LR_BASELINE=1",
        "env_shadow": "ESS_LR_BASELINE_SHADOW=1",
        "vcpo_key": "actor.grad_baselining.enable",
    }
    where = {"engine": "engine path", "fsdp": "FSDP actor", "tinker": "Tinker worker"}
    for name in names:
        for request, source in sources.items():
            error = r[f"{name}_{request}"]
            assert error.startswith(
                f"FailClosedNotImplementedError: ess-patch (verl): VCPO's baseline was "
                f"requested ({source}) but verl's {where[name]}"
                if name != "tinker"
                else "FailClosedNotImplementedError: ess-patch (verl): VCPO's baseline was "
                f"requested ({source}) but the Tinker worker"
            ), error
            assert "Supported: " in error and "turn the baseline off" in error
        assert "baseline" not in r[f"{name}_off"]  # verl's own error


def _engine_rank(src: str, scenario: dict) -> dict:
    sys.path.insert(0, str(HERE))
    import verl_engine_rank

    return verl_engine_rank.run(src, scenario)


ENGINE_ONLY = [p for p in SNAPSHOTS if has_engine_path(p) and not has_legacy_actor(p)]
# the engine-only tree that runs on this environment's megatron-core (verl >= 0.9 needs 0.17)
ENGINE_HERE = [p for p in ENGINE_ONLY if p.name == "verl-v0.8.0"][:1]


@needs_verl
@pytest.mark.dist
@pytest.mark.parametrize("src", ENGINE_HERE, ids=lambda p: p.name)
@pytest.mark.parametrize(
    "env", [{"ESS_LR_BASELINE": "1"}, {"ESS_LR_BASELINE": "1", "ESS_LR_ENABLE": "1"}]
)
def test_a_refused_engine_update_changes_nothing_dp2(tmp_path, src, env):
    """verl's real update_actor -> train_mini_batch -> train_batch (real megatron-core
    optimizer): with the baseline asked for (alone, or beside ESS-LR), every rank stops
    before any step: no inner update ran, the parameters and LRs are as they were."""
    results = run_ranks(
        _engine_rank,
        dp=2,
        args=(str(src), {"env": env}),
        tmp_path=tmp_path,
        timeout=600,
        collective_timeout=300,
    )
    import torch

    for r in results:
        assert r.get("error", "").startswith("FailClosedNotImplementedError"), r.get("error")
        assert "ESS_LR_BASELINE=1" in r["error"] and "engine path" in r["error"]
        assert r["applied"] == [] and r["seen"] == []
        assert r["after"] == r["scheduled"] and r["armed_after"] is None
        assert all(torch.equal(a, b) for a, b in zip(r["params_before"], r["params"], strict=True))


def _legacy_rank(src: str, scenario: dict) -> dict:
    sys.path.insert(0, str(HERE))
    import verl_rank

    return verl_rank.run(src, scenario)


@needs_verl
@pytest.mark.dist
@pytest.mark.parametrize("src", LEGACY, ids=lambda p: p.name)
def test_the_legacy_actor_refuses_until_its_norm_pass_lands(tmp_path, src):
    """VCPO's key through verl's real config check (McoreActorConfig from Hydra ``+``
    overrides, the wrapped omega_conf_to_dataclass), ESS-LR on beside it: the real
    make_minibatch_iterator refuses on every rank; no step, parameters and LRs unchanged."""
    actor = "actor_rollout_ref.actor"
    scenario = {
        "hydra": [
            f"+{actor}.grad_baselining.enable=true",
            f"{actor}.ppo_mini_batch_size=2",
            f"{actor}.ppo_micro_batch_size_per_gpu=2",
        ],
        "env": {"ESS_LR_ENABLE": "1"},
    }
    results = run_ranks(
        _legacy_rank, dp=2, args=(str(src), scenario), tmp_path=tmp_path, timeout=240
    )
    for r in results:
        assert r["config_type"] == "McoreActorConfig"
        assert r.get("error", "").startswith("FailClosedNotImplementedError"), r.get("error")
        assert "(actor.grad_baselining.enable)" in r["error"] and "legacy" in r["error"]
        assert r["applied"] == [] and r["seen"] == [] and r["params_unchanged"]
        assert r["after"] == r["scheduled"] and r["armed_after"] is None
