"""What miles and slime share: the flags, their validation, the advantage hook, the metrics.

Each framework module (``miles.py``, ``slime.py``) supplies a :class:`Framework` with the
parts that differ (where its process groups live, which combinations can never give train
log-probs) and lists its targets; the wrappers here are built from it.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from ..config import GRANULARITIES, NONFINITE_POLICIES, RULES, WEIGHT_MODES, EssLrConfig
from ..patching import MissingTargetError, Target
from ..result import EssLrResult
from ..state import STATE, arm, arm_steps, armed, disarm, set_role, set_step_source
from .binding import bind, call_with
from .shapes import History

__all__ = ["Framework", "Groups", "add_ess_arguments", "config_from_args"]

logger = logging.getLogger(__name__)

METRIC_PREFIX = "train/"


class Groups(NamedTuple):
    """The process groups one rollout's ESS is reduced over (None = a single rank)."""

    cp_group: Any
    cp_rank: int
    cp_size: int
    dp_group: Any  # data-parallel WITHOUT context-parallel: the ranks with other samples
    pp_group: Any
    is_pp_last: bool


@dataclass(frozen=True)
class Framework:
    """The framework-specific parts of the integration."""

    name: str
    groups: Callable[[], Groups]
    #: Why these args can never give train log-probs to the ESS hook (None if they can).
    no_input_reason: Callable[[argparse.Namespace], str | None]
    #: Why these args select a backend or mode the integration does not support.
    unsupported_reason: Callable[[argparse.Namespace], str | None]
    #: ``(args, rollout_data, dp_size) -> steps``: the indices of this rank's samples that each
    #: optimizer step of the rollout trains on (granularity "step"); None: "step" is refused.
    step_samples: Callable[[Any, dict, int], list[list[int]]] | None = None
    #: The groups from the advantage call's arguments, bound by name (a host whose
    #: ParallelState is an argument); default: ``groups()``.
    call_groups: Callable[[Mapping[str, Any]], Groups] | None = None
    #: The framework's known shapes: all decided when --use-ess-lr is parsed.
    history: History | None = None
    #: ``(args, rollout_data) -> reason or None``: why the advantage hook has no current-policy
    #: log-probs for this rollout (skipped or computed with the old actor), so that ESS-LR
    #: measures inside the policy loss and decides at each optimizer step (``loss_ledger``).
    #: Decided from the args and the step count alone: the same on every rank.
    measure_in_loss: Callable[[Any, Mapping[str, Any] | None], str | None] | None = None

    def groups_for(self, call: Mapping[str, Any]) -> Groups:
        """The groups for one advantage call."""
        return self.groups() if self.call_groups is None else self.call_groups(call)


def rollout_logprobs_only(args: argparse.Namespace) -> str | None:
    """The rule both frameworks share: with --use-rollout-logprobs and no mismatch metrics,
    the actor never recomputes the train log-probs (miles and slime megatron_utils/actor.py)."""
    if getattr(args, "use_rollout_logprobs", False) and not getattr(
        args, "get_mismatch_metrics", False
    ):
        return "--use-rollout-logprobs without --get-mismatch-metrics does not recompute them"
    return None


# --- flags -------------------------------------------------------------------------------------


def _config_field(name: str) -> Callable[[str], Any]:
    """argparse ``type`` for the flag of config field ``name``: :class:`EssLrConfig`'s own
    check of that field (its ``ValueError`` becomes argparse's usage error)."""

    def parse(text: str) -> Any:
        try:
            return getattr(EssLrConfig(**{name: text}), name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = name  # argparse names the type in some messages
    return parse


def add_ess_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--use-ess-lr`` and its options to a host framework's parser.

    Merges with what the host (a fork, or a second call) already defines: each option the
    parser lacks is added, each it has is kept as the host wrote it, provided it stores into
    the attribute ess-patch reads (``args.use_ess_lr``, ``args.ess_lr_floor``...).

    Raises:
        ValueError: the host defines one of our option strings with another ``dest`` (ESS-LR
            would silently read a default instead of the user's value).
    """
    known = parser._option_string_actions
    pending: list[tuple[tuple[str, ...], dict[str, Any]]] = []

    class _Collect:
        def add_argument(self, *flags: str, **kwargs: Any) -> None:
            pending.append((flags, kwargs))

    _declare_ess_arguments(_Collect())
    missing = []
    for flags, kwargs in pending:
        dest = flags[0].lstrip("-").replace("-", "_")
        action = known.get(flags[0])
        if action is None:
            missing.append((flags, kwargs))
        elif action.dest != dest:
            raise ValueError(
                f"the host parser already defines {flags[0]} with dest={action.dest!r}; "
                f"ess-patch reads args.{dest}. Rename the host's option or give it "
                f"dest={dest!r}, so that --use-ess-lr and its options are not silently ignored"
            )
    if missing:
        group = parser.add_argument_group("ESS learning-rate scaling (ess-patch)")
        for flags, kwargs in missing:
            group.add_argument(*flags, **kwargs)
    return parser


def _declare_ess_arguments(group: Any) -> None:
    """Our options, declared once (``add_ess_arguments`` decides which ones to add)."""
    group.add_argument(
        "--use-ess-lr",
        action="store_true",
        default=False,
        help="Scale each policy update's LR by clamp(sqrt(ESS/B), floor, 1), ESS from the "
        "train/rollout log-prob ratios of the rollout (ess-patch). Off by default.",
    )
    group.add_argument(
        "--ess-lr-floor",
        type=_config_field("floor"),
        default=0.1,
        help="Smallest LR scale, in (0, 1] (default 0.1).",
    )
    group.add_argument(
        "--ess-lr-weight-mode",
        choices=WEIGHT_MODES,
        default="geometric",
        help="Trajectory weight: exp(mean log-ratio) ('geometric', length-normalised, gentle) or "
        "exp(sum) ('product', VCPO's code, brakes hard on long responses).",
    )
    group.add_argument(
        "--ess-lr-rule",
        choices=RULES,
        default="sqrt",
        help="Scale from rho = ESS/B: sqrt(rho/base) (default) or rho/base ('linear').",
    )
    group.add_argument(
        "--ess-lr-base-ratio",
        type=_config_field("base_ratio"),
        default=1.0,
        help="rho is divided by this before the rule (default 1.0: no rescaling).",
    )
    group.add_argument(
        "--ess-lr-nonfinite",
        choices=NONFINITE_POLICIES,
        default="raise",
        help="On a NaN/inf log-ratio: 'raise' on every rank (default) or train at the floor.",
    )
    group.add_argument(
        "--ess-lr-shadow",
        action="store_true",
        default=None,  # None: not given, ESS_LR_SHADOW (via install's config) decides
        help="Compute and log rho/ESS and the scale ESS-LR would apply "
        "(train/ess_lr_shadow_scale) every rollout, but never change an LR. "
        "Use without --use-ess-lr.",
    )
    group.add_argument(
        "--ess-lr-granularity",
        choices=GRANULARITIES,
        default=None,  # None: not given, ESS_LR_GRANULARITY (via install's config) decides
        help="'rollout' (default): one ESS over the whole rollout, for each of its optimizer "
        "steps. 'step': one ESS per optimizer step over that step's mini-batch (VCPO's code).",
    )
    group.add_argument(
        "--ess-lr-weight-clip",
        type=_config_field("weight_clip"),
        default=None,  # None: not given, ESS_LR_WEIGHT_CLIP (via install's config) decides
        help="Clip each trajectory weight to min(w, this) before the ESS (VCPO's use_clipped "
        "with rollout_is_threshold). Off by default.",
    )


def compose_custom_arguments(
    user: Callable[[argparse.ArgumentParser], Any] | None,
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """The user's ``add_custom_arguments`` followed by ours (both frameworks accept one)."""

    def add(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if user is not None:
            returned = user(parser)
            parser = parser if returned is None else returned
        return add_ess_arguments(parser)

    return add


def config_from_args(args: argparse.Namespace) -> EssLrConfig:
    """The estimator settings: the ``--ess-lr-*`` flags where the host args have them, else
    the config given to ``install()`` (itself from ``ESS_LR_*`` by default)."""
    base = STATE.config or EssLrConfig()
    values = {f.name: getattr(args, f"ess_lr_{f.name}", None) for f in fields(base)}
    return EssLrConfig(
        **{k: getattr(base, k) if v is None else v for k, v in values.items()}  # None: not given
    )


def shadow_requested(args: Any) -> bool:
    """Whether shadow mode is on: ``--ess-lr-shadow``, else the installed config's ``shadow``."""
    value = getattr(args, "ess_lr_shadow", None)
    if value is None:
        return STATE.config is not None and STATE.config.shadow
    return bool(value)


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
        raise ValueError(
            "--use-ess-lr and --ess-lr-shadow (or ESS_LR_SHADOW=1) are both on: shadow mode "
            "never changes an LR, --use-ess-lr does. Keep one of them "
            f"({framework.name})"
        )
    flag = "--use-ess-lr" if enabled else "--ess-lr-shadow"
    config = config_from_args(args)  # field checks (e.g. a floor set programmatically)
    if config.granularity == "step":
        if framework.step_samples is None:
            raise ValueError(
                f"{flag} with granularity 'step' (--ess-lr-granularity / ESS_LR_GRANULARITY) is "
                f"not supported with {framework.name}: ess-patch does not know how its train "
                "loop splits a rollout into optimizer steps. Use granularity 'rollout'"
            )
        if shadow:
            raise ValueError(
                "--ess-lr-shadow with granularity 'step' is not supported yet (shadow mode logs "
                f"one result per rollout); use granularity 'rollout' ({framework.name})"
            )
    reason = framework.unsupported_reason(args)
    if reason:
        raise ValueError(f"{flag} is not supported with {reason} ({framework.name})")
    reason = framework.no_input_reason(args)
    if reason:
        raise ValueError(
            f"{flag} needs the train log-probs recomputed before the advantages, but "
            f"{reason}, so ESS-LR would never act ({framework.name}). Drop {flag} or "
            "change that setting"
        )


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
        if framework.history is not None and (
            getattr(parsed, "use_ess_lr", False) or shadow_requested(parsed)
        ):
            framework.history.choose_all()  # an unknown host fails here, not at a rollout
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
        if not getattr(host_args, "use_ess_lr", False):
            if not shadow_requested(host_args):
                return wrapped(*args, **kwargs)  # disabled: no collective, no state change
            STATE.shadow = None  # a failed rollout must not leave the previous one's logs
            set_step_source(None)
            out = wrapped(*args, **kwargs)
            if getattr(host_args, "loss_type", None) == "value_loss":
                set_role("critic")
                return out
            # the same collectives as enabled; nothing the optimizer wrappers read is touched
            groups = framework.groups_for(call.arguments)
            if _start_ledger(framework, host_args, rollout_data, groups, shadow=True):
                return out
            STATE.shadow = compute_from_rollout(framework, host_args, rollout_data, groups=groups)
            return out
        disarm()  # if anything below raises, the previous rollout's scale is not reused
        set_step_source(None)  # nor its ledger
        out = wrapped(*args, **kwargs)
        if getattr(host_args, "loss_type", None) == "value_loss":
            set_role("critic")  # the critic is never scaled
            disarm()
            return out
        groups = framework.groups_for(call.arguments)
        if _start_ledger(framework, host_args, rollout_data, groups, shadow=False):
            return out
        arm_from_rollout(framework, host_args, rollout_data, groups=groups)
        return out

    return wrapper


def _start_ledger(
    framework: Framework, args: Any, rollout_data: Any, groups: Groups, *, shadow: bool
) -> bool:
    """When this rollout's log-probs at the hook are not the current policy's, measure inside
    the policy loss from now on (every rank decides alike, from the args and the step count);
    returns whether it does."""
    reason = (
        None if framework.measure_in_loss is None else framework.measure_in_loss(args, rollout_data)
    )
    if reason is None:
        return False
    from .loss_ledger import LedgerSource

    source = LedgerSource(framework.name, args, groups, config_from_args(args), reason, shadow)
    set_step_source(source)
    logger.debug("ess-patch (%s): measuring inside the policy loss: %s", framework.name, reason)
    return True


def arm_from_rollout(
    framework: Framework, args: Any, rollout_data: dict, *, groups: Groups | None = None
) -> EssLrResult | None:
    """Compute this rollout's ESS on every rank of the actor and arm it (granularity "step":
    one result per optimizer step); returns what the next step uses (None: a rollout of no step).

    Whatever fails on one rank (a missing key, bad inputs, a non-finite log-prob) fails on
    every rank of the actor, CP, DP and PP alike, and leaves nothing armed.
    """
    disarm()  # a failed rollout must not leave the previous rollout's scale armed
    if config_from_args(args).granularity == "step":
        arm_steps(compute_steps_from_rollout(framework, args, rollout_data, groups=groups))
        return armed()
    return arm(compute_from_rollout(framework, args, rollout_data, groups=groups))


def compute_from_rollout(
    framework: Framework, args: Any, rollout_data: dict, *, groups: Groups | None = None
) -> EssLrResult:
    """This rollout's result, identical on every rank of the actor (arms nothing).

    ``groups``: the process groups (default: ``framework.groups()``)."""
    return _on_every_rank(framework, args, rollout_data, groups, per_step=False)


def compute_steps_from_rollout(
    framework: Framework, args: Any, rollout_data: dict, *, groups: Groups | None = None
) -> list[EssLrResult]:
    """Granularity "step": one result per optimizer step of this rollout, over the samples
    ``framework.step_samples`` says that step trains on; identical on every rank.

    ``groups``: the process groups (default: ``framework.groups()``)."""
    if framework.step_samples is None:
        raise ValueError(f"granularity 'step' is not supported with {framework.name}")
    return _on_every_rank(framework, args, rollout_data, groups, per_step=True)


def _on_every_rank(
    framework: Framework, args: Any, rollout_data: dict, groups: Groups | None, *, per_step: bool
) -> Any:
    """Compute on the last pipeline stage, then broadcast: a failure there (or anywhere in
    the CP/DP collectives) reaches every stage instead of leaving it waiting."""
    # Imported here: install() (run at start-up by the auto-install) must not import torch.
    from ..compute import compute_ess_lr, compute_ess_lr_steps
    from ..reduction import broadcast_from_last_stage, broadcast_steps_from_last_stage

    groups = framework.groups() if groups is None else groups
    config = config_from_args(args)
    inputs = [rollout_data.get(k) for k in ("log_probs", "rollout_log_probs", "loss_masks")]
    options = {
        "config": config,
        "cp_group": groups.cp_group,
        "dp_group": groups.dp_group,
        "prepare_masks": _mask_preparer(groups, args, rollout_data),
    }
    out = None
    error: BaseException | None = None
    try:
        if groups.is_pp_last and per_step:
            split = framework.step_samples
            dp_size = _group_size(groups.dp_group)
            # the split runs inside, so that a failure to split reaches every rank
            steps = lambda: split(args, rollout_data, dp_size)  # noqa: E731
            out = compute_ess_lr_steps(*inputs, steps, **options)
        elif groups.is_pp_last:
            out = compute_ess_lr(*inputs, **options)
    except Exception as exc:
        error = exc  # the other pipeline stages learn of it through the broadcast
    broadcast = broadcast_steps_from_last_stage if per_step else broadcast_from_last_stage
    out = broadcast(out, groups.pp_group, config=config, error=error)
    if any(r.status == "missing" for r in (out if per_step else [out])):
        _warn_missing(framework, rollout_data)
    return out


def _group_size(group: Any) -> int:
    import torch.distributed as dist

    return 1 if group is None else dist.get_world_size(group)


def _mask_preparer(groups: Groups, args: Any, rollout_data: dict) -> Callable[[Any], list] | None:
    """Under CP: slice the full-length loss masks to this CP rank's tokens."""
    from ..cp_slicing import local_response_masks

    if groups.cp_size <= 1:
        return None

    def prepare(masks: Any) -> list:
        # Raised here, a fault reaches every rank through the collectives.
        lengths = [rollout_data.get(k) for k in ("total_lengths", "response_lengths")]
        if None in lengths:
            raise ValueError(
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

    return prepare


def _warn_missing(framework: Framework, rollout_data: dict) -> None:
    logger.warning(
        "ess-patch (%s): this rollout has no %s on some rank; ESS-LR is a no-op for it",
        framework.name,
        "train log-probs" if rollout_data.get("log_probs") is None else "rollout log-probs",
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


def ess_metrics() -> dict[str, float]:
    """The armed result's metrics (keys without ``train/``), else shadow mode's (its would-be
    scale as ``ess_lr_shadow_scale``, never ``lr_scale``), else {}."""
    result = armed()
    if result is not None:
        return result.metrics()
    if STATE.shadow is None:
        return {}
    metrics = STATE.shadow.metrics()
    metrics["ess_lr_shadow_scale"] = metrics.pop("lr_scale")
    return metrics
