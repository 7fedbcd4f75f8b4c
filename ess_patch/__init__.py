"""ess-patch: ESS-guided learning-rate scaling for off-policy RL on Megatron.

Public surface (see README.md)::

    import ess_patch
    ess_patch.install()                     # patch Megatron optimizers (and miles/slime)
    # on every rank; non-last pipeline stages pass None for the log-probs and masks
    result = ess_patch.compute_ess_lr(log_probs, rollout_log_probs, loss_masks,
                                      cp_group=cp, dp_group=dp, pp_group=pp)
    ess_patch.arm(result)                   # every optimizer step of this rollout uses it

VCPO's other half, the minimum-variance baseline: ``ess_patch.min_variance_baseline`` and
``ess_patch.PerTrajectoryGrads`` (docs/baseline.md).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from .attach import attach, detach
from .config import EssLrConfig
from .guard import EssLrNotAppliedError, arm
from .install import install, installed_targets, is_installed, uninstall
from .lr import scaled_lr
from .patching import MissingTargetError
from .removed import removed_name
from .result import EssLrResult
from .state import StepCountError, armed, disarm, exclude, set_role

if TYPE_CHECKING:
    from .baseline import BaselineResult, NonFiniteBaselineInputError, min_variance_baseline
    from .compute import compute_ess_lr
    from .estimator import InvalidInputsElsewhereError, NonFiniteLogProbError
    from .per_trajectory import PerTrajectoryGrads, UnsupportedModuleError
    from .reduction import ConfigMismatchError, broadcast_from_last_stage

# The names that need torch are imported on first use, so that `import ess_patch` and
# install() stay cheap (the auto-install runs them in every process of a job).
_LAZY = {
    "compute_ess_lr": "compute",
    "NonFiniteLogProbError": "estimator",
    "InvalidInputsElsewhereError": "estimator",
    "ConfigMismatchError": "reduction",
    "broadcast_from_last_stage": "reduction",
    "min_variance_baseline": "baseline",
    "BaselineResult": "baseline",
    "NonFiniteBaselineInputError": "baseline",
    "PerTrajectoryGrads": "per_trajectory",
    "UnsupportedModuleError": "per_trajectory",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    error = removed_name(sys.modules[__name__], name)
    if error is not None:  # a name removed since 0.1.0: say what replaces it
        raise error
    raise AttributeError(f"module 'ess_patch' has no attribute {name!r}")


__version__ = "0.4.0"

__all__ = [
    "BaselineResult",
    "ConfigMismatchError",
    "EssLrConfig",
    "EssLrNotAppliedError",
    "EssLrResult",
    "InvalidInputsElsewhereError",
    "MissingTargetError",
    "NonFiniteBaselineInputError",
    "NonFiniteLogProbError",
    "PerTrajectoryGrads",
    "StepCountError",
    "UnsupportedModuleError",
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
    "min_variance_baseline",
    "scaled_lr",
    "set_role",
    "uninstall",
]
