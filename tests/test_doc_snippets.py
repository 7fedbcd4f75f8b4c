"""Every shell command and Python snippet in README.md, CHANGELOG.md and docs/ runs, so the
documentation cannot drift from the code (conventions: docs/development.md, "Documented
commands and snippets are tests"; discovery and setups: tests/doc_snippets.py).

Python blocks run in a fresh interpreter against the real API. Shell commands run by kind:
``ess-patch`` through the real CLI (``demo`` with ``--quick`` in the default run, as written
with ``-m slow``), ``pip install`` resolved offline against this environment, ``tox`` against
tox.ini, the repository's own scripts run, and a framework's launch (named ``covered-by=``, the
test that runs it where its snapshot is) checked for what ess-patch contributes to it.
"""

from __future__ import annotations

import argparse
import configparser
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_snippets import (
    PLACEHOLDER,
    ROOT,
    SHELL_SETUPS,
    Block,
    all_blocks,
    commands,
    ess_settings,
    known_variables,
    python_program,
    split_env,
    vcpo_keys,
)

BLOCKS = all_blocks()
TIMEOUT = 600
#: commands that already ran to success in this session (several pages show the same line)
_SUCCEEDED: set[tuple[str, ...]] = set()


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _params(lang: str) -> list:
    params = []
    for block in (b for b in BLOCKS if b.lang == lang):
        marks = [pytest.mark.slow] if "slow" in block.options else []
        if block.options.get("requires") == "gpu":
            marks.append(
                pytest.mark.skipif(
                    not _has_gpu(),
                    reason=f"{block.id}: needs a GPU (requires=gpu): runs where torch sees one",
                )
            )
        params.append(pytest.param(block, "default", id=block.id, marks=marks))
        if lang == "shell" and "slow" not in block.options and "ess-patch demo" in block.code:
            # the demo as written (the default run adds --quick)
            params.append(
                pytest.param(block, "exact", id=f"{block.id}-exact", marks=[pytest.mark.slow])
            )
    return params


def _gate(block: Block) -> Path | None:
    """The covering test's path when there is one."""
    covered = block.options.get("covered-by")
    if covered is None:
        return None
    path = ROOT / covered.split("::")[0]
    assert path.is_file(), f"{block.id}: covered-by={covered} names no file"
    return path


def _tail(text: str, limit: int = 4000) -> str:
    return text[-limit:]


def _run(argv: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> None:
    key = (*argv, *sorted((env or {}).items()))
    if key in _SUCCEEDED:
        return
    child_env = dict(os.environ)
    child_env.update(env or {})
    proc = subprocess.run(
        argv, cwd=cwd, env=child_env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, (
        f"{' '.join(argv)} exited {proc.returncode}\n--- stderr ---\n{_tail(proc.stderr)}\n"
        f"--- stdout ---\n{_tail(proc.stdout)}"
    )
    _SUCCEEDED.add(key)


# --- discovery -------------------------------------------------------------------------------


def test_every_documented_file_and_include_is_searched():
    paths = {b.path for b in BLOCKS}
    assert "README.md" in paths
    # the included files are searched through the pages that include them
    assert {"BENCHMARKS.md", "patches/README.md"} <= paths
    assert any(p.startswith("docs/frameworks/") for p in paths)
    assert sum(b.lang == "python" for b in BLOCKS) >= 5


def test_every_readme_link_points_to_a_file():
    """The README is read on its own (not built by mkdocs): its relative links must resolve."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+://", t) and t[0] != "#"]
    assert local
    missing = sorted({t for t in local if not (ROOT / t).exists()})
    assert not missing, f"README.md links to files that do not exist: {missing}"


# --- python ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("block", "mode"), _params("python"))
def test_python_snippet_runs(block, mode, fresh_python):
    if _gate(block) is not None:
        compile(block.code, block.id, "exec")  # the covering test runs it; here: it parses
        return
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "tests"), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    fresh_python(python_program(block), env, emits=False, timeout=TIMEOUT)


# --- shell -----------------------------------------------------------------------------------


def _ess_flags_parse(block: Block, tokens: list[str]) -> None:
    """Each ``--use-ess-lr`` / ``--ess-lr-*`` flag of a command parses with ess-patch's own
    options (the ones install() adds to miles', slime's and Megatron's parsers)."""
    ours = [t for t in tokens if re.match(r"--(use-ess-lr|ess-lr-|no-ess-lr-)", t)]
    if not ours:
        return
    from ess_patch.integrations.flags import add_ess_arguments

    parser = add_ess_arguments(argparse.ArgumentParser(add_help=False, exit_on_error=False))
    try:
        _, rest = parser.parse_known_args(tokens)
    except (argparse.ArgumentError, SystemExit) as exc:
        pytest.fail(f"{block.id}: {' '.join(tokens)}: ess-patch's flags do not parse: {exc}")
    left = [t for t in rest if t in ours]
    assert not left, f"{block.id}: not ess-patch flags: {left}"


def _ess_variables_valid(block: Block, tokens: list[str]) -> None:
    from ess_patch import EssLrConfig

    settings = ess_settings(tokens)
    unknown = sorted(set(settings) - known_variables())
    assert not unknown, f"{block.id}: ess-patch reads no variable {unknown}"
    EssLrConfig.from_env({k: v for k, v in settings.items() if k != "ESS_LR_ENABLE"})
    keys = vcpo_keys(tokens)
    if keys:  # verl reads them through its real settings(), with the variables beside them
        from ess_patch.integrations.verl import settings as verl_settings

        try:
            verl_settings({"ess_scaling": keys}, environ=settings)
        except ValueError as exc:
            pytest.fail(f"{block.id}: VCPO's keys {keys} are refused: {exc}")


def _ess_patch(block: Block, args: list[str], mode: str, tmp: Path, run: bool) -> None:
    from ess_patch.cli import build_parser

    try:
        build_parser().parse_args(args)
    except SystemExit as exc:
        if exc.code != 0:  # --help / --version exit 0
            pytest.fail(f"{block.id}: ess-patch {' '.join(args)}: the CLI refuses it")
    if not run:
        return
    if args[:1] == ["demo"] and mode == "default":
        args = _quick(args)
    argv = [sys.executable, "-m", "ess_patch.cli", *args]
    if args[:1] == ["doctor"] and not _installed():
        # in a bare checkout doctor's one problem is exactly that (exit 1)
        proc = subprocess.run(argv, cwd=tmp, capture_output=True, text=True, timeout=TIMEOUT)
        assert proc.returncode in (0, 1), proc.stderr
        problems = re.findall(r"^- (.*)$", proc.stdout, re.M)
        assert all("not installed" in p for p in problems), proc.stdout
        return
    _run(argv, cwd=tmp)


#: demo options whose value --quick chooses in the default run (a smoke run, not the study)
_SIZES = {"--steps", "--seeds", "--lags"}


def _quick(args: list[str]) -> list[str]:
    """The demo command as a smoke run: ``--quick`` added, its sizes left to ``--quick``."""
    out, skip = [], False
    for token in args:
        if skip:
            skip = False
        elif token in _SIZES:
            skip = True
        elif token.split("=", 1)[0] not in _SIZES:
            out.append(token)
    return out if "--quick" in out else [*out, "--quick"]


def _installed() -> bool:
    try:
        importlib.metadata.distribution("ess-patch")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _tox_pin() -> str:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    pins = re.findall(r"torch==([\w.]+)", tox["testenv"]["deps"])
    assert len(pins) == 1, tox["testenv"]["deps"]
    return pins[0]


_PIP_VALUE_OPTIONS = {"--index-url", "-i", "--extra-index-url", "--find-links", "-f"}


def _pip(block: Block, args: list[str], run: bool) -> None:
    assert args[:1] == ["install"], f"{block.id}: pip {' '.join(args)}: only install is checked"
    import tomllib  # Python 3.11+, as tox runs it

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    kept, requirements, i = [], [], 1
    while i < len(args):
        token = args[i]
        if token in _PIP_VALUE_OPTIONS:  # where from: --no-index decides here
            i += 2
            continue
        if token == "-e":
            kept.append(token)
        elif not token.startswith("-"):
            requirements.append(token)
            kept.append(token)
        i += 1
    for requirement in requirements:
        local = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", requirement)
        if local and local.group(1):
            missing = set(local.group(1).split(",")) - set(extras)
            assert not missing, f"{block.id}: pyproject.toml has no extra {missing}"
        pinned = re.fullmatch(r"torch==([\w.]+)", requirement)
        if pinned:
            assert pinned.group(1) == _tox_pin(), f"{block.id}: torch pin differs from tox.ini"
    if not run:
        return
    if importlib.util.find_spec("setuptools") is None:  # cannot build the checkout offline
        kept = [t for t in kept if not t.startswith(".") and t != "-e"]
    argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index"]
    argv += ["--no-build-isolation", "--disable-pip-version-check", "--quiet", *kept]
    _run(argv, cwd=ROOT)


def _tox(block: Block, args: list[str]) -> None:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    envs = {e.strip() for e in tox["tox"]["envlist"].split(",")}
    envs |= {s.split(":", 1)[1] for s in tox.sections() if s.startswith("testenv:")}
    if "-e" in args:
        named = set(args[args.index("-e") + 1].split(","))
        assert named <= envs, f"{block.id}: tox.ini has no env {named - envs}"
    else:  # plain tox is what CI runs
        assert re.search(r'^"\$venv/bin/tox"\s*$', (ROOT / ".ci" / "run").read_text(), re.M)


def _local_python(args: list[str]) -> bool:
    if args[:1] == ["-m"]:
        return (ROOT / args[1].split(".")[0]).is_dir()
    return bool(args) and (ROOT / args[0]).is_file()


@pytest.mark.parametrize(("block", "mode"), _params("shell"))
def test_shell_commands_run(block, mode, tmp_path):
    _check_shell(block, mode, tmp_path)


def _check_shell(block: Block, mode: str, tmp_path: Path) -> None:
    covered = _gate(block)
    code = block.code
    setup = block.options.get("setup")
    if setup:
        assert setup in SHELL_SETUPS, f"{block.id}: no shell setup {setup!r}"
        for placeholder, value in SHELL_SETUPS[setup](tmp_path).items():
            code = code.replace(placeholder, value)
    for tokens in commands(code):
        line = " ".join(tokens)
        _ess_flags_parse(block, tokens)
        _ess_variables_valid(block, tokens)
        env, command = split_env(tokens)
        run = covered is None
        if run and PLACEHOLDER.search(line):
            pytest.fail(f"{block.id}: {line!r} has a placeholder: give it setup= or covered-by=")
        program, args = command[0], command[1:]
        if program == "ess-patch":
            _ess_patch(block, args, mode, tmp_path, run)
        elif program == "pip" or command[:3] in (["python", "-m", "pip"], ["python3", "-m", "pip"]):
            _pip(block, args if program == "pip" else command[3:], run)
        elif program == "tox":
            _tox(block, args)
        elif program in ("python", "python3") and _local_python(args):
            if run:
                _run([sys.executable, *args], cwd=ROOT, env=env)
        else:
            assert covered is not None, (
                f"{block.id}: {line!r} needs what the default run lacks: name the test that "
                "runs it (covered-by=PATH)"
            )


@pytest.mark.parametrize(
    ("code", "says"),
    [
        ("python train.py --use-ess-lr --ess-lr-floor 2\n", "flags do not parse"),
        ("ESS_LR_FLOOR=abc torchrun train_rl.py\n", "ESS_LR_FLOOR"),
        ("ESS_LR_FLOR=0.1 torchrun train_rl.py\n", "reads no variable"),
        ("python -m x +actor_rollout_ref.actor.ess_scaling.bogus=1\n", "refused"),
        ("python train.py --use-ess-lr\n", "covered-by=PATH"),
        ("ess-patch demo --no-such-flag\n", "the CLI refuses it"),
        ("ess-patch analyze /path/to/dump\n", "placeholder"),
        ("tox -e nosuchenv\n", "no env"),
        ("pip install '.[nosuchextra]'\n", "no extra"),
    ],
)
def test_a_drifted_command_fails(code, says, tmp_path):
    """The checks above catch what drifts: a flag, a variable, a key, a CLI option, an env, an
    extra, or a command nothing runs (the block is built here, not read from a page)."""
    block = Block("docs/example.md", 1, "shell", code)
    with pytest.raises((AssertionError, ValueError, pytest.fail.Exception)) as caught:
        _check_shell(block, "default", tmp_path)
    assert says in str(caught.value)
