"""verl's known shapes, by feature: which actor path this verl has, the hooked methods'
parameters, where the process groups live, the config check (``VERL_HISTORY``); and the
modules ess-patch targets there, with the releases it supports.

The probes (:class:`~ess_patch.integrations.shapes.ModuleFound`, ``ModuleGone``,
``MethodTakes``) are ``integrations/shapes.py``'s; what ``ESS_LR_ENABLE`` does to a verl that
fits none is :class:`_VerlHistory`'s (here).
"""

from __future__ import annotations

import logging

from ...guard import allow_unscaled
from ...patching import FailClosedError, MissingTargetError
from ..baseline_flags import ENV_ON as ENV_BASELINE
from ..baseline_flags import ENV_SHADOW as ENV_BASELINE_SHADOW
from ..shapes import Aspect, Feature, History, MethodTakes, ModuleFound, ModuleGone, Shape
from .baseline_config import baseline_requested
from .config import ENV_ENABLE, enable_requested

logger = logging.getLogger(__name__)

#: the integration's name (install(), the registry, the shape history)
NAME = "verl"
#: the upstream commit the newest patches/ series and the framework tests are cut from
SNAPSHOT = "1dda039b9c6311889a9c9a26040677e1254814f9"
SUPPORTED = (
    f"verl v0.6.0 (2025-10-15) to main @{SNAPSHOT[:9]} (2026-08-22), releases v0.7.x, v0.8.0, "
    "0.9.x (PyPI 0.9.1) included: the Megatron actor through the legacy Megatron actor where it "
    "exists (before v0.8.0) and through the engine path where it exists (from v0.7.0)"
)

ACTOR = "verl.workers.actor.megatron_actor"
FSDP_ACTOR = "verl.workers.actor.dp_actor"
CONFIG = "verl.utils.config"
ENGINE_WORKERS = "verl.workers.engine_workers"
TINKER = "verl.workers.engine_workers_tinker"  # main: the Tinker-style split training API
RUNTIME_ENV = "verl.trainer.constants_ppo"  # the driver's Ray runtime environment
WORKERS = "verl.workers"
MPU = "megatron.core.parallel_state"
#: modules that import ``omega_conf_to_dataclass`` by name and call it on the actor's node
CONFIG_REIMPORTS = ("verl.utils", "verl.workers.megatron_workers", ENGINE_WORKERS)


class _VerlHistory(History):
    """verl's shapes; a verl that fits none while ``ESS_LR_ENABLE`` (or ``ESS_LR_BASELINE*``)
    is on in this process is refused with :class:`FailClosedError`, which fails the host's
    import (the run stops) instead of rolling verl back and training the policy at the
    scheduled LR (or with the group mean)."""

    def choose(self, name: str) -> Shape:
        try:
            return super().choose(name)
        except FailClosedError:
            raise
        except MissingTargetError as exc:
            baseline = baseline_requested()  # ESS_LR_BASELINE* (VCPO's key is read later)
            if enable_requested():
                if allow_unscaled() and not baseline:  # the opt-out: roll back, logged
                    logger.warning(
                        "ess-patch (verl, opt-out ESS_PATCH_ALLOW_UNSCALED): going on unscaled: %s",
                        exc,
                    )
                    raise
                raise FailClosedError(
                    f"{exc}. {ENV_ENABLE} is on in this process, so the run stops here rather "
                    f"than train the policy at the scheduled LR (unset {ENV_ENABLE} to run "
                    "verl without ESS-LR)"
                ) from exc
            if baseline:  # no opt-out: ESS_PATCH_ALLOW_UNSCALED is about the LR
                raise FailClosedError(
                    f"{exc}. VCPO's baseline is requested in this process ({ENV_BASELINE} or "
                    f"{ENV_BASELINE_SHADOW}), so the run stops here rather than train with the "
                    f"group mean (unset them to run verl without the baseline)"
                ) from exc
            raise


_ENGINE_FEATURES = (
    MethodTakes(ENGINE_WORKERS, "ActorRolloutRefWorker.update_actor", ("data",)),
    MethodTakes(ENGINE_WORKERS, "TrainingWorker.train_mini_batch", ("data",)),
    MethodTakes(ENGINE_WORKERS, "TrainingWorker.train_batch", ("data",)),
)


_LEGACY_FEATURES = (
    MethodTakes(ACTOR, "MegatronPPOActor.update_policy", ("dataloader",)),
    MethodTakes(ACTOR, "MegatronPPOActor.make_minibatch_iterator", ("data",)),
)


_MAIN = f"main @{SNAPSHOT[:9]}"


VERL_HISTORY = _VerlHistory(
    framework=NAME,
    supported=SUPPORTED,
    aspects=(
        Aspect(
            "path",
            (
                Shape(
                    "the legacy Megatron actor and the engine path",
                    "v0.7.0 to @b178a3cd5 (v0.7.x)",
                    (ModuleFound(ACTOR), ModuleFound(ENGINE_WORKERS)),
                ),
                Shape(
                    "the engine path (no legacy actor)",
                    f"v0.8.0 to {_MAIN}",
                    (ModuleGone(ACTOR), ModuleFound(ENGINE_WORKERS)),
                ),
                Shape(
                    "the legacy Megatron actor (no engine path)",
                    "v0.6.x",
                    (ModuleFound(ACTOR), ModuleGone(ENGINE_WORKERS)),
                ),
            ),
            when=(WORKERS,),
            phrase="actor through {label}",
        ),
        Aspect(
            "engine",
            (
                Shape(
                    "update_actor(data) -> TrainingWorker.train_mini_batch -> train_batch(data)",
                    f"v0.7.0 to {_MAIN}",
                    _ENGINE_FEATURES,
                ),
                Shape("none (before v0.7.0)", "v0.6.x", (ModuleGone(ENGINE_WORKERS),)),
            ),
            when=(ENGINE_WORKERS,),
            phrase="engine {label}",
        ),
        Aspect(
            "actor",
            (
                Shape(
                    "MegatronPPOActor.update_policy(dataloader) over make_minibatch_iterator(data)",
                    "v0.6.0 to @b178a3cd5",
                    _LEGACY_FEATURES,
                ),
                Shape("none (removed in v0.8.0)", f"v0.8.0 to {_MAIN}", (ModuleGone(ACTOR),)),
            ),
            when=(ACTOR,),
            phrase="legacy actor {label}",
        ),
        Aspect(
            "groups",
            (
                Shape(
                    "megatron.core.parallel_state (DP without CP, PP)",
                    f"v0.6.0 to {_MAIN}",
                    tuple(
                        Feature(MPU, name)
                        for name in (
                            "get_data_parallel_group",
                            "get_pipeline_model_parallel_group",
                            "is_pipeline_last_stage",
                        )
                    ),
                ),
            ),
            when=(ACTOR, ENGINE_WORKERS),
            phrase="groups from {label}",
        ),
        Aspect(
            "config",
            (
                Shape(
                    "omega_conf_to_dataclass(config, dataclass_type)",
                    f"v0.6.0 to {_MAIN}",
                    (Feature(CONFIG, "omega_conf_to_dataclass", ("config", "dataclass_type")),),
                ),
                # a verl whose actor config is not checked there: ESS_LR_* only
                Shape("no omega_conf_to_dataclass (actor.ess_scaling not read)", "other"),
            ),
            when=(CONFIG,),
            phrase="config via {label}",
        ),
    ),
)
