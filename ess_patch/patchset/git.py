"""Running git: ``git apply`` on a plain folder, and questions to the work tree holding one.

Every call runs without the caller's ``GIT_*`` variables and in the C locale (its messages
are parsed); a missing git raises :class:`PatchsetError`.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

from .series import PatchsetError

__all__ = ["committed", "dirty_files", "git", "git_apply", "head_commit"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["LC_ALL"] = "C"
    return env


def _run(
    cmd: list[str], env: dict[str, str], *, cwd: Path | None = None, text: bool = True
) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=text, env=env, check=False)
    except FileNotFoundError as err:
        raise PatchsetError("git is not installed (needed to apply patches)") from err


def git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``git -C cwd ARGS``: git finds the work tree holding ``cwd``, however far up."""
    return _run(["git", "-C", str(cwd), *args], _env())


def git_apply(
    root: Path, patch: Path, *, reverse: bool = False, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """``git apply`` (``--reverse``, ``--check``) of ``patch`` in the folder ``root``."""
    cmd = ["git", "apply", "--whitespace=nowarn"]
    if reverse:
        cmd.append("--reverse")
    if check:
        cmd.append("--check")
    cmd.append(str(Path(patch).resolve()))
    env = _env()
    # Never let git find a repository *above* the tree: inside one, `git apply` takes paths
    # relative to that repository's top and skips the ones outside the current folder.
    env["GIT_CEILING_DIRECTORIES"] = str(Path(root).resolve().parent)
    return _run(cmd, env, cwd=root)


def head_commit(root: Path) -> str | None:
    """HEAD's commit when ``root`` is the top of a git work tree (else None)."""
    top = git(root, "rev-parse", "--show-toplevel")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root.resolve():
        return None
    head = git(root, "rev-parse", "HEAD")
    return head.stdout.strip() if head.returncode == 0 else None


def committed(root: Path, rel: str) -> bytes | None:
    """The bytes of ``rel`` (relative to ``root``) in HEAD; None if HEAD has no such file."""
    out = _run(["git", "-C", str(root), "show", f"HEAD:./{rel}"], _env(), text=False)
    return out.stdout if out.returncode == 0 else None


def dirty_files(root: Path, files: Iterable[str]) -> list[str]:
    """Of ``files`` (relative to ``root``), those with uncommitted changes in the git work
    tree holding ``root`` (none when ``root`` is not in one; untracked files do not count).
    """
    files = list(files)
    if git(root, "rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
        return []
    prefix = git(root, "rev-parse", "--show-prefix").stdout.strip()
    status = git(root, "status", "--porcelain=v1", "-z", "--untracked-files=no", "--", *files)
    dirty = []
    for entry in filter(None, status.stdout.split("\0")):
        path = entry[3:]
        dirty.append(path[len(prefix) :] if prefix and path.startswith(prefix) else path)
    return [f for f in files if f in dirty]
