"""verl: how ESS-LR is configured there (no argument parser): ``ESS_LR_*`` variables and
VCPO's ``actor.ess_scaling`` keys, read per update by :func:`settings`; and the wrapper of
``omega_conf_to_dataclass`` that lets verl's checked actor config carry VCPO's node."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ...config import EssLrConfig
from ...errors import EssPatchValueError
from ...state import STATE
from ..binding import bind, call_with
from .baseline_config import FALSE, baseline_node, flag, refuse_unknown

__all__ = [
    "VCPO_KEYS",
    "VerlSettings",
    "config_wrapper",
    "enable_requested",
    "settings",
    "vcpo_scaling",
]

logger = logging.getLogger(__name__)

#: ``ESS_LR_ENABLE=1``: ESS-LR on for verl's actor (verl has no argument parser to add a flag to)
ENV_ENABLE = "ESS_LR_ENABLE"
ENV_GRANULARITY = "ESS_LR_GRANULARITY"
ENV_WEIGHT_MODE = "ESS_LR_WEIGHT_MODE"
#: VCPO's ``actor.ess_scaling`` keys (mit-han-lab/vcpo), plus the clip threshold, which VCPO
#: reads from the algorithm config that verl's actor worker never sees
VCPO_KEYS = ("enable", "scaling_rule", "base_ess_ratio", "use_clipped", "rollout_is_threshold")


# --- settings ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerlSettings:
    """What ESS-LR does in one ``update_policy`` call."""

    enabled: bool  # arm the scale (False: shadow mode, logs only)
    config: EssLrConfig


def _plain(node: Any) -> Any:
    """An OmegaConf node (or anything mapping-like) as plain Python containers."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(node, DictConfig | ListConfig):
            return OmegaConf.to_container(node, resolve=True)
    except ImportError:  # verl always has omegaconf; a plain dict needs nothing
        pass
    return dict(node) if isinstance(node, Mapping) else node


def enable_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``ESS_LR_ENABLE`` asks for ESS-LR in this process (a bad value counts: the
    hooks refuse it by name anyway)."""
    env = os.environ if environ is None else environ
    return env.get(ENV_ENABLE, "").strip().lower() not in FALSE


def vcpo_scaling(actor_config: Any) -> dict[str, Any] | None:
    """VCPO's ``ess_scaling`` node of the actor config (attribute, or key of a mapping)."""
    node = getattr(actor_config, "ess_scaling", None)
    if node is None and isinstance(actor_config, Mapping):
        node = actor_config.get("ess_scaling")
    if node is None:
        return None
    scaling = _plain(node)
    if not isinstance(scaling, dict):
        raise EssPatchValueError(f"actor.ess_scaling must be a mapping of {', '.join(VCPO_KEYS)}")
    refuse_unknown(scaling, "actor.ess_scaling", VCPO_KEYS)
    return scaling


def settings(actor_config: Any, environ: Mapping[str, str] | None = None) -> VerlSettings | None:
    """ESS-LR's settings for this actor, or None when it is off (then nothing is touched).

    On with ``ESS_LR_ENABLE=1`` or VCPO's ``actor.ess_scaling.enable: true``; shadow mode with
    ``ESS_LR_SHADOW=1``. The estimator settings are ``install()``'s config (``ESS_LR_*``), with
    verl's granularity default "step" (one ESS per optimizer step, VCPO's) unless
    ``ESS_LR_GRANULARITY`` is set. VCPO's keys set, for the fields they name: ``scaling_rule``
    -> rule, ``base_ess_ratio`` -> base_ratio, ``use_clipped`` -> weight_clip (the threshold
    from ``ess_scaling.rollout_is_threshold`` or ``ESS_LR_WEIGHT_CLIP``), and VCPO's
    sequence-product weights unless ``ESS_LR_WEIGHT_MODE`` is set.

    Raises:
        ValueError: a bad value or unknown key (named), enable and shadow both on, or
            ``use_clipped`` without a threshold.
    """
    env = os.environ if environ is None else environ
    base = STATE.config if STATE.config is not None else EssLrConfig.from_env(env)
    scaling = vcpo_scaling(actor_config)
    enabled = flag(ENV_ENABLE, env.get(ENV_ENABLE, ""))
    if scaling is not None and "enable" in scaling:
        enabled = enabled or flag("actor.ess_scaling.enable", scaling["enable"])
    if not (enabled or base.shadow):
        return None
    if enabled and base.shadow:
        raise EssPatchValueError(
            "ESS-LR is enabled (ESS_LR_ENABLE or actor.ess_scaling.enable) and shadow mode "
            "(ESS_LR_SHADOW) is on: shadow mode never changes an LR. Keep one of them (verl)"
        )
    changes: dict[str, Any] = {}
    if not env.get(ENV_GRANULARITY):
        changes["granularity"] = "step"
    if scaling is not None:
        if not env.get(ENV_WEIGHT_MODE):
            changes["weight_mode"] = "product"
        if "scaling_rule" in scaling:
            changes["rule"] = scaling["scaling_rule"]
        if "base_ess_ratio" in scaling:
            changes["base_ratio"] = scaling["base_ess_ratio"]
        if flag("actor.ess_scaling.use_clipped", scaling.get("use_clipped", False)):
            clip = scaling.get("rollout_is_threshold", base.weight_clip)
            if clip is None:
                raise EssPatchValueError(
                    "actor.ess_scaling.use_clipped is true but no threshold is known: verl's "
                    "actor never sees algorithm.rollout_correction.rollout_is_threshold. Set "
                    "actor.ess_scaling.rollout_is_threshold or ESS_LR_WEIGHT_CLIP to it"
                )
            changes["weight_clip"] = clip
        elif "use_clipped" in scaling:
            changes["weight_clip"] = None
    config = replace(base, **changes) if changes else base
    return VerlSettings(enabled=enabled, config=config)


# --- VCPO's config keys ------------------------------------------------------------------------


#: the actor-config nodes of VCPO's fork that verl's own dataclass lacks: ``ess_scaling``
#: (ESS-LR) and ``grad_baselining`` (the baseline, ``verl.baseline_config``)
VCPO_NODES = ("ess_scaling", "grad_baselining")


def config_wrapper(wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict) -> Any:
    """``omega_conf_to_dataclass(config, ...)``: VCPO's ``ess_scaling`` and ``grad_baselining``
    nodes are taken out of the actor's node before verl checks it against its dataclass
    (unknown keys fail there), then put back, and set on the dataclass as attributes of the
    same names (plain dicts)."""
    call = bind(wrapped, args, kwargs)
    node = None if call is None else call.arguments.get("config")
    if not isinstance(node, Mapping):
        return wrapped(*args, **kwargs)
    present = [key for key in VCPO_NODES if key in node]
    if not present:
        return wrapped(*args, **kwargs)
    carried: dict[str, Any] = {}
    if "ess_scaling" in present:
        carried["ess_scaling"] = vcpo_scaling(node)
    if "grad_baselining" in present:
        carried["grad_baselining"] = baseline_node(node)
    out = _without_keys(wrapped, call, node, present)
    for key, value in carried.items():
        try:
            object.__setattr__(out, key, value)
        except (AttributeError, TypeError):  # a slotted or builtin result: nothing to carry it
            logger.warning("ess-patch (verl): cannot keep %s on %s", key, type(out).__name__)
    return out


def _without_keys(wrapped: Callable[..., Any], call: Any, node: Any, keys: list[str]) -> Any:
    """Call with ``node`` lacking ``keys``; a DictConfig is changed in place (so that its
    interpolations still resolve against its root) and always restored."""
    try:
        from omegaconf import DictConfig, open_dict
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        DictConfig = ()  # type: ignore[assignment]
    if not isinstance(node, DictConfig):
        return call_with(wrapped, call, config={k: v for k, v in node.items() if k not in keys})
    saved = {key: node._get_node(key) for key in keys}
    with open_dict(node):
        for key in keys:
            del node[key]
    try:
        return call_with(wrapped, call, config=node)
    finally:
        with open_dict(node):
            for key, value in saved.items():
                node[key] = value
