"""``ess-patch demo --scenario weights``: which trajectory weights, measured on the demo's policy.

One process, the demo's megatron-core ``GPTModel`` (fp32 trainer) and its bf16 KV-cache
rollout engine (:mod:`.policy`). For each response length (16 to 256 tokens) it samples a few
rollouts of ``batch`` trajectories from the rollout policy ``theta_0`` and scores them with the
trainer at lag 0 (``theta_0`` itself, fp32) and at lag k (``theta_k``: ``theta_0`` after k Adam
updates of on-policy policy gradient on the task, the demo's learning rate and clipping). The
rollout log-probs carry the engine's own bf16-vs-fp32 mismatch, and optionally injected
per-token noise ``N(0, s^2)`` with ``s = level * sqrt(pi / 2)`` so that its mean ``|noise|``
per token is ``level``: 0.139 and 0.369 nats, the mean ``|train - rollout|`` miles issue #2722
reports for MoE models with and without routing replay.

For every (length, mismatch, lag) it reports rho and the scale (sqrt rule, floor 0.1) of
geometric and product weights, the product scale with the calibrated remedy
(``calibrate_rollouts``: the first rollouts at lag 0 calibrate, the others are measured), the
on-policy product rho the advice rule predicts (``exp(-L v)``) and the advice itself
(:func:`ess_patch.analyze.advice.advise`, the rule ``ess-patch analyze`` applies to a user's
dumps). Writes ``weights.md`` (table), ``weights.json`` (every row) and ``weights.png`` (rho
against response length, both weights).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ... import calibration
from ...analyze.advice import TokenStats, advise, evidence, on_policy_product_rho, token_stats
from ...compute import compute_ess_lr
from ...config import EssLrConfig
from ...errors import EssPatchRuntimeError, EssPatchValueError

__all__ = ["LEVELS", "WeightsConfig", "WeightsResult", "quick_weights_config", "run_weights"]

#: (name, injected mean |noise| per token): the engine's bf16 alone, then miles #2722's levels.
LEVELS: tuple[tuple[str, float], ...] = (
    ("bf16 engine", 0.0),
    ("+ MoE, routing replay", 0.139),
    ("+ MoE, no replay", 0.369),
)
FLOOR = 0.1


@dataclass(frozen=True)
class WeightsConfig:
    """What the measurement runs (defaults: a few minutes on 2 CPU cores)."""

    lengths: tuple[int, ...] = (16, 32, 64, 128, 256)
    levels: tuple[tuple[str, float], ...] = LEVELS
    #: 8: the demo's maximum lag; 2: a milder one
    lags: tuple[int, ...] = (0, 2, 8)
    #: trajectories per rollout (B)
    batch: int = 64
    #: rollouts per length; the first ``calibrate`` (at lag 0) calibrate, the rest are measured
    rollouts: int = 8
    #: as advised (``advice.CALIBRATE_ROLLOUTS``)
    calibrate: int = 4
    seed: int = 0
    task: str = "sort"
    #: the length the lag-k policy is trained at (its updates reach every length)
    train_length: int = 16
    group_size: int = 4
    lr: float = 1e-3
    clip_grad: float = 1.0
    num_layers: int = 2
    hidden: int = 64

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1:
            raise EssPatchValueError(f"lengths {self.lengths}: give response lengths >= 1")
        if 0 not in self.lags or min(self.lags) < 0:
            raise EssPatchValueError(f"lags {self.lags}: give lags >= 0, including 0")
        if not 1 <= self.calibrate < self.rollouts:
            raise EssPatchValueError(
                f"calibrate {self.calibrate}, rollouts {self.rollouts}: calibrate on at least "
                "one rollout and keep at least one to measure"
            )
        if self.batch < 2 or self.batch % self.group_size:
            raise EssPatchValueError(
                f"batch {self.batch}: a multiple of group_size {self.group_size}"
            )


def quick_weights_config(**overrides: Any) -> WeightsConfig:
    """A smoke run of seconds: short lengths, small batches."""
    base = WeightsConfig(
        lengths=(16, 32), lags=(0, 2), batch=16, rollouts=3, calibrate=1, train_length=8
    )
    return replace(base, **overrides)


@dataclass
class WeightsResult:
    rows: list[dict]
    table: str
    out_dir: Path
    wall_s: float
    files: list[Path] = field(default_factory=list)


def run_weights(
    cfg: WeightsConfig, out: Path, *, progress: Callable[[int], Callable[[str], None]] | None = None
) -> WeightsResult:
    """Measure, then write ``weights.md``, ``weights.json``, ``weights.png`` into ``out``.

    ``progress(total)`` returns a tick called once per sampled rollout (the CLI's tqdm bar).
    """
    from ..policy import single_process

    start = time.perf_counter()
    total = len(cfg.lengths) * cfg.rollouts + max(cfg.lags)
    tick = progress(total) if progress is not None else (lambda _what: None)
    with single_process():
        rows = _measure(cfg, tick)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, cfg)
    files = [out / "weights.md", out / "weights.json", out / "weights.png"]
    files[0].write_text(table + "\n")
    payload = {"config": asdict(cfg), "rows": rows}
    files[1].write_text(json.dumps(payload, indent=2) + "\n")
    figure(rows, files[2])
    return WeightsResult(rows, table, out, time.perf_counter() - start, files)


# --- the measurement ---------------------------------------------------------------------------


def _measure(cfg: WeightsConfig, tick: Callable[[str], None]) -> list[dict]:
    from .. import task
    from ..policy import PolicySpec, RolloutEngine, build_policy, train_logprobs

    longest = max(cfg.lengths)
    spec = PolicySpec(
        num_layers=cfg.num_layers,
        hidden=cfg.hidden,
        max_len=task.prompt_length(cfg.task, longest) + longest,
    )
    torch.manual_seed(cfg.seed)
    model = build_policy(spec)
    engine = RolloutEngine(spec)
    weights = _lagged_weights(cfg, model, engine, tick)
    engine.load(weights[0])  # every rollout comes from theta_0
    rows: list[dict] = []
    for length in cfg.lengths:
        gen = torch.Generator().manual_seed(cfg.seed * 1000 + length)
        samples = []
        for _ in range(cfg.rollouts):
            prompts = task.make_prompts(cfg.task, length, cfg.batch, gen)
            out = engine.sample(prompts, length, gen)
            tick(f"L={length}")
            train = {}
            with torch.no_grad():
                for lag in cfg.lags:
                    model.load_state_dict(weights[lag], strict=True)
                    train[lag] = train_logprobs(model, prompts, out.tokens).float()
            samples.append((out.logp, train))
        for index, (name, level) in enumerate(cfg.levels):
            noise = torch.Generator().manual_seed(cfg.seed * 7919 + length * 31 + index)
            sigma = level * math.sqrt(math.pi / 2)  # E|N(0, s^2)| = s sqrt(2 / pi)
            noisy = [
                (rlp + sigma * torch.randn(rlp.shape, generator=noise), train)
                for rlp, train in samples
            ]
            rows.extend(_cell(cfg, length, name, level, noisy))
    return rows


def _lagged_weights(
    cfg: WeightsConfig, model: Any, engine: Any, tick: Callable[[str], None]
) -> dict[int, dict]:
    """``theta_k`` for each lag k: ``theta_0`` after k on-policy Adam updates (policy gradient
    with group-relative advantages on the task, at ``train_length``)."""
    from .. import task
    from ..policy import global_weights, train_logprobs

    weights = {0: global_weights(model)}
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed + 17)
    groups = cfg.batch // cfg.group_size
    for step in range(1, max(cfg.lags) + 1):
        engine.load(global_weights(model))
        prompts = task.make_prompts(cfg.task, cfg.train_length, groups, gen)
        prompts = prompts.repeat_interleave(cfg.group_size, dim=0)
        out = engine.sample(prompts, cfg.train_length, gen)
        reward = task.rewards(out.tokens, task.targets(cfg.task, prompts, cfg.train_length))
        grouped = reward.view(groups, cfg.group_size)
        advantage = (grouped - grouped.mean(1, keepdim=True)).view(-1)
        logp = train_logprobs(model, prompts, out.tokens)
        loss = -(advantage[:, None] * logp).mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        optimizer.step()
        tick(f"update {step}")
        if step in cfg.lags:
            weights[step] = global_weights(model)
    return weights


def _results(rlp: torch.Tensor, train: torch.Tensor, config: EssLrConfig):
    masks = [torch.ones(rlp.shape[1], dtype=torch.bool)] * rlp.shape[0]
    return compute_ess_lr(list(train), list(rlp), masks, config=config)


def _cell(cfg: WeightsConfig, length: int, name: str, level: float, noisy: list) -> list[dict]:
    """The rows of one (length, mismatch): one per lag, means over the measured rollouts."""
    measured = noisy[cfg.calibrate :]
    geometric = EssLrConfig(weight_mode="geometric", floor=FLOOR)
    product = EssLrConfig(weight_mode="product", floor=FLOOR)
    calibrated = replace(product, calibrate_rollouts=cfg.calibrate)
    # the remedy as a run meets it: the first rollouts (lag 0) calibrate, then it brakes
    calibration.restart()
    for rlp, train in noisy[: cfg.calibrate]:
        status = _results(rlp, train[0], calibrated).status
        if status != "calibrating":
            raise EssPatchRuntimeError(
                f"the weights scenario expected a calibrating result, got {status}"
            )
    rows = []
    lag0_stats: list[TokenStats] = []
    lag0_scales: dict[str, list[float]] = {"geometric": [], "product": []}
    for lag in cfg.lags:
        got: dict[str, list[float]] = {}
        stats: list[TokenStats] = []
        for rlp, train in measured:
            lp = train[lag]
            stats.append(token_stats(list(lp), list(rlp), [torch.ones(length)] * len(lp)))
            for key, config in (("geometric", geometric), ("product", product)):
                r = _results(rlp, lp, config)
                got.setdefault(f"rho_{key}", []).append(r.rho)
                got.setdefault(f"scale_{key}", []).append(r.scale)
            r = _results(rlp, lp, calibrated)
            got.setdefault("scale_calibrated", []).append(r.scale)
            got.setdefault("calibrated_ratio", []).append(r.calibrated_ratio)
        ev = evidence(stats, got["scale_geometric"], got["scale_product"], lag0=lag == 0)
        if lag == 0:
            lag0_stats, lag0_scales = stats, {k: got[f"scale_{k}"] for k in lag0_scales}
        rows.append(
            {
                "length": length,
                "mismatch": name,
                "injected": level,
                "lag": lag,
                "mean_abs_d": ev.mismatch,
                "token_variance": ev.token_variance,
                "predicted_product_rho": on_policy_product_rho(
                    length, ev.token_variance, ev.trajectories
                ),
                **{key: _mean(values) for key, values in got.items()},
                # the worst rollout: each rollout's LR is scaled by its own rho
                **{f"min_{key}": min(values) for key, values in got.items()},
                "rollouts": len(measured),
            }
        )
    advice = advise(evidence(lag0_stats, *lag0_scales.values(), lag0=True))
    for row in rows:
        row["advice"] = advice.weights
    calibration.restart()
    return rows


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


# --- outputs -----------------------------------------------------------------------------------


def markdown(rows: list[dict], cfg: WeightsConfig) -> str:
    """One table per mismatch level: rows by length, lag 0 and lag k side by side."""
    lags = cfg.lags
    head = ["length", "mean abs(d)"]
    for lag in lags:
        head += [
            f"lag {lag}: geometric rho / scale",
            f"lag {lag}: product rho / scale",
            f"lag {lag}: product, calibrated: scale (worst)",
        ]
    head.append("advice")
    parts = []
    for name, level in cfg.levels:
        parts.append(f"**{name}** (injected mean abs noise {level:g} nats/token)\n")
        parts.append("| " + " | ".join(head) + " |")
        parts.append("|" + "---|" * len(head))
        for length in cfg.lengths:
            mine = {r["lag"]: r for r in rows if r["mismatch"] == name and r["length"] == length}
            cells = [str(length), f"{mine[0]['mean_abs_d']:.4f}"]
            for lag in lags:
                r = mine[lag]
                cells += [
                    f"{r['rho_geometric']:.4f} / {r['scale_geometric']:.3f}",
                    f"{r['rho_product']:.4f} / {r['scale_product']:.3f}",
                    f"{r['scale_calibrated']:.3f} ({r['min_scale_calibrated']:.3f})",
                ]
            cells.append(mine[0]["advice"])
            parts.append("| " + " | ".join(cells) + " |")
        parts.append("")
    return "\n".join(parts).rstrip()


def figure(rows: list[dict], path: Path) -> None:
    """rho against response length, geometric and product weights, one line per mismatch and
    lag (dashed: the on-policy product rho the advice rule predicts)."""
    import matplotlib

    from .. import report

    with report.figure(path, 1, 2, figsize=(13, 4.8), dpi=110) as (fig, axes):
        names = list(dict.fromkeys(r["mismatch"] for r in rows))
        lags = sorted({r["lag"] for r in rows})
        colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
        styles = ("-o", "--s", ":^", "-.v")
        for ax, mode in zip(axes, ("geometric", "product"), strict=True):
            for i, name in enumerate(names):
                for j, lag in enumerate(lags):
                    pts = sorted(
                        (r["length"], r[f"rho_{mode}"])
                        for r in rows
                        if (r["mismatch"], r["lag"]) == (name, lag)
                    )
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        styles[j % len(styles)],
                        color=colors[i % len(colors)],
                        label=f"{name}, lag {lag}",
                        ms=4,
                    )
                if mode == "product":
                    pred = sorted(
                        (r["length"], r["predicted_product_rho"])
                        for r in rows
                        if (r["mismatch"], r["lag"]) == (name, 0)
                    )
                    ax.plot(
                        [p[0] for p in pred],
                        [p[1] for p in pred],
                        color=colors[i % len(colors)],
                        lw=0.8,
                        alpha=0.5,
                    )
            ax.set_xscale("log", base=2)
            if mode == "product":
                ax.set_yscale("log")
            else:  # it stays near 1: a linear axis shows how near
                ax.set_ylim(0.95, 1.002)
            ax.set_xlabel("response length (tokens)")
            ax.set_title(f"{mode} weights")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("rho = ESS / B")
        axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.suptitle(
            "rho against response length (thin line: exp(-L v), the advice rule's prediction)"
        )
        fig.tight_layout()
