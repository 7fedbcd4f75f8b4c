"""``tox -e frameworks``: install the framework tiers only when an upstream snapshot is there.

Without any snapshot (no ``../shared`` and no ``MILES_SRC`` / ``SLIME_SRC``) this prints why
and exits 0 having installed nothing; the tiers cost ~2 GB (triton alone ~1 GB). Otherwise it
installs the pinned torch, ess-patch (``[test]``) and every ``requirements-*.txt`` in this
folder in one pip command (so nothing resolves torch by itself), then runs pytest here.
A new tier is a new ``requirements-<tier>.txt``; nothing to change in this file.

    python tests/frameworks/tox_run.py --pin torch==2.13.0 -- [pytest args]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))  # tests/, for the shared skip wording

from skips import missing_snapshot  # noqa: E402

# The snapshots a framework test can start from; the rest (MEGATRON_LM_SRC) only adds tiers.
SNAPSHOTS = {
    "MILES_SRC": ("miles", "miles/__init__.py"),
    "SLIME_SRC": ("slime", "slime/__init__.py"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pin", action="append", default=[], help="e.g. torch==2.13.0")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args(argv)
    reasons = [missing_snapshot(var, *spec) for var, spec in SNAPSHOTS.items()]
    if all(reasons):
        print("tox -e frameworks: skipped, nothing installed:", file=sys.stderr)
        for reason in reasons:
            print(f"  {reason}", file=sys.stderr)
        return 0
    requirements = sorted(HERE.glob("requirements-*.txt"))
    pip = [sys.executable, "-m", "pip", "install", *args.pin, f"{ROOT}[test,demo]"]
    for req in requirements:
        pip += ["-r", str(req)]
    subprocess.run(pip, check=True, cwd=ROOT)
    pytest = [sys.executable, "-m", "pytest", str(HERE), *args.pytest_args]
    os.chdir(ROOT)
    return subprocess.run(pytest, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
