"""What every framework integration may use (miles, slime, Megatron-RL, verl).

- :class:`Groups`, :func:`megatron_groups`: the process groups one ESS is reduced over;
- :class:`Framework`: a framework's parts (its groups, its shapes, why a run cannot be
  measured), and :func:`validate`, the check of its ESS-LR flags against them;
- :func:`ess_metrics`, :func:`applied_metrics`, :func:`result_metrics`: the metrics a result
  is logged with (the applied scale read back, shadow mode's would-be scale).

What only miles and slime share (the advantage hook, the critic, their targets) is
``miles_slime.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import EssPatchValueError
from ..guard import applied_scale
from ..result import EssLrResult
from ..state import STATE, armed
from .baseline_flags import baseline_metrics
from .flags import config_from_args, shadow_requested
from .shapes import History

__all__ = [
    "Framework",
    "Groups",
    "applied_metrics",
    "ess_metrics",
    "megatron_groups",
    "result_metrics",
    "validate",
]


class Groups(NamedTuple):
    """The process groups one rollout's ESS is reduced over (None = a single rank; a group of
    one is passed as it is: the reduction never issues a collective on it)."""

    cp_group: Any
    cp_rank: int
    cp_size: int
    dp_group: Any  # data-parallel WITHOUT context-parallel: the ranks with other samples
    pp_group: Any
    is_pp_last: bool


def megatron_groups() -> Groups:
    """This rank's groups from megatron-core's ``parallel_state`` (slime, Megatron-RL, verl)."""
    from megatron.core import parallel_state as mpu

    return Groups(
        cp_group=mpu.get_context_parallel_group(),
        cp_rank=mpu.get_context_parallel_rank(),
        cp_size=mpu.get_context_parallel_world_size(),
        dp_group=mpu.get_data_parallel_group(with_context_parallel=False),
        pp_group=mpu.get_pipeline_model_parallel_group(),
        is_pp_last=mpu.is_pipeline_last_stage(),
    )


@dataclass(frozen=True)
class Framework:
    """The framework-specific parts of the integration."""

    name: str
    groups: Callable[[], Groups]
    #: Why these args can never give train log-probs to the ESS hook (None if they can).
    no_input_reason: Callable[[argparse.Namespace], str | None]
    #: Why these args select a backend or mode the integration does not support.
    unsupported_reason: Callable[[argparse.Namespace], str | None]
    #: The groups from the advantage call's arguments, bound by name (a host whose
    #: ParallelState is an argument); default: ``groups()``.
    call_groups: Callable[[Mapping[str, Any]], Groups] | None = None
    #: The framework's known shapes: all decided when --use-ess-lr is parsed.
    history: History | None = None
    #: ``(args, rollout_data) -> reason or None``: why the advantage hook has no current-policy
    #: log-probs for this rollout (skipped or computed with the old actor), so that ESS-LR
    #: measures inside the policy loss and decides at each optimizer step (``loss_ledger``).
    #: Decided from the args and the step count alone: the same on every rank. Granularity
    #: "step" is always measured there; None: the framework has no loss hooks ("step" refused).
    measure_in_loss: Callable[[Any, Mapping[str, Any] | None], str | None] | None = None

    def groups_for(self, call: Mapping[str, Any]) -> Groups:
        """The groups for one advantage call."""
        return self.groups() if self.call_groups is None else self.call_groups(call)


# --- validation -----------------------------------------------------------------------------------


def validate(framework: Framework, args: argparse.Namespace) -> None:
    """Reject ESS-LR settings that cannot work, with the flag to change.

    Raises:
        ValueError: an unsupported backend or mode, or a combination that can never give
            train log-probs (the ESS would silently never act).
    """
    enabled = bool(getattr(args, "use_ess_lr", False))
    shadow = shadow_requested(args)
    if not (enabled or shadow):
        return
    if enabled and shadow:
        raise EssPatchValueError(
            "--use-ess-lr and --ess-lr-shadow (or ESS_LR_SHADOW=1) are both on: shadow mode "
            "never changes an LR, --use-ess-lr does. Keep one of them "
            f"({framework.name})"
        )
    flag = "--use-ess-lr" if enabled else "--ess-lr-shadow"
    config = config_from_args(args)  # field checks (e.g. a floor set programmatically)
    if config.granularity == "step" and framework.measure_in_loss is None:
        raise EssPatchValueError(
            f"{flag} with granularity 'step' (--ess-lr-granularity / ESS_LR_GRANULARITY) is "
            f"not supported with {framework.name}: ess-patch measures each optimizer step "
            "inside the policy loss and has no loss hook there. Use granularity 'rollout'"
        )
    reason = framework.unsupported_reason(args)
    if reason:
        raise EssPatchValueError(f"{flag} is not supported with {reason} ({framework.name})")
    if getattr(args, "compute_advantages_and_returns", True) is False:
        # miles and slime: store_false into args.compute_advantages_and_returns (meant for
        # SFT); the actor then never calls the advantage routine ESS-LR hooks into
        raise EssPatchValueError(
            f"{flag} cannot act with --disable-compute-advantages-and-returns: the actor then "
            "never computes advantages, where ESS-LR measures each rollout, and the LR would "
            f"never be scaled ({framework.name}). Drop {flag} or "
            "--disable-compute-advantages-and-returns"
        )
    reason = framework.no_input_reason(args)
    if reason:
        raise EssPatchValueError(
            f"{flag} cannot measure the current policy against the rollout policy as this run "
            f"is configured: {reason} ({framework.name}). Drop {flag} or change that setting"
        )


# --- metrics --------------------------------------------------------------------------------------


def ess_metrics() -> dict[str, float]:
    """The metrics to log for this rollout (keys without ``train/``): the armed result's with
    the scale the last step applied (:func:`applied_metrics`), else shadow mode's (its
    would-be scale as ``ess_lr_shadow_scale``, never ``lr_scale``), else {}; with the VCPO
    baseline's (``ess_baseline_*``, ``baseline_hook``) when it ran.

    A rollout that was not measured gives only ``ess_lr_measured: 0``
    (:meth:`EssLrResult.metrics`); a critic process gives {} (it is never scaled)."""
    if STATE.role == "critic":
        return {}
    return {**_ess_lr_metrics(), **baseline_metrics()}


def _ess_lr_metrics() -> dict[str, float]:
    result = armed()
    if result is not None:
        return applied_metrics(result)
    if STATE.shadow is None:
        return {}
    return result_metrics(STATE.shadow, applied=False)


def applied_metrics(result: EssLrResult) -> dict[str, float]:
    """``result``'s metrics with ``lr_scale`` read back from the last optimizer step since it
    was armed (``guard.applied_scale``: that step's applied LR / scheduled LR), never copied
    from the result. Before any step (Megatron-RL logs a collection before training on it) the
    scale armed for the coming steps is ``ess_lr_armed_scale``, and there is no ``lr_scale``."""
    metrics = result.metrics()
    if "lr_scale" not in metrics:
        return metrics
    scale = metrics.pop("lr_scale")
    applied = applied_scale()
    if applied is None:
        metrics["ess_lr_armed_scale"] = scale
    else:
        metrics["lr_scale"] = applied
    return metrics


def result_metrics(result: EssLrResult, *, applied: bool) -> dict[str, float]:
    """``result``'s metrics (keys without a prefix); shadow mode (``applied`` False) reports
    its would-be scale as ``ess_lr_shadow_scale``, never as an applied ``lr_scale``."""
    metrics = result.metrics()
    if not applied and "lr_scale" in metrics:
        metrics["ess_lr_shadow_scale"] = metrics.pop("lr_scale")
    return metrics
