"""ess-patch: ESS-guided learning-rate scaling for off-policy RL on Megatron.

Public surface (see README.md)::

    import ess_patch
    ess_patch.install()                     # patch Megatron optimizers (and miles/slime)
    # on every rank; non-last pipeline stages pass None for the log-probs and masks
    result = ess_patch.compute_ess_lr(log_probs, rollout_log_probs, loss_masks,
                                      cp_group=cp, dp_group=dp, pp_group=pp)
    ess_patch.arm(result)                   # every optimizer step of this rollout uses it
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .attach import attach, detach
from .config import EssLrConfig
from .install import install, installed_targets, is_installed, uninstall
from .lr import scaled_lr
from .patching import MissingTargetError
from .result import EssLrResult
from .state import StepCountError, arm, armed, disarm, exclude, set_role

if TYPE_CHECKING:
    from .compute import compute_ess_lr
    from .estimator import InvalidInputsElsewhereError, NonFiniteLogProbError
    from .reduction import ConfigMismatchError, broadcast_from_last_stage

# The names that need torch are imported on first use, so that `import ess_patch` and
# install() stay cheap (the auto-install runs them in every process of a job).
_LAZY = {
    "compute_ess_lr": "compute",
    "NonFiniteLogProbError": "estimator",
    "InvalidInputsElsewhereError": "estimator",
    "ConfigMismatchError": "reduction",
    "broadcast_from_last_stage": "reduction",
}

# Removed in 0.2.0: one granularity path (a rollout is one step that holds every trajectory).
_PER_STEP = (
    "call ess_patch.compute_ess_lr once per optimizer step, over the samples that step trains "
    "on, and ess_patch.arm(result) before that step (README: 'Per optimizer step')"
)
_REMOVED = {
    "compute_ess_lr_steps": _PER_STEP,
    "arm_steps": _PER_STEP,
    "armed_steps": "ess_patch.armed() is the result the coming optimizer step uses",
    "broadcast_steps_from_last_stage": (
        "pass pp_group to ess_patch.compute_ess_lr, once per optimizer step"
    ),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _REMOVED:
        raise AttributeError(
            f"ess_patch.{name} was removed in ess-patch 0.2.0 (one granularity path): "
            f"{_REMOVED[name]}"
        )
    raise AttributeError(f"module 'ess_patch' has no attribute {name!r}")


__version__ = "0.2.0"

__all__ = [
    "ConfigMismatchError",
    "EssLrConfig",
    "EssLrResult",
    "InvalidInputsElsewhereError",
    "MissingTargetError",
    "NonFiniteLogProbError",
    "StepCountError",
    "__version__",
    "arm",
    "armed",
    "attach",
    "broadcast_from_last_stage",
    "compute_ess_lr",
    "detach",
    "disarm",
    "exclude",
    "install",
    "installed_targets",
    "is_installed",
    "scaled_lr",
    "set_role",
    "uninstall",
]
