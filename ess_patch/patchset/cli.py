"""``ess-patch patches``: list, check, apply, revert the ``patches/`` series; compat table.

Wire into the main parser with ``add_parser(subparsers)``; the sub-parser sets
``func=run``. Also runs alone: ``python -m ess_patch.patchset.cli check --target DIR``.

Exit status: 0 done (or nothing to do); 1 refused (unknown or dirty tree, conflict);
2 usage error.

The compatibility table (``ess-patch patches compat``): which megatron-core releases each
series (and ``install()``) covers. For every final megatron-core release from the lower bound
of ``install()``'s supported range on that the package index lists for Python 3.12 (0.17+
require it, so they are fetched, never installed),
download the wheel with ``pip download --no-deps --python-version 3.12 --only-binary=:all:``,
unpack ``megatron/core`` to a scratch folder and report the series ``ess-patch patches apply``
would choose there and whether it applies (``git apply --check``); whether the symbols
``install()`` needs exist (parsed with ``ast``, never imported) and which optional ones it
would also wrap; whether the patched tree is the exact twin of ``install()``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .. import __version__
from ..errors import EssPatchRuntimeError
from ..integrations.registry import component
from .apply import PatchStatus, State, apply_series, check_series, conflicting_files, revert_series
from .series import PatchsetError, discover, patches_dir
from .trees import DETECTORS, Tree, detect
from .twin import class_defines, select_series, series_gaps

__all__ = ["CompatRow", "add_parser", "compat_rows", "main", "markdown", "run"]

#: the release-keyed component this table is about, and its pip distribution
_CORE = component("megatron")
MEGATRON = _CORE.integration
DISTRIBUTION: str = _CORE.integration.distribution  # type: ignore[assignment]
#: the oldest release the table covers: the lower bound of the supported range
MINIMUM = next(s.version for s in SpecifierSet(_CORE.integration.supported) if s.operator == ">=")
PYTHON = "3.12"

_EPILOG = """\
examples:
  ess-patch patches list
  ess-patch patches check  --target /path/to/Megatron-LM
  ess-patch patches apply  --target /path/to/Megatron-LM
  ess-patch patches revert --target /path/to/site-packages --component megatron-core
  ess-patch patches apply  --target /path/to/miles          # the folder holding miles/
  ess-patch patches check  --target /path/to/slime --version 624b824a8
  ess-patch patches compat > table.md
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``patches`` (with list/check/apply/revert/compat) to ``subparsers``."""
    parser = subparsers.add_parser(
        "patches",
        help="git-diff series for vendored Megatron (and miles/slime) trees",
        description="Apply ess-patch's call sites to a vendored source tree as reviewed "
        "diffs instead of install()'s monkeypatches (the same code runs either way).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _fill(parser)
    return parser


def _fill(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="patches_command", metavar="ACTION", required=True)

    def target_args(p: argparse.ArgumentParser, required: bool) -> None:
        p.add_argument(
            "--target",
            type=Path,
            required=required,
            help="tree root: a Megatron-LM checkout, an unpacked megatron-core, a site-packages "
            "folder (the folder holding megatron/core), or a miles / slime checkout or snapshot "
            "(the folder holding miles/ or slime/)",
        )
        p.add_argument("--component", choices=sorted(DETECTORS), help="skip detection")
        p.add_argument(
            "--version",
            dest="series_version",
            metavar="VERSION",
            help="use patches/<component>/VERSION: a megatron-core version, or a miles / slime "
            "commit (7+ hex digits or the full hash; default: chosen from the tree's version, "
            "git HEAD or fingerprint)",
        )

    p = actions.add_parser("list", help="list the shipped series (with --target: their status)")
    target_args(p, required=False)
    for name, text in (
        ("check", "report each patch: applicable, already applied, or conflicting"),
        ("apply", "apply the whole series, or nothing"),
        ("revert", "revert the whole series, or nothing"),
    ):
        p = actions.add_parser(name, help=text)
        target_args(p, required=True)
        if name != "check":
            p.add_argument(
                "--allow-dirty",
                action="store_true",
                help="write even if the touched files have uncommitted git changes",
            )
    p = actions.add_parser(
        "compat",
        help="megatron-core releases vs the series and install()'s symbols (markdown table)",
    )
    p.add_argument(
        "--versions",
        nargs="+",
        help=f"default: every final release >= {MINIMUM} on the index with a Python {PYTHON} wheel "
        f"(the table targets Python {PYTHON}: wheels are fetched for it, never installed)",
    )
    p.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "ess-patch" / "wheels",
        help="where downloaded wheels are kept (default: %(default)s)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Handler for ``ess-patch patches ...``; returns the exit status."""
    try:
        if args.patches_command == "list":
            return _list(args)
        if args.patches_command == "compat":
            return _compat(args)
        return _act(args)
    except PatchsetError as err:
        print(f"ess-patch patches {args.patches_command}: {err}", file=sys.stderr)
        return 1


def _print_statuses(statuses: list[PatchStatus]) -> None:
    width = max(len(s.patch.name) for s in statuses)
    for s in statuses:
        print(f"  {s.patch.name:<{width}}  {s.describe()}")


def _series_list(component: str) -> str:
    """The series of ``component`` and the upstream releases they were made from (the
    ``(release X)`` their message names), for a tree none of them fits."""
    named = []
    for series in discover(component):
        text = series.patches[0].read_text(encoding="utf-8") if series.patches else ""
        release = re.search(r"\(release ([^)\s]+)\)", text)
        named.append(f"{series.version} ({release.group(1)})" if release else series.version)
    return (
        f"no {component} series fits this tree; series exist for: {', '.join(named)}. Use "
        "one of those releases, or port the nearest series (patches/README.md)"
    )


def _describe_tree(tree: Tree) -> str:
    version = tree.version or "version unknown"
    return f"{tree.root} ({tree.component} {version}, from {tree.evidence})"


def _list(args: argparse.Namespace) -> int:
    if args.target is None:
        print(f"series in {patches_dir()}:")
        for series in discover(args.component):
            print(f"  {series.name}: {len(series.patches)} patch(es), touches")
            for path in series.files():
                print(f"      {path}")
        return 0
    tree = detect(args.target, args.component)
    print(f"target: {_describe_tree(tree)}")
    for series in discover(tree.component):
        print(f"series {series.name}:")
        _print_statuses(check_series(series, tree.root))
    return 0


def _act(args: argparse.Namespace) -> int:
    tree = detect(args.target, args.component)
    series, statuses = select_series(tree, args.series_version)
    print(f"target: {_describe_tree(tree)}")
    print(f"series: {series.name} ({series.directory})")
    _print_statuses(statuses)
    states = {s.state for s in statuses}
    conflicting = State.CONFLICTING in states
    if conflicting and args.patches_command != "revert":
        print(_series_list(tree.component), file=sys.stderr)
    gaps = [] if conflicting else series_gaps(series, tree.root)
    for gap in gaps:
        print(f"  gap with install(): {gap}")
    if gaps and args.patches_command == "apply" and args.series_version is None:
        print(
            f"result: refused: {series.name} applies but is not the exact twin of install() "
            f"here; pass --version {series.version} to apply it anyway",
            file=sys.stderr,
        )
        return 1
    if args.patches_command == "check":
        if conflicting:
            files = ", ".join(conflicting_files(statuses))
            print(f"result: conflicting ({files}); apply would change nothing")
            return 1
        if states == {State.APPLIED}:
            print("result: already applied")
        elif states == {State.APPLICABLE}:
            print("result: applicable")
        else:
            print("result: partly applied; apply would add the rest")
        return 0
    allow_dirty = args.allow_dirty
    if args.patches_command == "apply":
        before = apply_series(series, tree.root, allow_dirty=allow_dirty)
        done = [s for s in before if s.state is State.APPLICABLE]
        print(f"result: applied {len(done)} patch(es)" if done else "result: already applied")
    else:
        before = revert_series(series, tree.root, allow_dirty=allow_dirty)
        done = [s for s in before if s.state is State.APPLIED]
        print(f"result: reverted {len(done)} patch(es)" if done else "result: not applied")
    return 0


def _compat(args: argparse.Namespace) -> int:
    command = "ess-patch patches compat" + (
        f" --versions {' '.join(args.versions)}" if args.versions else ""
    )
    try:
        rows = compat_rows(args.versions, args.cache, progress=lambda m: print(m, file=sys.stderr))
    except RuntimeError as err:
        print(f"ess-patch patches compat: {err}", file=sys.stderr)
        return 1
    print(markdown(rows, command=command), end="")
    return 0


# The compatibility table.


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args, "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=False,
    )


def upstream_versions(minimum: str = MINIMUM, python: str = PYTHON) -> list[str]:
    """Final releases of megatron-core >= ``minimum`` on the index, oldest first.

    Raises:
        RuntimeError: pip could not list them (no network?), with pip's message.
    """
    out = _pip("index", "versions", DISTRIBUTION, "--python-version", python, "--only-binary=:all:")
    match = re.search(r"^Available versions: (.+)$", out.stdout, re.MULTILINE)
    if out.returncode != 0 or not match:
        raise EssPatchRuntimeError(
            f"pip index versions {DISTRIBUTION} failed: {out.stderr.strip()}"
        )
    found = []
    for text in match.group(1).split(","):
        try:
            v = Version(text.strip())
        except InvalidVersion:
            continue
        if not v.is_prerelease and not v.is_devrelease and v >= Version(minimum):
            found.append(v)
    return [str(v) for v in sorted(set(found))]


def fetch_wheel(version: str, cache: Path, python: str = PYTHON) -> Path:
    """The megatron-core ``version`` wheel for ``python`` in ``cache`` (downloaded if absent)."""
    cache.mkdir(parents=True, exist_ok=True)
    pattern = f"{DISTRIBUTION.replace('-', '_')}-{version}-*.whl"
    have = sorted(cache.glob(pattern))
    if not have:
        out = _pip(
            "download",
            "--no-deps",
            "--python-version",
            python,
            "--only-binary=:all:",
            f"{DISTRIBUTION}=={version}",
            "-d",
            str(cache),
        )
        have = sorted(cache.glob(pattern))
        if out.returncode != 0 or not have:
            raise EssPatchRuntimeError(
                f"pip download {DISTRIBUTION}=={version} failed: {out.stderr}"
            )
    return have[0]


def unpack_core(wheel: Path, dest: Path) -> Path:
    """Extract ``megatron/core/**`` of ``wheel`` into ``dest``; returns ``dest``."""
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith("megatron/core/"):
                zf.extract(name, dest)
    return dest


@dataclass(frozen=True)
class CompatRow:
    version: str
    series: str  # the series chosen, or "none"
    applies: str  # "yes" / "conflict: files"
    required_missing: tuple[str, ...]
    optional_wrapped: tuple[str, ...]
    gaps: tuple[str, ...]  # differences between the patched tree and install()


def check_tree(version: str, root: Path) -> CompatRow:
    """One row: series, ``git apply --check``, symbols and twin check on an unpacked tree."""
    tree = detect(root, _CORE.folder)
    missing, optional = [], []
    for t in MEGATRON.targets:
        present = class_defines(root, t)
        if t.required and not present:
            missing.append(f"{t.owner}.{t.attribute}")
        elif not t.required and present:
            optional.append(f"{t.owner}.{t.attribute}")
    try:
        series, statuses = select_series(tree)
    except Exception as err:  # no series at all: report, do not stop the table
        return CompatRow(version, "none", str(err), tuple(missing), tuple(optional), ())
    conflicts = conflicting_files(statuses)
    applies = "yes" if not conflicts else "conflict: " + ", ".join(conflicts)
    gaps = () if conflicts else tuple(series_gaps(series, tree.root))
    return CompatRow(version, series.version, applies, tuple(missing), tuple(optional), gaps)


def compat_rows(versions: Sequence[str] | None, cache: Path, *, progress=None) -> list[CompatRow]:
    """Fetch and check each version (default: :func:`upstream_versions`), one row each."""
    versions = list(versions) if versions else upstream_versions()
    rows = []
    for version in versions:
        if progress:
            progress(f"megatron-core {version} (Python {PYTHON} wheel): fetching and checking")
        wheel = fetch_wheel(version, cache)
        with tempfile.TemporaryDirectory(prefix=f"ess-patch-compat-{version}-") as tmp:
            rows.append(check_tree(version, unpack_core(wheel, Path(tmp))))
    return rows


def markdown(rows: Sequence[CompatRow], *, command: str) -> str:
    """The table, with the date and the versions it was made from."""
    git = subprocess.run(["git", "--version"], capture_output=True, text=True, check=False)
    pip = _pip("--version").stdout.split(" from ")[0]
    series = ", ".join(s.version for s in discover(_CORE.folder))
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    lines = [
        f"Generated {today} by `{command}` with ess-patch {__version__}, "
        f"{pip}, {git.stdout.strip()}, Python {platform.python_version()}; wheels from the "
        f"package index for Python {PYTHON}; series shipped: {series}.",
        "",
        "| megatron-core | series chosen | applies (`git apply --check`) "
        "| install() required symbols | install() also wraps | diff = install() |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        required = (
            "all present" if not r.required_missing else "missing " + ", ".join(r.required_missing)
        )
        optional = ", ".join(r.optional_wrapped) or "-"
        twin = "yes" if not r.gaps else "no: " + "; ".join(r.gaps)
        twin = twin if r.applies == "yes" else "-"
        lines.append(
            f"| {r.version} | {r.series} | {r.applies} | {required} | {optional} | {twin} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ess_patch.patchset.cli ACTION ...`` (the same as ``ess-patch patches``)."""
    parser = argparse.ArgumentParser(
        prog="ess-patch patches",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _fill(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
