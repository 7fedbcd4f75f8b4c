"""``ess-patch demo``'s scenarios as a table (:data:`SCENARIOS`): each runner checks the
options that apply to it, runs its scenario (``ess_patch.demo``: main_job, collapse, stress,
weights, and the mixed arms run) and prints its tables."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .cli_demo import (
    _demo_options,
    _ess_settings,
    _guarded,
    _install_hint,
    _out_dir,
    _progress,
    _refused,
)
from .errors import EssPatchValueError


def run_demo(args: argparse.Namespace) -> int:
    """``ess-patch demo``: logging, the demo extra's presence, then the scenario's runner."""
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from .doctor import findable

    missing = [m for m in ("megatron.core", "matplotlib", "tqdm") if not findable(m)]
    if missing:
        print(
            f"ess-patch demo: {', '.join(missing)} not installed; install the demo extra: "
            + _install_hint("demo"),
            file=sys.stderr,
        )
        return 2
    return SCENARIOS[args.scenario](args)


def _run_mixed(args: argparse.Namespace) -> int:
    """``--scenario mixed``: one run of the arms, DP2, workers up to ``--lag`` behind."""
    if args.seeds is not None or args.lags is not None:
        print("ess-patch demo: --seeds and --lags need --scenario stress", file=sys.stderr)
        return 2

    from .demo import DemoConfig, quick_config, run
    from .demo.train import DemoConfigError

    options = _demo_options(args)
    try:
        options["ess"] = _ess_settings(args)
    except ValueError as exc:
        return _refused(exc)
    try:
        cfg = quick_config(**options) if args.quick else DemoConfig(**options)
    except DemoConfigError as exc:
        return _refused(exc)
    out = _out_dir(args, "")
    if out is None:
        return 2
    print(
        f"ess-patch demo: {cfg.world_size} ranks (dp={cfg.dp} tp={cfg.tp} pp={cfg.pp}) on "
        f"{cfg.device}, {cfg.num_layers}-layer GPTModel, task {cfg.task} x{cfg.response_len} "
        f"tokens, {cfg.loss} loss, {cfg.steps} steps per arm ({', '.join(cfg.arms)}), "
        f"{cfg.rollout_workers} rollout workers per DP rank, max lag {cfg.lag}"
    )
    bar = _progress(cfg.steps * len(cfg.arms), "step", args.no_progress)

    def on_step(arm: str, step: int) -> None:
        bar.set_description(f"ESS-LR {arm}", refresh=False)
        bar.update(1)

    result, code = _guarded(bar, out, lambda: run(cfg, out, on_step=on_step))
    if code is not None:
        return code
    _table(result.table, "LR scaled = steps whose applied LR was below the scheduled LR")
    print(result.timing)
    print()
    print(f"finished in {result.wall_s:.0f}s; outputs in {result.out_dir.resolve()}:")
    for path in (*result.figures, result.records_path, result.summary_path):
        print(f"  {path.name}")
    print("  config.json, tb/ (TensorBoard events, if tensorboard is installed), ranks/")
    return 0


def _table(table: str, legend: str) -> None:
    """Print a scenario's table and what its columns mean."""
    print()
    print(table)
    print()
    print(
        "collapsed = the smoothed reward ends more than half of its peak gain below the peak; "
        + legend
    )


def _run_stress(args: argparse.Namespace) -> int:
    from .demo.scenarios.stress import QUICK_STEPS, STRESS, run_stress, stress_config

    options = _demo_options(
        args, "steps", "lag", "workers", "dp", "tp", "pp", "cp", "device", "response_len"
    )
    fixed = [
        f"--{flag.replace('_', '-')}"
        for flag in ("task", "layers", "lr", "loss", "arms")
        if getattr(args, flag) is not None
    ]
    if fixed:
        print(
            f"ess-patch demo: --scenario stress fixes {', '.join(fixed)} (chosen from the off "
            "arm alone, see benchmarks/stress_select.py); drop them",
            file=sys.stderr,
        )
        return 2
    if args.quick:
        options.setdefault("steps", QUICK_STEPS)
    seeds = args.seeds if args.seeds is not None else (2 if args.quick else 8)
    if args.seed is not None or args.weight_mode is not None:
        print(
            "ess-patch demo: --scenario stress runs seeds 0..N-1 (--seeds) and both weight "
            "modes; drop --seed / --weight-mode",
            file=sys.stderr,
        )
        return 2
    try:
        # the scenario's weight mode is its control arm's (each ESS-LR arm sets its own)
        options["ess"] = _ess_settings(args, weight_mode=STRESS["ess"].weight_mode)
        cfg = stress_config(**options)
        if seeds < 2:
            raise EssPatchValueError(f"--seeds {seeds}: paired statistics need at least 2 seeds")
    except ValueError as exc:  # DemoConfigError included
        return _refused(exc)
    lags = sorted({cfg.lag, *(args.lags or ())})
    out = _out_dir(args, "stress-")
    if out is None:
        return 2
    print(
        f"ess-patch demo --scenario stress: {cfg.world_size} ranks, {cfg.steps} steps, "
        f"{cfg.loss} loss, lr {cfg.lr:g}, max lag {', '.join(map(str, lags))}; "
        f"{seeds} paired seeds x arms {', '.join(cfg.arms)}"
    )
    bar = _progress(len(lags) * seeds * len(cfg.arms) * cfg.steps, "step", args.no_progress)

    def on_step(lag: int, seed: int, arm: str, step: int) -> None:
        bar.set_description(f"lag {lag} seed {seed} {arm}", refresh=False)
        bar.update(1)

    result, code = _guarded(
        bar, out, lambda: run_stress(cfg, out, seeds=seeds, lags=lags, on_step=on_step)
    )
    if code is not None:
        return code
    _table(
        result.table,
        "constant = armed every step with the mean scale of the same seed's product run",
    )
    print(f"finished in {result.wall_s:.0f}s; outputs in {result.out_dir.resolve()}:")
    for path in (result.figure, result.table_path, result.steps_path, result.summary_path):
        print(f"  {path.name}")
    return 0


def _run_main(args: argparse.Namespace) -> int:
    """``ess-patch demo`` (the main job): :mod:`ess_patch.demo.scenarios.main_job`, one seed,
    printed."""
    from .demo.scenarios import main_job

    refused = [
        f"--{n.replace('_', '-')}"
        for n in ("dp", "tp", "pp", "cp", "workers", "seeds", "lags", "lag_seeds")
        if getattr(args, n) is not None and getattr(args, n) is not False
    ]
    if refused:
        print(
            f"ess-patch demo: {', '.join(refused)} do not apply to the main job (one rank per "
            "run, one seed: --seed); the 8-seed version is --scenario collapse: "
            + main_job.EIGHT_SEEDS,
            file=sys.stderr,
        )
        return 2
    options = _demo_options(args, "steps", "lag", "device", "lr", "loss", "arms", "staleness")
    if args.quick:
        options = {**main_job.QUICK, **options}
    jobs = 2 if args.jobs is None else args.jobs
    try:
        options["ess"] = _ess_settings(args, weight_mode="product")
        cfg = main_job.main_config(**options)
        if "sync" not in cfg.arms or jobs < 1:
            raise EssPatchValueError(
                f"--arms {','.join(cfg.arms)} --jobs {jobs}: keep sync, >= 1 job"
            )
    except ValueError as exc:  # DemoConfigError included
        return _refused(exc)
    seed = main_job.MAIN_SEED if args.seed is None else args.seed
    out = _out_dir(args, "main-")
    if out is None:
        return 2
    print(
        f"ess-patch demo: LR {cfg.lr:g} (tuned on the synchronous arm), every rollout {cfg.lag} "
        f"updates stale, {cfg.task} x{cfg.response_len}, {cfg.loss} loss, {cfg.steps} steps, "
        f"seed {seed}, arms {', '.join(cfg.arms)}; {jobs} run(s) at a time"
    )
    bar = _progress(len(cfg.arms) * cfg.steps, "step", args.no_progress)

    def on_run(_seed: int, arm: str) -> None:
        bar.set_description(f"{arm} done")
        bar.update(cfg.steps)

    result, code = _guarded(
        bar,
        out,
        lambda: main_job.run_main(
            cfg, out, seed=seed, jobs=jobs, cache_dir=args.cache_dir, on_run=on_run
        ),
    )
    if code is not None:
        return code
    print()
    print(result.table)
    print()
    print(result.reading)
    print(
        "final = smoothed reward (20-step mean) at the end; collapsed: judged against the "
        "sync run (ess_patch/demo/criterion.py); 8 seeds, with the per-lag oracle LR: "
        "docs/demo.md. The same runs on 8 paired seeds:"
    )
    print(f"  {main_job.EIGHT_SEEDS}")
    print(f"finished in {result.wall_s:.0f}s; outputs in {out.resolve()}:")
    for path in result.files:
        print(f"  {path.name}")
    return 0


def _collapse_settings(args: argparse.Namespace) -> tuple[Any, int] | int:
    """The collapse scenario's config and seed count from the flags, or the exit code of a
    refusal (already printed)."""
    from .demo.scenarios import collapse

    refused = [f"--{n}" for n in ("seed", "dp", "tp", "pp", "cp", "workers") if getattr(args, n)]
    if refused:
        print(
            f"ess-patch demo --scenario collapse: {', '.join(refused)} do not apply (one rank "
            "per run, one rollout stream, seeds 0..N-1 from --seeds); drop them",
            file=sys.stderr,
        )
        return 2
    options = _demo_options(
        args,
        "steps",
        "lag",
        "device",
        "task",
        "response_len",
        "layers",
        "lr",
        "loss",
        "arms",
        "is_threshold",
        "staleness",
    )
    if args.quick:
        options = {**collapse.QUICK, **options}
    seeds = args.seeds if args.seeds is not None else (2 if args.quick else 8)
    args.jobs = 1 if args.jobs is None else args.jobs
    try:
        options["ess"] = _ess_settings(args, weight_mode="product")
        cfg = collapse.collapse_config(**options)
        if seeds < 2 or args.jobs < 1:
            raise EssPatchValueError(
                f"--seeds {seeds} --jobs {args.jobs}: give >= 2 seeds, >= 1 job"
            )
    except ValueError as exc:  # DemoConfigError included
        return _refused(exc)
    return cfg, seeds


def _run_collapse(args: argparse.Namespace) -> int:
    """``ess-patch demo --scenario collapse``: parse, run
    :mod:`ess_patch.demo.scenarios.collapse`, print."""

    settings = _collapse_settings(args)
    if isinstance(settings, int):
        return settings
    cfg, seeds = settings
    out = _out_dir(args, "collapse-")
    if out is None:
        return 2
    print(
        f"ess-patch demo --scenario collapse: {cfg.task} x{cfg.response_len}, {cfg.loss} loss, "
        f"lr {cfg.lr:g}, every rollout {cfg.lag} updates stale, {cfg.steps} steps; seeds "
        f"0..{seeds - 1} x arms {', '.join(cfg.arms)}; {args.jobs} job(s)"
        + (f"; then the adaptivity sweep over lags {args.lags}" if args.lags else "")
    )
    lag_seeds = min(args.lag_seeds or seeds, seeds)
    sweep = len(args.lags or ()) * lag_seeds * 2 + (lag_seeds if args.lags else 0)
    bar = _progress((seeds * len(cfg.arms) + sweep) * cfg.steps, "step", args.no_progress)

    def on_run(seed: int, arm: str) -> None:
        bar.set_description(f"seed {seed} {arm} done")
        bar.update(cfg.steps)

    runs, code = _guarded(
        bar, out, lambda: _collapse_runs(args, cfg, out, seeds, lag_seeds, on_run)
    )
    if code is not None:
        return code
    result, files, tables = runs
    print()
    print("\n\n".join(tables))
    print()
    print(
        "final = smoothed reward (20-step mean) at the end; collapsed: judged against the same "
        "seed's sync run (ess_patch/demo/criterion.py); constant = the same seed's product "
        "mean scale (adaptivity: one scale, product's mean over seeds at the scenario's lag)"
    )
    print(f"finished in {result.wall_s:.0f}s; outputs in {out.resolve()}:")
    for path in files:
        print(f"  {path.name}")
    return 0


def _collapse_runs(
    args: argparse.Namespace,
    cfg: Any,
    out: Path,
    seeds: int,
    lag_seeds: int,
    on_run: Callable[[int, str], None],
) -> tuple[Any, list[Path], list[str]]:
    """The scenario's runs, then the adaptivity sweep if ``--lags``: the result, its files and
    its tables."""
    import dataclasses

    from .demo.scenarios import collapse

    result = collapse.run_collapse(
        cfg, out, seeds=range(seeds), jobs=args.jobs, cache_dir=args.cache_dir, on_run=on_run
    )
    files = list(result.files)
    tables = [result.table]
    if args.lags:
        scale = result.summary["arms"][cfg.control_of]["mean_lr_scale"]
        adapt = collapse.run_adaptivity(
            dataclasses.replace(cfg, arms=("product", "constant")),
            out,
            seeds=range(lag_seeds),
            lags=args.lags,
            constant_scale=scale,
            jobs=args.jobs,
            cache_dir=args.cache_dir,
            on_run=on_run,
        )
        files += adapt.files
        tables.append(adapt.table)
    return result, files, tables


#: What the weights scenario reads of the demo's options; any other given is refused.
_WEIGHTS_OPTIONS = ("command", "func", "scenario", "seed", "out", "quick", "no_progress", "verbose")


def _run_weights(args: argparse.Namespace) -> int:
    """``ess-patch demo --scenario weights`` (the CLI's parsed ``args``)."""
    from .demo.scenarios.weights import WeightsConfig, quick_weights_config, run_weights

    # the training scenarios' settings mean nothing here: say so rather than ignore them
    ignored = [
        "--" + name.replace("_", "-")
        for name, value in vars(args).items()
        if name not in _WEIGHTS_OPTIONS and value is not None and value is not False
    ]
    if ignored:
        print(
            f"ess-patch demo --scenario weights: {', '.join(ignored)} do not apply (it measures "
            "geometric and product weights with the default rule; it takes --seed, --quick, "
            "--out, --no-progress)",
            file=sys.stderr,
        )
        return 2
    options: dict[str, Any] = {}
    if getattr(args, "seed", None) is not None:
        options["seed"] = args.seed
    try:
        cfg = quick_weights_config(**options) if args.quick else WeightsConfig(**options)
    except ValueError as exc:
        print(f"ess-patch demo --scenario weights: {exc}", file=sys.stderr)
        return 2
    out = _out_dir(args, "weights-")
    if out is None:
        return 2
    print(
        f"ess-patch demo --scenario weights: lengths {', '.join(map(str, cfg.lengths))}, "
        f"lags {', '.join(map(str, cfg.lags))}, {cfg.rollouts} rollouts of {cfg.batch} each "
        f"(the first {cfg.calibrate} calibrate)"
    )
    bar = None

    def progress(total: int) -> Callable[[str], None]:
        nonlocal bar
        bar = _progress(total, "batch", args.no_progress)

        def tick(what: str) -> None:
            bar.set_description(what, refresh=False)
            bar.update(1)

        return tick

    result = run_weights(cfg, Path(out), progress=progress)
    if bar is not None:
        bar.close()
    print()
    print(result.table)
    print()
    print(
        "rho = ESS/B over each rollout's trajectories; scale = clamp(sqrt(rho / base), 0.1, 1); "
        "calibrated: product weights with calibrate_rollouts (--ess-lr-calibrate-rollouts)"
    )
    print(f"finished in {result.wall_s:.0f}s; outputs in {result.out_dir.resolve()}:")
    for path in result.files:
        print(f"  {path.name}")
    return 0


#: ``--scenario`` -> its runner (``ess-patch demo`` dispatches on it).
SCENARIOS: dict[str, Callable[[argparse.Namespace], int]] = {
    "main": _run_main,
    "mixed": _run_mixed,
    "stress": _run_stress,
    "weights": _run_weights,
    "collapse": _run_collapse,
}
