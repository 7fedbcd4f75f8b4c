"""What miles and slime share: the advantage hook, the critic, the weights' publish, the targets.

Each framework module (``miles.py``, ``slime.py``) supplies a :class:`Framework` with the
parts that differ (where its process groups live, which combinations can never give train
log-probs) and lists its targets; the wrappers here are built from it.

What every integration may use (the groups, :class:`Framework` and the flags' validation, the
metrics) is ``framework.py``'s; the flags themselves (and the settings they give) are
``flags.py``'s. Both are re-exported here. ``integrations/rl_hooks.py``, this module's name
before 0.5, stays an alias of it.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

from .. import collapse_warning, ledger
from ..config import EssLrConfig
from ..errors import EssPatchValueError
from ..guard import arm, check_applier, refuse
from ..patching import MissingTargetError, Target
from ..result import EssLrResult
from ..state import STATE, disarm, set_role
from . import Integration
from .actors import check_actors_patched, check_in_actor, resolve_in_driver
from .baseline_flags import baseline_mode, train_actor_wrapper, validate_baseline
from .binding import bind, call_with
from .flags import add_ess_arguments, compose_custom_arguments, config_from_args, shadow_requested
from .framework import (
    Framework,
    Groups,
    applied_metrics,
    ess_metrics,
    megatron_groups,
    result_metrics,
    validate,
)
from .loss_ledger import per_step_reason, start_run

__all__ = [
    "Framework",
    "Groups",
    "actor_targets",
    "add_ess_arguments",
    "advantage_wrapper",
    "applied_metrics",
    "common_targets",
    "compose_custom_arguments",
    "config_from_args",
    "critic_wrapper",
    "ess_metrics",
    "integration",
    "megatron_groups",
    "parse_args_wrapper",
    "result_metrics",
    "shadow_requested",
    "validate",
]

logger = logging.getLogger(__name__)

METRIC_PREFIX = "train/"


def rollout_logprobs_only(args: argparse.Namespace) -> str | None:
    """The rule both frameworks share: with --use-rollout-logprobs and no mismatch metrics,
    the actor never recomputes the train log-probs (miles and slime megatron_utils/actor.py)."""
    if getattr(args, "use_rollout_logprobs", False) and not getattr(
        args, "get_mismatch_metrics", False
    ):
        return "--use-rollout-logprobs without --get-mismatch-metrics does not recompute them"
    return None


# --- the critic ---------------------------------------------------------------------------------


def is_critic(args: Any) -> bool:
    """Whether this process trains the critic: its train entry ran (:func:`critic_wrapper`,
    from rollout 0 on) or the host set ``loss_type = "value_loss"`` (from rollout 1 on)."""
    return STATE.role == "critic" or getattr(args, "loss_type", None) == "value_loss"


def published_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wrap the actor's ``update_weights`` (miles ``MegatronTrainRayActor``): once the rollout
    engines hold the trainer's weights, remember the version they were published as
    (``weight_updater.weight_version``, what each sample's ``weight_versions`` records), so
    that calibration counts only the samples those very weights generated."""
    out = wrapped(*args, **kwargs)
    version = getattr(getattr(instance, "weight_updater", None), "weight_version", None)
    if version is not None:
        STATE.trainer_version = str(version)
        STATE.trained_since_publish = False
    return out


def _policy_versions(rollout_data: dict, config: EssLrConfig) -> dict[str, Any]:
    """``compute_ess_lr``'s ``policy_versions`` / ``current_version`` for this rollout: each
    sample's recorded versions (miles ``weight_versions``) against the version the trainer's
    weights were published as; empty (every sample counts) without calibration, without
    recorded versions, or when no publish was seen in this process."""
    versions = rollout_data.get("weight_versions")
    if not config.calibrate_rollouts or not versions:
        return {}
    if STATE.trainer_version is None:
        logger.debug("ess-patch: no weight publish seen in this process: every sample counts")
        return {}
    # trained since its last publish: the trainer's weights generated no sample at all
    current = UNPUBLISHED if STATE.trained_since_publish else STATE.trainer_version
    return {"policy_versions": versions, "current_version": current}


#: The trainer's version after it trained past its last publish: matches no sample's.
UNPUBLISHED = "unpublished (trained since the last weight update)"


def critic_wrapper(wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wrap the critic's train entry (``MegatronTrainRayActor.train_critic``): it calls
    ``compute_advantages_and_returns`` before it sets ``args.loss_type = "value_loss"`` (miles
    and slime ``megatron_utils/actor.py``), so the role is taken here, before the advantage
    hook of the first rollout: the critic never measures, warns, scales or logs as a policy."""
    set_role("critic")
    disarm()
    STATE.shadow = None
    return wrapped(*args, **kwargs)


# --- wrappers ----------------------------------------------------------------------------------


def parse_args_wrapper(framework: Framework) -> Callable[..., Any]:
    """Wrap ``parse_args(add_custom_arguments=None)``: add our flags, validate the result,
    and with ESS-LR (or shadow mode) on, check that the host has a known shape."""

    def wrapper(wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict) -> Any:
        call = bind(wrapped, args, kwargs)
        if call is None:  # the call does not fit the signature: the host raises its TypeError
            return wrapped(*args, **kwargs)
        if "add_custom_arguments" not in call.arguments:
            raise MissingTargetError(
                f"ess-patch ({framework.name}): {getattr(wrapped, '__qualname__', wrapped)} "
                "takes no add_custom_arguments parameter, so --use-ess-lr cannot be added"
                + (f". Supported: {framework.history.supported}" if framework.history else "")
            )
        user = call.arguments["add_custom_arguments"]
        parsed = call_with(wrapped, call, add_custom_arguments=compose_custom_arguments(user))
        validate(framework, parsed)
        validate_baseline(framework.name, parsed)
        enabled = bool(getattr(parsed, "use_ess_lr", False))
        if enabled or shadow_requested(parsed) or baseline_mode(parsed) is not None:
            if framework.history is not None:
                framework.history.choose_all()  # an unknown host fails here, not at a rollout
            # the actors train: they get every setting through args, and ess-patch
            resolve_in_driver(parsed)
            flag = "--use-ess-lr" if enabled else "--ess-lr-shadow"
            if not (enabled or shadow_requested(parsed)):
                flag = "--use-ess-baseline"
            check_actors_patched(framework.name, parsed, flag)
        return parsed

    return wrapper


def advantage_wrapper(framework: Framework) -> Callable[..., Any]:
    """Wrap ``compute_advantages_and_returns`` (``args`` and ``rollout_data`` bound by name,
    whatever else the host passes): run it, then arm ESS (or, in shadow mode, compute it the
    same way and keep it for the logs only)."""

    def wrapper(wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict) -> Any:
        call = bind(wrapped, args, kwargs)
        if call is None:  # the call does not fit the signature: the host raises its TypeError
            return wrapped(*args, **kwargs)
        lacking = [p for p in ("args", "rollout_data") if p not in call.arguments]
        if lacking:  # a host the shape detection did not see (it checks these names)
            raise MissingTargetError(
                f"ess-patch ({framework.name}): {getattr(wrapped, '__qualname__', wrapped)} "
                f"has no parameter {', '.join(lacking)}"
                + (f". Supported: {framework.history.supported}" if framework.history else "")
            )
        host_args = call.arguments.get("args")
        rollout_data = call.arguments.get("rollout_data")
        if not check_in_actor(framework.name, host_args):  # a driver that was not patched
            return wrapped(*args, **kwargs)
        enabled = bool(getattr(host_args, "use_ess_lr", False))
        ess_on = enabled or shadow_requested(host_args)
        baseline = baseline_mode(host_args) is not None and not is_critic(host_args)
        if not ess_on and not baseline:
            return wrapped(*args, **kwargs)  # disabled: no collective, no state change
        if baseline:  # before the routine: it builds the advantages from these rewards
            from .baseline_hook import check_applied, rewrite_rewards  # torch: only when on

            dp_group = framework.groups_for(call.arguments).dp_group
            record = rewrite_rewards(framework.name, host_args, rollout_data, dp_group)
        if not ess_on:
            out = wrapped(*args, **kwargs)
            check_applied(framework.name, host_args, rollout_data, record, dp_group)
            return out
        # if anything below raises, nothing of the previous rollout is reused (shadow mode
        # forgets only its own result: nothing the optimizer wrappers read is touched)
        ledger.new_rollout(shadow=not enabled)
        out = wrapped(*args, **kwargs)
        if baseline:
            check_applied(framework.name, host_args, rollout_data, record, dp_group)
        if is_critic(host_args):
            set_role("critic")  # the critic is never scaled
            return out
        groups = framework.groups_for(call.arguments)
        config = config_from_args(host_args)
        if _start_ledger(framework, host_args, config, rollout_data, groups, shadow=not enabled):
            STATE.trained_since_publish = True  # this rollout's steps move the weights
            return out
        try:
            result = compute_from_rollout(
                framework, host_args, rollout_data, groups, config, shadow=not enabled
            )
        finally:
            STATE.trained_since_publish = True  # this rollout's steps move the weights
        collapse_warning.publish(result, config, framework=framework.name, shadow=not enabled)
        return out

    return wrapper


def _start_ledger(
    framework: Framework,
    args: Any,
    config: EssLrConfig,
    rollout_data: Any,
    groups: Groups,
    *,
    shadow: bool,
) -> bool:
    """Granularity "step", or a rollout whose log-probs at the hook are not the current
    policy's: measure inside the policy loss from now on (every rank decides alike, from the
    args and the step count); returns whether it does."""
    if framework.measure_in_loss is None:
        return False
    reason = framework.measure_in_loss(args, rollout_data) or per_step_reason(config)
    if reason is None:
        return False
    if not shadow:  # what arm() says when nothing would apply the step's scale
        check_applier()
    start_run(framework.name, args, config, groups, reason, shadow=shadow)
    logger.debug("ess-patch (%s): measuring inside the policy loss: %s", framework.name, reason)
    return True


def arm_from_rollout(
    framework: Framework, args: Any, rollout_data: dict, *, groups: Groups | None = None
) -> EssLrResult:
    """Compute this rollout's ESS on every rank of the actor and arm it.

    Whatever fails on one rank (a missing key, bad inputs, a non-finite log-prob) fails on
    every rank of the actor, CP, DP and PP alike, and leaves nothing armed.
    """
    disarm()  # a failed rollout must not leave the previous rollout's scale armed
    return arm(compute_from_rollout(framework, args, rollout_data, groups))


def compute_from_rollout(
    framework: Framework,
    args: Any,
    rollout_data: dict,
    groups: Groups | None = None,
    config: EssLrConfig | None = None,
    *,
    shadow: bool = False,
) -> EssLrResult:
    """This rollout's result, identical on every rank of the actor (arms nothing): one
    ``compute_ess_lr`` call on every pipeline stage, so that a fault on any rank of
    DP x CP x PP reaches every rank.

    ``groups``: the process groups (default: ``framework.groups()``); ``config``: the settings
    (default: from ``args``).

    Raises:
        EssLrNotAppliedError: the rollout has no log-probs to measure (on every rank alike:
            the status is agreed in the collectives), unless ``shadow`` or opted out."""
    # Imported here: install() (run at start-up by the auto-install) must not import torch.
    from ..compute import compute_ess_lr

    groups = framework.groups() if groups is None else groups
    config = config_from_args(args) if config is None else config
    masks, error = rollout_data.get("loss_masks"), None
    try:
        masks = _local_masks(masks, groups, args, rollout_data)
    except Exception as exc:  # raised inside compute_ess_lr's collectives, on every rank
        error = exc
    out = compute_ess_lr(
        rollout_data.get("log_probs"),
        rollout_data.get("rollout_log_probs"),
        masks,
        config=config,
        cp_group=groups.cp_group,
        dp_group=groups.dp_group,
        pp_group=groups.pp_group,
        error=error,
        **_policy_versions(rollout_data, config),
    )
    if out.status == "missing":
        _missing(framework, rollout_data, shadow)
    return out


def _local_masks(masks: Any, groups: Groups, args: Any, rollout_data: dict) -> Any:
    """Under CP: the full-length loss masks sliced to this CP rank's tokens."""
    from ..cp_slicing import local_response_masks

    if groups.cp_size <= 1 or masks is None:
        return masks
    lengths = [rollout_data.get(k) for k in ("total_lengths", "response_lengths")]
    if None in lengths:
        raise EssPatchValueError(
            "rollout_data has loss_masks but no total_lengths/response_lengths: "
            "ESS-LR cannot slice the masks to this CP rank's tokens"
        )
    return local_response_masks(
        masks,
        *lengths,
        groups.cp_rank,
        groups.cp_size,
        qkv_format=getattr(args, "qkv_format", "thd"),
        max_seq_lens=rollout_data.get("max_seq_lens"),
    )


#: What is missing, and what to change, when a rollout reaches the hook without one of the
#: two log-prob inputs.
MISSING_FIX = {
    "log_probs": (
        "the train log-probs (rollout_data['log_probs']) were not recomputed before the "
        "advantages (--use-rollout-logprobs without --get-mismatch-metrics skips that forward)",
        "Add --get-mismatch-metrics (forces the log-prob forward: one extra forward pass per "
        "rollout)",
    ),
    "rollout_log_probs": (
        "the rollout engine returned no log-probs (rollout_data['rollout_log_probs'])",
        "Make the rollout return them (a custom rollout function must fill "
        "Sample.rollout_log_probs)",
    ),
}


def _missing(framework: Framework, rollout_data: dict, shadow: bool) -> None:
    """A rollout without log-probs: stop the run (on every rank: the status is agreed);
    shadow mode, which never changes an LR, only says so."""
    key = "log_probs" if rollout_data.get("log_probs") is None else "rollout_log_probs"
    missing, fix = MISSING_FIX[key]
    if not shadow:
        refuse(framework.name, f"this rollout cannot be measured: {missing}", fix)
    logger.warning(
        "ess-patch (%s): this rollout was not measured, on this rank or another: %s. %s. Its "
        "metrics say train/ess_lr_measured 0 (no train/lr_scale, train/rho_ess)",
        framework.name,
        missing,
        fix,
    )


def actor_targets(name: str, actor: str) -> tuple[Target, Target]:
    """``MegatronTrainRayActor``'s ``train_critic`` (the critic's role, decorated
    ``<name>_train_critic``) and ``train_actor`` (the model lent to the baseline's norm pass,
    monkeypatched only) in module ``actor``: both frameworks have them."""
    return (
        Target(
            actor,
            "MegatronTrainRayActor",
            "train_critic",
            critic_wrapper,
            decorator=f"{name}_train_critic",
        ),
        Target(
            actor,
            "MegatronTrainRayActor",
            "train_actor",
            train_actor_wrapper,
            required=False,
            vendored=False,
        ),
    )


def integration(
    framework: Framework,
    *,
    snapshot: str,
    supported: str,
    arguments_module: str,
    advantage_sites: tuple[str, ...],
    targets: tuple[Target, ...],
) -> Integration:
    """A miles / slime :class:`~ess_patch.integrations.Integration` (no pip distribution):
    :func:`common_targets` first, then the framework's own ``targets``; its shapes are
    ``framework.history``."""
    return Integration(
        name=framework.name,
        snapshot=snapshot,
        distribution=None,
        supported=supported,
        targets=(*common_targets(framework, arguments_module, advantage_sites), *targets),
        history=framework.history,
    )


def common_targets(
    framework: Framework, arguments_module: str, advantage_sites: tuple[str, ...]
) -> tuple[Target, ...]:
    """The targets both frameworks have: ``parse_args``, and ``compute_advantages_and_returns``
    where it is defined (``advantage_sites[0]``: the diffs decorate it there with
    ``<name>_advantages``) and wherever it was imported by name."""
    advantages = advantage_wrapper(framework)
    return (
        Target(
            arguments_module,
            "",
            "parse_args",
            parse_args_wrapper(framework),
            decorator=f"{framework.name}_parse_args",
        ),
        *(
            Target(
                module,
                "",
                "compute_advantages_and_returns",
                advantages,
                decorator=f"{framework.name}_advantages" if module == advantage_sites[0] else None,
            )
            for module in advantage_sites
        ),
    )
