"""``--use-ess-baseline``'s settings (no torch: install() imports this), the train-actor hook
that lends the model, and the metrics. What the baseline does to a rollout: ``baseline_hook``."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from ..errors import EssPatchValueError
from ..state import STATE

__all__ = [
    "ESTIMATORS",
    "PATHS",
    "add_baseline_arguments",
    "baseline_metrics",
    "baseline_mode",
    "baseline_path",
    "parallel_problems",
    "train_actor_wrapper",
    "validate_baseline",
]

#: The norm pass's paths (``ess_patch.norm_pass.PATHS``; a test keeps them equal) and the
#: forward-only proxy (``ess_patch.proxy``).
PATHS = ("rules", "exact", "proxy")

logger = logging.getLogger(__name__)

#: The estimators whose baseline is the group mean of the rewards ``rollout_data`` carries.
ESTIMATORS = ("grpo", "gspo", "cispo")

ENV_ON, ENV_SHADOW, ENV_PATH = "ESS_LR_BASELINE", "ESS_LR_BASELINE_SHADOW", "ESS_LR_BASELINE_PATH"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def add_baseline_arguments(parser: argparse.ArgumentParser) -> None:
    """``--use-ess-baseline``, ``--ess-baseline-shadow``, ``--ess-baseline-path`` (each only if
    the parser lacks it)."""
    known = parser._option_string_actions
    options = [
        (
            "--use-ess-baseline",
            dict(
                action=argparse.BooleanOptionalAction,
                default=None,
                help="VCPO's minimum-variance baseline replaces the group mean of the "
                f"advantage (with or without --use-ess-lr; env {ENV_ON})",
            ),
        ),
        (
            "--ess-baseline-shadow",
            dict(
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"compute and log b* without applying it (env {ENV_SHADOW})",
            ),
        ),
        (
            "--ess-baseline-path",
            dict(
                choices=PATHS,
                default=None,
                help="how the norm pass gets per-sample gradient norms: 'rules' (one backward, "
                "default), 'exact' (one backward per sample) or 'proxy' (one forward, the "
                f"logits-only estimate of verl's Optimal Token Baseline; env {ENV_PATH})",
            ),
        ),
    ]
    missing = [(flag, kw) for flag, kw in options if flag not in known]
    if missing:
        group = parser.add_argument_group("VCPO baseline (ess-patch)")
        for flag, kw in missing:
            group.add_argument(flag, **kw)


def _env_bool(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise EssPatchValueError(f"{name}={os.environ[name]!r}: give 1 or 0")


def baseline_mode(args: Any) -> str | None:
    """``"on"``, ``"shadow"`` or None (off): the flags where given, else the environment."""
    on = getattr(args, "use_ess_baseline", None)
    shadow = getattr(args, "ess_baseline_shadow", None)
    on = _env_bool(ENV_ON) if on is None else bool(on)
    shadow = _env_bool(ENV_SHADOW) if shadow is None else bool(shadow)
    if on and shadow:
        raise EssPatchValueError(
            "--use-ess-baseline and --ess-baseline-shadow (or their ESS_LR_BASELINE* variables) "
            "are both on: shadow mode never changes an advantage. Keep one of them"
        )
    return "on" if on else ("shadow" if shadow else None)


def baseline_path(args: Any) -> str:
    path = getattr(args, "ess_baseline_path", None) or os.environ.get(ENV_PATH) or "rules"
    if path not in PATHS:
        raise EssPatchValueError(f"{ENV_PATH}={path!r}: give one of {PATHS}")
    return path


def validate_baseline(framework: str, args: Any) -> None:
    """Refuse, at parse time and by name, the runs the baseline cannot serve."""
    mode = baseline_mode(args)
    if mode is None:
        return
    baseline_path(args)
    flag = "--use-ess-baseline" if mode == "on" else "--ess-baseline-shadow"
    problems = []
    estimator = getattr(args, "advantage_estimator", None)
    if estimator not in ESTIMATORS:
        problems.append(
            f"--advantage-estimator {estimator} (its baseline is not the group mean; "
            f"supported: {', '.join(ESTIMATORS)})"
        )
    if getattr(args, "rewards_normalization", True) is False:
        problems.append("--disable-rewards-normalization (there is no group mean to replace)")
    if (getattr(args, "n_samples_per_prompt", 1) or 1) < 2:
        problems.append("--n-samples-per-prompt below 2 (a group of one has no baseline)")
    problems.extend(parallel_problems(args))
    backend = getattr(args, "train_backend", "megatron")
    if backend not in (None, "megatron"):
        problems.append(f"--train-backend {backend} (the norm pass runs on the Megatron actor)")
    if getattr(args, "custom_advantage_function_path", None):
        problems.append("--custom-advantage-function-path (it may not read the rewards)")
    if problems:
        raise EssPatchValueError(
            f"{flag} is not supported with " + "; ".join(problems) + f" ({framework}). "
            f"Drop {flag} or change that setting"
        )


def parallel_problems(args: Any) -> list[str]:
    """The model-parallel settings the norm pass cannot serve (miles, slime, Megatron-RL: the
    same Megatron flags), each as a problem for the refusal's message."""
    problems = []
    # pipeline stages run the pass together (ess_patch.pipeline_pass): served
    if (getattr(args, "context_parallel_size", 1) or 1) > 1:
        problems.append(
            f"--context-parallel-size {args.context_parallel_size} (the norm pass runs on "
            "whole sequences)"
        )
    if getattr(args, "virtual_pipeline_model_parallel_size", None):
        problems.append("--virtual-pipeline-model-parallel-size (one model chunk only)")
    return problems


# --- the model the norm pass runs ------------------------------------------------------------


def train_actor_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``MegatronTrainRayActor.train_actor``: lend ``self.model`` to the advantage hook."""
    if baseline_mode(getattr(instance, "args", None)) is None:
        return wrapped(*args, **kwargs)
    previous = STATE.baseline_model
    STATE.baseline_model = getattr(instance, "model", None)
    try:
        return wrapped(*args, **kwargs)
    finally:
        STATE.baseline_model = previous


def baseline_metrics() -> dict[str, float]:
    """The last rollout's baseline metrics (keys without ``train/``), or {}."""
    record = STATE.baseline
    return {} if record is None else dict(record["metrics"])
