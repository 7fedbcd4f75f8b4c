"""ESS as an early warning of a training collapse: one simple rule over a run's rho series.

VCPO (arXiv 2602.17616) diagnoses its asynchronous collapses by the ESS ratio: the synchronous
reference holds rho near 0.7 (the ESS-scaled runs 0.3-0.6), and before a stale run's accuracy
falls (MATH, k = 10: from about step 150 to about 0 by step 250) its rho goes to about 0.

The rule: **rho below** ``threshold`` **for** ``patience`` **consecutive results fires**, once
per episode; it re-arms after ``patience`` consecutive results at or above ``threshold``.
The defaults, 0.2 and 3: 0.2 sits below the whole healthy band VCPO reports (0.3-0.7), so a
run that holds it never fires, and well above the ~0 of a collapsing run, so the rule fires
on the way down rather than at the bottom; 3 results in a row keep one noisy rollout (rho over
a few dozen trajectories is itself noisy) from firing. These numbers are VCPO's, measured with
product weights (``weight_mode="product"``, exp(sum of log-ratios)); geometric weights sit
much nearer 1, so a threshold for them must be chosen from the run's own series
(``ess-patch analyze`` prints it).

Pure Python (a 0-d tensor is read with ``float()``); no collectives: every rank that feeds
the same rho series reaches the same answer. :class:`EarlyWarning` is the streaming form (one
rho at a time), :func:`firings` / :func:`first_firing` the batch form over a series, and
:func:`evaluate` scores the rule over many runs against their collapse onsets.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# the rule's settings are EssLrConfig fields (warn_threshold, warn_patience): checked there
from .config import DEFAULT_PATIENCE, DEFAULT_THRESHOLD, check_rule
from .errors import EssPatchValueError

__all__ = [
    "DEFAULT_PATIENCE",
    "DEFAULT_THRESHOLD",
    "MEANING",
    "EarlyWarning",
    "RunScore",
    "WarningScore",
    "check_rule",
    "evaluate",
    "firings",
    "first_firing",
    "lead_time",
]

#: What a firing means, for the messages that report one (shadow mode's log, ``analyze``).
MEANING = (
    "VCPO (arXiv 2602.17616) finds that in stale off-policy RL the ESS collapses before "
    "training does: the policy has drifted from the one that sampled the rollouts, and the "
    "importance-weighted gradient rests on a few trajectories. Watch reward and gradient norm"
)


def _rho(value: object) -> float:
    try:
        rho = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise EssPatchValueError(f"rho {value!r} is not a number") from None
    if not rho >= 0.0 or rho == math.inf:
        raise EssPatchValueError(
            f"rho {value!r} is not a finite number >= 0; feed only measured results "
            "(EssLrResult.measured, a finite rho)"
        )
    return rho


@dataclass
class EarlyWarning:
    """The rule, fed one rho at a time (:meth:`update`).

    Attributes:
        threshold, patience: the rule (see the module docstring).
        armed: whether the rule can fire now (False from a firing until it re-arms).
        streak: ``(step, rho)`` of the current run of results that count (below the
            threshold while armed; at or above it, towards re-arming, while not).
        last_firing: ``(step, rho)`` of the ``patience`` results that last fired the rule,
            oldest first (empty before any firing): what a warning message shows.
        fired: the step of each result that fired the rule, in order.

    Raises:
        ValueError: a threshold outside [0, 1] or a patience below 1.
    """

    threshold: float = DEFAULT_THRESHOLD
    patience: int = DEFAULT_PATIENCE
    armed: bool = field(default=True, init=False)
    streak: list[tuple[int, float]] = field(default_factory=list, init=False)
    last_firing: list[tuple[int, float]] = field(default_factory=list, init=False)
    fired: list[int] = field(default_factory=list, init=False)
    _count: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.threshold, self.patience = check_rule(self.threshold, self.patience)

    def update(self, rho: float, step: int | None = None) -> bool:
        """Feed one result's rho (``step``: its step or rollout; default: how many were fed
        before it). True exactly when this result fires the rule.

        Raises:
            ValueError: ``rho`` is NaN, infinite or negative (nothing is changed).
        """
        value = _rho(rho)
        at = self._count if step is None else int(step)
        self._count += 1
        counts = value < self.threshold if self.armed else value >= self.threshold
        if not counts:
            self.streak = []
            return False
        self.streak.append((at, value))
        if len(self.streak) < self.patience:
            return False
        if not self.armed:  # back above the threshold long enough: a new episode may fire
            self.armed, self.streak = True, []
            return False
        self.armed, self.last_firing, self.streak = False, self.streak, []
        self.fired.append(at)
        return True

    def reset(self) -> None:
        """Start over (a new run): armed, no streak, nothing fired."""
        self.armed, self.streak, self.last_firing, self.fired = True, [], [], []
        self._count = 0


def _steps(rhos: Sequence[float], steps: Sequence[int] | None) -> Iterable[tuple[int, float]]:
    if steps is None:
        return enumerate(rhos)
    if len(steps) != len(rhos):
        raise EssPatchValueError(
            f"steps has {len(steps)} entries and the rho series {len(rhos)}: give one step "
            "per rho (or none: the index is the step)"
        )
    return zip((int(s) for s in steps), rhos, strict=True)


def firings(
    rhos: Sequence[float],
    *,
    threshold: float = DEFAULT_THRESHOLD,
    patience: int = DEFAULT_PATIENCE,
    steps: Sequence[int] | None = None,
) -> list[int]:
    """The steps at which the rule fires over one run's rho series, in order (one per
    episode). ``steps``: the step of each rho (default: its index).

    Raises:
        ValueError: a bad rule setting, a non-finite or negative rho (naming it), or
            ``steps`` of another length.
    """
    rule = EarlyWarning(threshold, patience)
    for step, rho in _steps(rhos, steps):
        rule.update(rho, step)
    return rule.fired


def first_firing(
    rhos: Sequence[float],
    *,
    threshold: float = DEFAULT_THRESHOLD,
    patience: int = DEFAULT_PATIENCE,
    steps: Sequence[int] | None = None,
) -> int | None:
    """The step at which the rule first fires over one run's rho series, or None."""
    fired = firings(rhos, threshold=threshold, patience=patience, steps=steps)
    return fired[0] if fired else None


def lead_time(
    rhos: Sequence[float],
    onset: int,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    patience: int = DEFAULT_PATIENCE,
    steps: Sequence[int] | None = None,
) -> int | None:
    """``onset - first firing step`` for a run that collapsed at step ``onset``: > 0 warned
    that many steps ahead, 0 at the onset, < 0 late; None: the rule never fired (missed)."""
    first = first_firing(rhos, threshold=threshold, patience=patience, steps=steps)
    return None if first is None else int(onset) - first


@dataclass(frozen=True)
class RunScore:
    """The rule on one run.

    Attributes:
        name: the run's key in :func:`evaluate`'s input.
        onset: the step its collapse began, or None (it did not collapse).
        first_fired: the step the rule first fired, or None.
        lead: ``onset - first_fired`` (collapsed and fired), else None.
    """

    name: str
    onset: int | None
    first_fired: int | None
    lead: int | None

    @property
    def outcome(self) -> str:
        """ "hit" (fired at or before the onset), "late", "missed" (collapsed, never fired),
        "false alarm" (fired, no collapse), "quiet" (neither)."""
        if self.onset is None:
            return "quiet" if self.first_fired is None else "false alarm"
        if self.lead is None:
            return "missed"
        return "hit" if self.lead >= 0 else "late"


@dataclass(frozen=True)
class WarningScore:
    """The rule over many runs (:func:`evaluate`).

    Attributes:
        runs: one :class:`RunScore` per run, in input order.
        threshold, patience: the rule scored.
        hit_rate: collapsed runs warned at or before their onset / collapsed runs (None: no
            run collapsed).
        false_alarm_rate: runs without a collapse on which the rule fired / runs without a
            collapse (None: every run collapsed).
    """

    runs: tuple[RunScore, ...]
    threshold: float
    patience: int
    hit_rate: float | None
    false_alarm_rate: float | None

    @property
    def leads(self) -> dict[str, int | None]:
        """Each collapsed run's lead time (None: missed), by name."""
        return {r.name: r.lead for r in self.runs if r.onset is not None}


def evaluate(
    runs: Mapping[str, Sequence[float]],
    onsets: Mapping[str, int | None],
    *,
    threshold: float = DEFAULT_THRESHOLD,
    patience: int = DEFAULT_PATIENCE,
    steps: Mapping[str, Sequence[int]] | None = None,
) -> WarningScore:
    """Score the rule over many runs: ``runs`` maps a name to its rho series, ``onsets`` the
    same names to the step its collapse began (None: it did not collapse); ``steps`` the
    names to the step of each rho (default: the index).

    Raises:
        ValueError: a run without an onset entry (or an onset without a run), or what
            :func:`firings` raises, naming the run.
    """
    if set(runs) != set(onsets):
        raise EssPatchValueError(
            "runs and onsets must name the same runs (onset None: no collapse); only in runs: "
            f"{sorted(set(runs) - set(onsets))}, only in onsets: {sorted(set(onsets) - set(runs))}"
        )
    threshold, patience = check_rule(threshold, patience)
    scores = []
    for name, rhos in runs.items():
        try:
            first = first_firing(
                rhos,
                threshold=threshold,
                patience=patience,
                steps=None if steps is None else steps.get(name),
            )
        except ValueError as exc:
            raise EssPatchValueError(f"run {name!r}: {exc}") from None
        onset = onsets[name]
        onset = None if onset is None else int(onset)
        lead = None if onset is None or first is None else onset - first
        scores.append(RunScore(name, onset, first, lead))
    collapsed = [s for s in scores if s.onset is not None]
    steady = [s for s in scores if s.onset is None]
    return WarningScore(
        runs=tuple(scores),
        threshold=threshold,
        patience=patience,
        hit_rate=_rate(s.outcome == "hit" for s in collapsed) if collapsed else None,
        false_alarm_rate=_rate(s.first_fired is not None for s in steady) if steady else None,
    )


def _rate(flags: Iterable[bool]) -> float:
    values = list(flags)
    return sum(values) / len(values)
