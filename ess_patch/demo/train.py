"""Moved to :mod:`ess_patch.demo.trainer` (0.5, issue 40): this name stays an alias.

The trainer is split by job: :mod:`~ess_patch.demo.trainer.config` (``DemoConfig``, its
validation, the arms), :mod:`~ess_patch.demo.trainer.model` (the layout, the model stage and
its optimizer, the published weights), :mod:`~ess_patch.demo.trainer.sampling` (the
workers' staleness, a step's rollout), :mod:`~ess_patch.demo.trainer.loss` (the loss, the
micro-batches, megatron's forward/backward), :mod:`~ess_patch.demo.trainer.record` (a step's
record) and :mod:`~ess_patch.demo.trainer.loop` (``run_rank``, an arm's loop). Every name this
module had is imported here from its new home, the private ones under their old names.
"""

# An alias module: its imports are its contents.
# ruff: noqa: F401

from __future__ import annotations

from .trainer.config import (
    ARMS,
    BASELINE_ARMS,
    DEFAULT_ARMS,
    DEVICES,
    HEADS,
    LOSSES,
    MAX_LOG_RATIO,
    MAX_RESPONSE,
    MIN_RESPONSE,
    PROXY_ARMS,
    STALENESS,
    VCPO_FLOOR,
    DemoConfig,
    DemoConfigError,
)
from .trainer.loop import (
    _arm_step,
    _baseline_glue,
    _lr_recorder,
    _optimizer_step,
    _shim,
    _tape,
    _teardown,
    _train_arm,
    run_rank,
)
from .trainer.loss import forward_backward as _forward_backward
from .trainer.loss import forward_step as _forward_step
from .trainer.loss import micro_batches as _micro_batches
from .trainer.loss import policy_loss as _loss
from .trainer.model import Layout as _Layout
from .trainer.model import _load_init, is_writer
from .trainer.model import build as _build
from .trainer.model import digest as _digest
from .trainer.model import publish as _publish
from .trainer.record import baseline_fields as _baseline_fields
from .trainer.record import ess_fields as _ess_fields
from .trainer.record import lr_fields as _lr_fields
from .trainer.record import step_stats as _step_stats
from .trainer.record import time_fields as _time_fields
from .trainer.sampling import Rollout as _Rollout
from .trainer.sampling import rollout_lags, worker_lags
from .trainer.sampling import sample as _sample

# The old module's __all__; every other name imported above is kept for its callers (tests and
# benchmarks import some), re-exported as such.
__all__ = ["ARMS", "DemoConfig", "DemoConfigError", "rollout_lags", "run_rank", "worker_lags"]
