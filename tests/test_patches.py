"""patches/: the megatron-core series and the tool that applies it (tox -e patches).

The megatron-core 0.16.1 wheel is fetched from the package index (``pip download``; kept in
``$ESS_PATCH_WHEEL_CACHE`` when set) and unpacked to a scratch site-packages folder; the series
is applied there with ``ess_patch.patchset``. Then, in fresh processes with that copy first on
PYTHONPATH and no ``install()``:

- the Megatron behaviour tests (tests/test_megatron_integration.py, ESS_PATCH_TEST_MODE=vendored)
  pass;
- a fixed training sequence over every optimizer kind gives the same bytes (params, main
  params, optimizer state, LRs, grad norms) as the monkeypatch mode on the pristine wheel.

And the tool: check on a patched tree says so, apply with a conflicting hand edit changes
nothing and names the file, a dirty git tree is refused, revert restores the tree byte for
byte, a series is applied whole or not at all.

The miles and slime series, on copies of the upstream snapshots (``$MILES_SRC``,
``$SLIME_SRC``, and the releases ``$MILES_RELEASE_SRC``, ``$SLIME_RELEASE_SRC``; skipped when
unset): recognised without git by fingerprint, applied, "already
applied", reverted byte for byte, refused on a hand edit; the diff adds only the guarded import
and the decorators install() would wrap. That the patched copies behave like install() (the
framework tests, without it) is tests/frameworks/test_vendored_frameworks.py (tox -e
frameworks: it needs the frameworks' dependencies).
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from skips import missing_snapshot

import ess_patch
import ess_patch.vendored
from ess_patch import patchset
from ess_patch.install import INTEGRATIONS
from ess_patch.integrations.registry import component
from ess_patch.patchset import ConflictError, DirtyTreeError, State, UnknownTreeError
from ess_patch.patchset.cli import main as patches_main

pytestmark = pytest.mark.patches

VERSION = "0.16.1"
TESTS = Path(__file__).resolve().parent
ESS_ROOT = Path(ess_patch.__file__).resolve().parents[1]  # what the child processes import
TOUCHED = (
    "megatron/core/optimizer/optimizer.py",
    "megatron/core/optimizer/distrib_optimizer.py",
    "megatron/core/optimizer/layer_wise_optimizer.py",
)


def _git(cwd: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def _tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".git" not in p.relative_to(root).parts
    }


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = patches_main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# --------------------------------------------------------------------------------------
# Fixtures: the real megatron-core source from the package index
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    cache = Path(os.environ.get("ESS_PATCH_WHEEL_CACHE") or tmp_path_factory.mktemp("wheels"))
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"megatron_core-{VERSION}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += [f"megatron-core=={VERSION}", "-d", str(cache)]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        found = sorted(cache.glob(f"megatron_core-{VERSION}-*.whl"))
        assert found, f"pip download megatron-core=={VERSION} failed:\n{result.stderr}"
    return found[0]


@pytest.fixture(scope="module")
def pristine(wheel, tmp_path_factory) -> Path:
    """The unpacked wheel: a site-packages-like folder holding megatron/ and its dist-info."""
    root = tmp_path_factory.mktemp("pristine")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(root)
    return root


@pytest.fixture
def tree(pristine, tmp_path) -> Path:
    """A fresh copy of the pristine tree for one test."""
    dest = tmp_path / "tree"
    shutil.copytree(pristine, dest)
    return dest


@pytest.fixture(scope="module")
def patched(pristine, tmp_path_factory) -> Path:
    """One copy with the series applied by the tool (shared by the subprocess tests)."""
    dest = tmp_path_factory.mktemp("patched") / "site"
    shutil.copytree(pristine, dest)
    tree = patchset.detect(dest)
    series, statuses = patchset.select_series(tree)
    assert series.version == VERSION
    assert [s.state for s in statuses] == [State.APPLICABLE] * len(series.patches)
    patchset.apply_series(series, tree.root)
    return dest


def _child_env(vendored_tree: Path | None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(TESTS), str(ESS_ROOT)]
    if vendored_tree is not None:
        paths.insert(0, str(vendored_tree))
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("ESS_PATCH_TEST_MODE", None)
    env.update(extra)
    return env


# --------------------------------------------------------------------------------------
# The diffs behave like the monkeypatches
# --------------------------------------------------------------------------------------


def test_megatron_behaviour_tests_pass_on_the_patched_copy_without_install(patched, tmp_path):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    cmd += ["--rootdir", str(TESTS.parent), str(TESTS / "test_megatron_integration.py")]
    env = _child_env(patched, ESS_PATCH_TEST_MODE="vendored")
    result = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    tail = result.stdout[-3000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and "skipped" not in result.stdout, tail


def test_parameter_updates_equal_the_monkeypatch_mode_bitwise(patched, tmp_path):
    outs = {}
    for mode, vendored in (("vendored", patched), ("monkeypatch", None), ("plain", None)):
        outs[mode] = tmp_path / f"{mode}.bin"
        cmd = [sys.executable, str(TESTS / "patches_twin.py"), "--mode", mode]
        env = _child_env(vendored)
        if mode == "plain":
            # nothing applies the armed scale there: without the explicit opt-out the first
            # armed step stops the run (fail closed); with it, arming changes nothing
            env = {**env, "ESS_PATCH_ALLOW_UNSCALED": "1"}
        result = subprocess.run(
            [*cmd, "--out", str(outs[mode])],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    vendored, monkeypatched = outs["vendored"].read_bytes(), outs["monkeypatch"].read_bytes()
    assert hashlib.sha256(vendored).hexdigest() == hashlib.sha256(monkeypatched).hexdigest()
    assert vendored == monkeypatched
    # the control: without ess-patch, arming changes nothing, so the bytes differ
    assert outs["plain"].read_bytes() != monkeypatched


def test_install_skips_the_patched_copy_with_a_log_line(patched, fresh_python):
    code = """
        import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)
        import ess_patch
        import megatron.core.optimizer.layer_wise_optimizer
        import megatron.core.optimizer.distrib_optimizer
        ess_patch.install('megatron')
        emit(ess_patch.installed_targets())
    """
    result = fresh_python(code, _child_env(patched), timeout=120)
    # only the install()-only targets (the checkpoint's calibration), which no series carries
    install_only = {t.path for t in INTEGRATIONS["megatron"].targets if not t.vendored}
    assert result.result and set(result.result) <= install_only, result.result
    assert result.stdout.count("already calls ess-patch (vendored diff") == 8


def test_the_series_is_the_exact_twin_of_install(pristine):
    tree = patchset.detect(pristine)
    series, _ = patchset.select_series(tree)
    assert patchset.series_gaps(series, tree.root) == []
    assert sorted(series.files()) == sorted(TOUCHED)


# --------------------------------------------------------------------------------------
# The tool on the real tree
# --------------------------------------------------------------------------------------


def test_detects_the_tree_from_its_root_or_from_megatron_core(tree):
    found = patchset.detect(tree)
    assert (found.component, found.version, found.root) == ("megatron-core", VERSION, tree)
    assert patchset.detect(tree / "megatron" / "core").root == tree


def test_check_then_apply_then_check_says_already_applied(tree, capsys):
    rc, out, _ = _cli(capsys, "check", "--target", str(tree))
    assert rc == 0 and "result: applicable" in out and f"megatron-core/{VERSION}" in out
    rc, out, _ = _cli(capsys, "apply", "--target", str(tree))
    assert rc == 0 and "result: applied 1 patch(es)" in out
    rc, out, _ = _cli(capsys, "check", "--target", str(tree))
    assert rc == 0 and "already applied" in out and "result: already applied" in out
    before = _tree_hashes(tree)
    rc, out, _ = _cli(capsys, "apply", "--target", str(tree))
    assert rc == 0 and "result: already applied" in out
    assert _tree_hashes(tree) == before


def test_revert_restores_the_tree_byte_for_byte(tree, capsys):
    before = _tree_hashes(tree)
    assert _cli(capsys, "apply", "--target", str(tree))[0] == 0
    after = _tree_hashes(tree)
    assert {k for k in before if before[k] != after[k]} == set(TOUCHED)
    rc, out, _ = _cli(capsys, "revert", "--target", str(tree))
    assert rc == 0 and "result: reverted 1 patch(es)" in out
    assert _tree_hashes(tree) == before
    rc, out, _ = _cli(capsys, "revert", "--target", str(tree))
    assert rc == 0 and "result: not applied" in out


def test_a_conflicting_hand_edit_changes_nothing_and_names_the_file(tree, capsys):
    edited = tree / "megatron/core/optimizer/distrib_optimizer.py"
    text = edited.read_text()
    # the line right above DistributedOptimizer.step_with_ready_grads (a hunk's context)
    old = "        copy_group_params(self.model_fp32_groups, self.shard_fp32_groups)\n"
    assert text.count(old) == 1
    edited.write_text(text.replace(old, old.replace("copy_group_params", "my_copy")))
    before = _tree_hashes(tree)
    rc, out, err = _cli(capsys, "apply", "--target", str(tree))
    assert rc == 1
    assert "conflicting megatron/core/optimizer/distrib_optimizer.py" in err
    assert "Nothing was changed" in err
    assert "optimizer/optimizer.py" not in err  # only the file that conflicts is named
    assert _tree_hashes(tree) == before
    rc, out, _ = _cli(capsys, "check", "--target", str(tree))
    assert rc == 1 and "conflicting: megatron/core/optimizer/distrib_optimizer.py" in out


def test_a_dirty_git_tree_is_refused_and_apply_then_revert_is_clean(tree, capsys):
    _git(tree, "init", "-q", ".")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "-m", "vendored megatron-core")
    target = tree / TOUCHED[0]
    target.write_text(target.read_text() + "\n# local change\n")
    before = _tree_hashes(tree)
    series, _ = patchset.select_series(patchset.detect(tree))
    with pytest.raises(DirtyTreeError, match=r"uncommitted changes in .*optimizer/optimizer\.py"):
        patchset.apply_series(series, tree)
    assert _tree_hashes(tree) == before
    _git(tree, "checkout", "-q", "--", ".")
    # apply leaves uncommitted changes that are exactly the series: revert accepts them
    assert _cli(capsys, "apply", "--target", str(tree))[0] == 0
    assert _cli(capsys, "revert", "--target", str(tree))[0] == 0
    assert _git(tree, "status", "--porcelain") == ""


def test_an_unknown_tree_is_refused_naming_what_was_looked_for(tmp_path, capsys):
    rc, _, err = _cli(capsys, "check", "--target", str(tmp_path))
    assert rc == 1 and "megatron/core/__init__.py" in err
    rc, _, err = _cli(capsys, "apply", "--target", str(tmp_path), "--component", "megatron-core")
    assert rc == 1 and "no megatron/core/__init__.py" in err
    with pytest.raises(UnknownTreeError, match=r"no megatron-core series '9\.9'"):
        patchset.select_series(patchset.Tree(tmp_path, "megatron-core", None, "x"), "9.9")


# --------------------------------------------------------------------------------------
# The tool on a synthetic two-patch series (all or nothing, order)
# --------------------------------------------------------------------------------------


def _fake_megatron(root: Path, version: tuple[int, int, int]) -> None:
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("")
    major, minor, patch = version
    (core / "package_info.py").write_text(
        f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ''\n"
    )
    (core / "a.py").write_text("".join(f"a{i} = {i}\n" for i in range(20)))
    (core / "b.py").write_text("".join(f"b{i} = {i}\n" for i in range(20)))


def _make_series(tmp_path: Path) -> Path:
    """patches/megatron-core/1.2.0/{0001 (a.py), 0002 (b.py)} made with git format-patch."""
    work = tmp_path / "gen"
    _fake_megatron(work, (1, 2, 0))
    _git(work, "init", "-q", ".")
    _git(work, "add", "-A")
    _git(work, "commit", "-q", "-m", "base")
    for name in ("a", "b"):
        path = work / "megatron" / "core" / f"{name}.py"
        path.write_text(path.read_text().replace(f"{name}10 = 10", f"{name}10 = 'patched'"))
        _git(work, "commit", "-q", "-am", f"patch {name}")
    out = tmp_path / "patches" / "megatron-core" / "1.2.0"
    _git(work, "format-patch", "-2", "-o", str(out))
    return tmp_path / "patches"


def test_a_series_is_applied_whole_or_not_at_all(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(patchset.ENV_PATCHES_DIR, str(_make_series(tmp_path)))
    target = tmp_path / "target"
    _fake_megatron(target, (1, 2, 0))
    b = target / "megatron/core/b.py"
    b.write_text(b.read_text().replace("b11 = 11", "b11 = 'mine'"))  # breaks 0002 only
    before = _tree_hashes(target)
    series, statuses = patchset.select_series(patchset.detect(target))
    assert [s.state for s in statuses] == [State.APPLICABLE, State.CONFLICTING]
    assert statuses[1].files == ("megatron/core/b.py",)
    with pytest.raises(ConflictError) as err:
        patchset.apply_series(series, target)
    assert err.value.files == ("megatron/core/b.py",)
    assert _tree_hashes(target) == before  # 0001 was not applied either
    rc, out, _ = _cli(capsys, "check", "--target", str(target))
    assert rc == 1
    assert "0001-patch-a.patch  applicable" in out
    assert "0002-patch-b.patch  conflicting: megatron/core/b.py" in out


def test_a_partly_applied_series_is_completed_and_reverted_in_order(tmp_path, monkeypatch):
    patches = _make_series(tmp_path)
    monkeypatch.setenv(patchset.ENV_PATCHES_DIR, str(patches))
    target = tmp_path / "target"
    _fake_megatron(target, (1, 2, 0))
    pristine = _tree_hashes(target)
    series = patchset.discover("megatron-core")[0]
    first = subprocess.run(
        ["git", "apply", str(series.patches[0])], cwd=target, capture_output=True, check=False
    )
    assert first.returncode == 0
    assert [s.state for s in patchset.check_series(series, target)] == [
        State.APPLIED,
        State.APPLICABLE,
    ]
    patchset.apply_series(series, target)
    assert [s.state for s in patchset.check_series(series, target)] == [State.APPLIED] * 2
    patchset.revert_series(series, target)
    assert _tree_hashes(target) == pristine


def test_a_tree_inside_a_larger_git_repository(tmp_path, monkeypatch):
    # git apply inside a repository takes paths from its top: the tool must not be fooled
    monkeypatch.setenv(patchset.ENV_PATCHES_DIR, str(_make_series(tmp_path)))
    mono = tmp_path / "mono"
    target = mono / "third_party" / "Megatron-LM"
    _fake_megatron(target, (1, 2, 0))
    _git(mono, "init", "-q", ".")
    _git(mono, "add", "-A")
    _git(mono, "commit", "-q", "-m", "vendored")
    series = patchset.discover("megatron-core")[0]
    patchset.apply_series(series, target)
    assert "a10 = 'patched'" in (target / "megatron/core/a.py").read_text()
    assert sorted(_git(mono, "status", "--porcelain").split()) == sorted(
        [
            "M",
            "M",
            "third_party/Megatron-LM/megatron/core/a.py",
            "third_party/Megatron-LM/megatron/core/b.py",
        ]
    )
    patchset.revert_series(series, target)
    assert _git(mono, "status", "--porcelain") == ""
    b = target / "megatron/core/b.py"
    b.write_text(b.read_text() + "b_mine = 1\n")  # no conflict, but uncommitted
    with pytest.raises(DirtyTreeError, match=r"uncommitted changes in megatron/core/b\.py"):
        patchset.apply_series(series, target)


def test_a_version_without_its_own_series_gets_the_closest_that_applies(tmp_path, monkeypatch):
    monkeypatch.setenv(patchset.ENV_PATCHES_DIR, str(_make_series(tmp_path)))
    target = tmp_path / "target"
    _fake_megatron(target, (1, 3, 1))
    series, statuses = patchset.select_series(patchset.detect(target))
    assert series.version == "1.2.0"
    assert {s.state for s in statuses} == {State.APPLICABLE}


# --------------------------------------------------------------------------------------
# What ships
# --------------------------------------------------------------------------------------


def test_every_shipped_series_is_a_format_patch_with_what_and_why():
    series = patchset.discover()
    assert {s.name for s in series} >= {f"megatron-core/{VERSION}"}
    for s in series:
        for patch in s.patches:
            text = patch.read_text()
            assert text.startswith("From ") and "\nSubject: [PATCH" in text, patch
            assert "\nWhat: " in text and "\nWhy: " in text, patch
            assert "ess_patch.vendored" in text, patch


def _installed_files() -> list[str] | None:
    try:
        files = importlib.metadata.files("ess-patch")
    except importlib.metadata.PackageNotFoundError:
        return None
    return [str(f) for f in files or []]


@pytest.mark.skipif(_installed_files() is None, reason="ess-patch is not installed (source run)")
def test_the_wheel_ships_the_series():
    files = _installed_files()
    for s in patchset.discover(root=TESTS.parent / "patches"):
        for patch in s.patches:
            assert f"ess_patch/patches/{s.component}/{s.version}/{patch.name}" in files
    assert "ess_patch/patches/README.md" in files


# --------------------------------------------------------------------------------------
# miles and slime: the series on copies of the upstream snapshots ($MILES_SRC, $SLIME_SRC)
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """An upstream snapshot a shipped framework series is made for.

    ``moved``: call sites this snapshot has in another file than ``CALL_SITES`` says;
    ``pending_gaps``: what ``series_gaps`` reports there until install()'s target table knows
    that shape (then ``apply`` needs ``--version``; the list empties when the table learns it).
    """

    component: str
    env: str
    commit: str
    touched: tuple[str, ...]
    moved: tuple[tuple[str, str], ...] = ()
    pending_gaps: tuple[str, ...] = ()
    package: str = ""  # the package folder the detector looks for (default: the component)

    @property
    def marker(self) -> str:
        return f"{self.package or self.component}/__init__.py"

    def sites(self, tree: Path) -> list:
        """The call sites this snapshot's series decorates: those whose file ``tree`` has
        (the target table lists every version's locations, e.g. slime's three ``log``s)."""
        moved = dict(self.moved)
        out = []
        for s in ess_patch.vendored.CALL_SITES[self.component]:
            site = dataclasses.replace(s, path=moved.get(s.path, s.path))
            if (tree / site.path).is_file() and site not in out:
                out.append(site)
        return out

    def pick(self) -> tuple[str, ...]:
        """The CLI arguments that choose this series where install() has gaps."""
        return ("--version", self.commit[:9]) if self.pending_gaps else ()


_MILES_FILES = (
    "miles/utils/arguments.py",
    "miles/backends/training_utils/loss.py",
    "miles/backends/training_utils/log_utils.py",
    # the policy loss and its log-probs (ESS measured inside the loss)
    "miles/backends/training_utils/loss_hub/losses.py",
    "miles/backends/training_utils/loss_hub/logit_processors.py",
    "miles/backends/fsdp_utils/actor.py",
    "miles/backends/megatron_utils/actor.py",  # MegatronTrainRayActor.train_critic
)
_SLIME_LOG = ("slime/observability/logging_utils.py", "slime/utils/logging_utils.py")


def _snapshot(name: str) -> str:
    """The upstream commit the component's newest series is cut from (the registry's)."""
    return component(name).integration.snapshot  # type: ignore[return-value]


FRAMEWORKS = {
    "miles": Snapshot("miles", "MILES_SRC", _snapshot("miles"), _MILES_FILES),
    "miles-v0.1.0": Snapshot("miles", "MILES_RELEASE_SRC", "78527b910", _MILES_FILES),
    "slime": Snapshot(
        "slime",
        "SLIME_SRC",
        _snapshot("slime"),
        (
            "slime/utils/arguments.py",
            "slime/backends/megatron_utils/loss.py",
            "slime/observability/logging_utils.py",
            "slime/backends/megatron_utils/actor.py",  # MegatronTrainRayActor.train_critic
        ),
    ),
    "slime-v0.3.1": Snapshot(
        "slime",
        "SLIME_RELEASE_SRC",
        "a6272da0d",
        (
            "slime/utils/arguments.py",
            "slime/backends/megatron_utils/loss.py",
            "slime/utils/logging_utils.py",
            "slime/backends/megatron_utils/actor.py",
        ),
        # the series decorates log where v0.3.1 keeps it; install() knows that location too
        # (an optional target with decorator slime_log), so there is no gap
        moved=(_SLIME_LOG,),
    ),
    # Megatron-LM's own RL loop (NVIDIA Megatron-LM, tag core_v0.16.1)
    "megatron_rl": Snapshot(
        "megatron_rl",
        "MEGATRON_RL_SRC",
        _snapshot("megatron_rl"),
        (
            "megatron/training/arguments.py",
            "megatron/rl/rl_utils.py",
            "megatron/rl/sequence_packing_utils.py",
        ),
        package="megatron/rl",
    ),
}


def _snapshot_skip(name: str) -> str | None:
    snap = FRAMEWORKS[name]
    return missing_snapshot(snap.env, snap.component, snap.marker)


def _framework_params():
    return [
        pytest.param(
            name,
            marks=pytest.mark.skipif(bool(_snapshot_skip(name)), reason=_snapshot_skip(name) or ""),
            id=name,
        )
        for name in FRAMEWORKS
    ]


@pytest.fixture
def snapshot(request, tmp_path) -> tuple[Snapshot, Path]:
    """(the snapshot, a fresh copy of it): never the snapshot itself."""
    snap = FRAMEWORKS[request.param]
    dest = tmp_path / request.param
    shutil.copytree(os.environ[snap.env], dest)
    return snap, dest


def _framework_test(fn):
    return pytest.mark.parametrize("snapshot", _framework_params(), indirect=True)(fn)


@_framework_test
def test_framework_series_applies_to_the_snapshot_and_check_says_already_applied(snapshot, capsys):
    snap, tree = snapshot
    component, commit, touched = snap.component, snap.commit, snap.touched
    found = patchset.detect(tree)
    # a snapshot without git: told by the blob ids the series records
    assert (found.component, found.version) == (component, commit[:9])
    assert found.evidence.startswith("fingerprint") and found.evidence.endswith("pristine")
    series, statuses = patchset.select_series(found)
    assert series.name == f"{component}/{commit[:9]}"
    assert [s.state for s in statuses] == [State.APPLICABLE]
    assert sorted(series.files()) == sorted(touched)
    # decorates exactly what install() wraps
    assert patchset.series_gaps(series, tree) == list(snap.pending_gaps)
    before = _tree_hashes(tree)
    if snap.pending_gaps:  # not the twin of install() yet: apply refuses it unless it is named
        rc, out, err = _cli(capsys, "apply", "--target", str(tree))
        assert rc == 1 and "not the exact twin of install()" in err, err
        assert _tree_hashes(tree) == before
    rc, out, _ = _cli(capsys, "apply", "--target", str(tree), *snap.pick())
    assert rc == 0 and "result: applied 1 patch(es)" in out, out
    after = _tree_hashes(tree)
    assert {k for k in before if before[k] != after[k]} == set(touched)
    rc, out, _ = _cli(capsys, "check", "--target", str(tree))
    assert rc == 0 and "result: already applied" in out, out
    assert "fingerprint of the" in out and ": patched)" in out
    rc, out, _ = _cli(capsys, "apply", "--target", str(tree), *snap.pick())
    assert rc == 0 and "result: already applied" in out
    assert _tree_hashes(tree) == after


@_framework_test
def test_framework_series_adds_only_guarded_imports_and_decorators(snapshot):
    snap, tree = snapshot
    series = patchset.select_series(patchset.detect(tree))[0]
    added = [
        line[1:]
        for patch in series.patches
        for line in patch.read_text().splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]
    decorators = [line.strip() for line in added if line.strip().startswith("@")]
    sites = snap.sites(tree)
    assert sorted(decorators) == sorted(f"@{s.alias}" for s in sites)
    imports = [line.strip() for line in added if "import" in line and "ess_patch" in line]
    assert sorted(i for i in imports if i.startswith("from ")) == sorted(
        f"from ess_patch.vendored import {s.decorator} as {s.alias}" for s in sites
    )
    # the guard: the identity only when ess_patch itself is missing
    patchset.apply_series(series, tree)
    for site in sites:
        guard = _guard_block(tree / site.path)
        assert _run_guard(guard, site.alias, missing=None) is getattr(
            ess_patch.vendored, site.decorator
        )
        decorate = _run_guard(guard, site.alias, missing="ess_patch")
        assert decorate(len) is len
        with pytest.raises(ModuleNotFoundError, match="wrapt"):
            _run_guard(guard, site.alias, missing="wrapt")  # ess_patch installed but broken


def _guard_block(path: Path) -> ast.Module:
    """The diff's ``try: from ess_patch.vendored import ... except ...`` block in ``path``."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Try) and any(
            isinstance(n, ast.ImportFrom) and n.module == "ess_patch.vendored" for n in node.body
        ):
            return ast.Module(body=[node], type_ignores=[])
    raise AssertionError(f"no guarded ess_patch import in {path}")


def _run_guard(guard: ast.Module, alias: str, *, missing: str | None):
    """Run the guard with the import of ``ess_patch.vendored`` failing as if ``missing`` (a
    module name) were not installed; return what it binds to ``alias``."""
    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if missing is not None and name.startswith("ess_patch"):
            raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
        return real(name, *args, **kwargs)

    namespace: dict = {"__name__": "patched_module"}
    builtins.__import__ = fake
    try:
        exec(compile(guard, "<guard>", "exec"), namespace)
    finally:
        builtins.__import__ = real
    return namespace[alias]


@_framework_test
def test_framework_revert_restores_the_snapshot_byte_for_byte(snapshot, capsys):
    snap, tree = snapshot
    pristine = _tree_hashes(Path(os.environ[snap.env]))
    assert _tree_hashes(tree) == pristine
    assert _cli(capsys, "apply", "--target", str(tree), *snap.pick())[0] == 0
    assert _tree_hashes(tree) != pristine
    rc, out, _ = _cli(capsys, "revert", "--target", str(tree))
    assert rc == 0 and "result: reverted 1 patch(es)" in out
    assert _tree_hashes(tree) == pristine
    rc, out, _ = _cli(capsys, "revert", "--target", str(tree))
    assert rc == 0 and "result: not applied" in out


@_framework_test
def test_framework_conflicting_hand_edit_is_refused_naming_the_file(snapshot, capsys):
    snap, tree = snapshot
    site = snap.sites(tree)[1]  # compute_advantages_and_returns
    edited = tree / site.path
    text = edited.read_text()
    old = f"def {site.function}("
    assert text.count(old) == 1
    edited.write_text(text.replace(old, f"def {site.function}(  # local change\n    "))
    before = _tree_hashes(tree)
    rc, _, err = _cli(capsys, "apply", "--target", str(tree))
    assert rc == 1
    assert f"conflicting {site.path}" in err and "Nothing was changed" in err, err
    others = [p for p in snap.touched if p != site.path]
    assert not any(p in err for p in others)  # only the file that conflicts is named
    assert _tree_hashes(tree) == before
    rc, out, _ = _cli(capsys, "check", "--target", str(tree))
    assert rc == 1 and f"conflicting: {site.path}" in out
    # a hand-edited tree matches no fingerprint: its version is unknown, and said so
    assert "version unknown" in out


@_framework_test
def test_framework_commit_is_selectable_and_a_git_checkout_is_recognised(snapshot, capsys):
    snap, tree = snapshot
    component, commit = snap.component, snap.commit
    for name in dict.fromkeys((commit, commit[:7], commit[:9])):
        rc, out, _ = _cli(capsys, "check", "--target", str(tree), "--version", name)
        assert rc == 0 and f"series: {component}/{commit[:9]}" in out, out
    rc, _, err = _cli(capsys, "check", "--target", str(tree), "--version", "0123456")
    assert rc == 1 and f"no {component} series '0123456'" in err
    # a git checkout at another commit whose touched files are the same: fingerprint again
    _git(tree, "init", "-q", ".")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "-m", f"vendored {component}")
    found = patchset.detect(tree)
    assert found.version == commit[:9] and found.evidence.startswith("fingerprint")
    # a dirty git tree is refused; apply then revert leaves it clean
    target = tree / snap.touched[0]
    target.write_text(target.read_text() + "\n# local change\n")
    rc, _, err = _cli(capsys, "apply", "--target", str(tree), *snap.pick())
    assert rc == 1 and "uncommitted changes in" in err
    _git(tree, "checkout", "-q", "--", ".")
    assert _cli(capsys, "apply", "--target", str(tree), *snap.pick())[0] == 0
    assert _cli(capsys, "revert", "--target", str(tree))[0] == 0
    assert _git(tree, "status", "--porcelain") == ""


_MRL_SKIP = _snapshot_skip("megatron_rl")


@pytest.mark.skipif(bool(_MRL_SKIP), reason=_MRL_SKIP or "")
def test_a_megatron_lm_checkout_holds_two_components_and_each_is_named(tmp_path, capsys):
    """A full Megatron-LM checkout has megatron/core (the megatron-core series) and megatron/rl
    (the megatron_rl series): unnamed, the tool takes megatron-core (what every Megatron user
    vendors) and says how to get the other; named, each component is patched alone."""
    tree = tmp_path / "Megatron-LM"
    shutil.copytree(os.environ["MEGATRON_RL_SRC"], tree)
    core = Path(importlib.util.find_spec("megatron.core").origin).parent
    (tree / "megatron" / "core").mkdir()
    for name in ("__init__.py", "package_info.py"):
        shutil.copy(core / name, tree / "megatron" / "core" / name)
    found = patchset.detect(tree)
    assert (found.component, found.version) == ("megatron-core", VERSION)
    assert "--component megatron_rl" in found.evidence
    before = _tree_hashes(tree)
    rc, out, err = _cli(capsys, "check", "--target", str(tree))
    assert "megatron-core" in out + err and "--component megatron_rl" in out + err
    assert _tree_hashes(tree) == before  # check changes nothing
    assert patchset.detect(tree, "megatron-core").version == VERSION
    rc, out, _ = _cli(capsys, "apply", "--target", str(tree), "--component", "megatron_rl")
    assert rc == 0 and "series: megatron_rl/55ac70825" in out and "applied 1 patch" in out, out
