"""The ``ess-patch`` command line."""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import __version__
from .config import EssLrConfig
from .errors import EssPatchValueError
from .integrations.flags import add_config_options, given_options

#: The ESS-LR settings the demo takes as flags (``--floor``...; the others do not apply to it).
DEMO_ESS_FIELDS = ("floor", "weight_mode", "rule", "base_ratio", "weight_clip")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ess-patch",
        description="ESS-guided learning-rate scaling for off-policy RL on Megatron.",
    )
    parser.add_argument("--version", action="version", version=f"ess-patch {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(subparsers)
    from .patchset.cli import add_parser as add_patches_parser

    add_patches_parser(subparsers)
    from .analyze.cli import add_parser as add_analyze_parser

    add_analyze_parser(subparsers)
    subparsers.add_parser(
        "doctor",
        help="report versions, patch targets and activation; exit 1 if anything is wrong",
    )
    return parser


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="train a tiny megatron GPTModel with fully-async RL, ESS-LR off and on "
        "(needs the demo extra)",
        description=(
            "Trains a tiny megatron-core GPTModel (local transformer impl) on a digit task with "
            "partial credit (sort / reverse / add), by fully-async RL over local gloo ranks: "
            "rollout workers sample from stale snapshots (up to --lag updates old) with a bf16 "
            "KV-cache engine, the fp32 trainer runs megatron's DDP, optimizer, LR scheduler and "
            "pipeline schedule, patched by ess_patch.install(). Arms with the same seeds (ESS-LR "
            "off, geometric, product ...). Writes config.json, steps.jsonl, summary.json, "
            "figures, TensorBoard events (tb/) and ranks/ (each rank's log) to the output "
            "folder. Context parallelism is not offered: megatron's local attention has none."
        ),
    )
    _add_run_options(demo)
    # ESS-LR's settings, from EssLrConfig's fields: a flag given > ESS_LR_* > the default
    add_config_options(demo, "--", DEMO_ESS_FIELDS, check=False, installed=False)
    _add_scenario_options(demo)


def _add_run_options(demo: argparse.ArgumentParser) -> None:
    """One run's settings: length, layout, device, task, model, loss, staleness, arms."""
    demo.add_argument("--steps", type=int, help="optimizer steps (= rollouts) per arm [150]")
    demo.add_argument("--lag", type=int, help="maximum staleness of a rollout, in updates [8]")
    demo.add_argument("--workers", type=int, help="rollout workers per data-parallel rank [4]")
    demo.add_argument("--seed", type=int, help="seed of the model, the task and the rollouts [0]")
    demo.add_argument("--dp", type=int, help="data-parallel size [2]")
    demo.add_argument("--tp", type=int, help="tensor-parallel size: 1, 2 or 4 [1]")
    demo.add_argument("--pp", type=int, help="pipeline-parallel size, divides the layers [1]")
    demo.add_argument(
        "--cp",
        type=int,
        help="context-parallel size: only 1 (megatron's local attention has no CP)",
    )
    demo.add_argument(
        "--device", choices=("cpu", "cuda"), help="cpu (gloo) or cuda (NCCL, 1 GPU/rank) [cpu]"
    )
    demo.add_argument("--task", choices=("sort", "reverse", "add"), help="the task [sort]")
    demo.add_argument("--response-len", type=int, help="response tokens, 1..256 [16]")
    demo.add_argument("--layers", type=int, help="transformer layers [2]")
    demo.add_argument("--lr", type=float, help="peak learning rate (Adam) [1e-3]")
    demo.add_argument(
        "--loss",
        choices=("tis", "sequence", "seq-tis"),
        help="tis: token-level truncated IS (miles/slime); sequence: sequence-level IS, "
        "untruncated; seq-tis: VCPO's sequence-level truncated IS, min(exp(sum), "
        "--is-threshold), no PPO clip [tis]",
    )
    demo.add_argument("--is-threshold", type=float, help="seq-tis: the truncation threshold c [8]")
    demo.add_argument(
        "--staleness",
        choices=("mixed", "fixed", "drift", "longtail"),
        help="mixed: workers up to --lag updates behind; fixed: every rollout exactly --lag "
        "updates behind, as a fully-async trainer (--scenario collapse); drift: 0 to --lag and "
        "back every 100 steps; longtail: each step's lag drawn with P(k) ~ (k+1)^-2 [mixed]",
    )
    demo.add_argument(
        "--arms",
        type=_name_list,
        help="comma-separated arms among off, on (the --weight-mode... settings), geometric, "
        "product, vcpo (product, per step, no floor), constant (the mean LR of product), "
        "sync, calibrated, baseline / ess+baseline (VCPO's baseline, exact norms), "
        "proxy / ess+proxy (the same, forward-only proxy norms) [off,geometric,product]",
    )


def _add_scenario_options(demo: argparse.ArgumentParser) -> None:
    """Where it writes, which scenario, and the scenarios' own settings."""
    demo.add_argument("--out", type=Path, help="output folder [./ess-demo-out/<date>-<time>]")
    demo.add_argument(
        "--quick", action="store_true", help="a smoke run of a few seconds (12 steps, lag 4)"
    )
    demo.add_argument(
        "--scenario",
        choices=("main", "mixed", "stress", "weights", "collapse"),
        default="main",
        help="main: the collapse scenario's question for one seed (an LR tuned synchronously, "
        "every rollout 8 updates stale: sync, off, ESS-LR, ESS-LR + baseline; about 3 minutes "
        "on 2 cores); mixed: dp=2, rollout workers up to --lag behind, arms off / geometric / "
        "product; collapse: VCPO's fully-async regime from a supervised warm start, every arm "
        "judged against a synchronous run (benchmarks/collapse_select.py, docs/demo.md); "
        "stress: the regime chosen from the off arm alone (benchmarks/stress_select.py), "
        "arms off / geometric / product / constant-LR control / vcpo over paired seeds; "
        "weights: rho and scale of geometric and product weights against response length, lag "
        "and train/rollout mismatch (docs/which-weights.md) [main]",
    )
    demo.add_argument(
        "--seeds", type=int, help="stress, collapse: paired seeds 0..N-1 [8; --quick: 2]"
    )
    demo.add_argument(
        "--lags",
        type=_int_list,
        help="stress: also sweep these max lags, e.g. 0,4,16,64 (final reward vs lag figure); "
        "collapse: the adaptivity sweep over these lags (product against one constant LR)",
    )
    demo.add_argument(
        "--lag-seeds", type=int, help="collapse: the adaptivity sweep on seeds 0..N-1 [--seeds]"
    )
    # default None, not 1: the weights scenario refuses every option given to it
    demo.add_argument("--jobs", type=int, help="collapse: runs at a time (processes) [1]")
    demo.add_argument(
        "--cache-dir",
        type=Path,
        help="collapse: warm-start cache [$ESS_PATCH_CACHE/warm-start or ~/.cache/ess-patch]",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("-v", "--verbose", action="store_true", help="log progress details")


def _name_list(text: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more names separated by commas")
    return names


#: CLI flag -> DemoConfig field, for the flags that are not spelled like their field.
_DEMO_FIELDS = {
    "steps": "steps",
    "lag": "lag",
    "workers": "rollout_workers",
    "seed": "seed",
    "dp": "dp",
    "tp": "tp",
    "pp": "pp",
    "cp": "cp",
    "device": "device",
    "task": "task",
    "response_len": "response_len",
    "layers": "num_layers",
    "lr": "lr",
    "loss": "loss",
    "arms": "arms",
    "is_threshold": "is_threshold",
    "staleness": "staleness",
}
_FLAG_OF = {field: flag for flag, field in _DEMO_FIELDS.items()}


def _demo_options(args: argparse.Namespace, *names: str) -> dict:
    """DemoConfig fields from the demo flags the user gave (``names``: flags to read)."""
    return {
        _DEMO_FIELDS[name]: getattr(args, name)
        for name in names or _DEMO_FIELDS
        if getattr(args, name) is not None
    }


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers separated by commas") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more lags >= 0")
    return values


def _install_hint(extra: str) -> str:
    """How to add ``extra`` where this ess-patch came from (it is not on a package index)."""
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file():  # a checkout (editable or source run)
        return f"pip install -e '{root}[{extra}]'"
    return f"pip install -e '.[{extra}]' from an ess-patch checkout"


def _refused(exc: ValueError) -> int:
    """Print a demo setting's error, naming the flag the user typed (not the dataclass field)
    for a ``DemoConfigError``; returns the exit status 2."""
    from .demo.train import DemoConfigError

    if isinstance(exc, DemoConfigError):
        print(
            f"ess-patch demo: {_flag(exc.field)} {exc.problem} (got {exc.value})", file=sys.stderr
        )
    else:
        print(f"ess-patch demo: {exc}", file=sys.stderr)
    return 2


def _flag(field: str) -> str:
    return "--" + _FLAG_OF.get(field, field).replace("_", "-")


def _ess_settings(args: argparse.Namespace, **fixed: str) -> EssLrConfig:
    """The demo's ESS-LR settings: each flag given, else ``ESS_LR_*``, else the default;
    ``fixed``: what the scenario sets itself.

    Raises:
        ValueError: a flag's value is out of range (the message names the flag), or an
            ``ESS_LR_*`` variable is.
    """
    given = given_options(args, "", DEMO_ESS_FIELDS)
    for name, value in given.items():
        try:  # one field at a time, so that the error names the flag the user typed
            EssLrConfig(**{name: value})
        except ValueError as exc:
            problem = str(exc).removeprefix(f"EssLrConfig.{name}={value!r} ")
            raise EssPatchValueError(f"{_flag(name)} {problem} (got {value})") from None
    return EssLrConfig.from_env(**{**given, **fixed})


def _out_problem(out: Path) -> str | None:
    """Why ``out`` cannot be the demo's output folder (created if absent), else ``None``."""
    if out.exists() and not out.is_dir():
        return f"--out {out}: is a file, not a folder; give a folder (created if absent)"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--out {out}: cannot create the folder ({exc.strerror or exc})"
    if not os.access(out, os.W_OK | os.X_OK):
        return f"--out {out}: the folder is not writable; give another one"
    return None


def _run_demo(args: argparse.Namespace) -> int:
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
    runners: dict[str, Callable[[argparse.Namespace], int]] = {
        "main": _run_main,
        "mixed": _run_mixed,
        "stress": _run_stress,
        "weights": _run_weights,
        "collapse": _run_collapse,
    }
    return runners[args.scenario](args)


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
    out = args.out
    if out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = Path("ess-demo-out") / stamp
    problem = _out_problem(out)
    if problem:
        print(f"ess-patch demo: {problem}", file=sys.stderr)
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
    print()
    print(result.table)
    print()
    print(
        "collapsed = the smoothed reward ends more than half of its peak gain below the peak; "
        "LR scaled = steps whose applied LR was below the scheduled LR"
    )
    print(result.timing)
    print()
    print(f"finished in {result.wall_s:.0f}s; outputs in {result.out_dir.resolve()}:")
    for path in (*result.figures, result.records_path, result.summary_path):
        print(f"  {path.name}")
    print("  config.json, tb/ (TensorBoard events, if tensorboard is installed), ranks/")
    return 0


def _guarded(bar: Any, out: Path, work: Callable[[], Any]) -> tuple[Any, int | None]:
    """Run ``work`` and close the progress bar: (its result, None), or (None, the exit code)
    after saying why, for a run that failed (1) or was interrupted (130; the launcher has
    killed and joined the ranks on the way out)."""
    from .demo.launch import DemoError

    try:
        result = work()
    except DemoError as exc:
        bar.close()
        print(str(exc), file=sys.stderr)
        return None, 1
    except KeyboardInterrupt:
        bar.close()
        print(f"ess-patch demo: interrupted; partial outputs in {out}", file=sys.stderr)
        return None, 130
    bar.close()
    return result, None


def _run_stress(args: argparse.Namespace) -> int:
    from .demo.launch import DemoError
    from .demo.stress import QUICK_STEPS, STRESS, run_stress, stress_config

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
    out = args.out
    if out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = Path("ess-demo-out") / f"stress-{stamp}"
    print(
        f"ess-patch demo --scenario stress: {cfg.world_size} ranks, {cfg.steps} steps, "
        f"{cfg.loss} loss, lr {cfg.lr:g}, max lag {', '.join(map(str, lags))}; "
        f"{seeds} paired seeds x arms {', '.join(cfg.arms)}"
    )
    bar = _progress(len(lags) * seeds * len(cfg.arms) * cfg.steps, "step", args.no_progress)

    def on_step(lag: int, seed: int, arm: str, step: int) -> None:
        bar.set_description(f"lag {lag} seed {seed} {arm}", refresh=False)
        bar.update(1)

    try:
        result = run_stress(cfg, out, seeds=seeds, lags=lags, on_step=on_step)
    except DemoError as exc:
        bar.close()
        print(str(exc), file=sys.stderr)
        return 1
    bar.close()
    print()
    print(result.table)
    print()
    print(
        "collapsed = the smoothed reward ends more than half of its peak gain below the peak; "
        "constant = armed every step with the mean scale of the same seed's product run"
    )
    print(f"finished in {result.wall_s:.0f}s; outputs in {result.out_dir.resolve()}:")
    for path in (result.figure, result.table_path, result.steps_path, result.summary_path):
        print(f"  {path.name}")
    return 0


class _Lines:
    """Progress for a log file or CI: one line every :data:`STEP_PERCENT` percent."""

    STEP_PERCENT = 5

    def __init__(self, total: int, unit: str) -> None:
        self.total, self.unit, self.n, self.shown, self.what = max(total, 1), unit, 0, -1, ""
        self.t0 = datetime.datetime.now()

    def set_description(self, what: str, refresh: bool = False) -> None:
        self.what = what

    def update(self, n: int = 1) -> None:
        self.n += n
        pct = 100 * self.n // self.total
        if pct // self.STEP_PERCENT > self.shown:
            self.shown = pct // self.STEP_PERCENT
            elapsed = (datetime.datetime.now() - self.t0).total_seconds()
            print(
                f"  {pct:3d}% {self.n}/{self.total} {self.unit}s, {elapsed:.0f}s  {self.what}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        pass


def _progress(total: int, unit: str, disable: bool) -> Any:
    """A tqdm bar on a terminal; elsewhere (a log, CI) a line every few percent."""
    if not disable and not sys.stderr.isatty():
        return _Lines(total, unit)
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, disable=disable, dynamic_ncols=True)


def _run_main(args: argparse.Namespace) -> int:
    """``ess-patch demo`` (the main job): :mod:`ess_patch.demo.main_job`, one seed, printed."""
    from .demo import main_job

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
    seed = main_job.MAIN_SEED if args.seed is None else args.seed
    try:
        options["ess"] = _ess_settings(args, weight_mode="product")
        cfg = main_job.main_config(**options)
        if "sync" not in cfg.arms or jobs < 1:
            raise EssPatchValueError(
                f"--arms {','.join(cfg.arms)} --jobs {jobs}: keep sync, >= 1 job"
            )
    except ValueError as exc:  # DemoConfigError included
        return _refused(exc)
    out = args.out
    if out is None:
        out = Path("ess-demo-out") / datetime.datetime.now().strftime("main-%Y%m%d-%H%M%S")
    problem = _out_problem(out)
    if problem:
        print(f"ess-patch demo: {problem}", file=sys.stderr)
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
    from .demo import collapse

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
    """``ess-patch demo --scenario collapse``: parse, run :mod:`ess_patch.demo.collapse`, print."""
    from .demo.launch import DemoError

    settings = _collapse_settings(args)
    if isinstance(settings, int):
        return settings
    cfg, seeds = settings
    out = args.out
    if out is None:
        out = Path("ess-demo-out") / datetime.datetime.now().strftime("collapse-%Y%m%d-%H%M%S")
    problem = _out_problem(out)
    if problem:
        print(f"ess-patch demo: {problem}", file=sys.stderr)
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

    try:
        result, files, tables = _collapse_runs(args, cfg, out, seeds, lag_seeds, on_run)
    except DemoError as exc:
        bar.close()
        print(str(exc), file=sys.stderr)
        return 1
    bar.close()
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

    from .demo import collapse

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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the usage of the (sub)command the user typed, not the top-level one
        _subparser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "demo":
        return _run_demo(args)
    if args.command in ("patches", "analyze"):
        return args.func(args)
    if args.command == "doctor":
        return _run_doctor()
    return 0


def _subparser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The deepest sub-parser ``args`` went through (``demo``, ``patches check`` ...)."""
    for dest in ("command", "patches_command"):
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, dest, None)
        if not actions or name not in actions[0].choices:
            break
        parser = actions[0].choices[name]
    return parser


def _run_doctor() -> int:
    import warnings

    from .doctor import collect, render

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron's import-time notices are not problems
        report = collect()
    print(render(report))
    return 1 if report.problems else 0


#: What the weights scenario reads of the demo's options; any other given is refused.
_WEIGHTS_OPTIONS = ("command", "func", "scenario", "seed", "out", "quick", "no_progress", "verbose")


def _run_weights(args: argparse.Namespace) -> int:
    """``ess-patch demo --scenario weights`` (the CLI's parsed ``args``)."""
    from .demo.weights import WeightsConfig, quick_weights_config, run_weights

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
    out = args.out
    if out is None:
        out = Path("ess-demo-out") / datetime.datetime.now().strftime("weights-%Y%m%d-%H%M%S")
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


if __name__ == "__main__":
    sys.exit(main())
