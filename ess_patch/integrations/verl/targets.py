"""verl's targets (``VERL``): every attribute ess-patch wraps there, and with what. Each is
optional: which must exist is the "path" aspect's decision (``verl/shapes.py``)."""

from __future__ import annotations

from typing import Any

from ...patching import Target
from .. import Integration
from .config import config_wrapper
from .driver import runtime_env_wrapper
from .engine import engine_train_batch_wrapper, engine_update_actor_wrapper, tinker_wrapper
from .legacy_actor import (
    fsdp_update_policy_wrapper,
    minibatch_iterator_wrapper,
    update_policy_wrapper,
)
from .shapes import (
    ACTOR,
    CONFIG,
    CONFIG_REIMPORTS,
    ENGINE_WORKERS,
    FSDP_ACTOR,
    NAME,
    RUNTIME_ENV,
    SNAPSHOT,
    TINKER,
    VERL_HISTORY,
)


def _target(module: str, owner: str, attribute: str, wrapper: Any, decorator: str) -> Target:
    # every target is optional: which must exist is the "path" aspect's decision
    return Target(module, owner, attribute, wrapper, required=False, decorator=decorator)


VERL = Integration(
    name=NAME,
    snapshot=SNAPSHOT,
    distribution="verl",
    supported=">=0.6.0",
    targets=(
        _target(
            ENGINE_WORKERS,
            "ActorRolloutRefWorker",
            "update_actor",
            engine_update_actor_wrapper,
            "verl_engine_update_actor",
        ),
        _target(
            ENGINE_WORKERS,
            "TrainingWorker",
            "train_batch",
            engine_train_batch_wrapper,
            "verl_engine_train_batch",
        ),
        *(
            _target(TINKER, "TinkerActorRolloutRefWorker", name, tinker_wrapper, decorator)
            for name, decorator in (
                ("forward_backward", "verl_tinker_forward_backward"),
                ("optimizer_step", "verl_tinker_optimizer_step"),
            )
        ),
        _target(
            ACTOR,
            "MegatronPPOActor",
            "make_minibatch_iterator",
            minibatch_iterator_wrapper,
            "verl_minibatch_iterator",
        ),
        _target(
            ACTOR, "MegatronPPOActor", "update_policy", update_policy_wrapper, "verl_update_policy"
        ),
        _target(
            FSDP_ACTOR,
            "DataParallelPPOActor",
            "update_policy",
            fsdp_update_policy_wrapper,
            "verl_fsdp_update_policy",
        ),
        _target(
            CONFIG, "", "omega_conf_to_dataclass", config_wrapper, "verl_omega_conf_to_dataclass"
        ),
        _target(
            RUNTIME_ENV,
            "",
            "get_ppo_ray_runtime_env",
            runtime_env_wrapper,
            "verl_get_ppo_ray_runtime_env",
        ),
        # run_ppo's by-name import, for a script that imports main_ppo before install()
        Target(
            "verl.trainer.main_ppo",
            "",
            "get_ppo_ray_runtime_env",
            runtime_env_wrapper,
            required=False,
        ),
        *(
            Target(module, "", "omega_conf_to_dataclass", config_wrapper, required=False)
            for module in CONFIG_REIMPORTS
        ),
    ),
    history=VERL_HISTORY,
)
