"""The collapse criterion of the collapse scenario, and the ESS early-warning rule.

Written (with its tests, ``tests/test_collapse.py``) before any run of the scenario. A run is
judged against the synchronous run (lag 0, all else equal) of the same seed. It collapsed if
any of these holds (:func:`judge`; ``reasons`` names which):

* ``nonfinite``: a reward, loss or gradient norm is NaN or infinite;
* ``giveback``: after learning (the smoothed reward rose at least :data:`MIN_GAIN` above its
  start), the smoothed reward ends more than :data:`GIVEBACK` of that gain below its peak;
  start and peak are taken from the first full smoothing window on (a fix made after the
  first selection runs: the peak had included the shorter, noisier averages of the first
  window's steps; the selection was re-judged from its cached runs, see selection.txt);
* ``spike``: the gradient norm exceeds :data:`SPIKE_FACTOR` x the median of the previous
  :data:`SPIKE_HISTORY` steps (at least :data:`SPIKE_MIN_HISTORY` of them), and the smoothed
  reward ends at least :data:`LOST_REWARD` below its value at the spike;
* ``stalled``: the synchronous run learns (its smoothed reward gains >= :data:`MIN_GAIN` from
  start to end) while this one gains less than :data:`STALL_FRACTION` of that and makes no
  progress over its last quarter (less than 10% of the synchronous gain).

Every condition is judged at the run's end, so a dip that recovers is no collapse. The
collapse onset (for the early warning's lead time) is the earliest onset of the conditions
that hold: the first non-finite step; the step after which the smoothed reward stays below
``peak - GIVEBACK x gain``; the spike; the step of the stalled run's peak.

The early warning is the rule users get (:mod:`ess_patch.early_warning`, one implementation:
rho below ``warn_threshold``, 0.2, for ``warn_patience``, 3, consecutive steps; the scenario
also reports :data:`WARN_THRESHOLDS`). :func:`early_warning` scores it over runs: a hit fires
at or before the onset of a collapse (lead = onset - firing step), a miss does not, a false
alarm fires in a run that did not collapse. A firing within :data:`STALE_GRACE` steps of the
first stale rollout is not counted (it answers staleness, not a collapse; counted apart).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..early_warning import DEFAULT_PATIENCE, DEFAULT_THRESHOLD, firings
from ..errors import EssPatchValueError
from .report import smooth as trailing_mean

__all__ = [
    "Verdict",
    "early_warning",
    "judge",
    "smooth",
    "warning_steps",
    "window",
]

#: Trailing moving-average window of the reward (steps); runs shorter than 10 windows use a
#: tenth of their length (at least 1), so that a short (test) run has a start and an end.
SMOOTH = 20
MIN_GAIN = 0.05
GIVEBACK = 0.5
SPIKE_FACTOR = 10.0
SPIKE_HISTORY = 50
SPIKE_MIN_HISTORY = 20
LOST_REWARD = 0.05
STALL_FRACTION = 0.5
#: The rule users get (``EssLrConfig.warn_threshold`` / ``warn_patience``): the primary row.
WARN_THRESHOLD = DEFAULT_THRESHOLD
WARN_PATIENCE = DEFAULT_PATIENCE
WARN_THRESHOLDS = (0.1, 0.2, 0.3, 0.5)
#: Steps after the first stale rollout in which a firing is not counted: it answers the
#: staleness starting (rho drops at once when rollouts turn stale), not a collapse coming.
STALE_GRACE = 10


def window(steps: int) -> int:
    """The reward's smoothing window for a run of ``steps`` steps (see :data:`SMOOTH`)."""
    return max(1, min(SMOOTH, steps // 10))


def smooth(values: Sequence[float], w: int | None = None) -> list[float]:
    """Trailing moving average over ``w`` steps (shorter at the start; default
    :func:`window` of the length)."""
    return trailing_mean(values, window(len(values)) if w is None else w)


@dataclass(frozen=True)
class Verdict:
    """What :func:`judge` found in one run."""

    collapsed: bool
    reasons: tuple[str, ...]
    onset: int | None  # first step of the collapse (None: no collapse)
    start: float  # smoothed reward after the first window
    peak: float
    final: float
    sync_gain: float | None  # the synchronous run's final - start (None: not given)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _finite(records: Sequence[dict[str, Any]]) -> int | None:
    for i, r in enumerate(records):
        for key in ("reward", "loss", "grad_norm"):
            v = r.get(key)
            if v is not None and not math.isfinite(v):
                return i
    return None


def _spike(grads: Sequence[float], s: Sequence[float]) -> int | None:
    for t in range(SPIKE_MIN_HISTORY, len(grads)):
        med = statistics.median(grads[max(0, t - SPIKE_HISTORY) : t])
        if med > 0 and grads[t] > SPIKE_FACTOR * med and s[-1] <= s[t] - LOST_REWARD:
            return t
    return None


def _gain(s: Sequence[float]) -> tuple[float, float, float]:
    # from the first full window on: before it the average is over fewer steps (noisier)
    first = window(len(s)) - 1
    return s[first], max(s[first:]), s[-1]


def judge(
    records: Sequence[dict[str, Any]], sync: Sequence[dict[str, Any]] | None = None
) -> Verdict:
    """Judge one run (records in step order: ``reward``, ``grad_norm``, ``loss``) against
    the synchronous run of the same seed (``None``: the ``stalled`` condition is skipped).

    Raises:
        ValueError: no records.
    """
    if not records:
        raise EssPatchValueError("judge(): no records")
    onsets: dict[str, int] = {}
    bad = _finite(records)
    if bad is not None:
        onsets["nonfinite"] = bad
        rewards = [r["reward"] if math.isfinite(r["reward"]) else 0.0 for r in records]
    else:
        rewards = [r["reward"] for r in records]
    s = smooth(rewards)
    start, peak, final = _gain(s)
    gain = peak - start
    if gain >= MIN_GAIN and final < peak - GIVEBACK * gain:
        line = peak - GIVEBACK * gain
        onsets["giveback"] = max(i for i, v in enumerate(s) if v >= line) + 1
    grads = [r["grad_norm"] for r in records]
    if all(math.isfinite(g) for g in grads):
        spike = _spike(grads, s)
        if spike is not None:
            onsets["spike"] = spike
    sync_gain = None
    if sync:
        ss = smooth([r["reward"] for r in sync])
        sync_start, _, sync_final = _gain(ss)
        sync_gain = sync_final - sync_start
        quarter = s[(3 * len(s)) // 4]
        if (
            sync_gain >= MIN_GAIN
            and final - start < STALL_FRACTION * sync_gain
            and final - quarter < 0.1 * sync_gain
        ):
            first = window(len(s)) - 1
            onsets["stalled"] = max(range(first, len(s)), key=lambda i: (s[i], -i))
    reasons = tuple(k for k in ("nonfinite", "giveback", "spike", "stalled") if k in onsets)
    return Verdict(
        collapsed=bool(reasons),
        reasons=reasons,
        onset=min(onsets.values()) if onsets else None,
        start=start,
        peak=peak,
        final=final,
        sync_gain=sync_gain,
    )


def _clean(rhos: Sequence[float]) -> list[float]:
    # a non-finite rho is the worst case, not a reason to stop scoring: it counts as 0
    return [r if math.isfinite(r) and r >= 0 else 0.0 for r in rhos]


def warning_steps(
    rhos: Sequence[float], threshold: float = WARN_THRESHOLD, first_stale: int | None = None
) -> list[int]:
    """The steps the shipped rule fires on (:func:`ess_patch.early_warning.firings`: rho below
    ``threshold`` for ``warn_patience`` consecutive steps), leaving out those within
    :data:`STALE_GRACE` steps of ``first_stale`` (the first stale rollout; None: none was):
    those answer the staleness starting, not a collapse coming. A non-finite rho counts as 0."""
    fired = firings(_clean(rhos), threshold=threshold, patience=WARN_PATIENCE)
    if first_stale is None:
        return fired
    return [f for f in fired if f > first_stale + STALE_GRACE]


def early_warning(
    runs: Sequence[tuple[Sequence[float], Verdict]],
    threshold: float = WARN_THRESHOLD,
    first_stale: int | None = None,
) -> dict[str, Any]:
    """Score the shipped rule over ``runs`` (each: per-step rho and its verdict): a hit fires
    (after the staleness grace) at or before the onset of a collapse, lead = onset - firing;
    a miss fires late or never; a false alarm fires in a run that did not collapse;
    ``only_at_staleness_start`` counts the runs whose every firing fell within the grace."""
    hits = misses = quiet = false = at_start = 0
    leads: list[int] = []
    for rhos, verdict in runs:
        every = firings(_clean(rhos), threshold=threshold, patience=WARN_PATIENCE)
        fired = warning_steps(rhos, threshold, first_stale)
        at_start += bool(every) and not fired
        if verdict.collapsed and verdict.onset is not None:
            if fired and fired[0] <= verdict.onset:
                hits += 1
                leads.append(verdict.onset - fired[0])
            else:
                misses += 1
        else:
            quiet += 1
            false += bool(fired)
    collapses = hits + misses
    return {
        "threshold": threshold,
        "patience": WARN_PATIENCE,
        "grace": None if first_stale is None else STALE_GRACE,
        "collapses": collapses,
        "hits": hits,
        "misses": misses,
        "quiet_runs": quiet,
        "false_alarms": false,
        "only_at_staleness_start": at_start,
        "lead_steps": tuple(leads),
        "hit_rate": hits / collapses if collapses else math.nan,
        "false_alarm_rate": false / quiet if quiet else math.nan,
    }
