"""miles (radixark/miles, 2026-01-12 to main @31f1ca961): flags, advantage hook, metrics, FSDP.

What ess-patch does to miles: every target of ``MILES`` (below) and its effect. The LR
itself is scaled at megatron-core's ``optimizer.step()`` (``integrations/megatron.py``, the
only other file to read); the FSDP backend's torch optimizer is attach()ed instead.

- ``miles.utils.arguments.parse_args``: composes the ``--ess-lr-*`` flags (generated from
  ``EssLrConfig``) into ``add_custom_arguments``; after parsing, validates them and, with
  ``--use-ess-lr``, the host's shape. Refused here: fault-tolerant mode, multi-LoRA
  (``--multi-lora-n-adapters``), ``--disable-compute-advantages-and-returns``, the flags that
  leave no train log-probs, FSDP with granularity "step", several optimizer steps per rollout
  measured in the loss with granularity "rollout", ``--allgather-cp`` measured in the loss.
- ``compute_advantages_and_returns`` (where it is defined, ``training_utils.loss``, and in
  each module that imported it by name: ``megatron_utils.actor``, ``fsdp_utils.actor``,
  2026-04 to 2026-07 ``experimental.fsdp_utils.actor``): runs it unchanged, then computes the
  rollout's ESS over the CP / DP / PP groups of the shape chosen below and arms it (shadow
  mode: keeps it for the logs only). With granularity "step", or when the hook's log-probs
  are not the current policy's (``--keep-old-actor``, ``--skip-actor-forward-only``,
  ``--use-rollout-logprobs`` alone), it arms nothing and starts a loss ledger run.
- ``policy_loss_function`` (``loss_hub.losses`` from 2026-05-21, ``training_utils.loss``
  before): during a ledger run, adds the call's per-trajectory partial sums to the step's
  ledger (``integrations/loss_ledger.py``); the loss is returned unchanged.
- ``get_log_probs_and_entropy`` (``loss_hub.logit_processors``, ``training_utils.loss``):
  inside a policy-loss call, hands the log-probs it returns to that call.
- ``log_train_step`` (``log_utils``, ``megatron_utils.model``, ``fsdp_utils.actor``,
  ``experimental.fsdp_utils.actor``): adds ``lr_scale``, ``rho_ess``... to the actor's
  ``extra_metrics`` (logged as ``train/lr_scale``...).
- ``FSDPTrainRayActor._train_core``: attaches the plain torch optimizer (once) before training.
- ``MegatronTrainRayActor.train_actor``: with ``--use-ess-baseline`` (VCPO's baseline,
  ``integrations/baseline_flags.py``, ``baseline_hook.py``), lends ``self.model`` to the
  advantage hook for the call,
  which then rewrites the rewards to ``r - b*`` before the routine and reads the advantages
  back (install() only: no ``patches/`` series carries it yet).
- ``MegatronTrainRayActor.train_critic``: makes its process the critic before the advantage
  hook runs (never measured, scaled or logged as a policy).
- ``MegatronTrainRayActor.update_weights``: after the rollout engines receive the trainer's
  weights, remembers the version they were published as, so that ``calibrate_rollouts``
  counts only the samples whose ``weight_versions`` are that version (install() only: no
  ``patches/`` series carries it).

The shapes (read in the snapshots in ../shared/upstream and miles' public history):

- from 2026-01-12: groups from the ``parallel_state`` argument (flat fields ``dp_group
  cp_group cp_rank cp_size``); ``compute_advantages_and_returns(args, parallel_state,
  rollout_data)``;
- from 2026-04-03: ``get_parallel_state()``, GroupInfo ``intra_dp cp`` (``pp`` from
  2026-05-05); ``(args, rollout_data)`` from 04-04;
- from 2026-07-10: ``get_parallel_state().effective_dp`` (``indep_dp`` when fault-tolerant).

Before ``ParallelState.pp`` the pipeline group is megatron's ``parallel_state`` one (miles'
own megatron backend initialises it; the FSDP backend has no PP). ``log_train_step(...,
role="actor", extra_metrics=None, ...)`` is unchanged since 2026-01-12.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from ..attach import attach
from ..errors import EssPatchValueError
from ..patching import Target
from .binding import bind, call_with
from .flags import config_from_args
from .framework import Framework, Groups, ess_metrics
from .loss_ledger import loss_targets, per_step_reason, steps_per_rollout_refusal
from .miles_slime import (
    actor_targets,
    advantage_wrapper,
    integration,
    published_wrapper,
    rollout_logprobs_only,
)
from .shapes import Aspect, Feature, History, Shape

#: the integration's name (install(), the registry, the shape history)
NAME = "miles"
#: the upstream commit the newest patches/ series and the framework tests are cut from
SNAPSHOT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"
SUPPORTED = (
    f"miles from 2026-01-12 (training_utils with ParallelState) to @{SNAPSHOT[:9]} (2026-08-21), "
    "release v0.1.0 included"
)

_PARALLEL = "miles.backends.training_utils.parallel"
_LOSS = "miles.backends.training_utils.loss"
_LOG = "miles.backends.training_utils.log_utils"
_HUB = "miles.backends.training_utils.loss_hub"
_ADVANTAGE = "compute_advantages_and_returns"


# --- where the groups come from ----------------------------------------------------------------


def _pp(state: Any) -> tuple[Any, bool]:
    """(PP group or None, is last stage): the PP aspect's shape decides where PP lives."""
    pp = MILES_HISTORY.choose("pp").adapter(state)
    return pp, bool(getattr(state, "is_pp_last_stage", True))


def _groups_from_getter(dp_field: str) -> Callable[[Mapping[str, Any]], Groups]:
    def groups(_call: Mapping[str, Any]) -> Groups:
        from miles.backends.training_utils.parallel import get_parallel_state

        state = get_parallel_state()
        dp = getattr(state, dp_field)
        pp_group, is_last = _pp(state)
        return Groups(
            cp_group=state.cp.group,
            cp_rank=state.cp.rank,
            cp_size=state.cp.size,
            dp_group=dp.group,
            pp_group=pp_group,
            is_pp_last=is_last,
        )

    return groups


def _groups_from_argument(call: Mapping[str, Any]) -> Groups:
    state = call.get("parallel_state")
    if state is None:
        raise EssPatchValueError(
            f"ess-patch (miles): {_ADVANTAGE} was called without its parallel_state argument; "
            "ESS-LR needs its dp_group / cp_group"
        )
    pp_group, is_last = _pp(state)
    return Groups(
        cp_group=state.cp_group,
        cp_rank=state.cp_rank,
        cp_size=state.cp_size,
        dp_group=state.dp_group,  # DP without CP
        pp_group=pp_group,
        is_pp_last=is_last,
    )


def _pp_from_state(state: Any) -> Any:
    return state.pp.group


def _pp_from_megatron(_state: Any) -> Any:
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():  # the FSDP backend: one stage
        return None
    return mpu.get_pipeline_model_parallel_group()


def _call_groups(call: Mapping[str, Any]) -> Groups:
    return MILES_HISTORY.choose("groups").adapter(call)


def _advantage(*parameters: str) -> Feature:
    return Feature(_LOSS, _ADVANTAGE, ("args", *parameters, "rollout_data"))


MILES_HISTORY = History(
    framework=NAME,
    supported=SUPPORTED,
    aspects=(
        Aspect(
            "groups",
            (
                Shape(
                    "get_parallel_state().effective_dp",
                    "2026-07-10 to main",
                    (
                        Feature(_PARALLEL, "get_parallel_state"),
                        Feature(_PARALLEL, "ParallelState.effective_dp"),
                        Feature(_PARALLEL, "ParallelState.cp"),
                    ),
                    _groups_from_getter("effective_dp"),
                ),
                Shape(
                    "get_parallel_state().intra_dp",
                    "2026-04-03 to 2026-07-09",
                    (
                        Feature(_PARALLEL, "get_parallel_state"),
                        Feature(_PARALLEL, "ParallelState.intra_dp"),
                        Feature(_PARALLEL, "ParallelState.cp"),
                    ),
                    _groups_from_getter("intra_dp"),
                ),
                Shape(
                    "the parallel_state argument (flat dp_group / cp_group fields)",
                    "2026-01-12 to 2026-04-02",
                    (
                        Feature(_PARALLEL, "ParallelState.dp_group"),
                        Feature(_PARALLEL, "ParallelState.cp_group"),
                        Feature(_PARALLEL, "ParallelState.cp_rank"),
                        _advantage("parallel_state"),
                    ),
                    _groups_from_argument,
                ),
            ),
            when=(_LOSS,),
            phrase="groups from {label}",
        ),
        Aspect(
            "pp",
            (
                Shape(
                    "ParallelState.pp",
                    "2026-05-05 to main",
                    (Feature(_PARALLEL, "ParallelState.pp"),),
                    _pp_from_state,
                ),
                Shape(
                    "megatron.core.parallel_state",
                    "2026-01-12 to 2026-05-04",
                    (Feature("megatron.core.parallel_state", "get_pipeline_model_parallel_group"),),
                    _pp_from_megatron,
                ),
                Shape("none (one stage)", "FSDP without megatron-core", (), lambda _s: None),
            ),
            when=(_LOSS,),
            phrase="PP from {label}",
        ),
        Aspect(
            "hook",
            (
                Shape(
                    f"{_ADVANTAGE}(args, parallel_state, rollout_data)",
                    "2026-01-12 to 2026-04-03",
                    (_advantage("parallel_state"),),
                ),
                Shape(
                    f"{_ADVANTAGE}(args, rollout_data)",
                    "2026-04-04 to main",
                    (_advantage(),),
                ),
            ),
            when=(_LOSS,),
            phrase="hook {label}",
        ),
        Aspect(
            "metrics",
            (
                Shape(
                    "log_train_step",
                    "2026-01-12 to main",
                    (Feature(_LOG, "log_train_step", ("role", "extra_metrics")),),
                ),
            ),
            when=(_LOG, "miles.backends.megatron_utils.model"),
            phrase="metrics via {label}",
        ),
    ),
)


# --- validation --------------------------------------------------------------------------------


def _measure_in_loss(args: Any, _rollout_data: Any) -> str | None:
    """Why the advantage hook's ``log_probs`` are not the current policy's (None: they are).

    megatron_utils/actor.py: log_probs are recomputed only when not skip_actor_forward_only
    and (not use_rollout_logprobs or get_mismatch_metrics), with the old_actor's weights under
    --keep-old-actor."""
    if getattr(args, "keep_old_actor", False):
        return "--keep-old-actor computes log_probs with the old actor's weights"
    if getattr(args, "skip_actor_forward_only", False):
        return "--skip-actor-forward-only skips the actor's log-prob forward"
    if rollout_logprobs_only(args):
        return "--use-rollout-logprobs without --get-mismatch-metrics computes no log_probs"
    return None


def _no_input_reason(args: argparse.Namespace) -> str | None:
    # Every policy-loss configuration gets measured: at the advantage hook, or inside the loss
    # (_measure_in_loss). What remains: one ESS per rollout of several steps, inside the loss.
    reason = _measure_in_loss(args, None) or per_step_reason(config_from_args(args))
    if reason is not None and getattr(args, "train_backend", "megatron") == "fsdp":
        return f"{reason}, and the FSDP backend is not measured inside its loss yet"
    return steps_per_rollout_refusal(args, reason)


def _unsupported_reason(args: argparse.Namespace) -> str | None:
    backend = getattr(args, "train_backend", "megatron")
    if backend not in ("megatron", "fsdp"):
        return f"--train-backend {backend} (supported: megatron, fsdp)"
    if getattr(args, "use_fault_tolerance", False):
        return (
            "--use-fault-tolerance (its effective_dp may be a torchft group, which ess-patch "
            "does not reduce over yet; per-replica scales would let replicas drift)"
        )
    # miles.utils.multi_lora.validate_multi_lora_args sets args.multi_lora from
    # --multi-lora-n-adapters > 0 (2026-07-21 on)
    if getattr(args, "multi_lora", False) or (getattr(args, "multi_lora_n_adapters", 0) or 0) > 0:
        return (
            "multi-LoRA (--multi-lora-n-adapters > 0: step_stepped_adapter_slots steps each "
            "adapter's child optimizer itself and one batch mixes adapters, so one rollout-wide "
            "ESS would scale every adapter by the others' staleness; set "
            "--multi-lora-n-adapters 0 or drop the flag)"
        )
    return None


MILES_FRAMEWORK = Framework(
    name=NAME,
    groups=lambda: _call_groups({}),
    no_input_reason=_no_input_reason,
    unsupported_reason=_unsupported_reason,
    call_groups=_call_groups,
    history=MILES_HISTORY,
    measure_in_loss=_measure_in_loss,
)


# --- wrappers ----------------------------------------------------------------------------------


def log_train_step_wrapper(
    wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict
) -> Any:
    """Add the armed ESS metrics to the actor's ``extra_metrics`` (bound by name)."""
    metrics = ess_metrics()
    if not metrics:
        return wrapped(*args, **kwargs)
    call = bind(wrapped, args, kwargs)
    if call is None or call.arguments.get("role", "actor") != "actor":
        return wrapped(*args, **kwargs)
    extra = {**(call.arguments.get("extra_metrics") or {}), **metrics}
    return call_with(wrapped, call, extra_metrics=extra)


def fsdp_train_core_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """The FSDP backend steps a plain torch optimizer: attach it (once) before training."""
    if getattr(getattr(instance, "args", None), "use_ess_lr", False):
        optimizer = getattr(instance, "optimizer", None)
        if optimizer is not None:
            attach(optimizer)
    return wrapped(*args, **kwargs)


# The FSDP actor lived in backends/experimental/ from 2026-04 to 2026-07: both are listed; the
# experimental one is optional (absent from the trees the patches/ series are checked on).
_FSDP = "miles.backends.fsdp_utils.actor"
_FSDP_EXPERIMENTAL = "miles.backends.experimental.fsdp_utils.actor"
_ACTOR = "miles.backends.megatron_utils.actor"
_ADVANTAGE_SITES = (_LOSS, _ACTOR, _FSDP)
_LOG_SITES = (_LOG, "miles.backends.megatron_utils.model", _FSDP)


MILES = integration(
    MILES_FRAMEWORK,
    snapshot=SNAPSHOT,
    supported=SUPPORTED,
    arguments_module="miles.utils.arguments",
    advantage_sites=_ADVANTAGE_SITES,
    targets=(
        # the policy loss: in loss_hub/losses.py from 2026-05-21 (its log-probs from
        # loss_hub/logit_processors.py), both in loss.py before
        *loss_targets(
            NAME,
            (f"{_HUB}.losses", _LOSS),
            {
                "policy_loss_function": f"{_HUB}.losses",
                "get_log_probs_and_entropy": f"{_HUB}.logit_processors",
            },
        ),
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
            _FSDP,
            "FSDPTrainRayActor",
            "_train_core",
            fsdp_train_core_wrapper,
            decorator="miles_fsdp_train_core",
        ),
        *actor_targets(NAME, _ACTOR),
        Target(
            _ACTOR,
            "MegatronTrainRayActor",
            "update_weights",
            published_wrapper,
            required=False,
            vendored=False,
        ),
        Target(
            _FSDP_EXPERIMENTAL,
            "",
            _ADVANTAGE,
            advantage_wrapper(MILES_FRAMEWORK),
            required=False,
        ),
        Target(_FSDP_EXPERIMENTAL, "", "log_train_step", log_train_step_wrapper, required=False),
        Target(
            _FSDP_EXPERIMENTAL,
            "FSDPTrainRayActor",
            "_train_core",
            fsdp_train_core_wrapper,
            required=False,
        ),
    ),
)
