"""The outcome of one rollout's ESS computation, as armed for its optimizer steps."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from .errors import EssPatchValueError

__all__ = ["ENCODED_SIZE", "STATUSES", "UNMEASURED", "EssLrResult", "check_scale"]

#: ok: computed from at least one valid trajectory.
#: no_valid: no trajectory had a masked token anywhere: no-op (scale 1, rho 1).
#: missing: some rank lacked the log-prob inputs: no-op on every rank.
#: nonfinite: a NaN/inf log-ratio with the "floor" policy: fail closed to the floor.
#: manual: armed from a bare float by the caller.
#: calibrating: measured, one of the first ``calibrate_rollouts`` results: scale 1.
STATUSES = ("ok", "no_valid", "missing", "nonfinite", "manual", "calibrating")
#: The statuses of a rollout that nothing was measured on (its metrics say so).
UNMEASURED = ("no_valid", "missing")


def check_scale(scale: float) -> float:
    """Return ``scale`` as a float, or raise ``ValueError`` unless it is in (0, 1]."""
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise EssPatchValueError(
            f"LR scale {scale!r} is not a number; expected a float in (0, 1]"
        ) from None
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise EssPatchValueError(
            f"LR scale {scale!r} must be in (0, 1]: ESS-LR only ever lowers the LR"
        )
    return value


@dataclass(frozen=True)
class EssLrResult:
    """ESS, rho and the LR scale of one rollout (identical on every rank).

    Attributes:
        scale: factor applied to every param group's LR, in [floor, 1].
        rho: ESS / num_trajectories, in [1/B, 1]; 1.0 for a no-op.
        ess: effective sample size of the trajectory weights.
        num_trajectories: B, the trajectories with at least one masked token.
        num_empty: trajectories with no masked token (left out of the sums and of B).
        num_nonfinite: trajectories whose log-ratio was NaN/inf.
        status: one of ``STATUSES``.
        calibrated_ratio: what rho was divided by, when calibration chose it (``base_ratio``
            x the mean rho of the first ``calibrate_rollouts`` results); 0.0: not calibrated
            (none asked for, or still calibrating: the configured ``base_ratio`` applies).
    """

    scale: float
    rho: float
    ess: float
    num_trajectories: int
    num_empty: int = 0
    num_nonfinite: int = 0
    status: str = "ok"
    calibrated_ratio: float = 0.0

    @classmethod
    def noop(cls, status: str, *, num_empty: int = 0) -> EssLrResult:
        """The result that changes nothing (scale 1, rho 1)."""
        return cls(
            scale=1.0, rho=1.0, ess=0.0, num_trajectories=0, num_empty=num_empty, status=status
        )

    @classmethod
    def from_scale(cls, scale: float) -> EssLrResult:
        """Wrap a bare scale chosen by the caller; rho and ESS are unknown (NaN)."""
        scale = check_scale(scale)
        return cls(scale=scale, rho=math.nan, ess=math.nan, num_trajectories=0, status="manual")

    @property
    def measured(self) -> bool:
        """Whether rho and the scale come from log-probs ("missing": some rank had none;
        "no_valid": no trajectory had a masked token): an unmeasured no-op has scale 1 and
        rho 1, which would read as "no staleness"."""
        return self.status not in UNMEASURED

    def metrics(self) -> dict[str, float]:
        """Metrics for the host framework's train-step logging (keys without ``train/``).

        An unmeasured rollout (:attr:`measured` False) gives only ``{"ess_lr_measured": 0.0}``:
        no ``lr_scale`` / ``rho_ess`` / ``ess`` that would look measured. With calibration:
        ``ess_lr_calibrating`` (1.0) while calibrating, then ``ess_lr_base_ratio``."""
        if not self.measured:
            return {"ess_lr_measured": 0.0}
        out = {
            "lr_scale": self.scale,
            "rho_ess": self.rho,
            "ess": self.ess,
            "ess_num_trajectories": float(self.num_trajectories),
            "ess_num_nonfinite": float(self.num_nonfinite),
        }
        # only with calibration on: a run without it logs exactly what it logged before
        if self.status == "calibrating":
            out["ess_lr_calibrating"] = 1.0
        if self.calibrated_ratio > 0.0:
            out["ess_lr_base_ratio"] = self.calibrated_ratio
        return out

    def encode(self) -> list[float]:
        """The result as floats (one per field, the status as its index in ``STATUSES``), for
        a collective; :meth:`decode` inverts it exactly."""
        return [
            float(STATUSES.index(self.status))
            if f.name == "status"
            else float(getattr(self, f.name))
            for f in fields(self)
        ]

    @classmethod
    def decode(cls, values: list[float]) -> EssLrResult:
        """The result :meth:`encode` produced (``len(values) == ENCODED_SIZE``)."""
        kwargs: dict[str, object] = {}
        for f, v in zip(fields(cls), values, strict=True):
            if f.name == "status":
                kwargs[f.name] = STATUSES[int(v)]
            elif f.type in ("int", int):
                kwargs[f.name] = int(v)
            else:
                kwargs[f.name] = float(v)
        return cls(**kwargs)  # type: ignore[arg-type]


#: Floats in :meth:`EssLrResult.encode`'s output (derived from the fields, never kept by hand).
ENCODED_SIZE = len(fields(EssLrResult))
