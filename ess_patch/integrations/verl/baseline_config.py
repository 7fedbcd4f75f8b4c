"""verl: how VCPO's minimum-variance baseline is asked for there (no torch: install() imports
this), and the refusal of every verl path that cannot apply it.

Two ways to ask, either one enough (verl has no argument parser to add a flag to):

- the environment, as in miles and slime: ``ESS_LR_BASELINE=1`` (apply),
  ``ESS_LR_BASELINE_SHADOW=1`` (compute and log only), ``ESS_LR_BASELINE_PATH`` (``rules``,
  ``exact`` or ``proxy``); verl's driver hands every ``ESS_LR_*`` to its Ray actors
  (``verl.driver.worker_env``);
- VCPO's own actor key ``actor.grad_baselining`` (mit-han-lab/vcpo ``GradBaselineConfig``,
  beside its ``ess_scaling``): ``enable``, and ess-patch's ``shadow`` and ``path``. VCPO's other
  keys are taken where ess-patch does what they ask (``scope: group``, ``agg_mode: mean``,
  ``use_is_weights``; ``use_clipped_is_ratios`` and ``normalize_by_length`` false) and
  refused by name otherwise; ``norm_by_std`` is refused: the advantage keeps verl's own std
  (``algorithm.norm_adv_by_std_in_grpo``), which the actor cannot see.

Off unless asked: :func:`baseline_settings` returns None and nothing is touched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import EssPatchValueError, FailClosedNotImplementedError
from ..baseline_flags import ENV_ON, ENV_PATH, ENV_SHADOW, PATHS, baseline_mode, baseline_path

__all__ = [
    "BASELINE_KEY",
    "BASELINE_KEYS",
    "FALSE",
    "SUPPORTED_BASELINE",
    "TRUE",
    "BaselineSettings",
    "baseline_node",
    "baseline_requested",
    "baseline_settings",
    "flag",
    "refuse_baseline",
    "refuse_unknown",
]

#: VCPO's actor config key for its baseline (``actor_rollout_ref.actor.grad_baselining``)
BASELINE_KEY = "grad_baselining"
#: VCPO's keys (``GradBaselineConfig``) and ess-patch's own two
BASELINE_KEYS = (
    "enable",
    "scope",
    "agg_mode",
    "use_is_weights",
    "use_clipped_is_ratios",
    "normalize_by_length",
    "norm_by_std",
    "shadow",
    "path",
)
#: where verl gets the baseline (every other path refuses it by name)
SUPPORTED_BASELINE = (
    "verl's Megatron actor on either path: the engine path (ActorRolloutRefWorker.update_actor "
    "-> TrainingWorker.train_batch, verl v0.7.0 to main; from v0.8.0 the only one) or the legacy "
    "actor (MegatronPPOActor.update_policy, verl v0.6.0 to v0.7.x), with "
    "context_parallel_size=1 and one model chunk (no virtual pipeline), "
    "and GRPO-style advantages (algorithm.adv_estimator grpo: one value per trajectory, "
    "group mean zero)"
)

#: the spellings of a bool setting (``ESS_LR_ENABLE``, VCPO's keys): ``verl.config`` reads them too
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
#: VCPO's values ess-patch applies as VCPO does; anything else is refused by name
_ONLY = {"scope": "group", "agg_mode": "mean"}
_MUST_BE_FALSE = {
    "use_clipped_is_ratios": "the norms take the unclipped IS weights",
    "normalize_by_length": "VCPO's 1/L^2 length normalisation is not implemented",
}


@dataclass(frozen=True)
class BaselineSettings:
    """What the baseline does in one actor update."""

    #: ``"on"`` (the advantages get ``A - b*``) or ``"shadow"`` (computed and logged only)
    mode: str
    #: the norm pass's path: ``"rules"``, ``"exact"`` or ``"proxy"``
    path: str
    #: whether the norms carry the IS weights (VCPO's ``use_is_weights``, default true)
    use_is_weights: bool
    #: the setting that asked for it, for messages (``ESS_LR_BASELINE=1``, ...)
    source: str


def flag(name: str, value: Any) -> bool:
    """A bool setting: a bool, or one of :data:`TRUE` / :data:`FALSE` (any case, spaces
    around); anything else is refused, naming ``name``."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE or text in FALSE:
        return text in TRUE
    raise EssPatchValueError(f"{name}={value!r} must be a bool: 1/0/true/false")


def baseline_node(actor_config: Any) -> dict[str, Any] | None:
    """``actor.grad_baselining`` as a plain dict (attribute, key of a mapping, a DictConfig or
    VCPO's dataclass), or None."""
    node = getattr(actor_config, BASELINE_KEY, None)
    if node is None and isinstance(actor_config, Mapping):
        node = actor_config.get(BASELINE_KEY)
    if node is None:
        return None
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(node, DictConfig):
            node = OmegaConf.to_container(node, resolve=True)
    except ImportError:  # verl always has omegaconf; a plain dict needs nothing
        pass
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        node = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
        node.pop("_target_", None)
    if isinstance(node, Mapping):
        node = {k: v for k, v in node.items() if k != "_target_"}
    if not isinstance(node, dict):
        raise EssPatchValueError(
            f"actor.{BASELINE_KEY} must be a mapping of {', '.join(BASELINE_KEYS)}; got "
            f"{type(node).__name__}"
        )
    refuse_unknown(node, f"actor.{BASELINE_KEY}", BASELINE_KEYS)
    return node


def refuse_unknown(node: Mapping[str, Any], name: str, keys: tuple[str, ...]) -> None:
    """Refuse a key of the node ``name`` that is not one of ``keys``, naming those it reads."""
    unknown = sorted(set(node) - set(keys))
    if unknown:
        raise EssPatchValueError(
            f"{name} has unknown key(s) {', '.join(unknown)}; ess-patch reads {', '.join(keys)}"
        )


def _check_vcpo_values(node: dict[str, Any]) -> None:
    """VCPO's keys whose values ess-patch does not do: refused by name."""
    problems = []
    for key, value in _ONLY.items():
        if key in node and node[key] != value:
            problems.append(f"{key}={node[key]!r} (only {value!r})")
    for key, why in _MUST_BE_FALSE.items():
        if key in node and flag(f"actor.{BASELINE_KEY}.{key}", node[key]):
            problems.append(f"{key}=true ({why})")
    if "norm_by_std" in node:
        problems.append(
            "norm_by_std (the advantage keeps verl's own std: set "
            "algorithm.norm_adv_by_std_in_grpo instead, which the actor cannot see)"
        )
    if problems:
        raise EssPatchValueError(
            f"ess-patch (verl): actor.{BASELINE_KEY} asks for what the baseline does not do: "
            + "; ".join(problems)
            + f". Drop or change those keys (ess-patch reads {', '.join(BASELINE_KEYS)})"
        )


def baseline_settings(actor_config: Any) -> BaselineSettings | None:
    """The baseline's settings for this actor, or None when it is off (nothing is touched).

    On with ``ESS_LR_BASELINE=1`` or ``actor.grad_baselining.enable``; shadow with
    ``ESS_LR_BASELINE_SHADOW=1`` or ``actor.grad_baselining.shadow``; the path from
    ``actor.grad_baselining.path``, else ``ESS_LR_BASELINE_PATH``, else ``rules``.

    Raises:
        ValueError: a bad value or an unknown key (named), on and shadow both asked for, or a
            VCPO value ess-patch does not do.
    """
    node = baseline_node(actor_config) or {}
    env_mode = baseline_mode(None)  # the ESS_LR_BASELINE* variables
    on = env_mode == "on" or flag(f"actor.{BASELINE_KEY}.enable", node.get("enable", False))
    shadow = env_mode == "shadow" or flag(f"actor.{BASELINE_KEY}.shadow", node.get("shadow", False))
    if not (on or shadow):
        return None
    if on and shadow:
        raise EssPatchValueError(
            f"ess-patch (verl): the baseline is both on ({ENV_ON} or actor.{BASELINE_KEY}."
            f"enable) and in shadow mode ({ENV_SHADOW} or actor.{BASELINE_KEY}.shadow): shadow "
            "mode never changes an advantage. Keep one of them"
        )
    _check_vcpo_values(node)
    path = node.get("path") or baseline_path(None)
    if path not in PATHS:
        raise EssPatchValueError(
            f"actor.{BASELINE_KEY}.path={path!r} (or {ENV_PATH}): give one of {PATHS}"
        )
    if on:
        source = f"{ENV_ON}=1" if env_mode == "on" else f"actor.{BASELINE_KEY}.enable"
    else:
        source = f"{ENV_SHADOW}=1" if env_mode == "shadow" else f"actor.{BASELINE_KEY}.shadow"
    return BaselineSettings(
        mode="on" if on else "shadow",
        path=path,
        use_is_weights=flag(
            f"actor.{BASELINE_KEY}.use_is_weights", node.get("use_is_weights", True)
        ),
        source=source,
    )


def baseline_requested(actor_config: Any = None) -> bool:
    """Whether the baseline is asked for (a bad value counts: the hooks refuse it by name)."""
    try:
        return baseline_settings(actor_config) is not None
    except EssPatchValueError:
        return True


def refuse_baseline(actor_config: Any, where: str, fix: str = "") -> None:
    """Stop the update, by name, when the baseline is asked for on ``where`` (a verl path or
    setting it cannot serve); nothing has run yet. Off: returns.

    Raises:
        FailClosedNotImplementedError: the baseline is asked for (or its settings are bad:
            their own ``EssPatchValueError``).
    """
    chosen = baseline_settings(actor_config)
    if chosen is None:
        return
    raise FailClosedNotImplementedError(
        f"ess-patch (verl): VCPO's baseline was requested ({chosen.source}) but {where}, so "
        "the advantages would keep the group mean. Supported: "
        f"{SUPPORTED_BASELINE}. {fix or 'Use that path'}, or turn the baseline off "
        f"({ENV_ON}, {ENV_SHADOW}, actor.{BASELINE_KEY}.enable / .shadow)"
    )
