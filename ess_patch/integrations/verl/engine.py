"""verl's engine path (v0.7.0 on; from v0.8.0 the only actor path): ``update_actor`` marks
the actor's ``TrainingWorker``, each ``train_batch`` arms its mini-batch's ESS for the
engine's one ``optimizer_step()``; main's Tinker worker is refused. What each target does is
in the package's docstring (``verl/__init__.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import FailClosedNotImplementedError
from ...guard import arm, refuse
from ..binding import bind_method
from ..framework import applied_metrics, result_metrics
from .adapters import argument, attach_optimizer, refuse_other_backends, release, strategy_of
from .baseline_config import refuse_baseline
from .batch import compute_batch
from .config import settings

_ENGINE_STATE = "_ess_patch_engine_actor"  # on the actor's TrainingWorker during update_actor
_ENGINE_HAS_NO_BASELINE = (
    "verl's engine path (ActorRolloutRefWorker.update_actor -> TrainingWorker.train_batch) "
    "gets advantages with no norm pass"
)
_TO_LEGACY = (
    "On verl v0.7.x train through the legacy Megatron actor (trainer.use_legacy_worker_impl="
    "auto or enable); verl v0.8.0 and later have no legacy actor"
)


def engine_update_actor_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """``ActorRolloutRefWorker.update_actor(data)``: mark the actor's ``TrainingWorker`` for
    the call (with the rollout's result under granularity "rollout"), attach its engine's
    optimizer; refuse a non-Megatron actor while ESS-LR is on."""
    actor_config = getattr(getattr(instance, "config", None), "actor", None)
    trainer = getattr(instance, "actor", None)
    if actor_config is not None and trainer is not None:
        refuse_baseline(actor_config, _ENGINE_HAS_NO_BASELINE, _TO_LEGACY)
    chosen = None if actor_config is None else settings(actor_config)
    if chosen is None or trainer is None:
        return wrapped(*args, **kwargs)  # off (or not the actor's worker): untouched
    refuse_other_backends(strategy_of(actor_config))
    data = argument(bind_method(wrapped, instance, args, kwargs), wrapped, "data")
    rollout = compute_batch(data, chosen.config) if chosen.config.granularity == "rollout" else None
    optimizer = getattr(getattr(trainer, "engine", None), "optimizer", None)
    attached = False
    try:  # the mark and the attachment never outlive the call, even if attaching raises
        vars(trainer)[_ENGINE_STATE] = (chosen, rollout)
        attached = chosen.enabled and attach_optimizer(optimizer)
        return wrapped(*args, **kwargs)
    finally:
        vars(trainer).pop(_ENGINE_STATE, None)
        release(optimizer, attached, chosen.enabled)


def engine_train_batch_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """``TrainingWorker.train_batch(data)`` of the actor (inside ``update_actor``): arm this
    mini-batch's result for the engine's optimizer step and add it to the step's metrics
    (the driver prefixes them with ``actor/``). Any other TrainingWorker: untouched."""
    marked = None if instance is None else vars(instance).get(_ENGINE_STATE)
    if marked is None:
        return wrapped(*args, **kwargs)
    chosen, rollout = marked
    data = argument(bind_method(wrapped, instance, args, kwargs), wrapped, "data")
    result = rollout if rollout is not None else compute_batch(data, chosen.config)
    if chosen.enabled:
        arm(result)
    out = wrapped(*args, **kwargs)
    metrics = _engine_metrics(out)
    if metrics is not None:  # only the ranks verl gathers outputs from
        # the scale the step applied, read back from it (never copied from the result)
        metrics.update(
            applied_metrics(result) if chosen.enabled else result_metrics(result, applied=False)
        )
    return out


def tinker_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``TinkerActorRolloutRefWorker.forward_backward`` / ``optimizer_step`` (verl main's
    Tinker-style split API): refused while ESS-LR is on (or in shadow mode), before any
    gradient. They step the actor's optimizer outside ``update_actor`` / ``train_batch``, where
    nothing measures a mini-batch, so every step would run at the scheduled LR."""
    if instance is None:
        return wrapped(*args, **kwargs)
    actor_config = getattr(getattr(instance, "config", None), "actor", None)
    refuse_baseline(
        actor_config,
        f"the Tinker worker ({type(instance).__name__}.{wrapped.__name__}) trains the actor "
        "outside update_actor, with no norm pass",
        "Train through verl's PPO trainer on the legacy Megatron actor",
    )
    if settings(actor_config) is not None:
        refuse(
            "verl",
            f"the Tinker worker ({type(instance).__name__}.{wrapped.__name__}) trains the actor "
            "outside update_actor / train_batch, where ESS-LR measures each mini-batch",
            "Train through update_actor (verl's PPO trainer), or turn ESS-LR off (ESS_LR_ENABLE, "
            "actor.ess_scaling.enable, ESS_LR_SHADOW)",
            kind=FailClosedNotImplementedError,
        )
    return wrapped(*args, **kwargs)


def _engine_metrics(output: Any) -> dict | None:
    """The metrics dict of a ``train_batch`` output (None on ranks that return no output)."""
    if output is None:
        return None
    try:
        metrics = output.get("metrics")
    except Exception:  # not a TensorDict / mapping: nothing to add to
        return None
    metrics = getattr(metrics, "data", metrics)  # a NonTensorData holds the dict
    return metrics if isinstance(metrics, dict) else None
