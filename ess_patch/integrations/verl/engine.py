"""verl's engine path (v0.7.0 on; from v0.8.0 the only actor path): ``update_actor`` marks
the actor's ``TrainingWorker`` (and rewrites the advantages for VCPO's baseline), each
``train_batch`` reads its mini-batch back and arms its ESS for the engine's one
``optimizer_step()``; main's Tinker worker is refused. What each target does is
in the package's docstring (``verl/__init__.py``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, NamedTuple

from ...errors import FailClosedNotImplementedError
from ...guard import arm, refuse
from ..binding import bind_method
from ..framework import applied_metrics, result_metrics
from .adapters import argument, attach_optimizer, refuse_other_backends, release, strategy_of
from .baseline_config import baseline_settings, refuse_baseline
from .batch import compute_batch
from .config import settings

_ENGINE_STATE = "_ess_patch_engine_actor"  # on the actor's TrainingWorker during update_actor


class _Mark(NamedTuple):
    """What ``update_actor`` leaves on the actor's ``TrainingWorker`` for its ``train_batch``
    calls: ESS-LR's settings and the rollout's result (granularity "rollout"), the baseline's
    record; None where off."""

    chosen: Any
    rollout: Any
    baseline: dict | None


def engine_update_actor_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """``ActorRolloutRefWorker.update_actor(data)``: mark the actor's ``TrainingWorker`` for
    the call (with the rollout's result under granularity "rollout"), attach its engine's
    optimizer; refuse a non-Megatron actor while ESS-LR is on. VCPO's baseline: ``data``'s
    advantages rewritten to ``A - b*`` for the call (``verl/engine_baseline.py``)."""
    actor_config = getattr(getattr(instance, "config", None), "actor", None)
    trainer = getattr(instance, "actor", None)
    if actor_config is None or trainer is None:
        return wrapped(*args, **kwargs)  # not the actor's worker: untouched
    baseline = baseline_settings(actor_config)
    chosen = settings(actor_config)
    if chosen is None and baseline is None:
        return wrapped(*args, **kwargs)  # off: untouched
    strategy = strategy_of(actor_config)
    if chosen is not None:
        refuse_other_backends(strategy)
    if baseline is not None and strategy not in (None, "megatron"):
        refuse_baseline(
            actor_config,
            f"verl's {strategy!r} engine lends no Megatron model to the norm pass",
            "Use the Megatron actor (actor_rollout_ref.actor.strategy=megatron)",
        )
    data = argument(bind_method(wrapped, instance, args, kwargs), wrapped, "data")
    rollout = (
        compute_batch(data, chosen.config)
        if chosen is not None and chosen.config.granularity == "rollout"
        else None
    )
    enabled = chosen is not None and chosen.enabled
    optimizer = getattr(getattr(trainer, "engine", None), "optimizer", None)
    attached = False
    with ExitStack() as stack:
        try:  # the mark and the attachment never outlive the call, even if attaching raises
            record = None
            if baseline is not None:  # torch only now: install() itself imports none
                from .engine_baseline import rewritten

                record = stack.enter_context(rewritten(trainer, data, baseline))
            vars(trainer)[_ENGINE_STATE] = _Mark(chosen, rollout, record)
            attached = enabled and attach_optimizer(optimizer)
            return wrapped(*args, **kwargs)
        finally:
            vars(trainer).pop(_ENGINE_STATE, None)
            release(optimizer, attached, enabled)


def engine_train_batch_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """``TrainingWorker.train_batch(data)`` of the actor (inside ``update_actor``): the
    baseline's mini-batch read back, this mini-batch's result armed for the engine's optimizer
    step, both added to the step's metrics (the driver prefixes them with ``actor/``). Any
    other TrainingWorker: untouched."""
    marked = None if instance is None else vars(instance).get(_ENGINE_STATE)
    if marked is None:
        return wrapped(*args, **kwargs)
    data = argument(bind_method(wrapped, instance, args, kwargs), wrapped, "data")
    added: dict[str, float] = {}
    if marked.baseline is not None:  # before anything trains on it, on every rank
        from .engine_baseline import check

        added.update(check(data, marked.baseline))
    chosen, result = marked.chosen, None
    if chosen is not None:
        result = (
            marked.rollout if marked.rollout is not None else compute_batch(data, chosen.config)
        )
        if chosen.enabled:
            arm(result)
    out = wrapped(*args, **kwargs)
    metrics = _engine_metrics(out)
    if metrics is not None:  # only the ranks verl gathers outputs from
        if result is not None:  # the scale the step applied, read back from it
            metrics.update(
                applied_metrics(result) if chosen.enabled else result_metrics(result, applied=False)
            )
        metrics.update(added)
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
        "Train through verl's PPO trainer (ActorRolloutRefWorker.update_actor)",
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
