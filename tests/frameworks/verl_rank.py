"""What one rank runs in the verl tests: verl's REAL Megatron actor (and critic) on CPU.

Real (the legacy actor, verl < 0.8; the engine path is ``verl_engine_rank.py``):
``MegatronPPOActor.make_minibatch_iterator`` / ``update_policy``,
``MegatronPPOCritic.update_critic``, ``DataProto`` and its iterator, megatron-core's
optimizer (built on CPU by ``tests/megatron_cpu.py``), megatron's process groups, ess-patch's
``install("verl")``. Not real, because it cannot run on CPU: the model. Each actor's
``forward_backward_batch`` (not wrapped by ess-patch) is replaced on the instance by a DDP
forward/backward of megatron_cpu's tiny net, which also records which samples the mini-batch
held (their id is ``input_ids[:, 0]``: ``make_minibatch_iterator`` keeps only verl's keys).
Two CPU shims: ``transformers.AutoModelForVision2Seq`` (verl imports this transformers<5
name; the frameworks tier pins transformers 5, which calls it ``AutoModelForImageTextToText``)
and ``torch.cpu.empty_cache`` (``update_policy`` ends with ``get_torch_device().empty_cache()``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

#: the batch every test uses: N trajectories of R response tokens, split over DP by verl's
#: contiguous chunking
N, R, PROMPT = 8, 6, 3


def global_batch(seed: int, *, bypass: bool = False) -> dict[str, torch.Tensor]:
    """old / rollout log-probs and masks of the whole rollout (float32, as verl's batch).

    Per-trajectory offsets make the mini-batches' ESS differ; trajectory 5 has no counted
    token (left out of the ESS).
    """
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(N, R, generator=gen) * 2.0
    offsets = torch.linspace(-0.6, 0.5, N).unsqueeze(1)
    old = rollout + offsets + 0.05 * torch.randn(N, R, generator=gen)
    mask = (torch.rand(N, R, generator=gen) > 0.25).to(torch.int64)
    mask[:, 0] = 1
    mask[5] = 0
    if bypass:
        old = rollout.clone()
    return {"old_log_probs": old.float(), "rollout_log_probs": rollout.float(), "mask": mask}


def _import_verl(src: str) -> None:
    sys.path.insert(0, src)
    import transformers

    if not hasattr(transformers, "AutoModelForVision2Seq"):
        transformers.AutoModelForVision2Seq = transformers.AutoModelForImageTextToText
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None
    for name in ("max_memory_allocated", "max_memory_reserved"):  # verl >= 0.8 logs them
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: 0)


def has_legacy_actor() -> bool:
    """Whether the imported verl still has the legacy Megatron actor (gone since v0.8.0)."""
    from importlib.util import find_spec

    return find_spec("verl.workers.actor") is not None


def has_engine_path() -> bool:
    """Whether the imported verl has the engine path's workers (from v0.7.0)."""
    from importlib.util import find_spec

    return find_spec("verl.workers.engine_workers") is not None


def composed(src: str, overrides: list[str]) -> Any:
    """verl's own ``ppo_megatron_trainer`` config, composed by Hydra with ``overrides``."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=f"{src}/verl/trainer/config", version_base=None):
        return compose("ppo_megatron_trainer", overrides=overrides)


def _install(scenario: dict) -> None:
    """``install()`` (default), or, for a tree patched with patches/verl (``"vendored"``),
    nothing: its decorators must do everything, and must be what is in place."""
    import ess_patch

    if scenario.get("autoinstall"):  # what the .pth line does at a Ray worker's start-up
        from ess_patch import autoinstall

        os.environ.update(ESS_PATCH_AUTO_INSTALL="1", ESS_PATCH_INTEGRATIONS="verl")
        assert autoinstall.run()
        return
    if not scenario.get("vendored"):
        ess_patch.install(scenario.get("integrations", "verl"))
        return
    from verl.utils import config

    from ess_patch.vendored import is_vendored

    decorated = [config.omega_conf_to_dataclass]
    if has_engine_path():  # verl >= 0.7: the engine path
        from verl.workers import engine_workers

        decorated += [
            vars(engine_workers.ActorRolloutRefWorker)["update_actor"],
            vars(engine_workers.TrainingWorker)["train_batch"],
        ]
    if has_legacy_actor():  # verl < 0.8: the legacy actors are patched too
        from verl.workers.actor import dp_actor, megatron_actor

        decorated += [
            vars(megatron_actor.MegatronPPOActor)["update_policy"],
            vars(megatron_actor.MegatronPPOActor)["make_minibatch_iterator"],
            vars(dp_actor.DataParallelPPOActor)["update_policy"],
        ]
    assert all(is_vendored(f) for f in decorated), "the tree is not patched"
    assert not ess_patch.is_installed()


def _config(scenario: dict, src: str = "") -> Any:
    """The actor's config: verl's real McoreActorConfig from Hydra overrides (``"hydra"``),
    through verl's own (wrapped) ``omega_conf_to_dataclass``; else a DictConfig."""
    from omegaconf import OmegaConf

    if "hydra" in scenario:
        import verl.utils.config

        root = composed(src, scenario["hydra"])
        return verl.utils.config.omega_conf_to_dataclass(root.actor_rollout_ref.actor)

    node = {
        "ppo_mini_batch_size": scenario.get("mini_batch", 2),
        "ppo_micro_batch_size_per_gpu": 2,
        "ppo_epochs": scenario.get("epochs", 1),
        "data_loader_seed": 7,
        "shuffle": scenario.get("shuffle", False),
        "use_kl_loss": False,
        "entropy_coeff": 0.0,
        "use_dynamic_bsz": False,
        "ppo_max_token_len_per_gpu": 64,
        "megatron": {"context_parallel_size": 1},
        "router_replay": {"mode": "disabled"},
    }
    if "ess_scaling" in scenario:
        node["ess_scaling"] = scenario["ess_scaling"]
    return OmegaConf.create(node)


def _local(scenario: dict, dp_rank: int, dp_size: int) -> Any:
    from verl import DataProto

    full = global_batch(scenario.get("seed", 0), bypass=scenario.get("bypass", False))
    if "nan_sample" in scenario:  # a non-finite log-prob in one DP rank's chunk only
        full["old_log_probs"][scenario["nan_sample"], 0] = float("nan")
    ids = torch.arange(N)
    input_ids = torch.cat([ids.unsqueeze(1), torch.ones(N, PROMPT + R - 1, dtype=torch.long)], 1)
    tensors = {
        "old_log_probs": full["old_log_probs"],
        "rollout_log_probs": full["rollout_log_probs"],
        "response_mask": full["mask"],
        "responses": torch.ones(N, R, dtype=torch.long),
        "input_ids": input_ids,
        "attention_mask": torch.ones(N, PROMPT + R, dtype=torch.long),
        "position_ids": torch.arange(PROMPT + R).expand(N, -1).clone(),
        "advantages": torch.zeros(N, R),
    }
    if scenario.get("no_rollout_log_probs"):
        del tensors["rollout_log_probs"]
    data = DataProto.from_dict(tensors=tensors, meta_info={"micro_batch_size": 2})
    return data.chunk(dp_size)[dp_rank]  # verl's dispatch: contiguous chunks by DP rank


def _lr_recorder(optimizer: Any, into: list) -> None:
    """Record each inner torch optimizer's LRs as its update runs (observation only)."""
    for child in getattr(optimizer, "chained_optimizers", [optimizer]):
        child.optimizer.register_step_pre_hook(
            lambda opt, _a, _k: into.append([g["lr"] for g in opt.param_groups])
        )


def _stand_in_forward(setup: Any, seen: list, key: str) -> Any:
    from megatron_cpu import batch, forward_backward

    def forward_backward_batch(data: Any, **_kwargs: Any) -> dict:
        seen.append(data.batch["input_ids"][:, 0].tolist())
        x, y = batch(len(seen), 0)
        forward_backward(setup, x, y)
        return {"output": [[{key: 0.0}, None]] if key.startswith("actor") else [{key: 0.0}]}

    return forward_backward_batch


def run(src: str, scenario: dict) -> dict:
    """One rank: install, build the real actor (and critic), run one update; report."""
    os.environ.update(scenario.get("env", {}))
    _import_verl(src)
    import ess_patch

    _install(scenario)
    from megatron.core import parallel_state as mpu
    from megatron_cpu import build_megatron_optimizer
    from verl.workers.actor.megatron_actor import MegatronPPOActor
    from verl.workers.critic.megatron_critic import MegatronPPOCritic

    from ess_patch.demo.cpu import megatron_on_cpu

    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=False)
    dp_size = mpu.get_data_parallel_world_size(with_context_parallel=False)
    out: dict[str, Any] = {
        "coords": (dp_rank, mpu.get_context_parallel_rank(), mpu.get_pipeline_model_parallel_rank())
    }
    with megatron_on_cpu():
        actor_setup = build_megatron_optimizer("fp32", optimizer="adam", seed=1)
        critic_setup = build_megatron_optimizer("fp32", optimizer="adam", seed=2)
        actor = object.__new__(MegatronPPOActor)  # the model cannot be built on CPU
        vars(actor).update(
            config=_config(scenario, src),
            actor_module=actor_setup.models,
            actor_optimizer=actor_setup.optimizer,
            enable_routing_replay=False,
            use_torch_profiler=False,
            prof=None,
        )
        seen: list = []
        actor.forward_backward_batch = _stand_in_forward(actor_setup, seen, "actor/pg_loss")
        applied: list = []
        _lr_recorder(actor_setup.optimizer, applied)
        out["scheduled"] = [g["lr"] for g in actor_setup.optimizer.param_groups]
        out["config_type"] = type(actor.config).__name__
        before = [p.detach().clone() for p in actor_setup.models[0].parameters()]
        try:
            loader = actor.make_minibatch_iterator(_local(scenario, dp_rank, dp_size))
            out["metrics"] = actor.update_policy(dataloader=loader)
        except Exception as exc:  # reported, not raised: the test compares every rank's error
            out["error"] = f"{type(exc).__name__}: {exc}"
        out.update(seen=seen, applied=applied)
        out["params_unchanged"] = all(
            torch.equal(a, b.detach())
            for a, b in zip(before, actor_setup.models[0].parameters(), strict=True)
        )
        out["after"] = [g["lr"] for g in actor_setup.optimizer.param_groups]
        out["armed_after"] = ess_patch.armed()

        critic = object.__new__(MegatronPPOCritic)
        vars(critic).update(
            config=_config({}),
            critic_module=critic_setup.models,
            critic_optimizer=critic_setup.optimizer,
        )
        critic_seen: list = []
        critic.forward_backward_batch = _stand_in_forward(critic_setup, critic_seen, "critic/vf")
        critic_applied: list = []
        _lr_recorder(critic_setup.optimizer, critic_applied)
        out["critic_scheduled"] = [g["lr"] for g in critic_setup.optimizer.param_groups]
        critic_data = _local({}, dp_rank, dp_size)
        critic_data = critic_data.select(["input_ids", "responses", "attention_mask"])
        critic.update_critic(critic_data.make_iterator(mini_batch_size=2, epochs=1))
        out["critic_applied"] = critic_applied
    from ess_patch.install import installed_shapes

    out["shapes"] = installed_shapes()
    out["installed"] = ess_patch.is_installed()
    return out


def config_probe(src: str) -> dict:
    """verl's real Hydra config and ``omega_conf_to_dataclass`` with VCPO's keys, before and
    after ``install("verl")``: what each step gave or raised."""
    _import_verl(src)
    import verl.utils.config

    import ess_patch
    from ess_patch.integrations.verl import settings

    actor = "actor_rollout_ref.actor"
    base = [f"{actor}.ppo_micro_batch_size_per_gpu=2"]
    vcpo = [
        f"+{actor}.ess_scaling.enable=true",
        f"+{actor}.ess_scaling.scaling_rule=linear",
        f"+{actor}.ess_scaling.base_ess_ratio=0.5",
        f"+{actor}.ess_scaling.use_clipped=true",
        f"+{actor}.ess_scaling.rollout_is_threshold=2.0",
    ]
    out: dict[str, Any] = {}

    def attempt(name: str, fn: Any) -> Any:
        try:
            value = fn()
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
            return None
        out[name] = "ok"
        return value

    attempt("without_plus", lambda: composed(src, [*base, f"{actor}.ess_scaling.enable=true"]))
    root = composed(src, [*base, *vcpo])
    node = root.actor_rollout_ref.actor
    attempt("uninstalled", lambda: verl.utils.config.omega_conf_to_dataclass(node))
    ess_patch.install("verl")
    config = attempt("installed", lambda: verl.utils.config.omega_conf_to_dataclass(node))
    out["type"] = type(config).__name__
    out["carried"] = getattr(config, "ess_scaling", None)
    out["node_kept"] = "ess_scaling" in node
    chosen = settings(config, environ={})
    out["settings"] = (chosen.enabled, chosen.config)
    bad = composed(src, [*base, f"+{actor}.ess_scaling.enabled=true"])
    attempt(
        "unknown_key",
        lambda: verl.utils.config.omega_conf_to_dataclass(bad.actor_rollout_ref.actor),
    )
    no_clip = composed(src, [*base, f"+{actor}.ess_scaling.use_clipped=true"])
    attempt(
        "clip_without_threshold",
        lambda: settings(no_clip.actor_rollout_ref.actor, environ={"ESS_LR_ENABLE": "1"}),
    )
    return out


def missing_probe(src: str) -> dict:
    """A verl whose actor lacks a hooked method (or a parameter): what install() says, and
    that nothing of verl stays patched."""
    _import_verl(src)
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    import ess_patch
    from ess_patch.install import installed_targets

    out: dict[str, Any] = {}
    saved = vars(MegatronPPOActor)["make_minibatch_iterator"]
    del MegatronPPOActor.make_minibatch_iterator
    try:
        ess_patch.install("verl")
    except Exception as exc:
        out["missing"] = f"{type(exc).__name__}: {exc}"
    out["installed"], out["targets"] = ess_patch.is_installed(), installed_targets()
    MegatronPPOActor.make_minibatch_iterator = saved

    def renamed(self, batches):  # update_policy without a ``dataloader`` parameter
        return {}

    original = vars(MegatronPPOActor)["update_policy"]
    MegatronPPOActor.update_policy = renamed
    try:
        ess_patch.install("verl")
    except Exception as exc:
        out["parameter"] = f"{type(exc).__name__}: {exc}"
    MegatronPPOActor.update_policy = original
    return out


def other_backends_probe(src: str) -> dict:
    """verl's FSDP actor and a non-Megatron engine with ESS-LR on: refused, by name; off:
    verl's own code runs (and here fails on its own, on a batch of None)."""
    from omegaconf import OmegaConf

    _import_verl(src)
    import ess_patch

    ess_patch.install("verl")
    out: dict[str, Any] = {}
    calls = []
    if has_engine_path():
        from verl.workers.engine_workers import ActorRolloutRefWorker

        worker = object.__new__(ActorRolloutRefWorker)
        config = OmegaConf.create({"actor": {"strategy": "fsdp"}})
        vars(worker).update(actor=object(), config=config)
        calls.append(("engine", lambda: worker.update_actor(None)))
    if has_legacy_actor():
        from verl.workers.actor.dp_actor import DataParallelPPOActor

        actor = object.__new__(DataParallelPPOActor)
        vars(actor).update(config=OmegaConf.create({"strategy": "fsdp"}))
        calls.append(("fsdp", lambda: actor.update_policy(None)))
    for enable in ("1", "0"):
        os.environ["ESS_LR_ENABLE"] = enable
        for name, call in calls:
            try:
                call()
            except Exception as exc:
                out[f"{name}_{enable}"] = f"{type(exc).__name__}: {exc}"
    return out


#: the recipe of docs/frameworks/verl.md, as verl's command line takes it
RECIPE = [
    "actor_rollout_ref.rollout.calculate_log_probs=True",
    "+ray_kwargs.ray_init.runtime_env.env_vars.ESS_PATCH_AUTO_INSTALL=1",
    "+ray_kwargs.ray_init.runtime_env.env_vars.ESS_PATCH_INTEGRATIONS=verl",
    "+ray_kwargs.ray_init.runtime_env.env_vars.ESS_LR_ENABLE=1",
    "+ray_kwargs.ray_init.runtime_env.env_vars.ESS_LR_FLOOR=0.1",
    "+actor_rollout_ref.actor.ess_scaling.enable=true",
    "+actor_rollout_ref.actor.ess_scaling.scaling_rule=sqrt",
]


def _ray_init_env(config: Any) -> dict:
    """The ``env_vars`` of the runtime environment ``main_ppo.run_ppo`` hands ``ray.init``:
    its lines, with verl's own ``get_ppo_ray_runtime_env`` imported by name as ``main_ppo``
    imports it (importing ``main_ppo`` itself needs torchdata, which the frameworks tier does
    not install)."""
    import inspect

    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    takes_config = "config" in inspect.signature(get_ppo_ray_runtime_env).parameters
    default = get_ppo_ray_runtime_env(config) if takes_config else get_ppo_ray_runtime_env()
    ray_init_kwargs = config.ray_kwargs.get("ray_init", {})
    runtime_env = OmegaConf.merge(default, ray_init_kwargs.get("runtime_env", {}))
    return OmegaConf.to_container(runtime_env)["env_vars"]


def recipe_probe(src: str) -> dict:
    """The recipe through verl's own config, and the runtime environment ``main_ppo.run_ppo``
    hands ``ray.init``: what every Ray actor's environment gets, and the actor's
    ``ess_scaling`` node."""
    from omegaconf import OmegaConf

    _import_verl(src)
    config = composed(src, RECIPE)
    return {
        "env_vars": _ray_init_env(config),
        "ess_scaling": OmegaConf.to_container(config.actor_rollout_ref.actor.ess_scaling),
        "calculate_log_probs": config.actor_rollout_ref.rollout.calculate_log_probs,
    }


def driver_probe(src: str, installed: str) -> dict:
    """A driver with ``ESS_LR_ENABLE=1`` and ``ESS_LR_FLOOR=0.3`` in its environment, whose
    command line puts ``ESS_LR_ENABLE`` in the Ray runtime environment but not the
    auto-install: the ``env_vars`` every Ray actor starts with, with ess-patch running in the
    driver (``installed`` "1": ``install("verl")`` before verl is imported) or not; and with
    the user's explicit ``ESS_PATCH_AUTO_INSTALL=0`` there."""
    os.environ.update(ESS_LR_ENABLE="1", ESS_LR_FLOOR="0.3")
    if installed == "1":
        import ess_patch

        ess_patch.install("verl")
    _import_verl(src)
    env = "+ray_kwargs.ray_init.runtime_env.env_vars"
    forgot = composed(src, [f"{env}.ESS_LR_ENABLE=1"])
    opted_out = composed(src, [f"{env}.ESS_LR_ENABLE=1", f"{env}.ESS_PATCH_AUTO_INSTALL=0"])
    return {"forgot": _ray_init_env(forgot), "opted_out": _ray_init_env(opted_out)}


def engine_missing_probe(src: str) -> dict:
    """A verl newer than any known shape: ``TrainingWorker.train_batch`` without its ``data``
    parameter. What install() says, and that nothing of verl stays patched."""
    _import_verl(src)
    from verl.workers.engine_workers import TrainingWorker

    import ess_patch
    from ess_patch.install import installed_targets

    out: dict[str, Any] = {}

    def train_batch(self, batch):  # renamed parameter
        return None

    original = vars(TrainingWorker)["train_batch"]
    TrainingWorker.train_batch = train_batch
    try:
        ess_patch.install("verl")
    except Exception as exc:
        out["parameter"] = f"{type(exc).__name__}: {exc}"
    out["installed"], out["targets"] = ess_patch.is_installed(), installed_targets()
    TrainingWorker.train_batch = original
    return out


def neither_probe(tree: str, enable: str = "", baseline: str = "") -> dict:
    """A verl with neither the engine path nor the legacy actor (``tree``: a copy without
    them), imported after install(): what is logged and recorded, what stays patched, and
    what the import of ``verl.workers`` raised (with ``ESS_LR_ENABLE=enable``); then VCPO's
    ``actor.ess_scaling`` through verl's own config check. (Without a request, a host's import
    never fails because of ess-patch: the integration is rolled back.)"""
    import logging

    if enable:
        os.environ["ESS_LR_ENABLE"] = enable
    if baseline:  # VCPO's baseline asked for by the environment (test_verl_baseline.py)
        os.environ["ESS_LR_BASELINE"] = baseline
    _import_verl(tree)
    import ess_patch
    from ess_patch.install import failed_integrations, installed_targets

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ess_patch").addHandler(handler)
    ess_patch.install("verl")
    import verl.utils.config

    out: dict[str, Any] = {"import_error": ""}
    try:
        import verl.workers
    except Exception as exc:
        out["import_error"] = f"{type(exc).__name__}: {exc}"
    node = composed(tree, ["+actor_rollout_ref.actor.ess_scaling.enable=true"])
    try:
        verl.utils.config.omega_conf_to_dataclass(node.actor_rollout_ref.actor)
        out["vcpo"] = "ok"
    except Exception as exc:
        out["vcpo"] = f"{type(exc).__name__}: {exc}"
    out.update(
        failure=failed_integrations().get("verl", ""),
        logged=[r for r in records if "verl" in r],
        targets=[t for t in installed_targets() if t.startswith("verl")],
    )
    return out


def doctor_probe(src: str) -> dict:
    """``ess-patch doctor``'s verl section on this tree: its lines and its problems. Run as in a
    verl environment: the other frameworks' snapshots and import stubs, which the test session
    may have put on ``sys.path``, are taken off (doctor imports every framework it finds)."""
    others = ("miles-", "slime-", "megatron-lm-", "/stubs")
    sys.path[:] = [p for p in sys.path if not any(o in p for o in others)]
    _import_verl(src)
    from ess_patch.doctor import collect

    report = collect()
    lines = [line for key, value in report.sections.items() if "verl" in key for line in value]
    return {"lines": lines, "problems": [p for p in report.problems if "verl" in p]}


def tinker_probe(src: str) -> dict:
    """verl main's Tinker worker (``TinkerActorRolloutRefWorker``, whose split
    ``forward_backward`` / ``optimizer_step`` bypass ``update_actor``) after install("verl"),
    with ESS-LR requested by ``ESS_LR_ENABLE=1``, by VCPO's key, and not at all: what each
    call raised. Off, verl's own code runs (and here fails on its own: the worker has no actor
    role)."""
    from omegaconf import OmegaConf

    _import_verl(src)
    import ess_patch

    ess_patch.install("verl")
    from verl.workers.engine_workers_tinker import TinkerActorRolloutRefWorker

    requests = {
        "env": ({"ESS_LR_ENABLE": "1"}, {}),
        "vcpo": ({}, {"ess_scaling": {"enable": True}}),
        "off": ({}, {}),
    }
    calls = {
        "forward_backward": lambda worker: worker.forward_backward(None),
        "optimizer_step": lambda worker: worker.optimizer_step(),
    }
    out: dict[str, Any] = {}
    for request, (env, actor) in requests.items():
        os.environ.pop("ESS_LR_ENABLE", None)
        os.environ.update(env)
        worker = object.__new__(TinkerActorRolloutRefWorker)
        config = OmegaConf.create({"actor": {"strategy": "megatron", **actor}})
        vars(worker).update(config=config, role="rollout")
        for name, call in calls.items():
            try:
                call(worker)
                out[f"{request}_{name}"] = "ok"
            except Exception as exc:
                out[f"{request}_{name}"] = f"{type(exc).__name__}: {exc}"
    out["targets"] = [t for t in ess_patch.installed_targets() if "Tinker" in t]
    return out


def first_import_probe(src: str, module: str) -> dict:
    """install("verl"), then ``module`` as the first verl module this process imports (the
    driver's ``main_ppo`` -> ``ray_trainer`` -> ``core_algos`` chain starts there): what
    failed, and whether the targets of the modules it pulled in are wrapped."""
    import importlib

    _import_verl(src)
    import ess_patch
    from ess_patch.install import failed_integrations, installed_targets

    ess_patch.install("verl")
    importlib.import_module(module)
    import verl.utils.config
    import verl.workers

    from ess_patch.patching import is_ours

    return {
        "failures": failed_integrations(),
        "targets": [t for t in installed_targets() if t.startswith("verl.")],
        "config_wrapped": is_ours(verl.utils.config.omega_conf_to_dataclass),
    }
