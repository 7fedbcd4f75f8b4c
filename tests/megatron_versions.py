"""megatron-core of a given version, for tests that run in a fresh interpreter (test-only).

The environment has one megatron-core installed (0.16.1, the newest with a Python 3.11 wheel
that declares 3.11). Others are installed once into a cache folder with ``pip install --no-deps
--ignore-requires-python --target`` (0.17-0.19 declare Python >= 3.12, yet their cp311 wheels
run here: DESIGN.md section 3; their other needs, numpy, packaging and triton, are in the
environment) and put first on ``PYTHONPATH`` of the subprocess that runs the tests. The cache
is ``$ESS_PATCH_MCORE_CACHE`` (tox points it into its env folder), else a folder in the temp
dir; one subfolder per version.

A Megatron-LM tree needs the megatron-core of its own version (its ``megatron/rl`` imports
what older cores lack): :func:`core_version_for` reads it from the tree.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = [
    "ENV_CACHE",
    "ENV_VERSION",
    "OPTIMIZER_VERSIONS",
    "child_env",
    "core_path",
    "core_version_for",
    "installed_core",
    "pip_target",
    "pythonpath",
    "shim_dir",
]

ENV_CACHE = "ESS_PATCH_MCORE_CACHE"
#: set by :func:`child_env` to the version a subprocess must import
ENV_VERSION = "ESS_PATCH_MCORE_VERSION"

#: the megatron-core releases whose optimizers the megatron integration is tested on
OPTIMIZER_VERSIONS = ("0.14.0", "0.16.1", "0.17.1", "0.18.2", "0.19.2")

#: trees whose folder name carries no release: the megatron-core they go with
_TREE_CORE = {
    # radixark's miles-main fork; miles pins megatron-core 0.16.0rc0, 0.16.1 matches it
    "2e64d788b": "0.16.1",
}

_SHIM = Path(__file__).resolve().parent / "py311_shim"


def installed_core() -> str | None:
    """The version of the megatron-core installed in this environment (None: none)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def core_version_for(tree: Path) -> str:
    """The megatron-core version a Megatron-LM tree goes with: its own
    ``megatron/core/package_info.py`` if it has one, else the ``core_vX.Y.Z`` of its folder name,
    else the known commit in the folder name.

    Raises:
        ValueError: none of these says (name the tree's version in ``_TREE_CORE``).
    """
    info = tree / "megatron" / "core" / "package_info.py"
    if info.is_file():
        found = dict(re.findall(r"^(MAJOR|MINOR|PATCH)\s*=\s*(\d+)", info.read_text(), re.M))
        if len(found) == 3:
            return f"{found['MAJOR']}.{found['MINOR']}.{found['PATCH']}"
    match = re.search(r"core_v(\d+\.\d+\.\d+)", tree.name)
    if match:
        return match.group(1)
    for commit, version in _TREE_CORE.items():
        if commit in tree.name:
            return version
    raise ValueError(
        f"{tree}: no megatron/core/package_info.py, no core_vX.Y.Z in its name and no known "
        f"commit ({', '.join(_TREE_CORE)}): add its megatron-core version to _TREE_CORE"
    )


def _cache_root() -> Path:
    root = os.environ.get(ENV_CACHE)
    return Path(root) if root else Path(tempfile.gettempdir()) / "ess-patch-megatron-core"


def core_path(version: str) -> Path | None:
    """A folder holding ``megatron/core`` of ``version`` (installed there on first use), or
    None when the environment's own megatron-core is that version.

    Raises:
        RuntimeError: pip could not install it (its output in the message).
    """
    if installed_core() == version:
        return None
    return pip_target(version, [f"megatron-core=={version}"], "megatron/core/package_info.py")


def pip_target(name: str, requirements: list[str], marker: str) -> Path:
    """``pip install --no-deps --ignore-requires-python --target`` of ``requirements`` into
    the cache folder ``name`` (once: a folder holding ``marker`` is reused), whole or not at
    all. Nothing resolves dependencies, so nothing can pull torch.

    Raises:
        RuntimeError: pip could not install them (its output in the message).
    """
    target = _cache_root() / name
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    cmd += ["--ignore-requires-python", "--target", str(partial), *requirements]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(f"could not install {' '.join(requirements)}: {result.stderr[-2000:]}")
    try:
        partial.rename(target)  # whole or not at all, if two runs race
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def shim_dir() -> Path:
    """A folder whose ``sitecustomize`` gives Python 3.11 ``typing.override`` (3.12), which
    some megatron-core 0.18+ modules import."""
    return _SHIM


def pythonpath(version: str, *first: Path | str) -> str:
    """``PYTHONPATH`` for a subprocess that must import megatron-core ``version``: ``first``
    (e.g. a Megatron-LM tree, whose ``megatron/training`` must win over the one 0.17+ wheels
    ship), that megatron-core, the 3.11 shim, tests/, then the caller's ``PYTHONPATH``."""
    core = core_path(version)
    entries = [str(p) for p in first]
    if core is not None:
        entries.append(str(core))
    entries += [str(_SHIM), str(Path(__file__).resolve().parent)]
    if os.environ.get("PYTHONPATH"):
        entries.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(entries)


def child_env(version: str, *first: Path | str) -> dict[str, str]:
    """This process's environment for a subprocess that must run megatron-core ``version``:
    :func:`pythonpath`, the version itself in ``ESS_PATCH_MCORE_VERSION`` (for its tests to
    check), no auto-install (the tests install what they need)."""
    env = {k: v for k, v in os.environ.items() if k != "ESS_PATCH_AUTO_INSTALL"}
    env["PYTHONPATH"] = pythonpath(version, *first)
    env[ENV_VERSION] = version
    return env
