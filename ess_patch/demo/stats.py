"""Paired statistics over seeds for the stress and collapse scenarios: mean difference,
bootstrap CI, wins."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import EssPatchValueError

__all__ = ["Paired", "bootstrap_ci", "paired", "paired_pairs"]


def bootstrap_ci(
    values: Sequence[float], *, level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values``.

    Draws ``resamples`` samples of ``len(values)`` with replacement (``random.Random(seed)``,
    so the interval is reproducible), sorts their means ``m`` and returns
    ``(m[floor(a * R)], m[ceil((1 - a) * R) - 1])`` with ``a = (1 - level) / 2``.
    """
    if not values:
        raise EssPatchValueError("bootstrap_ci needs at least one value")
    if not 0.0 < level < 1.0:
        raise EssPatchValueError(f"level={level} must be in (0, 1)")
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    a = (1.0 - level) / 2.0
    return means[math.floor(a * resamples)], means[math.ceil((1.0 - a) * resamples) - 1]


@dataclass(frozen=True)
class Paired:
    """``arm - base`` over the same seeds."""

    arm: str
    base: str
    diffs: tuple[float, ...]
    mean: float
    ci_low: float
    ci_high: float
    wins: int  # seeds where arm > base
    n: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def paired(
    arm: str, values: Sequence[float], base: str, base_values: Sequence[float], **ci: Any
) -> Paired:
    """Paired differences ``values[i] - base_values[i]`` (same seed ``i``) and their summary."""
    if len(values) != len(base_values) or not values:
        raise EssPatchValueError(
            f"paired({arm!r}, {base!r}): need the same non-zero number of seeds, got "
            f"{len(values)} and {len(base_values)}"
        )
    diffs = tuple(a - b for a, b in zip(values, base_values))
    low, high = bootstrap_ci(diffs, **ci)
    return Paired(
        arm=arm,
        base=base,
        diffs=diffs,
        mean=sum(diffs) / len(diffs),
        ci_low=low,
        ci_high=high,
        wins=sum(d > 0 for d in diffs),
        n=len(diffs),
    )


def paired_pairs(
    pairs: Sequence[tuple[str, str]], seeds: Sequence[int], final: Callable[[int, str], float]
) -> list[dict[str, Any]]:
    """:func:`paired` of each ``(arm, base)`` in ``pairs`` over ``seeds``, as dicts;
    ``final(seed, arm)``: that run's value."""
    return [
        paired(arm, [final(s, arm) for s in seeds], base, [final(s, base) for s in seeds]).to_dict()
        for arm, base in pairs
    ]
