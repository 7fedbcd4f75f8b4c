"""Per rollout and per setting: rho, ESS and the scale ESS-LR would have applied.

Outputs, all inside the ``out`` folder (fixed names, nothing else is written):
``per_rollout.csv``, ``summary.md`` (the table also returned, and which weights suit the run:
:mod:`.advice`), ``summary.json`` and ``analyze.png`` (rho and scale against rollout, one line
per setting).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..compute import compute_ess_lr
from ..config import (
    DEFAULT_PATIENCE,
    DEFAULT_THRESHOLD,
    RULES,
    WEIGHT_MODES,
    EssLrConfig,
    check_rule,
)
from .advice import Advice, TokenStats, advise, evidence, token_stats
from .assemble import discover, iter_rollouts
from .read import DumpError
from .warning import RunWarning, early_warnings

__all__ = ["OUTPUT_NAMES", "AnalyzeResult", "Setting", "analyze", "default_settings"]

OUTPUT_NAMES = ("per_rollout.csv", "summary.md", "summary.json", "analyze.png")
DEFAULT_FLOORS = (0.1, 0.3)


@dataclass(frozen=True)
class Setting:
    """One ESS-LR configuration to replay."""

    weight_mode: str
    rule: str
    floor: float

    @property
    def label(self) -> str:
        return f"{self.weight_mode}/{self.rule}/floor={self.floor:g}"

    def config(self) -> EssLrConfig:
        # "floor": a NaN/inf token in a dump shows as a floored rollout instead of aborting.
        return EssLrConfig(
            weight_mode=self.weight_mode, rule=self.rule, floor=self.floor, nonfinite="floor"
        )


def default_settings(
    weight_modes: Sequence[str] = WEIGHT_MODES,
    rules: Sequence[str] = RULES,
    floors: Sequence[float] = DEFAULT_FLOORS,
) -> list[Setting]:
    """Every combination; each is validated by :class:`EssLrConfig`."""
    settings = [Setting(m, r, float(f)) for m in weight_modes for r in rules for f in floors]
    for s in settings:
        s.config()
    return settings


@dataclass
class AnalyzeResult:
    rows: list[dict]
    summary: list[dict]
    table: str
    out_dir: Path
    num_rollouts: int
    advice: Advice | None = None
    #: the early warning per weight mode replayed (:mod:`.warning`)
    warnings: list[RunWarning] = field(default_factory=list)


def analyze(
    paths: Sequence[Path],
    out: Path,
    settings: Sequence[Setting] | None = None,
    *,
    progress: Callable[[int], Callable[[], None]] | None = None,
    figure: bool = True,
    warn_threshold: float = DEFAULT_THRESHOLD,
    warn_patience: int = DEFAULT_PATIENCE,
) -> AnalyzeResult:
    """Replay ``settings`` over the dumps under ``paths``; write the outputs into ``out``.

    ``progress(total)`` returns a per-rollout tick (the CLI passes a tqdm bar);
    ``warn_threshold`` / ``warn_patience``: the early-warning rule run over each weight mode's
    rho series (:mod:`ess_patch.early_warning`; a threshold of 0: none).

    Raises:
        DumpError: bad input (nothing is written then, except an already existing ``out``).
        ValueError: a bad ``warn_threshold`` or ``warn_patience`` (before any file is read).
    """
    check_rule(warn_threshold, warn_patience)
    settings = default_settings() if settings is None else list(settings)
    out = Path(out)
    groups = discover([Path(p) for p in paths])
    tick = progress(len(groups)) if progress is not None else (lambda: None)
    rows: list[dict] = []
    stats: list[TokenStats] = []
    advice_scales: dict[str, list[float]] = {mode: [] for mode in WEIGHT_MODES}
    if out.exists() and not out.is_dir():  # before the work, not after it
        raise DumpError(f"{out}: --out names an existing file; give a folder (new or existing)")
    for rollout in iter_rollouts(groups):
        for s in settings:
            try:
                r = compute_ess_lr(
                    rollout.log_probs,
                    rollout.rollout_log_probs,
                    rollout.loss_masks,
                    config=s.config(),
                )
            except (TypeError, ValueError) as exc:  # the reader's checks should catch all
                raise DumpError(f"rollout {rollout.rollout_id}: {exc}") from None
            rows.append(
                {
                    "rollout_id": rollout.rollout_id,
                    "weight_mode": s.weight_mode,
                    "rule": s.rule,
                    "floor": s.floor,
                    "rho": r.rho,
                    "ess": r.ess,
                    "num_trajectories": r.num_trajectories,
                    "scale": r.scale,
                    "status": r.status,
                }
            )
        stats.append(token_stats(rollout.log_probs, rollout.rollout_log_probs, rollout.loss_masks))
        for mode, scales in advice_scales.items():  # the default rule, whatever was asked
            config = EssLrConfig(weight_mode=mode, nonfinite="floor")
            r = compute_ess_lr(
                rollout.log_probs, rollout.rollout_log_probs, rollout.loss_masks, config=config
            )
            scales.append(r.scale)
        tick()
    summary = _summarize(rows, settings)
    table = _table(summary)
    advice = advise(evidence(stats, advice_scales["geometric"], advice_scales["product"]))
    warnings = (
        early_warnings(rows, threshold=warn_threshold, patience=warn_patience)
        if warn_threshold > 0
        else []
    )
    out_dir = _prepare_out(Path(out))
    _write_csv(out_dir / "per_rollout.csv", rows)
    advice_md = "\n".join(f"- {line}" for line in advice.lines)
    warning_md = "".join(f"\n- {w.text()}" for w in warnings)
    (out_dir / "summary.md").write_text(
        f"{table}\n\n## Which weights for this run\n\n{advice_md}\n"
        + (f"\n## Early warning (ESS collapse)\n{warning_md}\n" if warnings else "")
    )
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if figure:
        _figure(out_dir / "analyze.png", rows, settings)
    return AnalyzeResult(rows, summary, table, out_dir, len(groups), advice, warnings)


def _prepare_out(out: Path) -> Path:
    if out.exists() and not out.is_dir():
        raise DumpError(f"{out}: --out names an existing file; give a folder (new or existing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DumpError(f"{out}: cannot create the --out folder: {exc.strerror or exc}") from None
    for name in OUTPUT_NAMES:
        target = out / name
        if target.is_symlink() or (target.exists() and not target.is_file()):
            raise DumpError(
                f"{target}: exists and is not a plain file; refusing to write through it"
            )
    return out


def _summarize(rows: list[dict], settings: Sequence[Setting]) -> list[dict]:
    out = []
    for s in settings:
        mine = [
            r
            for r in rows
            if (r["weight_mode"], r["rule"], r["floor"]) == (s.weight_mode, s.rule, s.floor)
        ]
        scales = [r["scale"] for r in mine]
        braked = [r for r in mine if r["scale"] < 1.0]
        worst = sorted(mine, key=lambda r: (r["scale"], r["rollout_id"]))[:3]
        out.append(
            {
                "setting": s.label,
                "weight_mode": s.weight_mode,
                "rule": s.rule,
                "floor": s.floor,
                "rollouts": len(mine),
                "braked": len(braked),
                "braked_fraction": len(braked) / len(mine) if mine else math.nan,
                "at_floor": sum(r["scale"] <= s.floor for r in mine),
                "mean_scale": sum(scales) / len(scales) if scales else math.nan,
                "min_scale": min(scales) if scales else math.nan,
                "mean_scale_when_braked": (
                    sum(r["scale"] for r in braked) / len(braked) if braked else 1.0
                ),
                "worst_rollouts": [[r["rollout_id"], r["scale"]] for r in worst if r["scale"] < 1],
            }
        )
    return out


def _table(summary: list[dict]) -> str:
    head = (
        "| setting | braked | at floor | mean scale (LR multiplier) | scale when braked | "
        "min scale | worst rollouts (id: scale) |"
    )
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in summary:
        worst = ", ".join(f"{rid}: {sc:.3f}" for rid, sc in s["worst_rollouts"]) or "-"
        lines.append(
            f"| {s['setting']} | {s['braked']}/{s['rollouts']} ({100 * s['braked_fraction']:.0f}%)"
            f" | {s['at_floor']} | {s['mean_scale']:.4f} | {s['mean_scale_when_braked']:.4f} | "
            f"{s['min_scale']:.4f} | {worst} |"
        )
    return "\n".join(lines)


def _write_csv(path: Path, rows: list[dict]) -> None:
    fields = [
        "rollout_id",
        "weight_mode",
        "rule",
        "floor",
        "rho",
        "ess",
        "num_trajectories",
        "scale",
        "status",
    ]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in r.items()})


def _figure(path: Path, rows: list[dict], settings: Sequence[Setting]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rho, ax_scale) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for mode in dict.fromkeys(s.weight_mode for s in settings):
        pts = sorted({(r["rollout_id"], r["rho"]) for r in rows if r["weight_mode"] == mode})
        ax_rho.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=mode)
    ax_rho.set_ylabel("rho = ESS / B")
    ax_rho.set_ylim(0, 1.05)
    ax_rho.legend(title="weight mode", fontsize=8)
    floors = list(dict.fromkeys(s.floor for s in settings))
    styles = ("-", "--", ":", "-.")
    for s in settings:
        pts = [
            (r["rollout_id"], r["scale"])
            for r in rows
            if (r["weight_mode"], r["rule"], r["floor"]) == (s.weight_mode, s.rule, s.floor)
        ]
        # One line style per floor: settings that never reach their floor overlap otherwise.
        style = styles[floors.index(s.floor) % len(styles)]
        ax_scale.step(
            [p[0] for p in pts], [p[1] for p in pts], where="mid", ls=style, label=s.label
        )
    ax_scale.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax_scale.set_ylabel("LR scale it would apply")
    ax_scale.set_xlabel("rollout id")
    ax_scale.xaxis.get_major_locator().set_params(integer=True)
    ax_scale.set_ylim(0, 1.05)
    ax_scale.legend(fontsize=7, ncol=2)
    fig.suptitle("ess-patch analyze: below 1 = ESS-LR would brake")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
