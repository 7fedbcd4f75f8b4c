"""The early warning over a replayed run: per weight mode, where the rule
(:mod:`ess_patch.early_warning`) first fired on the run's rho series, and the rho there."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import DEFAULT_PATIENCE, DEFAULT_THRESHOLD
from ..early_warning import MEANING, EarlyWarning
from ..result import UNMEASURED

__all__ = ["RunWarning", "early_warnings"]


@dataclass(frozen=True)
class RunWarning:
    """The rule on one weight mode's rho series (rollout ids as steps).

    Attributes:
        weight_mode: whose rho.
        threshold, patience: the rule.
        fired: the rollout ids where it fired (one per episode).
        first_streak: ``(rollout id, rho)`` of the results that fired it first (empty: never).
        lowest: ``(rollout id, rho)`` of the lowest rho measured.
    """

    weight_mode: str
    threshold: float
    patience: int
    fired: tuple[int, ...]
    first_streak: tuple[tuple[int, float], ...]
    lowest: tuple[int, float]

    def text(self) -> str:
        """One line: where the rule first fired and the rho there, or that it never did."""
        rule = f"rho below {self.threshold:g} for {self.patience} rollouts in a row"
        if not self.fired:
            rid, rho = self.lowest
            return (
                f"{self.weight_mode} weights: no early warning ({rule}: never; lowest rho "
                f"{rho:.3g} at rollout {rid})"
            )
        rid, rho = self.first_streak[-1]
        values = ", ".join(f"{r:.3g}" for _, r in self.first_streak)
        again = f"; {len(self.fired)} episodes, at rollouts {list(self.fired)}" * (
            len(self.fired) > 1
        )
        return (
            f"{self.weight_mode} weights: EARLY WARNING first at rollout {rid}, rho {rho:.3g} "
            f"({rule}: {values}{again}). {MEANING} from there; turn on ESS-LR (--use-ess-lr) "
            "or lower the staleness"
        )


def early_warnings(
    rows: Sequence[dict],
    *,
    threshold: float = DEFAULT_THRESHOLD,
    patience: int = DEFAULT_PATIENCE,
) -> list[RunWarning]:
    """The rule over each weight mode's rho per rollout in ``rows`` (analyze's rows: one per
    rollout and setting; rho depends on the weight mode only). Unmeasured rollouts and a
    non-finite rho are left out.

    Raises:
        ValueError: a threshold outside [0, 1] or a patience below 1.
    """
    series: dict[str, dict[int, float]] = {}
    for row in rows:
        rho = float(row["rho"])
        if row["status"] in UNMEASURED or not math.isfinite(rho):
            continue
        series.setdefault(row["weight_mode"], {})[int(row["rollout_id"])] = rho
    out = []
    for mode, by_id in series.items():
        rule = EarlyWarning(threshold, patience)
        first: tuple[tuple[int, float], ...] = ()
        for rid in sorted(by_id):
            if rule.update(by_id[rid], rid) and not first:
                first = tuple(rule.last_firing)
        lowest = min(by_id.items(), key=lambda item: (item[1], item[0]))
        out.append(
            RunWarning(mode, rule.threshold, rule.patience, tuple(rule.fired), first, lowest)
        )
    return out
