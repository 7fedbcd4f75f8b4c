"""ESS-LR inside verl's REAL Megatron actor, on every verl snapshot (``verl-*`` folders).

Each case runs ``install("verl")`` in fresh gloo ranks with real megatron process groups,
builds verl's real ``MegatronPPOActor`` around a real megatron-core optimizer (the model is a
stand-in: see ``verl_rank.py``), and runs verl's own ``make_minibatch_iterator`` and
``update_policy`` on a batch dispatched over DP as verl does. The parent recomputes, in float64
from the whole batch (``tests/reference.py``), each optimizer step's ESS scale over the samples
that step trained on (on every DP rank), and checks the LR each inner update applied:
scheduled LR x that scale, exactly once, on the actor only (verl's real
``MegatronPPOCritic.update_critic`` runs after it in the same process, unscaled).
"""

from __future__ import annotations

import math
import os
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: harness, reference
from harness import run_ranks
from reference import reference_ess

HERE = Path(__file__).resolve().parent
_PACKAGES = ("megatron.core", "tensordict", "omegaconf", "codetiming", "ray", "transformers")


def _upstream_root() -> Path | None:
    root = os.environ.get("ESS_PATCH_UPSTREAM")
    if root:
        return Path(root)
    for var in ("MILES_SRC", "SLIME_SRC"):
        if os.environ.get(var):
            return Path(os.environ[var]).resolve().parent
    return None


def verl_snapshots() -> list[Path]:
    """Every ``verl-*`` folder holding ``verl/`` under ``$ESS_PATCH_UPSTREAM``."""
    root = _upstream_root()
    if root is None or not root.is_dir():
        return []
    return [p for p in sorted(root.glob("verl-*")) if (p / "verl" / "__init__.py").is_file()]


def _skip_reason() -> str | None:
    if not verl_snapshots():
        return "no verl-* snapshot: set ESS_PATCH_UPSTREAM to ../shared/upstream"
    missing = [p for p in _PACKAGES if find_spec(p.split(".")[0]) is None]
    if missing:
        return (
            f"the verl tests need {', '.join(missing)}: pip install -r "
            "tests/frameworks/requirements-verl.txt (with torch pinned)"
        )
    return None


def release(src: Path) -> Version:
    """The verl version a snapshot folder declares (``verl/version/version``)."""
    return Version((src / "verl" / "version" / "version").read_text().strip())


def has_legacy_actor(src: Path) -> bool:
    """Whether the tree still has the legacy Megatron actor (removed in verl PR #6067, v0.8.0)."""
    return (src / "verl" / "workers" / "actor" / "megatron_actor.py").is_file()


def has_engine_path(src: Path) -> bool:
    """Whether the tree has the engine path's workers (from verl v0.7.0)."""
    return (src / "verl" / "workers" / "engine_workers.py").is_file()


def path_shape(src: Path) -> str:
    """The actor path(s) ``install("verl")`` must detect in the tree, by what the tree has."""
    legacy, engine = has_legacy_actor(src), has_engine_path(src)
    if legacy and engine:
        return "actor through the legacy Megatron actor and the engine path"
    return (
        "actor through the legacy Megatron actor (no engine path)"
        if legacy
        else ("actor through the engine path (no legacy actor)")
    )


SKIP = _skip_reason()
SNAPSHOTS = verl_snapshots()
#: the snapshots with the legacy Megatron actor (v0.6.0, v0.7.0, @b178a3cd5): its tests run
#: there only
LEGACY = [p for p in SNAPSHOTS if has_legacy_actor(p)]
#: the legacy actor without the engine path (v0.6.x)
LEGACY_ONLY = [p for p in LEGACY if not has_engine_path(p)]
#: the snapshot text every refusal names
SUPPORTED = "Supported: verl v0.6.0 (2025-10-15) to main @1dda039b9"
#: the newest snapshot (by its declared version): the engine path's single-snapshot cases
NEWEST = [max(SNAPSHOTS, key=release)] if SNAPSHOTS else []
#: a case run on one snapshot of each legacy-actor shape: the first by name with the engine
#: path beside it (v0.7.x), and every one without it (v0.6.x)
ONE_OF_EACH = [*[p for p in LEGACY if has_engine_path(p)][:1], *LEGACY_ONLY]
on_legacy = pytest.mark.parametrize("src", ONE_OF_EACH, ids=[p.name for p in ONE_OF_EACH])
on_newest = pytest.mark.parametrize("src", NEWEST, ids=[p.name for p in NEWEST])
pytestmark = [pytest.mark.dist, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]


def _rank(src: str, scenario: dict) -> dict:
    sys.path.insert(0, str(HERE))
    import verl_rank

    return verl_rank.run(src, scenario)


def _run(tmp_path, src: Path, scenario: dict, *, dp=2, cp=1, pp=1) -> list[dict]:
    return run_ranks(
        _rank,
        dp=dp,
        cp=cp,
        pp=pp,
        args=(str(src), scenario),
        tmp_path=tmp_path,
        timeout=240,
        collective_timeout=120,
    )


def _batch(seed: int = 0, **kwargs):
    sys.path.insert(0, str(HERE))
    from verl_rank import global_batch

    return global_batch(seed, **kwargs)


def _expected_scales(results: list[dict], seed: int = 0, **rule) -> list[dict]:
    """Per optimizer step: the float64 reference over the samples every DP rank trained on
    in that step (the ids each rank's mini-batch held)."""
    for r in results:
        assert "error" not in r, r["error"]
    batch = _batch(seed)
    by_dp = {r["coords"][0]: r["seen"] for r in results}
    steps = len(next(iter(by_dp.values())))
    out = []
    for s in range(steps):
        ids = sorted(i for seen in by_dp.values() for i in seen[s])
        out.append(
            reference_ess(
                [batch["old_log_probs"][i].double() for i in ids],
                [batch["rollout_log_probs"][i].double() for i in ids],
                [batch["mask"][i] for i in ids],
                shift=True,
                **rule,
            )
        )
    return out


def _check_applied(results: list[dict], expected: list[dict]) -> None:
    for r in results:
        assert "error" not in r, r.get("error")
        assert len(r["applied"]) == len(expected), "one inner update per mini-batch"
        for lrs, ref in zip(r["applied"], expected, strict=True):
            for lr, scheduled in zip(lrs, r["scheduled"], strict=True):
                assert lr == pytest.approx(scheduled * ref["scale"], rel=1e-9)
        assert r["after"] == r["scheduled"]  # restored: the scheduler never sees a scaled LR
        assert r["armed_after"] is None  # nothing armed after the actor's update
        # the critic, stepped next in the same process, is never scaled
        assert r["critic_applied"] and all(
            lrs == r["critic_scheduled"] for lrs in r["critic_applied"]
        )
        got = r["metrics"]["actor/lr_scale"]
        assert got == pytest.approx([e["scale"] for e in expected], rel=1e-9)
        assert r["metrics"]["actor/rho_ess"] == pytest.approx(
            [e["rho"] for e in expected], rel=1e-9
        )


@pytest.mark.parametrize("src", LEGACY, ids=[p.name for p in LEGACY])
def test_each_step_uses_its_mini_batch_scale_dp2(tmp_path, src):
    """ESS_LR_ENABLE=1 (geometric weights): per optimizer step over that step's mini-batch."""
    results = _run(tmp_path, src, {"env": {"ESS_LR_ENABLE": "1", "ESS_LR_FLOOR": "0.05"}})
    expected = _expected_scales(results, floor=0.05)
    assert len(expected) == 2 and expected[0]["scale"] != expected[1]["scale"]
    assert all(e["scale"] < 1 for e in expected)
    _check_applied(results, expected)
    shapes = results[0]["shapes"]["verl"]
    assert path_shape(src) in shapes  # each path detected on its own, by feature
    assert "legacy actor MegatronPPOActor.update_policy" in shapes


@pytest.mark.parametrize("src", LEGACY, ids=[p.name for p in LEGACY])
def test_vcpo_ess_scaling_keys_shuffled_two_epochs(tmp_path, src):
    """VCPO's actor.ess_scaling keys given as Hydra ``+`` overrides to verl's own config, the
    actor built on verl's real McoreActorConfig (through the wrapped omega_conf_to_dataclass):
    product weights, linear rule, base_ess_ratio; verl's shuffled mini-batches over two epochs
    (4 steps), ids read back from what each step held."""
    actor = "actor_rollout_ref.actor"
    scenario = {
        "hydra": [
            f"+{actor}.ess_scaling.enable=true",
            f"+{actor}.ess_scaling.scaling_rule=linear",
            f"+{actor}.ess_scaling.base_ess_ratio=0.8",
            f"{actor}.ppo_mini_batch_size=2",
            f"{actor}.ppo_micro_batch_size_per_gpu=2",
            f"{actor}.shuffle=true",
            f"{actor}.ppo_epochs=2",
        ],
        "env": {"ESS_LR_FLOOR": "0.01"},
    }
    results = _run(tmp_path, src, scenario)
    assert results[0]["config_type"] == "McoreActorConfig"
    expected = _expected_scales(results, mode="product", rule="linear", base_ratio=0.8, floor=0.01)
    assert len(expected) == 4
    _check_applied(results, expected)


@on_legacy
def test_rollout_granularity_and_megatron_installed_too(tmp_path, src):
    """ESS_LR_GRANULARITY=rollout: one ESS over the whole rollout for every step; with
    install("megatron") as well, each update is still scaled exactly once."""
    scenario = {
        "env": {"ESS_LR_ENABLE": "1", "ESS_LR_GRANULARITY": "rollout", "ESS_LR_FLOOR": "0.05"},
        "integrations": "megatron,verl",
    }
    results = _run(tmp_path, src, scenario)
    batch = _batch()
    whole = reference_ess(
        [x.double() for x in batch["old_log_probs"]],
        [x.double() for x in batch["rollout_log_probs"]],
        list(batch["mask"]),
        floor=0.05,
    )
    _check_applied(results, [whole, whole])


@on_legacy
@pytest.mark.parametrize(("cp", "pp"), [(2, 1), (1, 2)])
def test_cp_and_pp_ranks_agree_with_dp_only(tmp_path, src, cp, pp):
    """CP ranks hold whole sequences and every PP stage the whole batch: every rank applies
    the scale computed over DP alone (last stage, broadcast over PP)."""
    results = _run(tmp_path, src, {"env": {"ESS_LR_ENABLE": "1"}}, dp=2, cp=cp, pp=pp)
    assert len(results) == 4
    _check_applied(results, _expected_scales(results))


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ({"bypass": True}, "old_log_probs equal rollout_log_probs"),
        ({"no_rollout_log_probs": True}, "rollout.calculate_log_probs=True"),
    ],
    ids=["bypass_mode", "no_rollout_log_probs"],
)
@on_legacy
def test_nothing_to_measure_raises_on_every_rank_and_changes_nothing(
    tmp_path, src, scenario, message
):
    results = _run(tmp_path, src, {**scenario, "env": {"ESS_LR_ENABLE": "1"}})
    for r in results:
        assert message in r["error"]
        assert r["applied"] == [] and r["after"] == r["scheduled"] and r["armed_after"] is None


@on_legacy
def test_disabled_changes_nothing(tmp_path, src):
    """No ESS_LR_ENABLE, no ess_scaling: LRs as scheduled, no actor/ESS metrics."""
    results = _run(tmp_path, src, {"env": {}}, dp=1)
    (r,) = results
    assert "error" not in r, r.get("error")
    assert r["applied"] == [r["scheduled"]] * 4
    assert not any(k.startswith(("actor/lr_scale", "actor/rho_ess")) for k in r["metrics"])


@on_legacy
def test_shadow_logs_but_never_scales(tmp_path, src):
    results = _run(tmp_path, src, {"env": {"ESS_LR_SHADOW": "1"}})
    expected = _expected_scales(results)
    for r in results:
        assert "error" not in r, r.get("error")
        assert all(lrs == r["scheduled"] for lrs in r["applied"])
        assert "actor/lr_scale" not in r["metrics"]
        assert r["metrics"]["actor/ess_lr_shadow_scale"] == pytest.approx(
            [e["scale"] for e in expected], rel=1e-9
        )
        assert not math.isnan(r["metrics"]["actor/rho_ess"][0])


def _config_rank(src: str) -> dict:
    sys.path.insert(0, str(HERE))
    import verl_rank

    return verl_rank.config_probe(src)


@pytest.mark.parametrize("src", SNAPSHOTS, ids=[p.name for p in SNAPSHOTS])
def test_vcpo_keys_through_verls_hydra_config(tmp_path, src):
    """verl's real config: ``+actor_rollout_ref.actor.ess_scaling...`` composes, verl's own
    check rejects the unknown node, install("verl") takes it out, carries it on the
    McoreActorConfig and maps it; bad VCPO settings fail with the key named."""
    from ess_patch import EssLrConfig

    (r,) = run_ranks(_config_rank, args=(str(src),), tmp_path=tmp_path, timeout=240)
    assert "Could not override" in r["without_plus"]  # Hydra needs the '+' for a new key
    assert "unexpected keyword argument 'ess_scaling'" in r["uninstalled"]
    assert r["installed"] == "ok" and r["type"] == "McoreActorConfig"
    assert r["carried"] == {
        "enable": True,
        "scaling_rule": "linear",
        "base_ess_ratio": 0.5,
        "use_clipped": True,
        "rollout_is_threshold": 2.0,
    }
    assert r["node_kept"]  # verl's DictConfig is given back as it was
    assert r["settings"] == (
        True,
        EssLrConfig(
            weight_mode="product",
            rule="linear",
            base_ratio=0.5,
            granularity="step",
            weight_clip=2.0,
        ),
    )
    assert "unknown key(s) enabled" in r["unknown_key"]
    assert "ESS_LR_WEIGHT_CLIP" in r["clip_without_threshold"]


@pytest.mark.parametrize(("dp", "pp"), [(2, 1), (2, 2)])
@on_legacy
def test_a_nan_on_one_rank_raises_on_every_rank_before_any_update(tmp_path, src, dp, pp):
    """Sample 1 (DP rank 0's first mini-batch) has a NaN log-prob: every rank of every stage
    raises at that step (the NaN policy is "raise"), nothing was updated, nothing stays armed."""
    scenario = {"env": {"ESS_LR_ENABLE": "1"}, "nan_sample": 1}
    results = _run(tmp_path, src, scenario, dp=dp, pp=pp)
    for r in results:
        last = r["coords"][2] == pp - 1  # computes (and raises alike on every DP rank)
        expected = "NonFiniteLogProbError" if last else "InvalidInputsElsewhereError"
        assert r["error"].split(":")[0] == expected, r["error"]
        assert r["applied"] == [] and r["after"] == r["scheduled"] and r["armed_after"] is None


@on_legacy
def test_the_auto_installer_covers_a_verl_worker(tmp_path, src):
    """ESS_PATCH_AUTO_INSTALL=1 with ESS_PATCH_INTEGRATIONS=verl (what the .pth line runs in
    each Ray worker) before verl is imported: the same per-step scales."""
    scenario = {"env": {"ESS_LR_ENABLE": "1"}, "autoinstall": True}
    results = _run(tmp_path, src, scenario)
    _check_applied(results, _expected_scales(results))


def _missing_rank(src: str) -> dict:
    sys.path.insert(0, str(HERE))
    import verl_rank

    return verl_rank.missing_probe(src)


@on_legacy
def test_a_verl_without_the_hooked_symbols_is_refused_by_name(tmp_path, src):
    (r,) = run_ranks(_missing_rank, args=(str(src),), tmp_path=tmp_path, timeout=240)
    assert r["missing"].startswith("MissingTargetError")
    assert "MegatronPPOActor.make_minibatch_iterator does not exist" in r["missing"]
    assert SUPPORTED in r["missing"]
    assert (r["installed"], r["targets"]) == (False, [])
    assert "update_policy has no parameter dataloader" in r["parameter"]


def _backends_rank(src: str) -> dict:
    sys.path.insert(0, str(HERE))
    import verl_rank

    return verl_rank.other_backends_probe(src)


@pytest.mark.parametrize("src", [*ONE_OF_EACH, *NEWEST], ids=lambda p: p.name)
def test_fsdp_actor_and_engine_are_refused_while_on_and_untouched_while_off(tmp_path, src):
    (r,) = run_ranks(_backends_rank, args=(str(src),), tmp_path=tmp_path, timeout=240)
    # no dp_actor since v0.8, no engine path before v0.7
    names = [n for n, has in (("fsdp", has_legacy_actor), ("engine", has_engine_path)) if has(src)]
    assert names
    for name in names:
        # the one fail-closed type (guard.refuse), still a NotImplementedError
        assert r[f"{name}_1"].startswith("FailClosedNotImplementedError"), r[f"{name}_1"]
        assert "strategy 'fsdp' is not supported" in r[f"{name}_1"]
        assert not r[f"{name}_0"].startswith("FailClosed")  # verl's own error


def _recipe_rank(src: str) -> dict:
    sys.path.insert(0, str(HERE))
    import verl_rank

    return verl_rank.recipe_probe(src)


@pytest.mark.parametrize("src", SNAPSHOTS, ids=[p.name for p in SNAPSHOTS])
def test_the_documented_recipe_reaches_every_ray_actor(tmp_path, src):
    """docs/frameworks/verl.md's command-line block, composed by verl's own Hydra config and
    merged as ``main_ppo.run_ppo`` merges it for ``ray.init``: the ESS variables are in the
    runtime environment every Ray actor starts with, VCPO's keys on the actor's node."""
    (r,) = run_ranks(_recipe_rank, args=(str(src),), tmp_path=tmp_path, timeout=240)
    assert {
        "ESS_PATCH_AUTO_INSTALL": "1",
        "ESS_PATCH_INTEGRATIONS": "verl",
        "ESS_LR_ENABLE": "1",
        "ESS_LR_FLOOR": "0.1",
    }.items() <= {k: str(v) for k, v in r["env_vars"].items()}.items()
    assert r["ess_scaling"] == {"enable": True, "scaling_rule": "sqrt"}
    assert r["calculate_log_probs"] is True


def _probe(name: str, *args: str) -> dict:
    sys.path.insert(0, str(HERE))
    import verl_rank

    return getattr(verl_rank, name)(*args)


@pytest.mark.parametrize("src", SNAPSHOTS, ids=[p.name for p in SNAPSHOTS])
def test_a_driver_running_ess_patch_starts_every_ray_actor_with_it(tmp_path, src):
    """ESS_LR_ENABLE=1 reaches the workers but ESS_PATCH_AUTO_INSTALL does not (forgotten in
    ray_kwargs.ray_init.runtime_env): with ess-patch running in the driver, verl's own
    runtime environment carries the auto-install and the driver's ESS_LR_* to every Ray
    actor; the user's explicit ESS_PATCH_AUTO_INSTALL=0 still wins. Without ess-patch in the
    driver (0.3.0's behaviour for both), the workers would train unscaled."""
    (on,) = run_ranks(_probe, args=("driver_probe", str(src), "1"), tmp_path=tmp_path / "on")
    assert {
        "ESS_PATCH_AUTO_INSTALL": "1",
        "ESS_PATCH_INTEGRATIONS": "verl",
        "ESS_LR_ENABLE": "1",
        "ESS_LR_FLOOR": "0.3",
    }.items() <= {k: str(v) for k, v in on["forgot"].items()}.items()
    assert str(on["opted_out"]["ESS_PATCH_AUTO_INSTALL"]) == "0"
    (off,) = run_ranks(_probe, args=("driver_probe", str(src), "0"), tmp_path=tmp_path / "off")
    assert "ESS_PATCH_AUTO_INSTALL" not in off["forgot"]
    assert "ESS_LR_FLOOR" not in off["forgot"]


@on_newest
def test_a_verl_newer_than_any_known_shape_is_refused_by_name(tmp_path, src):
    """``train_batch`` without ``data``: install() refuses with the parameter and the supported
    releases named; nothing of verl stays patched."""
    (r,) = run_ranks(_probe, args=("engine_missing_probe", str(src)), tmp_path=tmp_path)
    assert r["parameter"].startswith("MissingTargetError"), r["parameter"]
    assert "TrainingWorker.train_batch has no parameter data" in r["parameter"]
    assert SUPPORTED in r["parameter"]
    assert (r["installed"], r["targets"]) == (False, [])


def _without_actor_paths(src: Path, into: Path) -> Path:
    """A copy of ``src`` without the actor paths it has (the engine path's workers, the
    legacy Megatron actor): a verl release ess-patch has never seen, with neither."""
    import shutil

    tree = into / f"{src.name}-neither"
    shutil.copytree(src / "verl", tree / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    for rel in ("workers/engine_workers.py", "workers/actor/megatron_actor.py"):
        (tree / "verl" / rel).unlink(missing_ok=True)
    return tree


_NEITHER = [*LEGACY_ONLY, *NEWEST]


@pytest.mark.parametrize("src", _NEITHER, ids=[p.name for p in _NEITHER])
def test_a_verl_with_neither_actor_path_is_told_the_supported_releases(tmp_path, src):
    """No engine_workers and no legacy actor, ESS-LR not requested: one logged line naming
    the supported releases when verl.workers is imported; verl stays unpatched (install()'s
    late-import rule), and the import goes on."""
    tree = _without_actor_paths(src, tmp_path)
    (r,) = run_ranks(_probe, args=("neither_probe", str(tree)), tmp_path=tmp_path / "run")
    assert r["import_error"] == ""
    assert "module verl.workers.engine_workers does not exist" in r["failure"]
    assert SUPPORTED in r["failure"]
    assert len(r["logged"]) == 1 and "\n" not in r["logged"][0]  # one line, on every rank
    assert r["failure"] in r["logged"][0]
    assert r["targets"] == []  # verl.utils.config imported after it: not wrapped either


@pytest.mark.parametrize("src", _NEITHER, ids=[p.name for p in _NEITHER])
def test_a_verl_with_neither_actor_path_stops_a_run_that_requests_ess_lr(tmp_path, src):
    """The same verl with ESS_LR_ENABLE=1 (the recipe's request): importing verl.workers
    fails with the refusal (the run stops before any step, not an ERROR line and an unscaled
    run), naming what is missing, the supported releases and how to run without ESS-LR.
    VCPO's actor.ess_scaling alone: verl's own config check refuses the unknown node."""
    tree = _without_actor_paths(src, tmp_path)
    (r,) = run_ranks(_probe, args=("neither_probe", str(tree), "1"), tmp_path=tmp_path / "run")
    assert r["import_error"].startswith("FailClosedError: ess-patch (verl)"), r["import_error"]
    for part in (
        "module verl.workers.engine_workers does not exist",
        "module verl.workers.actor.megatron_actor does not exist",
        SUPPORTED,
        "ESS_LR_ENABLE is on in this process, so the run stops here",
        "unset ESS_LR_ENABLE",
    ):
        assert part in r["import_error"]
    assert r["targets"] == []  # rolled back, and recorded as such
    assert r["import_error"].split(": ", 1)[1] in r["failure"]
    assert "ess_scaling" in r["vcpo"] and r["vcpo"] != "ok"  # stops there too


def _has_tinker(src: Path) -> bool:
    return (src / "verl" / "workers" / "engine_workers_tinker.py").is_file()


@pytest.mark.parametrize(
    "src",
    [
        pytest.param(
            p,
            id=p.name,
            marks=pytest.mark.skipif(
                not _has_tinker(p), reason=f"{p.name} has no Tinker worker (verl main has it)"
            ),
        )
        for p in NEWEST
    ],
)
def test_the_tinker_worker_is_refused_while_ess_lr_is_on(tmp_path, src):
    """verl main's Tinker worker steps the actor outside update_actor / train_batch: with
    ESS_LR_ENABLE=1 or VCPO's key its forward_backward (the first call of a step) and
    optimizer_step refuse by name, before verl's own code; off, verl's own code runs."""
    (r,) = run_ranks(_probe, args=("tinker_probe", str(src)), tmp_path=tmp_path, timeout=240)
    assert sorted(r["targets"]) == [
        "verl.workers.engine_workers_tinker.TinkerActorRolloutRefWorker.forward_backward",
        "verl.workers.engine_workers_tinker.TinkerActorRolloutRefWorker.optimizer_step",
    ]
    for request in ("env", "vcpo"):
        for call in ("forward_backward", "optimizer_step"):
            error = r[f"{request}_{call}"]
            assert error.startswith(
                "FailClosedNotImplementedError: ess-patch (verl): ESS-LR was requested but the "
                "Tinker worker"
            ), error
            assert "would run at the scheduled LR" in error and "ESS_LR_ENABLE" in error
    for call in ("forward_backward", "optimizer_step"):  # verl's own assertion: no actor role
        assert r[f"off_{call}"] == f"AssertionError: {call} only support actor role"


@pytest.mark.parametrize("src", [*ONE_OF_EACH, *NEWEST], ids=lambda p: p.name)
def test_doctor_names_the_supported_releases_and_the_path_used(tmp_path, src):
    (r,) = run_ranks(_probe, args=("doctor_probe", str(src)), tmp_path=tmp_path, timeout=240)
    assert r["problems"] == []
    assert "supported: verl v0.6.0 (2025-10-15) to main @1dda039b9 (2026-08-22)" in "\n".join(
        r["lines"]
    )
    (shape,) = [line for line in r["lines"] if line.startswith("shape: verl: ")]
    assert path_shape(src) in shape
    if not has_legacy_actor(src):
        assert "legacy actor none (removed in v0.8.0)" in shape
    if not has_engine_path(src):
        assert "engine none (before v0.7.0)" in shape


@pytest.mark.parametrize("src", SNAPSHOTS, ids=[p.name for p in SNAPSHOTS])
def test_verl_stays_installed_when_core_algos_is_its_first_import(tmp_path, src):
    """The driver imports verl.trainer.ppo.core_algos (through ray_trainer) before anything
    in verl.workers: the shape checks that this import triggers find modules without
    importing their packages (v0.7.x's verl.workers.actor imports dp_actor, which imports the
    core_algos still mid-import), so verl is installed, not rolled back."""
    (r,) = run_ranks(
        _probe,
        args=("first_import_probe", str(src), "verl.trainer.ppo.core_algos"),
        tmp_path=tmp_path,
    )
    assert r["failures"] == {}, r["failures"]
    assert r["config_wrapped"] and r["targets"]
