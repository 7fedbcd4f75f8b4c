"""Find and import the real miles / slime code from the upstream snapshots (test-only helpers).

The snapshots are located through environment variables that ``.ci/run`` and ``tox.ini`` set:

- ``MILES_SRC``: a folder holding ``miles/`` (and ``miles_plugins/``),
- ``SLIME_SRC``: a folder holding ``slime/``,
- ``MEGATRON_LM_SRC``: a folder holding ``megatron/training`` (what the megatron-core wheel
  lacks; needed only by the "full" tier).
- ``ESS_PATCH_UPSTREAM``: the folder of snapshots (default: the parent of ``MILES_SRC``, else
  of ``SLIME_SRC``). :func:`snapshots` finds every ``miles-*`` / ``slime-*`` folder in it, so a
  new snapshot of either framework is tested by adding its folder.

Two tiers of third-party dependencies (see ``requirements-loss.txt`` / ``requirements-full.txt``
and NOTES.md):

- ``"loss"``: the advantage / loss modules (``miles.backends.training_utils.loss``,
  ``slime.backends.megatron_utils.loss``).
- ``"full"``: the argument parsers, ``megatron_utils.model`` / ``.actor`` and
  ``fsdp_utils.actor``; also needs ``megatron.training`` and, where sglang / mooncake are not
  installed, the import-time stubs in ``stubs/``.

Usage from a test module::

    from upstream import import_upstream, skip_reason

    MILES = skip_reason("miles", "loss")

    @pytest.mark.skipif(MILES is not None, reason=MILES or "")
    def test_x():  # import_upstream raises ImportError(reason) if the tier is unusable
        loss = import_upstream("miles.backends.training_utils.loss")

``skip_reason`` returns ``None`` when the tier is usable (and has put the snapshot folders on
``sys.path``), else a one-line reason naming the missing environment variable or package.
Nothing heavy is imported to decide: packages are looked up with ``importlib.util.find_spec``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

_TESTS_DIR = str(Path(__file__).resolve().parents[1])
if _TESTS_DIR not in sys.path:  # tests/, for the shared skip wording (also in subprocesses)
    sys.path.insert(0, _TESTS_DIR)

from skips import missing_packages, missing_snapshot  # noqa: E402

from ess_patch.integrations.actors import INIT_PATH  # noqa: E402

__all__ = [
    "ENV_UPSTREAM",
    "ENV_VARS",
    "STUBS_DIR",
    "TIER_PACKAGES",
    "import_upstream",
    "miles_parallel_state",
    "parse_upstream_args",
    "skip_reason",
    "snapshots",
    "tier_reason",
    "use_snapshot",
]

ENV_VARS = {"miles": "MILES_SRC", "slime": "SLIME_SRC", "megatron": "MEGATRON_LM_SRC"}
_PACKAGE_DIR = {"miles": "miles", "slime": "slime", "megatron": "megatron/training"}

STUBS_DIR = Path(__file__).resolve().parent / "stubs"

# Top-level import names each tier needs (pip names in the requirements files).
TIER_PACKAGES: dict[tuple[str, str], tuple[str, ...]] = {
    ("miles", "loss"): ("megatron.core", "ray", "yaml", "httpx", "h2", "pydantic"),
    ("slime", "loss"): ("megatron.core", "yaml", "httpx"),
}
_FULL_EXTRA = (
    "triton",
    "transformers",
    "sglang_router",
    "torch_memory_saver",
    "polars",
    "six",
    "psutil",
)
TIER_PACKAGES[("miles", "full")] = (*TIER_PACKAGES[("miles", "loss")], *_FULL_EXTRA)
# slime v0.2.0's megatron_utils package imports pandas on the way to its loss module
TIER_PACKAGES[("slime", "loss")] = (*TIER_PACKAGES[("slime", "loss")], "pandas")
TIER_PACKAGES[("slime", "full")] = (
    *TIER_PACKAGES[("miles", "loss")],
    *_FULL_EXTRA,
    "wandb",
)

_INSTALL_HINT = {
    "loss": "pip install -r tests/frameworks/requirements-loss.txt",
    "full": "pip install -r tests/frameworks/requirements-full.txt",
}


def _snapshot_dir(name: str) -> tuple[Path | None, str | None]:
    var = ENV_VARS[name]
    reason = missing_snapshot(var, name, _PACKAGE_DIR[name])
    return (None, reason) if reason else (Path(os.environ[var]), None)


def _missing_packages(names: Sequence[str]) -> list[str]:
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def _prepend(path: Path) -> None:
    entry = str(path)
    if entry not in sys.path:
        sys.path.insert(0, entry)


def _needs_stubs() -> bool:
    """Use ``stubs/`` only where the real sglang / mooncake are absent (never shadow them)."""
    return _missing_packages(["sglang"]) == ["sglang"]


def skip_reason(framework: str, tier: str = "loss") -> str | None:
    """``None`` if ``framework``'s ``tier`` can be imported (paths are then set up), else why not.

    ``framework``: ``"miles"`` or ``"slime"``; ``tier``: ``"loss"`` or ``"full"``.
    """
    if (framework, tier) not in TIER_PACKAGES:
        raise ValueError(f"unknown framework/tier {framework!r}/{tier!r}")
    roots = []
    for name in (framework, "megatron") if tier == "full" else (framework,):
        root, reason = _snapshot_dir(name)
        if reason:
            return reason
        roots.append(root)
    missing = _missing_packages(TIER_PACKAGES[(framework, tier)])
    if missing:
        return missing_packages(
            f"the {tier!r} tier of the {framework} tests", missing, _INSTALL_HINT[tier]
        )
    for root in roots:
        _prepend(root)
    if tier == "full" and _needs_stubs():
        # After the snapshots: a real package of the same name always wins.
        sys.path.append(str(STUBS_DIR))
    return None


ENV_UPSTREAM = "ESS_PATCH_UPSTREAM"


def _upstream_root() -> Path | None:
    root = os.environ.get(ENV_UPSTREAM)
    if root:
        return Path(root)
    for var in ("MILES_SRC", "SLIME_SRC"):
        if os.environ.get(var):
            return Path(os.environ[var]).resolve().parent
    return None


def snapshots() -> list[tuple[str, Path]]:
    """``(framework, folder)`` for every ``miles-*`` / ``slime-*`` folder of the upstream root
    that holds the package (sorted by name); empty when there is no root."""
    root = _upstream_root()
    if root is None or not root.is_dir():
        return []
    return [
        (framework, folder)
        for framework in ("miles", "slime")
        for folder in sorted(root.glob(f"{framework}-*"))
        if (folder / framework / "__init__.py").is_file()
    ]


NO_SNAPSHOT = (
    "no miles/slime snapshot: runs where $ESS_PATCH_UPSTREAM (or MILES_SRC / SLIME_SRC) names "
    "one, as tox -e frameworks and .ci/run set it to ../shared/upstream"
)


def no_snapshot_param(width: int = 2) -> Any:
    """The one parameter set of a test parametrized over :func:`snapshots` when there are none:
    skipped, saying why and when it runs (never an empty parametrization)."""
    import pytest

    return pytest.param(*([None] * width), marks=pytest.mark.skipif(True, reason=NO_SNAPSHOT))


def megatron_lm_snapshots() -> list[Path]:
    """Every ``megatron-lm-*`` folder of the upstream root that holds Megatron-RL
    (``megatron/rl/rl_utils.py``), sorted by name; empty when there is no root."""
    root = _upstream_root()
    if root is None or not root.is_dir():
        return []
    return [
        folder
        for folder in sorted(root.glob("megatron-lm-*"))
        if (folder / "megatron" / "rl" / "rl_utils.py").is_file()
    ]


def run_pytest(
    test_file: Path,
    env: dict[str, str],
    cwd: Path,
    timeout: float = 900,
    extra_args: Sequence[str] = (),
) -> tuple[set[str], list[tuple[str, str]], str]:
    """Run one test file in a fresh interpreter (its own ``sys.modules`` and ``sys.path``):
    the names of the tests that passed, ``(name, skip message)`` of those skipped, and the
    output's tail. Fails the caller's test when the run fails. ``extra_args`` go to pytest
    (e.g. ``-k``)."""
    import subprocess
    import xml.etree.ElementTree as ET

    report = cwd / f"{test_file.stem}-report.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    cmd += ["-p", "no:randomly", "--rootdir", str(Path(__file__).resolve().parents[2])]
    cmd += [*extra_args, f"--junitxml={report}", str(test_file)]
    result = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    tail = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    passed, skipped = set(), []
    for case in ET.parse(report).getroot().iter("testcase"):
        skip = case.find("skipped")
        if skip is None:
            passed.add(case.get("name"))
        else:
            skipped.append((case.get("name"), skip.get("message") or ""))
    return passed, skipped, tail


def tier_reason(framework: str, tier: str = "loss") -> str | None:
    """Why ``framework``'s ``tier`` cannot run here (missing packages; for the full tier also
    ``MEGATRON_LM_SRC``), whatever snapshot is used; None when it can. Sets nothing up."""
    if tier == "full":
        _, reason = _snapshot_dir("megatron")
        if reason:
            return reason
    missing = _missing_packages(TIER_PACKAGES[(framework, tier)])
    if missing:
        return missing_packages(
            f"the {tier!r} tier of the {framework} tests", missing, _INSTALL_HINT[tier]
        )
    return None


def use_snapshot(framework: str, folder: str | Path, tier: str = "loss") -> None:
    """In a fresh process (a rank, a subprocess): import ``framework`` from ``folder``,
    before any other snapshot on ``sys.path``; for the full tier also megatron and the stubs.

    Raises:
        RuntimeError: ``framework`` was already imported from elsewhere in this process.
    """
    loaded = sys.modules.get(framework)
    if loaded is not None and not str(loaded.__file__).startswith(str(folder)):
        raise RuntimeError(f"{framework} is already imported from {loaded.__file__}")
    sys.path.insert(0, str(folder))
    if tier == "full":
        root, reason = _snapshot_dir("megatron")
        if reason:
            raise RuntimeError(reason)
        sys.path.insert(1, str(root))
        if _needs_stubs() and str(STUBS_DIR) not in sys.path:
            sys.path.append(str(STUBS_DIR))


def import_upstream(module: str, tier: str = "loss") -> ModuleType:
    """Import a real upstream module (``"miles.…"`` / ``"slime.…"``).

    Callers are tests guarded by ``skipif(skip_reason(...) is not None, reason=...)``; if one
    is not, it fails here with the same reason rather than skipping silently.
    """
    framework = module.split(".", 1)[0]
    reason = skip_reason(framework, tier)
    if reason is not None:
        raise ImportError(f"{module}: {reason}")
    return importlib.import_module(module)


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _argv(argv: Sequence[str]) -> Iterator[None]:
    old = sys.argv
    sys.argv = ["train.py", *argv]
    try:
        yield
    finally:
        sys.argv = old


# What a driver's command line needs for ESS-LR's train actors to be patched, else the driver
# stops at parse time (ess_patch.integrations.actors; the editable install has no .pth).
ACTORS_PATCHED = ("--custom-megatron-init-path", INIT_PATH)
# The least a parse needs: both frameworks require --rollout-batch-size and one of
# --num-rollout / --num-epoch; and the train actors patched.
MINIMAL_ARGV = ("--rollout-batch-size", "4", "--num-rollout", "1", *ACTORS_PATCHED)


def parse_upstream_args(
    framework: str,
    argv: Sequence[str] = MINIMAL_ARGV,
    add_custom_arguments: Callable[[Any], Any] | None = None,
    *,
    megatron_validate: bool = False,
    quiet: bool = True,
) -> Any:
    """Run the real ``<framework>.utils.arguments.parse_args`` on ``argv``; return the namespace.

    Megatron's own ``validate_args`` (from ``MEGATRON_LM_SRC``) is replaced by a no-op unless
    ``megatron_validate=True``: the snapshot's ``megatron/training`` comes from the Megatron-LM
    fork miles runs on, which is newer than the megatron-core 0.16.1 wheel that installs on
    Python 3.11 (``validate_args`` reads ``args.mtp_hybrid_override_pattern``, a
    ``TransformerConfig`` field 0.16.1 lacks, then imports ``parse_hybrid_pattern`` which 0.16.1
    does not have). Everything else (the framework's parser, its ``*_validate_args`` and the
    sglang validate) runs for real. Bad input raises ``SystemExit`` (argparse, exit code 2).
    """
    args_mod = import_upstream(f"{framework}.utils.arguments", tier="full")
    mega_mod = importlib.import_module(f"{framework}.backends.megatron_utils.arguments")
    with contextlib.ExitStack() as stack:
        stack.enter_context(_argv(argv))
        if not megatron_validate:
            stack.enter_context(_patched(mega_mod, "validate_args", lambda args: None))
            # slime v0.2.0 imports it from the package inside parse_args
            package = importlib.import_module(f"{framework}.backends.megatron_utils")
            if hasattr(package, "validate_args"):
                stack.enter_context(_patched(package, "validate_args", lambda args: None))
        if quiet:
            stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        return args_mod.parse_args(add_custom_arguments=add_custom_arguments)


def miles_parallel_state(*, set_state: bool = True) -> Any:
    """Inside a rank: miles' ``ParallelState`` built from the real megatron ``parallel_state``.

    The same fields as miles' own ``create_megatron_parallel_state``
    (``miles/backends/megatron_utils/parallel.py``), which needs ``megatron.training``'s global
    args (full tier); this one needs only the loss tier. ``indep_dp`` is the trivial group, as
    without fault tolerance, so ``effective_dp`` is ``intra_dp`` (DP without CP). With
    ``set_state`` it is also installed with miles' ``set_parallel_state``.

    Older miles: only the fields its ``ParallelState`` declares (no ``pp ep etp`` before
    2026-05-05, no ``indep_dp`` before 2026-07-10); before 2026-04-03 the flat fields
    (``dp_group cp_group``...), with no ``set_parallel_state`` to call.
    """
    from dataclasses import fields

    from megatron.core import parallel_state as mpu
    from miles.backends.training_utils import parallel

    names = {f.name for f in fields(parallel.ParallelState)}
    if "dp_group" in names:  # 2026-01-12 to 2026-04-02: flat fields, passed as an argument
        return parallel.ParallelState(
            dp_rank=mpu.get_data_parallel_rank(with_context_parallel=False),
            dp_src_rank=mpu.get_data_parallel_src_rank(with_context_parallel=True),
            dp_size=mpu.get_data_parallel_world_size(with_context_parallel=False),
            cp_rank=mpu.get_context_parallel_rank(),
            cp_size=mpu.get_context_parallel_world_size(),
            dp_cp_rank=mpu.get_data_parallel_rank(with_context_parallel=True),
            dp_cp_size=mpu.get_data_parallel_world_size(with_context_parallel=True),
            dp_group=mpu.get_data_parallel_group(with_context_parallel=False),
            dp_cp_group=mpu.get_data_parallel_group(with_context_parallel=True),
            dp_cp_group_gloo=None,
            cp_group=mpu.get_context_parallel_group(),
            tp_size=mpu.get_tensor_model_parallel_world_size(),
            tp_rank=mpu.get_tensor_model_parallel_rank(),
            tp_group=mpu.get_tensor_model_parallel_group(),
            is_pp_last_stage=mpu.is_pipeline_last_stage(),
        )
    ParallelState, set_parallel_state = parallel.ParallelState, parallel.set_parallel_state
    GroupInfo = getattr(parallel, "GroupInfo", None)  # moved to ft_utils on 2026-07-10
    if GroupInfo is None:
        from miles.utils.ft_utils.process_group_utils import GroupInfo

    def dp(with_cp: bool) -> Any:
        return GroupInfo(
            rank=mpu.get_data_parallel_rank(with_context_parallel=with_cp),
            size=mpu.get_data_parallel_world_size(with_context_parallel=with_cp),
            group=mpu.get_data_parallel_group(with_context_parallel=with_cp),
        )

    def info(kind: str) -> Any:
        return GroupInfo(
            rank=getattr(mpu, f"get_{kind}_rank")(),
            size=getattr(mpu, f"get_{kind}_world_size")(),
            group=getattr(mpu, f"get_{kind}_group")(),
        )

    every = {
        "intra_dp": lambda: dp(False),
        "intra_dp_cp": lambda: dp(True),
        "cp": lambda: info("context_parallel"),
        "tp": lambda: info("tensor_model_parallel"),
        "pp": lambda: info("pipeline_model_parallel"),
        "ep": lambda: info("expert_model_parallel"),
        "etp": lambda: info("expert_tensor_parallel"),
        "indep_dp": lambda: GroupInfo(rank=0, size=1, group=None),
    }
    state = ParallelState(
        **{name: make() for name, make in every.items() if name in names},
        is_pp_last_stage=mpu.is_pipeline_last_stage(),
    )
    if set_state:
        set_parallel_state(state)
    return state
