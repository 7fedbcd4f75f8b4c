"""verl's legacy Megatron actor (v0.6.x, v0.7.x; removed in v0.8.0): ``MegatronPPOActor``'s
``make_minibatch_iterator`` (the rollout's ESS, the kept keys, VCPO's baseline) and
``update_policy`` (each mini-batch's ESS armed as verl draws it, the metrics); the FSDP actor
beside it is refused. What each target does is in the package's docstring
(``verl/__init__.py``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from ...errors import EssPatchValueError
from ...guard import applied_scale, arm
from ...patching import FailClosedError
from ...result import EssLrResult
from ..binding import bind, bind_method, call_method, call_with
from ..framework import result_metrics
from .adapters import argument, attach_optimizer, refuse_other_backends, release, strategy_of
from .baseline_config import baseline_settings, refuse_baseline
from .batch import actor_groups, compute_batch
from .config import settings

logger = logging.getLogger(__name__)

#: verl's metric names: the actor's own prefix
METRIC_PREFIX = "actor/"
_ROLLOUT_LOG_PROBS = "rollout_log_probs"
_ROLLOUT_RESULT = "_ess_patch_rollout_result"  # on the legacy actor: the rollout's result
_BASELINE_RECORD = "_ess_patch_baseline"  # on the legacy actor: the baseline's record


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
    data = argument(bind_method(wrapped, instance, args, kwargs), wrapped, "data")
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
    record = rewrite(instance, data, chosen, actor_groups().dp_group)
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
    dataloader = argument(call, wrapped, "dataloader")
    if record is not None:
        from .baseline import read_back

        dataloader = read_back(dataloader, record, actor_groups().dp_group)
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
    attached = chosen.enabled and attach_optimizer(optimizer)
    try:
        metrics = call_method(wrapped, call, dataloader=loader)
    finally:
        release(optimizer, attached, chosen.enabled)
    _add_metrics(metrics, results, chosen.enabled)
    _add_baseline_metrics(metrics, record)
    return metrics


def fsdp_update_policy_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """verl's FSDP actor (``DataParallelPPOActor.update_policy``, before v0.8.0): refused
    while ESS-LR is on, never a silent no-op."""
    if instance is not None:
        strategy = strategy_of(getattr(instance, "config", None)) or "fsdp"
        refuse_baseline(
            getattr(instance, "config", None),
            f"verl's FSDP actor (DataParallelPPOActor, strategy {strategy!r}) lends no Megatron "
            "model to the norm pass",
            "Use the Megatron actor (actor_rollout_ref.actor.strategy=megatron)",
        )
    if instance is not None and settings(getattr(instance, "config", None)) is not None:
        refuse_other_backends(strategy_of(getattr(instance, "config", None)) or "fsdp")
    return wrapped(*args, **kwargs)
