"""slime (THUDM/slime, v0.2.0 to main @624b824a8): flags, the advantage hook and metrics.

What ess-patch does to slime: every target of ``SLIME`` (below) and its effect. The LR itself
is scaled at megatron-core's ``optimizer.step()`` (``integrations/megatron.py``, the only
other file to read).

- ``slime.utils.arguments.parse_args``: composes the ``--ess-lr-*`` flags (generated from
  ``EssLrConfig``) into ``add_custom_arguments``; after parsing, validates them and, with
  ``--use-ess-lr``, the host's shape. Refused here: a ``--train-backend`` other than
  megatron, the flags that leave no train log-probs, several optimizer steps per rollout
  measured in the loss with granularity "rollout", ``--allgather-cp`` measured in the loss.
- ``compute_advantages_and_returns`` (``backends/megatron_utils/loss.py``, and
  ``megatron_utils.actor`` that imports it by name): runs it unchanged, then computes the
  rollout's ESS over megatron's CP / DP / PP groups and arms it (shadow mode: keeps it for
  the logs only). With granularity "step", or when the hook's log-probs may not be the
  current policy's (one optimizer step per rollout: slime reuses the loss's own;
  ``--keep-old-actor``; ``--use-rollout-logprobs`` alone), it arms nothing and starts a loss
  ledger run.
- ``policy_loss_function`` (``megatron_utils.loss``): during a ledger run, adds the call's
  per-trajectory partial sums to the step's ledger (``integrations/loss_ledger.py``); the loss
  is returned unchanged.
- ``get_log_probs_and_entropy`` (``megatron_utils.loss``): inside a policy-loss call, hands
  the log-probs it returns to that call.
- ``log`` (in the module of the table below): adds ``train/lr_scale``, ``train/rho_ess``... to
  the train-step record (``step_key="train/step"``).
- ``MegatronTrainRayActor.train_actor`` and ``MegatronTrainRayActor.train_critic``: as in
  miles (both built by ``miles_slime.actor_targets``): the first lends ``self.model`` to the
  advantage hook for VCPO's baseline (``--use-ess-baseline``; install() only), the second
  makes its process the critic before the advantage hook runs (never measured or scaled).

slime has no ParallelState object: the groups come from megatron's ``parallel_state``
throughout. ``compute_advantages_and_returns(args, rollout_data)`` lives in
``backends/megatron_utils/loss.py`` in every release. ``train()`` logs the train step
through ``<module>.log(args, metrics, step_key="train/step")``, looked up on the module at
call time, where the module moved twice:

| from | train-step log |
|---|---|
| v0.2.0 (2025-11-28), v0.2.1 | ``slime.utils.tracking_utils.log`` (``logging_utils``: no ``log``) |
| v0.2.2 (2026-01-18) to v0.3.1 (2026-08-06) | ``slime.utils.logging_utils.log`` |
| 2026-08-21 (main) | ``slime.observability.logging_utils.log`` |

All three are listed as optional targets; the "metrics" aspect, decided when
``megatron_utils.model`` is imported, requires one of them, so a slime whose log moved again
is an import-time error, never silently unlogged metrics.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..patching import Target
from .binding import bind, call_with
from .flags import config_from_args
from .framework import Framework, ess_metrics, megatron_groups
from .loss_ledger import loss_targets, per_step_reason, steps_per_rollout_refusal
from .miles_slime import METRIC_PREFIX, actor_targets, integration, rollout_logprobs_only
from .shapes import Aspect, Feature, History, Shape

#: the integration's name (install(), the registry, the shape history)
NAME = "slime"
#: the upstream commit the newest patches/ series and the framework tests are cut from
SNAPSHOT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
SUPPORTED = (
    f"slime v0.2.0 (2025-11-28) to @{SNAPSHOT[:9]} (2026-08-21), "
    "releases v0.3.0 and v0.3.1 included"
)

_LOSS = "slime.backends.megatron_utils.loss"
_MPU = "megatron.core.parallel_state"
#: where the train-step ``log(args, metrics, step_key)`` lives, newest first
_LOG_MODULES = (
    ("slime.observability.logging_utils", "2026-08-21 to main"),
    ("slime.utils.logging_utils", "v0.2.2 to v0.3.1"),
    ("slime.utils.tracking_utils", "v0.2.0 to v0.2.1"),
)


#: slime has taken its groups from megatron's parallel_state throughout
_GROUPS = Aspect(
    "groups",
    when=(_LOSS,),
    phrase="groups from {label}",
    shapes=(
        Shape(
            "megatron.core.parallel_state (CP, DP without CP, PP)",
            "v0.2.0 to main",
            tuple(
                Feature(_MPU, name)
                for name in (
                    "get_context_parallel_group",
                    "get_data_parallel_group",
                    "get_pipeline_model_parallel_group",
                    "is_pipeline_last_stage",
                )
            ),
        ),
    ),
)

SLIME_HISTORY = History(
    framework=NAME,
    supported=SUPPORTED,
    aspects=(
        _GROUPS,
        Aspect(
            "hook",
            (
                Shape(
                    "compute_advantages_and_returns(args, rollout_data)",
                    "v0.2.0 to main",
                    (Feature(_LOSS, "compute_advantages_and_returns", ("args", "rollout_data")),),
                ),
            ),
            when=(_LOSS,),
            phrase="hook {label}",
        ),
        Aspect(
            "metrics",
            tuple(
                Shape(f"{module}.log", span, (Feature(module, "log", ("step_key",)),))
                for module, span in _LOG_MODULES
            ),
            when=("slime.backends.megatron_utils.model",),
            phrase="metrics via {label}",
        ),
    ),
)


def _unsupported_reason(args: argparse.Namespace) -> str | None:
    backend = getattr(args, "train_backend", "megatron")
    return None if backend == "megatron" else f"--train-backend {backend} (supported: megatron)"


def _one_step_per_rollout(rollout_data: Any) -> bool:
    """One optimizer step in this rollout (slime's rollout-side schedule, the same on every
    rank). slime >= v0.3.0 then usually skips the separate log-prob forward and reuses the
    loss's own (``can_reuse_log_probs_in_loss`` in ``megatron_utils/actor.py``); whether it did
    or not, the loss's log-probs are then the current policy's on the same samples, so
    ess-patch measures there without copying slime's rule (which changes between versions)."""
    steps = (rollout_data or {}).get("num_microbatches")
    return steps is not None and len(steps) == 1


def _measure_in_loss(args: Any, rollout_data: Any) -> str | None:
    """Why the advantage hook's ``log_probs`` are not (or may not be) the current policy's
    (None: they are)."""
    if getattr(args, "keep_old_actor", False):
        return "--keep-old-actor computes log_probs with the old actor's weights"
    if rollout_logprobs_only(args):
        return "--use-rollout-logprobs without --get-mismatch-metrics computes no log_probs"
    if _one_step_per_rollout(rollout_data):
        return "one optimizer step per rollout (slime reuses the loss's log-probs)"
    return None


def _no_input_reason(args: argparse.Namespace) -> str | None:
    # Every policy-loss configuration gets measured: at the advantage hook, or inside the loss
    # (_measure_in_loss). What remains: one ESS per rollout of several steps, inside the loss.
    return steps_per_rollout_refusal(
        args, _measure_in_loss(args, None) or per_step_reason(config_from_args(args))
    )


SLIME_FRAMEWORK = Framework(
    NAME,
    groups=megatron_groups,
    no_input_reason=_no_input_reason,
    unsupported_reason=_unsupported_reason,
    history=SLIME_HISTORY,
    measure_in_loss=_measure_in_loss,
)


def log_wrapper(wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict) -> Any:
    """Add the armed ESS metrics to the train-step record (``step_key="train/step"``), every
    argument bound by name and passed on as given."""
    metrics = ess_metrics()
    if not metrics:
        return wrapped(*args, **kwargs)
    call = bind(wrapped, args, kwargs)
    if call is None or call.arguments.get("step_key") != "train/step":
        return wrapped(*args, **kwargs)
    logged = {
        **(call.arguments.get("metrics") or {}),
        **{METRIC_PREFIX + k: v for k, v in metrics.items()},
    }
    return call_with(wrapped, call, metrics=logged)


_ACTOR = "slime.backends.megatron_utils.actor"
_ADVANTAGE_SITES = (_LOSS, _ACTOR)

SLIME = integration(
    SLIME_FRAMEWORK,
    snapshot=SNAPSHOT,
    supported=SUPPORTED,
    arguments_module="slime.utils.arguments",
    advantage_sites=_ADVANTAGE_SITES,
    targets=(
        *loss_targets(
            NAME,
            (_LOSS,),
            {"policy_loss_function": _LOSS, "get_log_probs_and_entropy": _LOSS},
        ),
        *(
            Target(module, "", "log", log_wrapper, required=False, decorator="slime_log")
            for module, _ in _LOG_MODULES
        ),
        *actor_targets(NAME, _ACTOR),
    ),
)
