"""Compatibility table: which megatron-core releases each series (and ``install()``) covers.

For every final megatron-core release from 0.14 on that the package index lists for
Python 3.12 (0.17+ require it, so they are fetched, never installed), download the wheel
with ``pip download --no-deps --python-version 3.12 --only-binary=:all:``, unpack
``megatron/core`` to a scratch folder and report:

- the series ``ess-patch patches apply`` would choose there and whether it applies
  (``git apply --check``);
- whether the symbols ``install()`` needs exist (parsed with ``ast``, never imported) and
  which optional ones it would also wrap;
- whether the patched tree is the exact twin of ``install()`` (every method it wraps is
  decorated, nothing else is).

Run: ``ess-patch patches compat`` (or ``python -m ess_patch.patchset.cli compat``).
"""

from __future__ import annotations

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

from packaging.version import InvalidVersion, Version

from .. import __version__
from ..integrations.megatron import MEGATRON
from .apply import conflicting_files
from .series import discover
from .trees import detect
from .twin import class_defines, select_series, series_gaps

__all__ = ["CompatRow", "compat_rows", "fetch_wheel", "markdown", "upstream_versions"]

DISTRIBUTION = "megatron-core"
PYTHON = "3.12"


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args, "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=False,
    )


def upstream_versions(minimum: str = "0.14", python: str = PYTHON) -> list[str]:
    """Final releases of megatron-core >= ``minimum`` on the index, oldest first.

    Raises:
        RuntimeError: pip could not list them (no network?), with pip's message.
    """
    out = _pip("index", "versions", DISTRIBUTION, "--python-version", python, "--only-binary=:all:")
    match = re.search(r"^Available versions: (.+)$", out.stdout, re.MULTILINE)
    if out.returncode != 0 or not match:
        raise RuntimeError(f"pip index versions {DISTRIBUTION} failed: {out.stderr.strip()}")
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
    pattern = f"megatron_core-{version}-*.whl"
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
            raise RuntimeError(f"pip download {DISTRIBUTION}=={version} failed: {out.stderr}")
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
    tree = detect(root, "megatron-core")
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
    series = ", ".join(s.version for s in discover("megatron-core"))
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
