"""ess-patch: ESS-guided learning-rate scaling for off-policy RL on Megatron.

Public surface (see README.md)::

    import ess_patch
    ess_patch.install()                     # patch Megatron optimizers (and miles/slime)
    result = ess_patch.compute_ess_lr(log_probs, rollout_log_probs, loss_masks,
                                      cp_group=cp, dp_group=dp)
    ess_patch.arm(result)                   # every optimizer step of this rollout uses it
"""

from __future__ import annotations

from .attach import attach, detach
from .compute import compute_ess_lr
from .config import EssLrConfig
from .estimator import NonFiniteLogProbError
from .install import install, installed_targets, is_installed, uninstall
from .lr import scaled_lr
from .patching import MissingTargetError
from .reduction import broadcast_from_last_stage
from .result import EssLrResult
from .state import arm, armed, disarm, exclude, set_role

__version__ = "0.1.0"

__all__ = [
    "EssLrConfig",
    "EssLrResult",
    "MissingTargetError",
    "NonFiniteLogProbError",
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
