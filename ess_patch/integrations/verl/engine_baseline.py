"""VCPO's minimum-variance baseline on verl's engine path (v0.7.0 on; from v0.8.0 the only
actor path), with the same package code as the legacy actor's (``verl/baseline.py``).

``ActorRolloutRefWorker.update_actor(data)`` gets this DP rank's chunk as the driver makes it
(``to_tensordict`` then ``left_right_2_no_padding``): one TensorDict with ``input_ids``
nested (each trajectory unpadded), the padded ``attention_mask``, ``response_mask``,
``advantages`` and log-probs ``[batch, response]`` beside it, ``uid`` a NonTensorStack and
``temperature`` a non-tensor entry. There, before ``train_mini_batch`` draws a mini-batch,
:func:`rewritten` runs :func:`verl.baseline.rewrite` on a DataProto-shaped view of it (the
norm pass on the engine's model chunks, groups from ``uid`` reduced over DP) and writes
``A - b*`` into it; each ``train_batch`` then hands its mini-batch to :func:`check`, which
reads it back before the engine trains on it. The engine's loss (PPO clipping, dual-clip, KL,
entropy) is unchanged; its forward packs (``use_remove_padding``, THD) or pads (bshd), and the
norm pass runs each unpadded trajectory on the same model, so both forms get the same norms.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from .baseline import ROW_KEY, check_minibatch, rewrite
from .baseline_config import BaselineSettings
from .batch import actor_groups

__all__ = ["check", "rewritten"]

_DRAWN_BY = "TrainingWorker.train_mini_batch"


def _value(data: Any, key: str) -> Any:
    """A non-tensor entry of a TensorDict as plain Python (a NonTensorStack as its list, a
    NonTensorData as its value); a tensor as it is."""
    from tensordict.tensorclass import NonTensorData, NonTensorStack  # verl's own dependency

    value = data.get(key)
    if isinstance(value, NonTensorStack):
        return value.tolist()
    return value.data if isinstance(value, NonTensorData) else value


def _view(data: Any) -> SimpleNamespace:
    """The engine's TensorDict as the DataProto fields :func:`verl.baseline.rewrite` reads:
    ``batch`` is the TensorDict itself (the rewrite lands in it), ``uid`` and the multimodal
    marker in ``non_tensor_batch``, the temperature in ``meta_info``."""
    keys = set(data.keys())
    non_tensor = {k: _value(data, k) for k in ("uid", "multi_modal_inputs") if k in keys}
    temperature = _value(data, "temperature") if "temperature" in keys else 1.0
    return SimpleNamespace(
        batch=data, non_tensor_batch=non_tensor, meta_info={"temperature": temperature}
    )


def _engine_actor(trainer: Any) -> SimpleNamespace:
    """What :func:`verl.baseline.rewrite` asks of the actor: its model chunks (the Megatron
    engine's ``module``) and the micro-batch size (the engine config's)."""
    engine = getattr(trainer, "engine", None)
    engine_config = getattr(trainer, "engine_config", None) or getattr(
        engine, "engine_config", None
    )
    micro = getattr(engine_config, "micro_batch_size_per_gpu", None)
    return SimpleNamespace(
        actor_module=getattr(engine, "module", None),
        config={"ppo_micro_batch_size_per_gpu": micro},
    )


@contextmanager
def rewritten(trainer: Any, data: Any, chosen: BaselineSettings) -> Iterator[dict]:
    """For ``update_actor``'s call: ``data``'s advantages rewritten to ``A - b*`` (on, every
    DP rank; shadow: measured only) and its row key added; yields the record :func:`check`
    reads. Afterwards ``data`` has its own advantages back and no row key.

    Raises:
        FailClosedNotImplementedError: a layout the pass cannot serve (every rank alike).
        EssLrNotAppliedError: advantages that are not GRPO-style (on every DP rank).
    """
    original = data.get("advantages") if "advantages" in data.keys() else None  # noqa: SIM118
    try:
        yield rewrite(_engine_actor(trainer), _view(data), chosen, actor_groups().dp_group)
    finally:
        if original is not None:
            data["advantages"] = original
        if ROW_KEY in data.keys():  # noqa: SIM118 - a TensorDict refuses `in`
            del data[ROW_KEY]


def check(data: Any, record: dict) -> dict[str, float]:
    """``train_batch``'s mini-batch before the engine trains on it: its rows' advantages read
    back against ``A - b*`` (every DP rank and stage together) and the row key taken out;
    returns the metrics to log for it (``ess_baseline_applied`` 1 once read back, 0 in shadow).

    Raises:
        EssLrNotAppliedError: a mini-batch that is not ``A - b*``, or one that
            ``train_mini_batch``'s iterator did not make.
    """
    check_minibatch(data, record, actor_groups().dp_group, _DRAWN_BY)
    metrics = dict(record["metrics"])
    metrics["ess_baseline_applied"] = 1.0 if record["mode"] == "on" else 0.0
    return metrics
