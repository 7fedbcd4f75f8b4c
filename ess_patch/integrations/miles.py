"""miles (radixark/miles @31f1ca961): flags, the advantage hook, metrics, the FSDP optimizer.

- ``miles.utils.arguments.parse_args(add_custom_arguments=None)`` gets our flags composed
  in and validates them after parsing.
- ``compute_advantages_and_returns`` is wrapped where it is defined and in each module that
  imported it by name (``megatron_utils.actor``, ``fsdp_utils.actor``); after it runs, the
  rollout's ESS is computed over miles' ``effective_dp`` / ``cp`` / ``pp`` groups and armed.
- ``log_train_step`` gets ``lr_scale``, ``rho_ess``... added to ``extra_metrics`` for the
  actor (logged as ``train/lr_scale``...).
- ``FSDPTrainRayActor._train_core`` attaches the plain torch optimizer before stepping.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..attach import attach
from ..patching import Target
from . import Integration
from .rl_hooks import (
    Framework,
    Groups,
    common_targets,
    ess_metrics,
    rollout_logprobs_only,
)
from .steps import miles_step_samples

SUPPORTED = "miles @31f1ca961 (2026-08-21; later commits with the same functions)"


def _groups() -> Groups:
    from miles.backends.training_utils.parallel import get_parallel_state

    state = get_parallel_state()
    dp = state.effective_dp  # intra_dp normally; indep_dp in fault-tolerant mode
    return Groups(
        cp_group=state.cp.group if state.cp.size > 1 else None,
        cp_rank=state.cp.rank,
        cp_size=state.cp.size,
        dp_group=dp.group if dp.size > 1 else None,
        pp_group=state.pp.group if state.pp.size > 1 else None,
        is_pp_last=bool(state.is_pp_last_stage),
    )


def _no_input_reason(args: argparse.Namespace) -> str | None:
    # megatron_utils/actor.py: log_probs are recomputed only when
    # not skip_actor_forward_only and (not use_rollout_logprobs or get_mismatch_metrics)
    if getattr(args, "skip_actor_forward_only", False):
        return "--skip-actor-forward-only skips the actor's forward pass"
    return rollout_logprobs_only(args)


def _unsupported_reason(args: argparse.Namespace) -> str | None:
    backend = getattr(args, "train_backend", "megatron")
    if backend not in ("megatron", "fsdp"):
        return f"--train-backend {backend} (supported: megatron, fsdp)"
    if getattr(args, "use_fault_tolerance", False):
        return (
            "--use-fault-tolerance (its effective_dp may be a torchft group, which ess-patch "
            "does not reduce over yet; per-replica scales would let replicas drift)"
        )
    return None


MILES_FRAMEWORK = Framework(
    name="miles",
    groups=_groups,
    no_input_reason=_no_input_reason,
    unsupported_reason=_unsupported_reason,
    step_samples=miles_step_samples,
)


def log_train_step_wrapper(
    wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict
) -> Any:
    """Add the armed ESS metrics to the actor's ``extra_metrics``."""
    role = kwargs.get("role", args[6] if len(args) > 6 else "actor")
    metrics = ess_metrics()
    if role != "actor" or not metrics:
        return wrapped(*args, **kwargs)
    if len(args) > 7:
        args = (*args[:7], {**(args[7] or {}), **metrics}, *args[8:])
    else:
        kwargs = {**kwargs, "extra_metrics": {**(kwargs.get("extra_metrics") or {}), **metrics}}
    return wrapped(*args, **kwargs)


def fsdp_train_core_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """The FSDP backend steps a plain torch optimizer: attach it (once) before training."""
    if getattr(getattr(instance, "args", None), "use_ess_lr", False):
        optimizer = getattr(instance, "optimizer", None)
        if optimizer is not None:
            attach(optimizer)
    return wrapped(*args, **kwargs)


_LOSS = "miles.backends.training_utils.loss"
_ADVANTAGE_SITES = (_LOSS, "miles.backends.megatron_utils.actor", "miles.backends.fsdp_utils.actor")
_LOG_SITES = (
    "miles.backends.training_utils.log_utils",
    "miles.backends.megatron_utils.model",
    "miles.backends.fsdp_utils.actor",
)

MILES = Integration(
    name="miles",
    distribution=None,
    supported=SUPPORTED,
    targets=(
        *common_targets(MILES_FRAMEWORK, "miles.utils.arguments", _ADVANTAGE_SITES),
        *(
            Target(
                module,
                "",
                "log_train_step",
                log_train_step_wrapper,
                decorator="miles_log_train_step" if module == _LOG_SITES[0] else None,
            )
            for module in _LOG_SITES
        ),
        Target(
            "miles.backends.fsdp_utils.actor",
            "FSDPTrainRayActor",
            "_train_core",
            fsdp_train_core_wrapper,
            decorator="miles_fsdp_train_core",
        ),
    ),
)
