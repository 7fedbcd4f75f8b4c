"""``ess-patch demo``: its options, and what every scenario's runner shares (the ESS-LR
settings from the flags, the output folder's checks, the refusals, the progress display)."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import EssLrConfig
from .errors import EssPatchValueError
from .integrations.flags import add_config_options, given_options

#: The ESS-LR settings the demo takes as flags (``--floor``...; the others do not apply to it).
DEMO_ESS_FIELDS = ("floor", "weight_mode", "rule", "base_ratio", "weight_clip")


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


def _out_dir(args: Any, prefix: str) -> Path | None:
    """``--out``, or ``ess-demo-out/<prefix><time stamp>``, made ready; None (the reason
    printed) where it cannot be the output folder."""
    out = args.out
    if out is None:
        out = Path("ess-demo-out") / (prefix + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    problem = _out_problem(out)
    if problem:
        print(f"ess-patch demo: {problem}", file=sys.stderr)
        return None
    return out


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
