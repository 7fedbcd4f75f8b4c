"""slime (THUDM/slime @624b824a8): flags, the advantage hook and metrics.

slime has no ParallelState object: the groups come from megatron's ``parallel_state``.
Its ``train()`` logs through ``slime.observability.logging_utils.log(args, metrics,
step_key="train/step")`` (looked up on the module at call time), so the metrics are added
there.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..patching import Target
from . import Integration
from .rl_hooks import (
    METRIC_PREFIX,
    Framework,
    Groups,
    common_targets,
    ess_metrics,
    rollout_logprobs_only,
)
from .steps import slime_step_samples

SUPPORTED = "slime @624b824a8 (2026-08-21; later commits with the same functions)"


def _groups() -> Groups:
    from megatron.core import parallel_state as mpu

    cp_size = mpu.get_context_parallel_world_size()
    dp_group = mpu.get_data_parallel_group(with_context_parallel=False)
    pp_size = mpu.get_pipeline_model_parallel_world_size()
    return Groups(
        cp_group=mpu.get_context_parallel_group() if cp_size > 1 else None,
        cp_rank=mpu.get_context_parallel_rank(),
        cp_size=cp_size,
        dp_group=dp_group if mpu.get_data_parallel_world_size() > 1 else None,
        pp_group=mpu.get_pipeline_model_parallel_group() if pp_size > 1 else None,
        is_pp_last=mpu.is_pipeline_last_stage(),
    )


def _unsupported_reason(args: argparse.Namespace) -> str | None:
    backend = getattr(args, "train_backend", "megatron")
    return None if backend == "megatron" else f"--train-backend {backend} (supported: megatron)"


SLIME_FRAMEWORK = Framework(
    name="slime",
    groups=_groups,
    # Same rule as miles. (When slime reuses the log-probs inside the loss instead, they are
    # missing at advantage time: a logged no-op, see README.)
    no_input_reason=rollout_logprobs_only,
    unsupported_reason=_unsupported_reason,
    step_samples=slime_step_samples,
)


def log_wrapper(wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict) -> Any:
    """Add the armed ESS metrics to the train-step record (``step_key="train/step"``)."""
    step_key = kwargs.get("step_key", args[2] if len(args) > 2 else None)
    metrics = ess_metrics()
    if step_key != "train/step" or not metrics:
        return wrapped(*args, **kwargs)
    host_args = kwargs.get("args", args[0] if args else None)
    logged = kwargs.get("metrics", args[1] if len(args) > 1 else None)
    logged = {**(logged or {}), **{METRIC_PREFIX + k: v for k, v in metrics.items()}}
    return wrapped(host_args, logged, step_key=step_key)


_ADVANTAGE_SITES = ("slime.backends.megatron_utils.loss", "slime.backends.megatron_utils.actor")

SLIME = Integration(
    name="slime",
    distribution=None,
    supported=SUPPORTED,
    targets=(
        *common_targets(SLIME_FRAMEWORK, "slime.utils.arguments", _ADVANTAGE_SITES),
        Target("slime.observability.logging_utils", "", "log", log_wrapper, decorator="slime_log"),
    ),
)
