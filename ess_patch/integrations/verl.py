"""verl (volcengine/verl, v0.7.0 to main @b178a3cd5): ESS-LR for the Megatron actor.

verl facts this relies on (both snapshots in ../shared/upstream; detected by feature):

- ``verl.workers.megatron_workers.ActorRolloutRefWorker.update_actor(data)`` hands this DP
  rank's chunk of the batch to ``MegatronPPOActor.make_minibatch_iterator(data)`` and the
  iterator to ``MegatronPPOActor.update_policy(dataloader)``, which runs one
  ``actor_optimizer.step()`` (a megatron-core optimizer) per mini-batch it draws, then returns
  a dict of metric lists that the driver averages (``reduce_metrics``) and logs. The LR
  scheduler steps once per ``update_actor``, after ``update_policy``.
- Each mini-batch (a ``DataProto``) holds ``old_log_probs``, ``response_mask`` and, when the
  rollout engine returned them (``rollout.calculate_log_probs``), ``rollout_log_probs``,
  ``[mini_batch, response_length]``, whole on every rank of the DP rank: the dispatch is by DP
  rank, CP ranks split sequences only inside the forward, and every pipeline stage holds the
  batch (``forward_backward_batch`` even broadcasts it from the last stage). So the ESS needs
  one reduction over DP without CP; it is computed on the last stage and broadcast over PP so
  that a fault there reaches every stage.
- With ``algorithm.rollout_correction.bypass_mode`` the driver sets ``old_log_probs`` to the
  rollout log-probs: the ratio is then 1 everywhere and ESS-LR refuses it (see README).
- ``verl.utils.config.omega_conf_to_dataclass`` turns the actor's Hydra node into its
  dataclass and fails on unknown keys; it is wrapped (also where it was imported by name) so
  that VCPO's ``actor.ess_scaling`` node is taken out first and kept on the dataclass as the
  attribute ``ess_scaling``.
- The critic (``MegatronPPOCritic.update_critic``) is never wrapped, and nothing stays armed
  after ``update_policy`` returns: only the actor's optimizer is scaled, even when verl
  colocates the critic in the same process.
- The engine path (``trainer.use_legacy_worker_impl=disable``):
  ``ActorRolloutRefWorker.update_actor(data)`` -> the actor's ``TrainingWorker.train_mini_batch``
  -> ``train_batch(mini_batch)``, one engine optimizer step each; the same tensors stay padded
  in its no-padding TensorDict. ``update_actor`` marks the actor's TrainingWorker (the critic's
  is another instance) and ``train_batch`` arms each mini-batch's result for it.

Settings, per ``update_policy`` call (see :func:`settings`): on with ``ESS_LR_ENABLE=1`` or
``actor.ess_scaling.enable``; the rest from ``ESS_LR_*`` (``EssLrConfig.from_env`` via
``install()``), VCPO's keys winning for the fields they name.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..config import EssLrConfig
from ..patching import MissingTargetError, Target
from ..result import EssLrResult
from ..state import STATE, arm, disarm
from . import Integration
from .binding import bind, call_with
from .rl_hooks import Groups, megatron_groups
from .shapes import Aspect, Feature, History, Shape

__all__ = ["VERL", "VERL_HISTORY", "VerlSettings", "settings"]

logger = logging.getLogger(__name__)

#: the integration's name (install(), the registry, the shape history)
NAME = "verl"
#: the upstream commit the newest patches/ series and the framework tests are cut from
SNAPSHOT = "b178a3cd56f58b2d502255daba591e92833930a7"
SUPPORTED = (
    f"verl v0.7.0 (2026-01-05) to @{SNAPSHOT[:9]} (2026-01-29): the Megatron actor (legacy worker "
    "and engine path)"
)

_ACTOR = "verl.workers.actor.megatron_actor"
_CONFIG = "verl.utils.config"
_ENGINE_WORKERS = "verl.workers.engine_workers"
_MPU = "megatron.core.parallel_state"
#: modules that import ``omega_conf_to_dataclass`` by name and call it on the actor's node
_CONFIG_REIMPORTS = ("verl.utils", "verl.workers.megatron_workers", _ENGINE_WORKERS)

#: ``ESS_LR_ENABLE=1``: ESS-LR on for verl's actor (verl has no argument parser to add a flag to)
ENV_ENABLE = "ESS_LR_ENABLE"
ENV_GRANULARITY = "ESS_LR_GRANULARITY"
ENV_WEIGHT_MODE = "ESS_LR_WEIGHT_MODE"
#: verl's metric names: the actor's own prefix
METRIC_PREFIX = "actor/"
#: VCPO's ``actor.ess_scaling`` keys (mit-han-lab/vcpo), plus the clip threshold, which VCPO
#: reads from the algorithm config that verl's actor worker never sees
VCPO_KEYS = ("enable", "scaling_rule", "base_ess_ratio", "use_clipped", "rollout_is_threshold")
_ROLLOUT_RESULT = "_ess_patch_rollout_result"  # on the actor: make_minibatch_iterator's result

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


# --- settings ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerlSettings:
    """What ESS-LR does in one ``update_policy`` call."""

    enabled: bool  # arm the scale (False: shadow mode, logs only)
    config: EssLrConfig


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{name}={value!r} must be a bool: 1/0/true/false")


def _plain(node: Any) -> Any:
    """An OmegaConf node (or anything mapping-like) as plain Python containers."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(node, DictConfig | ListConfig):
            return OmegaConf.to_container(node, resolve=True)
    except ImportError:  # verl always has omegaconf; a plain dict needs nothing
        pass
    return dict(node) if isinstance(node, Mapping) else node


def vcpo_scaling(actor_config: Any) -> dict[str, Any] | None:
    """VCPO's ``ess_scaling`` node of the actor config (attribute, or key of a mapping)."""
    node = getattr(actor_config, "ess_scaling", None)
    if node is None and isinstance(actor_config, Mapping):
        node = actor_config.get("ess_scaling")
    if node is None:
        return None
    scaling = _plain(node)
    if not isinstance(scaling, dict):
        raise ValueError(f"actor.ess_scaling must be a mapping of {', '.join(VCPO_KEYS)}")
    unknown = sorted(set(scaling) - set(VCPO_KEYS))
    if unknown:
        raise ValueError(
            f"actor.ess_scaling has unknown key(s) {', '.join(unknown)}; ess-patch reads "
            f"{', '.join(VCPO_KEYS)}"
        )
    return scaling


def settings(actor_config: Any, environ: Mapping[str, str] | None = None) -> VerlSettings | None:
    """ESS-LR's settings for this actor, or None when it is off (then nothing is touched).

    On with ``ESS_LR_ENABLE=1`` or VCPO's ``actor.ess_scaling.enable: true``; shadow mode with
    ``ESS_LR_SHADOW=1``. The estimator settings are ``install()``'s config (``ESS_LR_*``), with
    verl's granularity default "step" (one ESS per optimizer step, VCPO's) unless
    ``ESS_LR_GRANULARITY`` is set. VCPO's keys set, for the fields they name: ``scaling_rule``
    -> rule, ``base_ess_ratio`` -> base_ratio, ``use_clipped`` -> weight_clip (the threshold
    from ``ess_scaling.rollout_is_threshold`` or ``ESS_LR_WEIGHT_CLIP``), and VCPO's
    sequence-product weights unless ``ESS_LR_WEIGHT_MODE`` is set.

    Raises:
        ValueError: a bad value or unknown key (named), enable and shadow both on, or
            ``use_clipped`` without a threshold.
    """
    env = os.environ if environ is None else environ
    base = STATE.config if STATE.config is not None else EssLrConfig.from_env(env)
    scaling = vcpo_scaling(actor_config)
    enabled = _flag(ENV_ENABLE, env.get(ENV_ENABLE, ""))
    if scaling is not None and "enable" in scaling:
        enabled = enabled or _flag("actor.ess_scaling.enable", scaling["enable"])
    if not (enabled or base.shadow):
        return None
    if enabled and base.shadow:
        raise ValueError(
            "ESS-LR is enabled (ESS_LR_ENABLE or actor.ess_scaling.enable) and shadow mode "
            "(ESS_LR_SHADOW) is on: shadow mode never changes an LR. Keep one of them (verl)"
        )
    changes: dict[str, Any] = {}
    if not env.get(ENV_GRANULARITY):
        changes["granularity"] = "step"
    if scaling is not None:
        if not env.get(ENV_WEIGHT_MODE):
            changes["weight_mode"] = "product"
        if "scaling_rule" in scaling:
            changes["rule"] = scaling["scaling_rule"]
        if "base_ess_ratio" in scaling:
            changes["base_ratio"] = scaling["base_ess_ratio"]
        if _flag("actor.ess_scaling.use_clipped", scaling.get("use_clipped", False)):
            clip = scaling.get("rollout_is_threshold", base.weight_clip)
            if clip is None:
                raise ValueError(
                    "actor.ess_scaling.use_clipped is true but no threshold is known: verl's "
                    "actor never sees algorithm.rollout_correction.rollout_is_threshold. Set "
                    "actor.ess_scaling.rollout_is_threshold or ESS_LR_WEIGHT_CLIP to it"
                )
            changes["weight_clip"] = clip
        elif "use_clipped" in scaling:
            changes["weight_clip"] = None
    config = replace(base, **changes) if changes else base
    return VerlSettings(enabled=enabled, config=config)


# --- groups and the ESS of one batch -----------------------------------------------------------


def _groups() -> Groups:
    """DP without CP (CP peers hold the same sequences whole), the PP group, the last stage."""
    return megatron_groups()._replace(cp_group=None)


def _tensors(data: Any) -> tuple[Any, Any, Any]:
    """``(old_log_probs, rollout_log_probs, response_mask)`` of a DataProto (or TensorDict).

    Raises:
        ValueError: a key is missing (the same on every rank: every DP chunk has the keys of
            the whole batch), naming the verl setting that provides it.
    """
    batch = data.batch if hasattr(data, "non_tensor_batch") else data  # DataProto or TensorDict
    keys = set(batch.keys())
    if "rollout_log_probs" not in keys:
        raise ValueError(
            "ESS-LR (verl): the actor's batch has no rollout_log_probs, so there is nothing to "
            "measure the policy against. Set actor_rollout_ref.rollout.calculate_log_probs=True "
            "(the rollout engine then returns them), or turn ESS-LR off"
        )
    if "old_log_probs" not in keys:
        raise ValueError("ESS-LR (verl): the actor's batch has no old_log_probs")
    if "response_mask" in keys:
        mask = batch["response_mask"]
    elif {"attention_mask", "responses"} <= keys:  # older verl: the actor derived it so
        mask = batch["attention_mask"][:, -batch["responses"].shape[-1] :]
    else:
        raise ValueError(
            "ESS-LR (verl): the actor's batch has neither response_mask nor attention_mask "
            "and responses to tell which tokens count"
        )
    return batch["old_log_probs"], batch["rollout_log_probs"], mask


def _check_not_bypassed(old: Any, rollout: Any, mask: Any) -> None:
    """A refusal when the old log-probs ARE the rollout log-probs on every counted token."""
    import torch

    if mask is None or not len(mask):
        return
    counted = torch.stack([m.bool() for m in mask])
    if bool(counted.any()) and torch.equal(old[counted], rollout[counted]):
        raise ValueError(
            "ESS-LR (verl): old_log_probs equal rollout_log_probs on every token "
            "(algorithm.rollout_correction.bypass_mode=True copies them): the ratio is "
            "1 and the ESS would measure nothing. Turn bypass_mode off (verl then "
            "recomputes old_log_probs with the current weights) or ESS-LR off"
        )


def compute_batch(data: Any, config: EssLrConfig, groups: Groups | None = None) -> EssLrResult:
    """The ESS of one batch (a mini-batch, or the whole rollout chunk) over every DP rank,
    identical on every rank of the actor; a fault on any rank raises on all of them."""
    from ..compute import compute_ess_lr
    from ..reduction import broadcast_from_last_stage

    groups = _groups() if groups is None else groups
    out: EssLrResult | None = None
    error: BaseException | None = None
    try:
        if groups.is_pp_last:
            fault: Exception | None = None
            old = rollout = mask = None
            try:
                old, rollout, mask = _tensors(data)
                _check_not_bypassed(old, rollout, mask)
            except Exception as exc:  # still enter the DP collectives, flagged
                fault = exc
            rows = [[] if t is None else list(t) for t in (old, rollout, mask)]
            out = compute_ess_lr(*rows, config=config, dp_group=groups.dp_group, error=fault)
    except Exception as exc:
        error = exc  # the other pipeline stages learn of it through the broadcast
    return broadcast_from_last_stage(out, groups.pp_group, config=config, error=error)


# --- wrappers ----------------------------------------------------------------------------------


def _undecorated(function: Any) -> Any:
    """The function under verl's decorators: ``__wrapped__`` where set, and the closure of
    ``GPUMemoryLogger`` (on ``update_policy`` and ``update_critic``), which wraps its
    ``decorated_function`` in ``f(*args, **kwargs)`` without ``functools.wraps``."""
    for _ in range(8):  # a few layers at most; never loop on a self-referencing wrapper
        inner = getattr(function, "__wrapped__", None)
        code = getattr(function, "__code__", None)
        cells = getattr(function, "__closure__", None)
        if (
            inner is None
            and code is not None
            and cells
            and "decorated_function" in code.co_freevars
        ):
            inner = cells[code.co_freevars.index("decorated_function")].cell_contents
        if inner is None:
            return function
        function = inner
    return function


class _MethodFeature(Feature):
    """A method that takes ``parameters`` by name once verl's decorators are looked through."""

    def missing(self) -> str | None:
        import importlib
        import inspect

        holder: Any = importlib.import_module(self.module)
        for part in self.symbol.split("."):
            holder = getattr(holder, part, None)
            if holder is None:
                return f"{self.module}.{self.symbol} does not exist"
        names = inspect.signature(_undecorated(holder)).parameters
        lacking = [p for p in self.parameters if p not in names]
        if lacking:
            return f"{self.module}.{self.symbol} has no parameter {', '.join(lacking)}"
        return None


def _bind_method(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """The call's arguments by name (``self`` included), read from the undecorated method."""
    # wrapt hands over the bound method; a vendored tree's decorator a partial(method, self)
    function = wrapped.func if isinstance(wrapped, functools.partial) else wrapped
    return bind(_undecorated(getattr(function, "__func__", function)), (instance, *args), kwargs)


def _call_method(wrapped: Any, call: Any, **changes: Any) -> Any:
    call.arguments.update(changes)
    return wrapped(*call.args[1:], **call.kwargs)  # ``wrapped`` is bound: no ``self``


def _each(
    dataloader: Iterable[Any],
    result_of: Callable[[Any], EssLrResult],
    results: list[EssLrResult],
    enabled: bool,
) -> Iterator[Any]:
    """The mini-batches as drawn, each one's result computed (and armed) before verl trains
    on it, so that the optimizer step that follows uses that mini-batch's scale."""
    for data in dataloader:
        result = result_of(data)
        results.append(result)
        if enabled:
            arm(result)
        yield data


def _add_metrics(metrics: Any, results: list[EssLrResult], enabled: bool) -> None:
    """One value per optimizer step under ``actor/``, as verl's own per-step metrics."""
    if not isinstance(metrics, dict):
        logger.warning("ess-patch (verl): update_policy returned no metrics dict; ESS not logged")
        return
    for result in results:
        for key, value in result.metrics().items():
            if key == "lr_scale" and not enabled:
                key = "ess_lr_shadow_scale"  # shadow mode: never reported as an applied scale
            metrics.setdefault(METRIC_PREFIX + key, []).append(value)


def minibatch_iterator_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """Granularity "rollout": the ESS over this DP rank's whole chunk (every DP rank), kept on
    the actor for the ``update_policy`` that follows."""
    out = wrapped(*args, **kwargs)
    if instance is None:
        return out
    vars(instance).pop(_ROLLOUT_RESULT, None)  # never a previous rollout's
    chosen = settings(getattr(instance, "config", None))
    if chosen is None or chosen.config.granularity != "rollout":
        return out
    call = _bind_method(wrapped, instance, args, kwargs)
    if call is None or "data" not in call.arguments:
        raise MissingTargetError(
            f"ess-patch (verl): {getattr(wrapped, '__qualname__', wrapped)} takes no data "
            f"parameter. Supported: {SUPPORTED}"
        )
    data = call.arguments["data"]
    vars(instance)[_ROLLOUT_RESULT] = compute_batch(data, chosen.config)
    return out


def update_policy_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """Compute each mini-batch's ESS as verl draws it (or take the rollout's), arm it for that
    mini-batch's optimizer step, log it under ``actor/``, and disarm on the way out."""
    chosen = None if instance is None else settings(getattr(instance, "config", None))
    if chosen is None:
        return wrapped(*args, **kwargs)  # off: no collective, no LR write
    call = _bind_method(wrapped, instance, args, kwargs)
    if call is None or "dataloader" not in call.arguments:
        raise MissingTargetError(
            f"ess-patch (verl): {getattr(wrapped, '__qualname__', wrapped)} takes no dataloader "
            f"parameter. Supported: {SUPPORTED}"
        )
    results: list[EssLrResult] = []
    if chosen.config.granularity == "rollout":
        rollout = vars(instance).pop(_ROLLOUT_RESULT, None)
        if rollout is None:
            raise ValueError(
                "ESS-LR (verl) granularity 'rollout': update_policy got a dataloader that "
                "make_minibatch_iterator did not make, so the rollout's ESS is unknown. Use "
                "ESS_LR_GRANULARITY=step"
            )
        result_of: Callable[[Any], EssLrResult] = lambda _data: rollout  # noqa: E731
    else:
        result_of = lambda data: compute_batch(data, chosen.config)  # noqa: E731
    loader = _each(call.arguments["dataloader"], result_of, results, chosen.enabled)
    optimizer = getattr(instance, "actor_optimizer", None)
    attached = chosen.enabled and _attach(optimizer)
    try:
        metrics = _call_method(wrapped, call, dataloader=loader)
    finally:
        if chosen.enabled:
            disarm()  # the critic, and anything after the actor's update, is never scaled
        if attached:
            from ..attach import detach

            detach(optimizer)
    _add_metrics(metrics, results, chosen.enabled)
    return metrics


def _attach(optimizer: Any) -> bool:
    """Make the actor's optimizer apply the armed scale even without ``install("megatron")``
    (with it, the nested wrappers still scale each update once). Returns whether we did."""
    from ..attach import attach
    from ..patching import is_ours

    if optimizer is None or is_ours(vars(optimizer).get("step")):
        return False
    attach(optimizer)
    return True


def config_wrapper(wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict) -> Any:
    """``omega_conf_to_dataclass(config, ...)``: VCPO's ``ess_scaling`` node is taken out of the
    actor's node before verl checks it against its dataclass (unknown keys fail there), then
    put back, and set on the dataclass as the attribute ``ess_scaling`` (a plain dict)."""
    call = bind(wrapped, args, kwargs)
    node = None if call is None else call.arguments.get("config")
    if not isinstance(node, Mapping) or "ess_scaling" not in node:
        return wrapped(*args, **kwargs)
    scaling = vcpo_scaling(node)
    out = _without_key(wrapped, call, node)
    try:
        object.__setattr__(out, "ess_scaling", scaling)
    except (AttributeError, TypeError):  # a slotted or builtin result: nothing to carry it
        logger.warning("ess-patch (verl): cannot keep ess_scaling on %s", type(out).__name__)
    return out


def _without_key(wrapped: Callable[..., Any], call: Any, node: Any) -> Any:
    """Call with ``node`` lacking ``ess_scaling``; a DictConfig is changed in place (so that
    its interpolations still resolve against its root) and always restored."""
    try:
        from omegaconf import DictConfig, open_dict
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        DictConfig = ()  # type: ignore[assignment]
    if not isinstance(node, DictConfig):
        return call_with(
            wrapped, call, config={k: v for k, v in node.items() if k != "ess_scaling"}
        )
    saved = node._get_node("ess_scaling")
    with open_dict(node):
        del node["ess_scaling"]
    try:
        return call_with(wrapped, call, config=node)
    finally:
        with open_dict(node):
            node["ess_scaling"] = saved


def _refuse_other_backends(strategy: Any) -> None:
    if strategy not in (None, "megatron"):
        raise NotImplementedError(
            f"ESS-LR (verl) supports the Megatron actor (actor_rollout_ref.actor.strategy="
            f"megatron); strategy {strategy!r} is not supported and would never be scaled. "
            "Turn ESS-LR off (ESS_LR_ENABLE, actor.ess_scaling.enable) or use Megatron"
        )


def fsdp_update_policy_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """verl's FSDP actor (``DataParallelPPOActor.update_policy``): refused while ESS-LR is on,
    never a silent no-op."""
    if instance is not None and settings(getattr(instance, "config", None)) is not None:
        _refuse_other_backends(getattr(getattr(instance, "config", None), "strategy", "fsdp"))
    return wrapped(*args, **kwargs)


_ENGINE_STATE = "_ess_patch_engine_actor"  # on the actor's TrainingWorker during update_actor


def engine_update_actor_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """The engine path (``trainer.use_legacy_worker_impl=disable``):
    ``ActorRolloutRefWorker.update_actor(data)`` hands the DP chunk to the actor's
    ``TrainingWorker.train_mini_batch``, which runs ``train_batch`` (one optimizer step of the
    engine) per mini-batch. Mark that TrainingWorker as the actor's for the call (the critic's
    is another instance), with the rollout's result under granularity "rollout"."""
    config = getattr(getattr(instance, "config", None), "actor", None)
    chosen = None if config is None else settings(config)
    trainer = getattr(instance, "actor", None)
    if chosen is None or trainer is None:
        return wrapped(*args, **kwargs)
    _refuse_other_backends(config.get("strategy") if isinstance(config, Mapping) else None)
    call = _bind_method(wrapped, instance, args, kwargs)
    if call is None or "data" not in call.arguments:
        raise MissingTargetError(
            f"ess-patch (verl): {getattr(wrapped, '__qualname__', wrapped)} takes no data "
            f"parameter. Supported: {SUPPORTED}"
        )
    rollout = None
    if chosen.config.granularity == "rollout":
        rollout = compute_batch(call.arguments["data"], chosen.config)
    vars(trainer)[_ENGINE_STATE] = (chosen, rollout)
    optimizer = getattr(getattr(trainer, "engine", None), "optimizer", None)
    attached = chosen.enabled and _attach(optimizer)
    try:
        return wrapped(*args, **kwargs)
    finally:
        vars(trainer).pop(_ENGINE_STATE, None)
        if chosen.enabled:
            disarm()
        if attached:
            from ..attach import detach

            detach(optimizer)


def engine_train_batch_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """``TrainingWorker.train_batch(data)`` of the actor (inside ``update_actor``): arm this
    mini-batch's result for the engine's optimizer step, and add it to the step's metrics
    (the driver prefixes them with ``actor/``). Any other TrainingWorker: untouched."""
    marked = None if instance is None else vars(instance).get(_ENGINE_STATE)
    if marked is None:
        return wrapped(*args, **kwargs)
    chosen, rollout = marked
    call = _bind_method(wrapped, instance, args, kwargs)
    if call is None or "data" not in call.arguments:
        raise MissingTargetError(
            f"ess-patch (verl): {getattr(wrapped, '__qualname__', wrapped)} takes no data "
            f"parameter. Supported: {SUPPORTED}"
        )
    result = (
        rollout if rollout is not None else compute_batch(call.arguments["data"], chosen.config)
    )
    if chosen.enabled:
        arm(result)
    out = wrapped(*args, **kwargs)
    metrics = _engine_metrics(out)
    if metrics is not None:
        for key, value in result.metrics().items():
            if key == "lr_scale" and not chosen.enabled:
                key = "ess_lr_shadow_scale"
            metrics[key] = value
    return out


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


# --- shapes and targets ------------------------------------------------------------------------

VERL_HISTORY = History(
    framework=NAME,
    supported=SUPPORTED,
    aspects=(
        Aspect(
            "actor",
            (
                Shape(
                    "MegatronPPOActor.update_policy(dataloader) over make_minibatch_iterator(data)",
                    "v0.7.0 to main",
                    (
                        _MethodFeature(_ACTOR, "MegatronPPOActor.update_policy", ("dataloader",)),
                        _MethodFeature(
                            _ACTOR, "MegatronPPOActor.make_minibatch_iterator", ("data",)
                        ),
                    ),
                ),
            ),
            when=(_ACTOR,),
            phrase="actor {label}",
        ),
        Aspect(
            "groups",
            (
                Shape(
                    "megatron.core.parallel_state (DP without CP, PP)",
                    "v0.7.0 to main",
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
            when=(_ACTOR,),
            phrase="groups from {label}",
        ),
        Aspect(
            "config",
            (
                Shape(
                    "omega_conf_to_dataclass(config, dataclass_type)",
                    "v0.7.0 to main",
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

VERL = Integration(
    name=NAME,
    snapshot=SNAPSHOT,
    distribution="verl",
    supported=">=0.7.0",
    targets=(
        Target(
            _ACTOR,
            "MegatronPPOActor",
            "make_minibatch_iterator",
            minibatch_iterator_wrapper,
            decorator="verl_minibatch_iterator",
        ),
        Target(
            _ACTOR,
            "MegatronPPOActor",
            "update_policy",
            update_policy_wrapper,
            decorator="verl_update_policy",
        ),
        Target(
            _CONFIG,
            "",
            "omega_conf_to_dataclass",
            config_wrapper,
            required=False,  # only for VCPO's keys; ESS_LR_* work without it
            decorator="verl_omega_conf_to_dataclass",
        ),
        *(
            Target(module, "", "omega_conf_to_dataclass", config_wrapper, required=False)
            for module in _CONFIG_REIMPORTS
        ),
        Target(
            "verl.workers.actor.dp_actor",
            "DataParallelPPOActor",
            "update_policy",
            fsdp_update_policy_wrapper,
            required=False,
            decorator="verl_fsdp_update_policy",
        ),
        Target(
            _ENGINE_WORKERS,
            "ActorRolloutRefWorker",
            "update_actor",
            engine_update_actor_wrapper,
            required=False,
            decorator="verl_engine_update_actor",
        ),
        Target(
            _ENGINE_WORKERS,
            "TrainingWorker",
            "train_batch",
            engine_train_batch_wrapper,
            required=False,
            decorator="verl_engine_train_batch",
        ),
    ),
    history=VERL_HISTORY,
)
