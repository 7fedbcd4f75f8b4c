"""Configuration of the ESS learning-rate rule: validated once, immutable afterwards."""

from __future__ import annotations

import difflib
import math
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from .errors import EssPatchValueError

__all__ = [
    "CHOICES",
    "DEFAULT_PATIENCE",
    "DEFAULT_THRESHOLD",
    "ENV_NAMES",
    "FINGERPRINT_SIZE",
    "GRANULARITIES",
    "HELP",
    "NONFINITE_POLICIES",
    "RULES",
    "WEIGHT_MODES",
    "EssLrConfig",
    "check_env_names",
    "check_rule",
    "describe_fingerprint",
]

#: "geometric": per-trajectory *mean* log-ratio (length-normalised, the seed's default).
#: "product": per-trajectory *sum* of log-ratios (VCPO's published code); brakes much harder.
WEIGHT_MODES = ("geometric", "product")
#: How rho/base_ratio maps to a scale before clamping to [floor, 1].
RULES = ("sqrt", "linear")
#: "raise": a non-finite log-ratio raises on every rank, naming the rank and sample index.
#: "floor": fail closed: the update still runs, at the floor LR, and the result says why.
NONFINITE_POLICIES = ("raise", "floor")
#: "rollout": one ESS over all the rollout's trajectories, for every optimizer step of it (the
#: seed). "step": one ESS per optimizer step, over the trajectories of that step's mini-batch
#: (VCPO's code); the host integration splits the rollout as its train loop does.
GRANULARITIES = ("rollout", "step")

#: The early warning's threshold (``ess_patch.early_warning``): below the healthy band VCPO
#: reports (synchronous ~0.7, ESS-scaled 0.3-0.6), above the ~0 of a collapsing run.
DEFAULT_THRESHOLD = 0.2
#: Consecutive results below the threshold before the rule fires (and above it to re-arm).
DEFAULT_PATIENCE = 3


_ENV_PREFIX = "ESS_LR_"
#: The key of a field's help text in its ``metadata`` (the ``--ess-lr-*`` options are
#: generated from the fields: ``ess_patch.integrations.flags``).
HELP = "help"

#: The named choices of the string fields (a fingerprint encodes them as their index, so that
#: a rank can say which value its peer has; the options list them).
CHOICES: dict[str, tuple[str, ...]] = {
    "weight_mode": WEIGHT_MODES,
    "rule": RULES,
    "nonfinite": NONFINITE_POLICIES,
    "granularity": GRANULARITIES,
}


def _choice(name: str, value: object, valid: tuple[str, ...]) -> str:
    if value not in valid:
        raise EssPatchValueError(
            f"EssLrConfig.{name}={value!r} is not a known value; valid values: {', '.join(valid)}"
        )
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class EssLrConfig:
    """How the ESS of a rollout becomes an LR scale.

    ``scale = clamp(rule(rho / base_ratio), floor, 1)`` with ``rho = ESS / B``, over the weights
    ``w_i = exp(m_i)``, or ``min(w_i, weight_clip)`` when ``weight_clip`` is set. With
    ``calibrate_rollouts = K > 0`` the first K measured results apply scale 1, and every later
    one divides rho by ``base_ratio x`` their mean rho instead (``ess_patch.calibration``).

    Raises:
        ValueError: a field is out of range or names an unknown mode (the message
            lists the valid values).
    """

    floor: float = field(
        default=0.1, metadata={HELP: "Smallest LR scale, in (0, 1]: scale = max(floor, ...)."}
    )
    weight_mode: str = field(
        default="geometric",
        metadata={
            HELP: "Trajectory weight: exp(mean log-ratio) ('geometric', length-normalised, "
            "gentle) or exp(sum) ('product', VCPO's code, brakes hard on long responses)."
        },
    )
    rule: str = field(
        default="sqrt",
        metadata={HELP: "Scale from rho = ESS/B: sqrt(rho/base_ratio) or rho/base_ratio."},
    )
    base_ratio: float = field(
        default=1.0,
        metadata={
            HELP: "rho is divided by this before the rule (1.0: no rescaling); with "
            "calibrate_rollouts, by this x the calibrated rho."
        },
    )
    nonfinite: str = field(
        default="raise",
        metadata={
            HELP: "On a NaN/inf log-ratio: 'raise' on every rank, or 'floor': train at the floor."
        },
    )
    #: Compute and log everything every rollout, but never change an LR (``--ess-lr-shadow``).
    shadow: bool = field(
        default=False,
        metadata={
            HELP: "Compute and log rho/ESS and the scale ESS-LR would apply "
            "(train/ess_lr_shadow_scale) every rollout, but never change an LR. "
            "Use without --use-ess-lr."
        },
    )
    #: "rollout" (default) or "step": see :data:`GRANULARITIES` (``--ess-lr-granularity``).
    #: Read by the integrations (miles/slime: "step" is measured inside the policy loss); with
    #: the library, "step" means calling ``compute_ess_lr`` once per optimizer step over that
    #: step's samples. In the fingerprint, so ranks that disagree all raise.
    granularity: str = field(
        default="rollout",
        metadata={
            HELP: "'rollout': one ESS over the whole rollout, for each of its optimizer steps. "
            "'step': one ESS per optimizer step over that step's mini-batch (VCPO's code)."
        },
    )
    #: Clip each trajectory weight to ``min(w_i, weight_clip)`` before the ESS (VCPO's
    #: ``use_clipped`` with ``rollout_is_threshold``); None (default) = no clipping.
    weight_clip: float | None = field(
        default=None,
        metadata={
            HELP: "Clip each trajectory weight to min(w, this) before the ESS (VCPO's "
            "use_clipped with rollout_is_threshold); 'none': no clipping."
        },
    )

    #: Calibrate the base ratio from the first K measured results (0: off): see
    #: ``ess_patch.calibration``. Product weights brake even on-policy at long responses,
    #: because the train/rollout mismatch noise sums over the tokens; this divides it out.
    calibrate_rollouts: int = field(
        default=0,
        metadata={
            HELP: "Calibrate: the LR is not scaled during the first K measured rollouts (or "
            "optimizer steps, with granularity 'step'); then rho is divided by base_ratio x "
            "their mean rho, so that only a drop below the run's on-policy rho brakes (the "
            "train/inference mismatch alone no longer does). Logged. 0: off."
        },
    )

    #: The early warning (``ess_patch.early_warning``): rho below ``warn_threshold`` for
    #: ``warn_patience`` consecutive results logs one warning (shadow mode included). Logging
    #: only: no LR depends on it.
    warn_threshold: float = field(
        default=DEFAULT_THRESHOLD,
        metadata={
            HELP: "Early warning: log a WARNING when rho stays below this for --ess-lr-warn-"
            "patience results in a row (VCPO: ESS collapse precedes training collapse; its "
            "synchronous runs hold rho ~0.7 with product weights). Logging only; 0: off."
        },
    )
    warn_patience: int = field(
        default=DEFAULT_PATIENCE,
        metadata={
            HELP: "Early warning: consecutive results below --ess-lr-warn-threshold before it "
            "warns (once per episode; re-armed after as many at or above it)."
        },
    )

    def __post_init__(self) -> None:
        floor = _as_float("floor", self.floor)
        if not 0.0 < floor <= 1.0:
            raise EssPatchValueError(
                f"EssLrConfig.floor={self.floor!r} must be in (0, 1]: it is the smallest "
                "fraction of the scheduled LR an update may use (default 0.1)"
            )
        base = _as_float("base_ratio", self.base_ratio)
        if not base > 0.0 or base == float("inf"):
            raise EssPatchValueError(
                f"EssLrConfig.base_ratio={self.base_ratio!r} must be a finite number > 0 "
                "(rho is divided by it; 1.0 means no rescaling)"
            )
        object.__setattr__(self, "floor", floor)
        object.__setattr__(self, "base_ratio", base)
        _choice("weight_mode", self.weight_mode, WEIGHT_MODES)
        _choice("rule", self.rule, RULES)
        _choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        _choice("granularity", self.granularity, GRANULARITIES)
        object.__setattr__(self, "shadow", _as_bool("shadow", self.shadow))
        object.__setattr__(self, "weight_clip", _weight_clip(self.weight_clip))
        object.__setattr__(self, "calibrate_rollouts", _calibration(self.calibrate_rollouts))
        threshold, patience = check_rule(self.warn_threshold, self.warn_patience)
        object.__setattr__(self, "warn_threshold", threshold)
        object.__setattr__(self, "warn_patience", patience)

    def fingerprint(self) -> list[float]:
        """One float per field, equal on two ranks exactly when that field is equal.

        Travels with the collectives, so that ranks running different settings all raise
        (:func:`describe_fingerprint` names the fields) instead of drifting silently.
        """
        return [_encode_field(f.name, getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> EssLrConfig:
        """Build a config from ``ESS_LR_FLOOR``, ``ESS_LR_WEIGHT_MODE``, ``ESS_LR_RULE``,
        ``ESS_LR_BASE_RATIO``, ``ESS_LR_NONFINITE``, ``ESS_LR_SHADOW`` (1/0/true/false),
        ``ESS_LR_GRANULARITY``, ``ESS_LR_WEIGHT_CLIP`` (a number, or ``none``),
        ``ESS_LR_CALIBRATE_ROLLOUTS`` (an integer >= 0), ``ESS_LR_WARN_THRESHOLD`` (in [0, 1]),
        ``ESS_LR_WARN_PATIENCE`` (an integer >= 1); explicit ``overrides`` win.

        Raises:
            ValueError: a variable holds a value its field does not take; the message names
                the variable, its value and the allowed values (checked one variable at a
                time, so the first bad one is named, not the field behind it). Or an
                ``ESS_LR_*`` name ess-patch does not know (:func:`check_env_names`).
        """
        env = os.environ if environ is None else environ
        check_env_names(env)
        values: dict[str, object] = {}
        for f in fields(cls):
            variable = _ENV_PREFIX + f.name.upper()
            raw = env.get(variable)
            if raw is not None and raw != "":
                try:
                    cls(**{f.name: raw})  # type: ignore[arg-type]
                except (TypeError, ValueError) as exc:
                    raise EssPatchValueError(_bad_variable(variable, f.name, raw, exc)) from None
                values[f.name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


#: The ``ESS_LR_*`` variables of VCPO's baseline, read by ``integrations/baseline_flags.py``
#: (not ESS-LR settings; a test keeps the two lists equal).
BASELINE_ENV_NAMES: tuple[str, ...] = (
    _ENV_PREFIX + "BASELINE",
    _ENV_PREFIX + "BASELINE_SHADOW",
    _ENV_PREFIX + "BASELINE_PATH",
)

#: Every ``ESS_LR_*`` variable ess-patch reads: one per field, verl's switch, and the
#: baseline's three (without them here install() refused the baseline's own variables).
ENV_NAMES: tuple[str, ...] = (
    *(_ENV_PREFIX + f.name.upper() for f in fields(EssLrConfig)),
    _ENV_PREFIX + "ENABLE",
    *BASELINE_ENV_NAMES,
)


def check_env_names(environ: Mapping[str, str]) -> None:
    """Refuse an ``ESS_LR_*`` variable that no setting reads (a typo would be ignored); the
    baseline's variables are known.

    Raises:
        ValueError: names the variable and the closest valid name.
    """
    known = ENV_NAMES
    for name in sorted(k for k in environ if k.startswith(_ENV_PREFIX) and k not in known):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}? " if close else ""
        raise EssPatchValueError(
            f"{name} is not an ESS-LR setting: {hint}Known: {', '.join(known)}. Rename "
            f"or unset {name}"
        )


#: What each ``ESS_LR_*`` variable takes, for the error that names a bad one.
_ALLOWED = {
    "floor": "a number in (0, 1], the smallest fraction of the scheduled LR (e.g. 0.1)",
    "base_ratio": "a finite number > 0 (e.g. 1.0)",
    "shadow": "1, 0, true or false",
    "weight_clip": "a finite number > 0, or none (no clipping)",
    "calibrate_rollouts": "an integer >= 0, the rollouts to calibrate on (0: off)",
    "warn_threshold": "a number in [0, 1], the rho the early warning watches for (0: off)",
    "warn_patience": "an integer >= 1, the results in a row below the warning threshold",
    **{name: ", ".join(choices) for name, choices in CHOICES.items()},
}


def _bad_variable(variable: str, name: str, raw: str, error: Exception) -> str:
    allowed = _ALLOWED.get(name)
    return (
        f"{variable}={raw!r} is not a valid ESS-LR setting"
        + (f"; allowed: {allowed}" if allowed else "")
        + f" ({error}). Fix or unset {variable}"
    )


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool):
        raise EssPatchValueError(f"EssLrConfig.{name}={value!r} must be a number, not a bool")
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise EssPatchValueError(f"EssLrConfig.{name}={value!r} is not a number") from None
    if out != out:
        raise EssPatchValueError(f"EssLrConfig.{name} is NaN; give a number")
    return out


def _weight_clip(value: object) -> float | None:
    # from_env hands "none" over for "no clipping" (an empty variable is simply not read)
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None
    clip = _as_float("weight_clip", value)
    if not 0.0 < clip < math.inf:
        raise EssPatchValueError(
            f"EssLrConfig.weight_clip={value!r} must be a finite number > 0 (each trajectory "
            "weight w_i = exp(m_i) becomes min(w_i, weight_clip)), or None for no clipping"
        )
    return clip


#: More rollouts than any run holds: a typo (e.g. a learning rate in the wrong field).
_MAX_CALIBRATION = 1_000_000


def _whole(value: object) -> int | None:
    """``value`` as a whole number, or None. From_env and the options hand strings over:
    "4" and 4.0 yes; "4.5", "-1" (a sign), True no."""
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str) and text.lstrip("+").isdecimal():
        text = int(text)
    if isinstance(text, float) and text.is_integer():
        text = int(text)
    return None if isinstance(text, bool) or not isinstance(text, int) else text


def _calibration(value: object) -> int:
    text = _whole(value)
    if text is None or not 0 <= text <= _MAX_CALIBRATION:
        raise EssPatchValueError(
            f"EssLrConfig.calibrate_rollouts={value!r} must be a whole number of rollouts in "
            f"[0, {_MAX_CALIBRATION}]: the base ratio is calibrated from the mean rho of the "
            "first that many measured rollouts (0: off, base_ratio as given)"
        )
    return text


def check_rule(threshold: object, patience: object) -> tuple[float, int]:
    """``(threshold, patience)`` as numbers, or ``ValueError`` naming the bad one.

    ``threshold`` in [0, 1] (0: the rule never fires, rho is never below 0); ``patience`` a
    whole number >= 1."""
    if isinstance(threshold, bool):
        raise EssPatchValueError(
            f"early-warning threshold {threshold!r} must be a number, not a bool"
        )
    try:
        value = float(threshold)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise EssPatchValueError(f"early-warning threshold {threshold!r} is not a number") from None
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise EssPatchValueError(
            f"early-warning threshold {threshold!r} must be in [0, 1]: the rule fires when rho "
            f"(ESS / B, in (0, 1]) stays below it (default {DEFAULT_THRESHOLD}; 0 turns it off)"
        )
    whole = _whole(patience)
    if whole is None or whole < 1:
        raise EssPatchValueError(
            f"early-warning patience {patience!r} must be a whole number >= 1: the consecutive "
            f"results below the threshold before it fires (default {DEFAULT_PATIENCE})"
        )
    return value, whole


_TRUE = ("1", "true")
_FALSE = ("0", "false")


def _as_bool(name: str, value: object) -> bool:
    # from_env hands strings over: only unambiguous spellings, never Python truthiness
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    env = _ENV_PREFIX + name.upper()
    raise EssPatchValueError(
        f"EssLrConfig.{name}={value!r} (or {env}) must be a bool: 1/0/true/false"
    )


def _encode_field(name: str, value: object) -> float:
    if value is None:
        return -math.inf
    if name in CHOICES:
        return float(CHOICES[name].index(value))  # type: ignore[arg-type]
    if isinstance(value, str):
        return float(zlib.crc32(value.encode()))
    return float(value)  # type: ignore[arg-type]


def describe_fingerprint(values: list[float]) -> dict[str, object]:
    """The field values an :meth:`EssLrConfig.fingerprint` stands for (for error messages)."""
    out: dict[str, object] = {}
    for f, v in zip(fields(EssLrConfig), values, strict=True):
        if f.name in CHOICES and 0 <= v < len(CHOICES[f.name]):
            out[f.name] = CHOICES[f.name][int(v)]
        elif f.type in ("bool", bool):
            out[f.name] = bool(v)
        elif v == -math.inf:
            out[f.name] = None
        else:
            out[f.name] = v
    return out


#: Floats in a fingerprint (one per field of :class:`EssLrConfig`).
FINGERPRINT_SIZE = len(fields(EssLrConfig))
