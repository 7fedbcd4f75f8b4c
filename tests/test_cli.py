"""``ess-patch`` as a user types it: errors name flags, usage of the sub-command, --out, Ctrl-C.

Each bad invocation exits 2 with one line on stderr (or argparse's usage + error) and
starts nothing; Ctrl-C during a demo run exits 130 with one line and leaves no process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ess_patch import cli, doctor

ROOT = Path(cli.__file__).resolve().parents[1]


def _demo_error(capsys, *argv: str) -> str:
    assert cli.main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--lag", "-1"], "ess-patch demo: --lag must be >= 0 (got -1)"),
        (["--steps", "0"], "ess-patch demo: --steps must be >= 1 (got 0)"),
        (["--dp", "0"], "ess-patch demo: --dp must be >= 1 (got 0)"),
        (["--pp", "3"], "ess-patch demo: --pp must divide the number of layers (2) (got 3)"),
        (["--tp", "3"], "ess-patch demo: --tp must divide the vocabulary (16) (got 3)"),
        (["--cp", "2"], "ess-patch demo: --cp context parallelism needs Transformer Engine"),
        (["--response-len", "300"], "ess-patch demo: --response-len must be in [1, 256]"),
        (["--workers", "0"], "ess-patch demo: --workers must be >= 1 (got 0)"),
        (["--arms", "off,bogus"], "ess-patch demo: --arms give distinct arms among"),
        (["--arms", "off,constant"], "ess-patch demo: --arms the 'constant' arm copies"),
        (["--floor", "2"], "ess-patch demo: --floor must be in (0, 1]"),
        (["--quick", "--lag", "-3"], "ess-patch demo: --lag must be >= 0 (got -3)"),
    ],
)
def test_config_errors_name_the_flag(capsys, tmp_path, monkeypatch, argv, expected):
    pytest.importorskip("megatron.core")
    monkeypatch.chdir(tmp_path)
    # the mixed scenario's layout flags (the main job refuses them: its own test below)
    err = _demo_error(capsys, "--scenario", "mixed", *argv, "--out", str(tmp_path / "out"))
    assert err.startswith(expected), err
    assert "DemoConfig" not in err and "EssLrConfig" not in err
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_demo_config_error_carries_the_field():
    pytest.importorskip("megatron.core")
    from ess_patch.demo.train import DemoConfig, DemoConfigError

    with pytest.raises(DemoConfigError) as info:
        DemoConfig(lag=-1)
    assert (info.value.field, info.value.value) == ("lag", -1)
    assert isinstance(info.value, ValueError)  # what Python callers caught before


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["demo", "--bogus"], "usage: ess-patch demo "),
        (["patches", "check", "--target", ".", "--bogus"], "usage: ess-patch patches check "),
        (["--bogus"], "usage: ess-patch [-h]"),
    ],
)
def test_unknown_flag_prints_the_subcommand_usage(capsys, argv, usage):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert err.rstrip().endswith("unrecognized arguments: --bogus"), err


def test_out_is_a_file(capsys, tmp_path):
    pytest.importorskip("megatron.core")
    target = tmp_path / "results.txt"
    target.write_text("keep me\n")
    err = _demo_error(capsys, "--quick", "--out", str(target))
    assert err == f"ess-patch demo: --out {target}: is a file, not a folder; give a folder " + (
        "(created if absent)"
    )
    assert target.read_text() == "keep me\n"


def test_out_cannot_be_created(capsys, tmp_path):
    pytest.importorskip("megatron.core")
    (tmp_path / "afile").write_text("")
    target = tmp_path / "afile" / "out"  # a parent that is a file: no user can create it
    err = _demo_error(capsys, "--quick", "--out", str(target))
    assert err.startswith(f"ess-patch demo: --out {target}: cannot create the folder ("), err


def test_missing_extra_gives_an_install_hint_for_this_checkout(capsys, monkeypatch):
    monkeypatch.setattr(doctor, "findable", lambda module: module != "matplotlib")
    err = _demo_error(capsys, "--quick")
    installed_from = Path(cli.__file__).resolve().parents[1]
    if (installed_from / "pyproject.toml").is_file():  # run from the checkout
        hint = f"pip install -e '{installed_from}[demo]'"  # a folder pip can install
    else:  # an installed wheel (tox): no checkout to name
        hint = "pip install -e '.[demo]' from an ess-patch checkout"
    assert err == f"ess-patch demo: matplotlib not installed; install the demo extra: {hint}"


def test_compat_help_names_the_python_it_targets(capsys):
    from ess_patch.patchset.cli import PYTHON

    with pytest.raises(SystemExit):
        cli.main(["patches", "compat", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"the table targets Python {PYTHON}" in out
    assert PYTHON == "3.12"  # megatron-core 0.17+ wheels exist only for it (DESIGN.md)


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: session id
            pids.append(int(entry.name))
    return pids


@pytest.mark.dist
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_ctrl_c_exits_130_with_one_line_and_no_process_left(tmp_path):
    pytest.importorskip("megatron.core")
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "ess_patch.cli", "demo", "--scenario", "mixed"]
    argv += ["--no-progress", "--out", str(out)]
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        # a runner started in the background (`cmd &`) ignores SIGINT, and children inherit
        # that: give the demo a terminal's default, as a user's Ctrl-C meets it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 180
        # Ranks log their first line once they are up; then the run is under way.
        while not any(p.stat().st_size for p in out.glob("ranks/rank*.log")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.2)
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = err.decode()
    assert proc.returncode == 130, text
    assert "Traceback" not in text, text
    assert text.strip().splitlines() == [f"ess-patch demo: interrupted; partial outputs in {out}"]
    deadline = time.monotonic() + 10
    while _session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session_pids(proc.pid) == []
