"""verl (verl-project/verl, v0.6.0 to main @1dda039b9; PyPI 0.9.1): ESS-LR for the Megatron actor.

What ess-patch does to verl: every target of ``VERL`` (below) and its effect, per release.
Nothing else is touched; the LR itself is scaled at the actor's megatron-core
``optimizer.step()``, which each actor hook attaches for its call (``attach.py``).

| target (under ``verl.``) | v0.6.0 | v0.7.0, @b178a3cd5 | v0.8.0, 0.9.x, main |
|---|---|---|---|
| ``workers.engine_workers``: ``ActorRolloutRefWorker`` | absent | engine path | the path |
| ``.update_actor``; ``TrainingWorker.train_batch`` | | | |
| ``workers.actor.megatron_actor``: ``MegatronPPOActor`` | the path | legacy (default) | absent |
| ``.make_minibatch_iterator``, ``.update_policy`` | | | |
| ``workers.actor.dp_actor``: ``DataParallelPPOActor.update_policy`` | refused | refused | absent |
| ``utils.config.omega_conf_to_dataclass`` (+ by-name imports) | VCPO keys | VCPO keys | VCPO keys |
| ``trainer.constants_ppo.get_ppo_ray_runtime_env`` (+ main_ppo) | driver | driver | driver |
| ``workers.engine_workers_tinker``: ``TinkerActorRolloutRefWorker`` | absent | absent | refused |
| ``.forward_backward``, ``.optimizer_step`` | | | |

v0.6.0 trains the Megatron actor through the legacy actor only (its ``workers/roles`` serve
the FSDP strategy). The engine path is ``trainer.use_legacy_worker_impl=disable`` in v0.7.x;
verl PR #6067 (2026-04-20) removed the legacy workers, so from v0.8.0 it is the only actor
path.

- ``update_actor``: on the actor's worker, marks the actor's ``TrainingWorker`` for the call
  (the critic's is another instance and is never touched), refuses a non-Megatron actor
  (``actor.strategy``) while ESS-LR is on, attaches the engine's optimizer, and with
  granularity "rollout" computes the ESS of the whole batch it got; disarms on the way out.
- ``train_batch``: on the marked ``TrainingWorker`` only, computes this mini-batch's ESS
  (granularity "step", VCPO's), arms it for the engine's one ``optimizer_step()`` inside,
  and adds ``lr_scale``, ``rho_ess``... to the step's metrics (the driver logs them as
  ``actor/lr_scale``...). Shadow mode: computed and logged as ``ess_lr_shadow_scale``, never
  armed.
- ``make_minibatch_iterator`` / ``update_policy`` (legacy): the same per mini-batch (or per
  rollout) ESS, armed for each ``actor_optimizer.step()`` as ``update_policy`` draws the
  mini-batches, metrics as ``actor/...`` lists.
- VCPO's baseline (``ESS_LR_BASELINE*`` or VCPO's ``actor.grad_baselining``, with or without
  ESS-LR; ``verl/baseline_config.py``): ``make_minibatch_iterator`` rewrites the chunk's
  GRPO advantages to ``A - b*`` for the mini-batches (``verl/baseline.py``: the norm pass on
  ``actor_module``, groups from ``uid`` reduced over DP), ``update_policy`` reads each
  mini-batch back before verl trains on it and logs ``actor/ess_baseline_*``. The engine
  path's ``update_actor``, the FSDP actor and the Tinker worker refuse it by name.
- ``forward_backward`` / ``optimizer_step`` of main's Tinker worker: refused while ESS-LR is
  on (they step the actor outside ``update_actor`` / ``train_batch``), before any gradient.
- ``get_ppo_ray_runtime_env`` (the driver, before ``ray.init``): every Ray actor's environment
  gets the auto-install and the driver's ``ESS_LR_*`` (``verl/driver.py``), so a driver that
  runs ess-patch never starts workers that train unscaled.
- ``omega_conf_to_dataclass``: VCPO's ``actor.ess_scaling`` node taken out before verl checks
  the actor config against its dataclass (unknown keys fail there), kept on the dataclass.

What the engine path hands ``train_batch`` (read in each snapshot's ``ray_trainer.py``,
``workers/utils/padding.py``, ``engine_workers.py``, ``workers/engine/megatron/``): the driver
turns the batch into a TensorDict and ``left_right_2_no_padding`` makes ``input_ids`` /
``position_ids`` / ``loss_mask`` nested (jagged); ``old_log_probs``, ``rollout_log_probs``
(with ``rollout.calculate_log_probs``) and ``response_mask`` stay padded ``[batch,
response_length]`` in every release (verl's own loss still calls ``to_padded_tensor`` on
them: a nested one is read per row too). ``update_actor`` gets this DP rank's chunk (dispatch
by DP; TP and CP ranks of a DP rank hold the same rows, CP splits sequences only inside the
model, every PP stage holds the batch); ``train_mini_batch`` draws
``tu.make_iterator(mini_batch_size / dp, epochs, seed + dp_rank, shuffle)`` and calls
``train_batch`` once per mini-batch: one ``optimizer_step()`` each, the LR scheduler after the
last. ``use_dynamic_bsz`` regroups micro-batches inside ``train_batch`` only (the step's
batch is the same). Metrics come back only from ``is_mp_src_rank_with_outputs()`` ranks (TP 0,
last PP stage, CP 0). So the ESS is one reduction over DP without CP, computed on the last
stage and broadcast over PP so that a fault there reaches every stage. main's
``dynamic_context_parallel`` replicates the mini-batch over DP x CP: rho and the scale are
unchanged by a uniform replication. With ``algorithm.rollout_correction.bypass_mode`` the
driver sets ``old_log_probs`` to the rollout log-probs (every release): refused, the ratio is
1. Without ``rollout_log_probs``: refused. Both on every rank, before any step.

The shapes, by feature (never by version string), each actor path on its own: the "path"
aspect, decided when ``verl.workers`` is imported, takes the legacy actor wherever its module
exists and the engine path wherever its module exists (both in v0.7.x, the legacy actor alone
in v0.6.x, the engine path alone from v0.8.0; a release in between is read the same way).
With neither, verl is rolled back at that import with one logged error line naming the
supported releases (``failed_integrations()``; ``doctor`` reports it as a problem); with
``ESS_LR_ENABLE`` on in that process, the import itself fails with that error
(:class:`~ess_patch.patching.FailClosedError`): the run stops instead of training unscaled
(VCPO's ``actor.ess_scaling`` then fails verl's own check of the actor config).
The "engine" and "actor" aspects check the hooked methods' parameters when their modules are
imported, so a verl that renamed them is refused by name instead of silently unscaled.

Settings, per update (``verl.config.settings``): on with ``ESS_LR_ENABLE=1`` or
``actor.ess_scaling.enable``; the rest from ``ESS_LR_*`` (``EssLrConfig.from_env`` via
``install()``), VCPO's keys winning for the fields they name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from ... import collapse_warning
from ...config import EssLrConfig
from ...errors import EssPatchValueError, FailClosedNotImplementedError
from ...guard import allow_unscaled, applied_scale, arm, refuse
from ...patching import FailClosedError, MissingTargetError, Target
from ...result import EssLrResult
from ...state import disarm
from .. import Integration
from ..baseline_flags import ENV_ON as ENV_BASELINE
from ..baseline_flags import ENV_SHADOW as ENV_BASELINE_SHADOW
from ..binding import bind, bind_method, call_method, call_with, undecorated
from ..rl_hooks import Groups, applied_metrics, megatron_groups, result_metrics
from ..shapes import Aspect, Feature, History, Shape
from .baseline_config import baseline_requested, baseline_settings, refuse_baseline
from .config import ENV_ENABLE, VerlSettings, config_wrapper, enable_requested, settings
from .driver import runtime_env_wrapper

__all__ = [
    "VERL",
    "VERL_HISTORY",
    "VerlSettings",
    "config_wrapper",
    "runtime_env_wrapper",
    "settings",
    "tinker_wrapper",
]

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

_ACTOR = "verl.workers.actor.megatron_actor"
_FSDP_ACTOR = "verl.workers.actor.dp_actor"
_CONFIG = "verl.utils.config"
_ENGINE_WORKERS = "verl.workers.engine_workers"
_TINKER = "verl.workers.engine_workers_tinker"  # main: the Tinker-style split training API
_RUNTIME_ENV = "verl.trainer.constants_ppo"  # the driver's Ray runtime environment
_WORKERS = "verl.workers"
_MPU = "megatron.core.parallel_state"
#: modules that import ``omega_conf_to_dataclass`` by name and call it on the actor's node
_CONFIG_REIMPORTS = ("verl.utils", "verl.workers.megatron_workers", _ENGINE_WORKERS)
#: verl's metric names: the actor's own prefix
METRIC_PREFIX = "actor/"
_ROLLOUT_LOG_PROBS = "rollout_log_probs"
_ROLLOUT_RESULT = "_ess_patch_rollout_result"  # on the legacy actor: the rollout's result
_BASELINE_RECORD = "_ess_patch_baseline"  # on the legacy actor: the baseline's record
_ENGINE_STATE = "_ess_patch_engine_actor"  # on the actor's TrainingWorker during update_actor
_ENGINE_HAS_NO_BASELINE = (
    "verl's engine path (ActorRolloutRefWorker.update_actor -> TrainingWorker.train_batch) "
    "gets advantages with no norm pass"
)
_TO_LEGACY = (
    "On verl v0.7.x train through the legacy Megatron actor (trainer.use_legacy_worker_impl="
    "auto or enable); verl v0.8.0 and later have no legacy actor"
)


# --- the ESS of one batch ----------------------------------------------------------------------


def _groups() -> Groups:
    """DP without CP (CP peers hold the same sequences whole), the PP group, the last stage."""
    return megatron_groups()._replace(cp_group=None)


def _rows(tensor: Any) -> list[Any]:
    """One 1-D tensor per trajectory: the rows of a padded ``[batch, response]`` tensor or
    of a nested (jagged) one."""
    return list(tensor.unbind()) if getattr(tensor, "is_nested", False) else list(tensor)


def _tensors(data: Any) -> tuple[list[Any], list[Any], list[Any]]:
    """``(old_log_probs, rollout_log_probs, response_mask)`` rows of a DataProto or TensorDict.

    Raises:
        ValueError: a key is missing (the same on every rank: every DP chunk has the keys of
            the whole batch), naming the verl setting that provides it.
    """
    batch = data.batch if hasattr(data, "non_tensor_batch") else data  # DataProto or TensorDict
    keys = set(batch.keys())
    if "rollout_log_probs" not in keys:
        raise EssPatchValueError(
            "ESS-LR (verl): the actor's batch has no rollout_log_probs, so there is nothing to "
            "measure the policy against. Set actor_rollout_ref.rollout.calculate_log_probs=True "
            "(the rollout engine then returns them), or turn ESS-LR off"
        )
    if "old_log_probs" not in keys:
        raise EssPatchValueError("ESS-LR (verl): the actor's batch has no old_log_probs")
    if "response_mask" in keys:
        mask = _rows(batch["response_mask"])
    elif {"attention_mask", "responses"} <= keys:  # older verl: the actor derived it so
        mask = list(batch["attention_mask"][:, -batch["responses"].shape[-1] :])
    else:
        raise EssPatchValueError(
            "ESS-LR (verl): the actor's batch has neither response_mask nor attention_mask "
            "and responses to tell which tokens count"
        )
    return _rows(batch["old_log_probs"]), _rows(batch["rollout_log_probs"]), mask


def _check_not_bypassed(old: list[Any], rollout: list[Any], mask: list[Any]) -> None:
    """A refusal when the old log-probs ARE the rollout log-probs on every counted token."""
    import torch

    counted = [m.bool() for m in mask]
    if not any(bool(m.any()) for m in counted):
        return
    if all(torch.equal(o[m], r[m]) for o, r, m in zip(old, rollout, counted, strict=True)):
        raise EssPatchValueError(
            "ESS-LR (verl): old_log_probs equal rollout_log_probs on every token "
            "(algorithm.rollout_correction.bypass_mode=True copies them): the ratio is "
            "1 and the ESS would measure nothing. Turn bypass_mode off (verl then "
            "recomputes old_log_probs with the current weights) or ESS-LR off"
        )


def compute_batch(data: Any, config: EssLrConfig, groups: Groups | None = None) -> EssLrResult:
    """The ESS of one batch (a mini-batch, or the whole rollout chunk) over every DP rank,
    identical on every rank of the actor; a fault on any rank raises on all of them."""
    from ...compute import compute_ess_lr
    from ...reduction import broadcast_from_last_stage

    groups = _groups() if groups is None else groups
    out: EssLrResult | None = None
    error: BaseException | None = None
    try:
        if groups.is_pp_last:
            fault: Exception | None = None
            rows: tuple[list[Any], ...] = ([], [], [])
            try:
                rows = _tensors(data)
                _check_not_bypassed(*rows)
            except Exception as exc:  # still enter the DP collectives, flagged
                fault, rows = exc, ([], [], [])
            out = compute_ess_lr(*rows, config=config, dp_group=groups.dp_group, error=fault)
    except Exception as exc:
        error = exc  # the other pipeline stages learn of it through the broadcast
    result = broadcast_from_last_stage(out, groups.pp_group, config=config, error=error)
    # verl's shadow mode is the config's (settings(): enable and shadow never both on); the
    # result is armed per mini-batch, before the step that uses it (arm_now=False)
    return collapse_warning.publish(
        result, config, framework="verl", shadow=config.shadow, arm_now=False
    )


# --- adapters ----------------------------------------------------------------------------------


def _the(call: Any, wrapped: Any, name: str) -> Any:
    """Argument ``name`` of a bound call, or a refusal naming the method and the releases."""
    if call is None or name not in call.arguments:
        raise MissingTargetError(
            f"ess-patch (verl): {getattr(wrapped, '__qualname__', wrapped)} takes no {name} "
            f"parameter. Supported: {SUPPORTED}"
        )
    return call.arguments[name]


def _attach(optimizer: Any) -> bool:
    """Make the actor's optimizer apply the armed scale even without ``install("megatron")``
    (with it, the nested wrappers still scale each update once). Returns whether we did."""
    from ...attach import attach
    from ...patching import is_ours

    if optimizer is None or is_ours(vars(optimizer).get("step")):
        return False
    attach(optimizer)
    return True


def _release(optimizer: Any, attached: bool, enabled: bool) -> None:
    """After the actor's update: nothing stays armed (the critic, and anything after, is never
    scaled), and the optimizer is detached if we attached it."""
    if enabled:
        disarm()
    if attached:
        from ...attach import detach

        detach(optimizer)


def _strategy(actor_config: Any) -> Any:
    if isinstance(actor_config, Mapping):
        return actor_config.get("strategy")
    return getattr(actor_config, "strategy", None)


def _refuse_other_backends(strategy: Any) -> None:
    if strategy not in (None, "megatron"):
        refuse(
            "verl",
            f"strategy {strategy!r} is not supported and would never be scaled (ESS-LR (verl) "
            "supports the Megatron actor, actor_rollout_ref.actor.strategy=megatron)",
            "Use the Megatron actor, or turn ESS-LR off (ESS_LR_ENABLE, actor.ess_scaling.enable)",
            kind=FailClosedNotImplementedError,
        )


# --- the engine path (every release) -----------------------------------------------------------


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
    _refuse_other_backends(_strategy(actor_config))
    data = _the(bind_method(wrapped, instance, args, kwargs), wrapped, "data")
    rollout = compute_batch(data, chosen.config) if chosen.config.granularity == "rollout" else None
    optimizer = getattr(getattr(trainer, "engine", None), "optimizer", None)
    attached = False
    try:  # the mark and the attachment never outlive the call, even if attaching raises
        vars(trainer)[_ENGINE_STATE] = (chosen, rollout)
        attached = chosen.enabled and _attach(optimizer)
        return wrapped(*args, **kwargs)
    finally:
        vars(trainer).pop(_ENGINE_STATE, None)
        _release(optimizer, attached, chosen.enabled)


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
    data = _the(bind_method(wrapped, instance, args, kwargs), wrapped, "data")
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


# --- the legacy Megatron actor (v0.6.x, v0.7.x) -----------------------------------------------


def _each(
    dataloader: Iterable[Any],
    result_of: Callable[[Any], EssLrResult],
    results: list[tuple[EssLrResult, float | None]],
    enabled: bool,
) -> Iterator[Any]:
    """The mini-batches as drawn, each one's result computed (and armed) before verl trains
    on it, so that the optimizer step that follows uses that mini-batch's scale; when verl
    asks for the next one, the scale that step applied is read back for the metrics."""
    for data in dataloader:
        result = result_of(data)
        if enabled:
            arm(result)
        yield data
        results.append((result, applied_scale() if enabled else None))


def _add_metrics(
    metrics: Any, results: list[tuple[EssLrResult, float | None]], enabled: bool
) -> None:
    """One value per optimizer step under ``actor/``, as verl's own per-step metrics; the
    ``lr_scale`` of a step is the one it applied (read back), never the armed result's."""
    if not isinstance(metrics, dict):
        logger.warning("ess-patch (verl): update_policy returned no metrics dict; ESS not logged")
        return
    for result, applied in results:
        values = result_metrics(result, applied=enabled)
        if enabled and "lr_scale" in values:
            scale = values.pop("lr_scale")
            if applied is None:
                values["ess_lr_armed_scale"] = scale
            else:
                values["lr_scale"] = applied
        for key, value in values.items():
            metrics.setdefault(METRIC_PREFIX + key, []).append(value)


def minibatch_iterator_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """Granularity "rollout": the ESS over this DP rank's whole chunk (every DP rank), kept on
    the actor for the ``update_policy`` that follows. Granularity "step": the mini-batches
    keep ``rollout_log_probs`` (each one's ESS needs them), which v0.6's selection drops.
    VCPO's baseline (``verl.baseline``): the chunk's advantages rewritten to ``A - b*`` for
    the mini-batches (the caller's ``data`` keeps its own), the record kept on the actor."""
    if instance is None:
        return wrapped(*args, **kwargs)
    vars(instance).pop(_ROLLOUT_RESULT, None)  # never a previous rollout's
    vars(instance).pop(_BASELINE_RECORD, None)
    config = getattr(instance, "config", None)
    baseline = baseline_settings(config)
    chosen = settings(config)
    if chosen is None and baseline is None:
        return wrapped(*args, **kwargs)  # off: untouched
    data = _the(bind_method(wrapped, instance, args, kwargs), wrapped, "data")
    if chosen is not None and chosen.config.granularity == "rollout":
        vars(instance)[_ROLLOUT_RESULT] = compute_batch(data, chosen.config)
    keys = [] if chosen is None or chosen.config.granularity == "rollout" else [_ROLLOUT_LOG_PROBS]
    with ExitStack() as stack:
        if baseline is not None:
            from .baseline import ROW_KEY

            stack.enter_context(_baseline_rewritten(instance, data, baseline))
            keys.append(ROW_KEY)
        stack.enter_context(_selection_keeps(data, *keys))
        return wrapped(*args, **kwargs)


@contextmanager
def _baseline_rewritten(instance: Any, data: Any, chosen: Any) -> Iterator[None]:
    """For the call: ``data``'s advantages rewritten (``verl.baseline.rewrite``, on every DP
    rank) and its row key added; afterwards ``data`` is as it was, the record on the actor."""
    from .baseline import ROW_KEY, rewrite

    batch = getattr(data, "batch", None)
    has = batch is not None and "advantages" in batch.keys()  # noqa: SIM118 - a TensorDict
    original = batch["advantages"] if has else None
    record = rewrite(instance, data, chosen, _groups().dp_group)
    try:
        yield
        vars(instance)[_BASELINE_RECORD] = record
    finally:
        if original is not None:
            data.batch["advantages"] = original
        if ROW_KEY in data.batch.keys():  # noqa: SIM118 - TensorDict refuses `in`
            del data.batch[ROW_KEY]


@contextmanager
def _selection_keeps(data: Any, *wanted: str) -> Iterator[None]:
    """For the call: ``data.select(batch_keys=...)`` keeps each key of ``wanted`` that
    ``data`` has.

    verl v0.6.0's ``make_minibatch_iterator`` selects the keys its loss reads and drops
    ``rollout_log_probs`` (v0.7.0 keeps them itself: then this changes nothing); the baseline's
    row key is ess-patch's own. An extra key in a mini-batch is never read by verl's loss.
    """
    select = getattr(data, "select", None)
    keys = getattr(getattr(data, "batch", None), "keys", None)
    present = [] if keys is None else [k for k in wanted if k in keys()]
    if select is None or not present or not hasattr(data, "__dict__"):
        yield
        return

    def keeping(*args: Any, **kwargs: Any) -> Any:
        call = bind(select, args, kwargs)
        chosen = None if call is None else call.arguments.get("batch_keys")
        if chosen is None or all(k in chosen for k in present):
            return select(*args, **kwargs)
        extra = [k for k in present if k not in chosen]
        return call_with(select, call, batch_keys=[*chosen, *extra])

    vars(data)["select"] = keeping  # this object only, for this call
    try:
        yield
    finally:
        vars(data).pop("select", None)


def _add_baseline_metrics(metrics: Any, record: dict | None) -> None:
    """The baseline's metrics, one value per update under ``actor/`` (as verl's own lists)."""
    if record is None or not isinstance(metrics, dict):
        return
    for key, value in record["metrics"].items():
        metrics.setdefault(METRIC_PREFIX + key, []).append(value)


def update_policy_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """Compute each mini-batch's ESS as verl draws it (or take the rollout's), arm it for that
    mini-batch's optimizer step, log it under ``actor/``, and disarm on the way out. With the
    baseline, every mini-batch's advantages are read back before verl trains on it."""
    if instance is None:
        return wrapped(*args, **kwargs)
    config = getattr(instance, "config", None)
    record = vars(instance).pop(_BASELINE_RECORD, None)
    if record is None and baseline_settings(config) is not None:
        raise FailClosedError(
            "ess-patch (verl): VCPO's baseline was requested but update_policy got a "
            "dataloader that make_minibatch_iterator did not make, so no advantage was "
            "rewritten. Build it with actor.make_minibatch_iterator(data) (verl's own workers "
            "do), or turn the baseline off"
        )
    chosen = settings(config)
    if chosen is None and record is None:
        return wrapped(*args, **kwargs)  # off: no collective, no LR write
    call = bind_method(wrapped, instance, args, kwargs)
    dataloader = _the(call, wrapped, "dataloader")
    if record is not None:
        from .baseline import read_back

        dataloader = read_back(dataloader, record, _groups().dp_group)
    if chosen is None:
        metrics = call_method(wrapped, call, dataloader=dataloader)
        _add_baseline_metrics(metrics, record)
        return metrics
    results: list[tuple[EssLrResult, float | None]] = []
    if chosen.config.granularity == "rollout":
        rollout = vars(instance).pop(_ROLLOUT_RESULT, None)
        if rollout is None:
            raise EssPatchValueError(
                "ESS-LR (verl) granularity 'rollout': update_policy got a dataloader that "
                "make_minibatch_iterator did not make, so the rollout's ESS is unknown. Use "
                "ESS_LR_GRANULARITY=step"
            )
        result_of: Callable[[Any], EssLrResult] = lambda _data: rollout  # noqa: E731
    else:
        result_of = lambda data: compute_batch(data, chosen.config)  # noqa: E731
    loader = _each(dataloader, result_of, results, chosen.enabled)
    optimizer = getattr(instance, "actor_optimizer", None)
    attached = chosen.enabled and _attach(optimizer)
    try:
        metrics = call_method(wrapped, call, dataloader=loader)
    finally:
        _release(optimizer, attached, chosen.enabled)
    _add_metrics(metrics, results, chosen.enabled)
    _add_baseline_metrics(metrics, record)
    return metrics


def fsdp_update_policy_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """verl's FSDP actor (``DataParallelPPOActor.update_policy``, before v0.8.0): refused
    while ESS-LR is on, never a silent no-op."""
    if instance is not None:
        strategy = _strategy(getattr(instance, "config", None)) or "fsdp"
        refuse_baseline(
            getattr(instance, "config", None),
            f"verl's FSDP actor (DataParallelPPOActor, strategy {strategy!r}) lends no Megatron "
            "model to the norm pass",
            "Use the Megatron actor (actor_rollout_ref.actor.strategy=megatron)",
        )
    if instance is not None and settings(getattr(instance, "config", None)) is not None:
        _refuse_other_backends(_strategy(getattr(instance, "config", None)) or "fsdp")
    return wrapped(*args, **kwargs)


# --- shapes and targets ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Module(Feature):
    """A module that exists (found without importing it: the engine path imports datasets,
    ray... which a check must not pull into every process that imports ``verl.workers``)."""

    symbol: str = ""

    def missing(self) -> str | None:
        from importlib.util import find_spec

        try:
            found = find_spec(self.module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        return None if found else f"module {self.module} does not exist"

    def __str__(self) -> str:
        return self.module


class _Method(Feature):
    """A method that takes ``parameters`` by name once verl's decorators are looked through
    (``GPUMemoryLogger`` on ``update_policy`` has no ``functools.wraps``)."""

    def missing(self) -> str | None:
        import importlib
        import inspect

        gone = _Module(self.module).missing()
        if gone is not None:
            return gone
        holder: Any = importlib.import_module(self.module)
        for part in self.symbol.split("."):
            holder = getattr(holder, part, None)
            if holder is None:
                return f"{self.module}.{self.symbol} does not exist"
        names = inspect.signature(undecorated(holder)).parameters
        lacking = [p for p in self.parameters if p not in names]
        if lacking:
            return f"{self.module}.{self.symbol} has no parameter {', '.join(lacking)}"
        return None


@dataclass(frozen=True)
class _Gone(_Module):
    """A module that does NOT exist (the legacy actor, removed in verl v0.8.0)."""

    def missing(self) -> str | None:
        return None if super().missing() is not None else f"module {self.module} exists"


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
    _Method(_ENGINE_WORKERS, "ActorRolloutRefWorker.update_actor", ("data",)),
    _Method(_ENGINE_WORKERS, "TrainingWorker.train_mini_batch", ("data",)),
    _Method(_ENGINE_WORKERS, "TrainingWorker.train_batch", ("data",)),
)
_LEGACY_FEATURES = (
    _Method(_ACTOR, "MegatronPPOActor.update_policy", ("dataloader",)),
    _Method(_ACTOR, "MegatronPPOActor.make_minibatch_iterator", ("data",)),
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
                    (_Module(_ACTOR), _Module(_ENGINE_WORKERS)),
                ),
                Shape(
                    "the engine path (no legacy actor)",
                    f"v0.8.0 to {_MAIN}",
                    (_Gone(_ACTOR), _Module(_ENGINE_WORKERS)),
                ),
                Shape(
                    "the legacy Megatron actor (no engine path)",
                    "v0.6.x",
                    (_Module(_ACTOR), _Gone(_ENGINE_WORKERS)),
                ),
            ),
            when=(_WORKERS,),
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
                Shape("none (before v0.7.0)", "v0.6.x", (_Gone(_ENGINE_WORKERS),)),
            ),
            when=(_ENGINE_WORKERS,),
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
                Shape("none (removed in v0.8.0)", f"v0.8.0 to {_MAIN}", (_Gone(_ACTOR),)),
            ),
            when=(_ACTOR,),
            phrase="legacy actor {label}",
        ),
        Aspect(
            "groups",
            (
                Shape(
                    "megatron.core.parallel_state (DP without CP, PP)",
                    f"v0.6.0 to {_MAIN}",
                    tuple(
                        Feature(_MPU, name)
                        for name in (
                            "get_data_parallel_group",
                            "get_pipeline_model_parallel_group",
                            "is_pipeline_last_stage",
                        )
                    ),
                ),
            ),
            when=(_ACTOR, _ENGINE_WORKERS),
            phrase="groups from {label}",
        ),
        Aspect(
            "config",
            (
                Shape(
                    "omega_conf_to_dataclass(config, dataclass_type)",
                    f"v0.6.0 to {_MAIN}",
                    (Feature(_CONFIG, "omega_conf_to_dataclass", ("config", "dataclass_type")),),
                ),
                # a verl whose actor config is not checked there: ESS_LR_* only
                Shape("no omega_conf_to_dataclass (actor.ess_scaling not read)", "other"),
            ),
            when=(_CONFIG,),
            phrase="config via {label}",
        ),
    ),
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
            _ENGINE_WORKERS,
            "ActorRolloutRefWorker",
            "update_actor",
            engine_update_actor_wrapper,
            "verl_engine_update_actor",
        ),
        _target(
            _ENGINE_WORKERS,
            "TrainingWorker",
            "train_batch",
            engine_train_batch_wrapper,
            "verl_engine_train_batch",
        ),
        *(
            _target(_TINKER, "TinkerActorRolloutRefWorker", name, tinker_wrapper, decorator)
            for name, decorator in (
                ("forward_backward", "verl_tinker_forward_backward"),
                ("optimizer_step", "verl_tinker_optimizer_step"),
            )
        ),
        _target(
            _ACTOR,
            "MegatronPPOActor",
            "make_minibatch_iterator",
            minibatch_iterator_wrapper,
            "verl_minibatch_iterator",
        ),
        _target(
            _ACTOR, "MegatronPPOActor", "update_policy", update_policy_wrapper, "verl_update_policy"
        ),
        _target(
            _FSDP_ACTOR,
            "DataParallelPPOActor",
            "update_policy",
            fsdp_update_policy_wrapper,
            "verl_fsdp_update_policy",
        ),
        _target(
            _CONFIG, "", "omega_conf_to_dataclass", config_wrapper, "verl_omega_conf_to_dataclass"
        ),
        _target(
            _RUNTIME_ENV,
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
            for module in _CONFIG_REIMPORTS
        ),
    ),
    history=VERL_HISTORY,
)
