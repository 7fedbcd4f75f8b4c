"""megatron-core optimizers: wrap every class that defines ``step`` / ``step_with_ready_grads``.

megatron-core 0.16.1 facts this relies on:
- ``step`` is defined on MixedPrecisionOptimizer (Float16OptimizerWithFloat16Params and
  DistributedOptimizer inherit it), FP32Optimizer and ChainedOptimizer; the update itself
  happens in ``step_with_ready_grads``, which DistributedOptimizer overrides (calling
  ``super()``) and ChainedOptimizer calls on each child (never the child's ``step``).
- LayerWiseDistributedOptimizer (a ChainedOptimizer) overrides ``step`` and calls ``super()``.
- ChainedOptimizer.param_groups is a fresh list of the children's shared dicts.
A skipped step returns ``(False, None, None)`` before any update; the LR context restores
the LRs in every case, before the caller's scheduler runs.

And the checkpoint (``ess_patch.checkpoint``): ``state_dict`` / ``sharded_state_dict`` /
``load_state_dict`` of the classes that define them (Float16OptimizerWithFloat16Params,
FP32Optimizer, DistributedOptimizer; ChainedOptimizer delegates to its children) carry the
``calibrate_rollouts`` calibration, so a job resumed from its checkpoint keeps its ratio.
"""

from __future__ import annotations

from ..checkpoint import load_state_dict_wrapper, state_dict_wrapper
from ..lr import step_wrapper
from ..patching import Target
from . import Integration

_OPT = "megatron.core.optimizer.optimizer"
_DIST = "megatron.core.optimizer.distrib_optimizer"
_LAYER = "megatron.core.optimizer.layer_wise_optimizer"
_METHODS = ("step", "step_with_ready_grads")


def _checkpoint_targets() -> tuple[Target, ...]:
    """The leaf optimizers' state dicts (optional: a class that inherits one is skipped)."""
    classes = [
        (_OPT, "Float16OptimizerWithFloat16Params"),
        (_OPT, "FP32Optimizer"),
        (_DIST, "DistributedOptimizer"),
    ]
    methods = {
        "state_dict": state_dict_wrapper,
        "sharded_state_dict": state_dict_wrapper,
        "load_state_dict": load_state_dict_wrapper,
    }
    return tuple(
        # install() only: the patches/ series decorate the optimizer steps, not these (a
        # vendored tree keeps its calibration across a resume when install() runs too)
        Target(module, owner, method, wrapper, required=False, vendored=False)
        for module, owner in classes
        for method, wrapper in methods.items()
    )


def _targets() -> tuple[Target, ...]:
    required = {
        ("MixedPrecisionOptimizer", "step"),
        ("FP32Optimizer", "step"),
        ("ChainedOptimizer", "step"),
        ("MixedPrecisionOptimizer", "step_with_ready_grads"),
        ("FP32Optimizer", "step_with_ready_grads"),
    }
    classes = [
        (_OPT, "MixedPrecisionOptimizer"),
        (_OPT, "Float16OptimizerWithFloat16Params"),
        (_OPT, "FP32Optimizer"),
        (_OPT, "ChainedOptimizer"),
        (_DIST, "DistributedOptimizer"),
        (_LAYER, "LayerWiseDistributedOptimizer"),
    ]
    return tuple(
        Target(
            module,
            owner,
            method,
            step_wrapper,
            required=(owner, method) in required,
            decorator="optimizer_step",
        )
        for module, owner in classes
        for method in _METHODS
    )


MEGATRON = Integration(
    name="megatron",
    distribution="megatron-core",
    supported=">=0.14,<0.20",
    targets=_targets() + _checkpoint_targets(),
)
