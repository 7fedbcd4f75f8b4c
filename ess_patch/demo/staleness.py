"""How stale each step's rollouts are: fixed, per-worker periods, or varying within a run.

Fully-async runs do not hold one lag: it drifts as generation and training speeds change,
and comes in bursts when a slow batch of long rollouts lands. Two schedules reproduce that
at the demo's scale (every worker at the step's lag; ``max_lag`` is the config's ``lag``):

* ``drift``: a triangle wave, 0 up to ``max_lag`` and back, over :data:`DRIFT_PERIOD` steps;
* ``longtail``: each step's lag drawn independently with P(k) proportional to (k + 1)^-2 on
  0..max_lag (mostly fresh, now and then very stale), from the run's seed and the step, so
  every arm of a seed sees the same lags.

Neither is ever staler than the step itself (the first steps sample the initial weights).
"""

from __future__ import annotations

import random

from ..errors import EssPatchValueError

__all__ = ["DRIFT_PERIOD", "VARYING", "step_lag"]

#: Steps of one drift cycle (0 -> max_lag -> 0): 4 cycles in the collapse scenario's 400.
DRIFT_PERIOD = 100
VARYING = ("drift", "longtail")


def step_lag(schedule: str, step: int, max_lag: int, seed: int) -> int:
    """The lag of every rollout at ``step`` under ``schedule`` (one of :data:`VARYING`)."""
    if schedule == "drift":
        phase = (step % DRIFT_PERIOD) / DRIFT_PERIOD
        lag = round(max_lag * (1.0 - abs(2.0 * phase - 1.0)))
    elif schedule == "longtail":
        weights = [1.0 / (k + 1) ** 2 for k in range(max_lag + 1)]
        rng = random.Random(seed * 1_000_003 + step)
        lag = rng.choices(range(max_lag + 1), weights=weights)[0]
    else:
        raise EssPatchValueError(f"staleness schedule {schedule!r}: give one of {VARYING}")
    return min(step, lag)
