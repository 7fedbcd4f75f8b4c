"""Run a snippet of Python in a fresh interpreter and get its result back through a file.

Used where the state under test is the interpreter itself (its module table, import hooks,
the ``.pth`` start-up) or where two versions of one framework cannot share ``sys.modules``.
The snippet calls ``emit(obj)`` (defined for it, nothing imported beyond ``json``/``os``/
``sys``) to hand back plain data as JSON; stdout stays free for what the code under test
prints or logs. A child that fails, hangs or never emits raises :class:`FreshPythonError`
with its own stderr (its traceback), so a failing test shows the child's error.

Tests use the ``fresh_python`` fixture (tests/conftest.py); this module is the same callable
for code outside a fixture.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the variable that tells the child where ``emit`` writes
RESULT_VAR = "ESS_PATCH_TEST_RESULT"

# Runs the snippet file as ``__main__`` under its own name (tracebacks show its real lines),
# with ``emit`` in its globals (a namespace of its own: nothing of this boot code leaks in).
# ``-c`` keeps ``sys.path[0]`` the working directory, as for a ``python -c`` snippet.
_BOOT = f"""
import json, os, sys
def emit(obj):
    with open(os.environ[{RESULT_VAR!r}], "w", encoding="utf-8") as f:
        json.dump(obj, f, default=repr)
_path = sys.argv[1]
sys.argv = sys.argv[1:]
with open(_path, encoding="utf-8") as _f:
    _code = compile(_f.read(), _path, "exec")
exec(_code, {{"__name__": "__main__", "__file__": _path, "__builtins__": __builtins__,
             "emit": emit}})
"""


@dataclass(frozen=True)
class Fresh:
    """What a fresh interpreter gave back: the emitted object and its output."""

    result: Any
    stdout: str
    stderr: str


class FreshPythonError(AssertionError):
    """The child failed, timed out or emitted nothing; the message holds its stderr."""


def _tail(text: str | bytes | None, limit: int = 6000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-limit:]


def fresh_python(
    code: str,
    env: Mapping[str, str] | None = None,
    *,
    args: Sequence[str] = (),
    cwd: str | Path | None = None,
    timeout: float = 180,
    emits: bool = True,
) -> Fresh:
    """Run ``code`` (dedented) in a new interpreter (``sys.executable``).

    Args:
        code: the snippet; it calls ``emit(obj)`` once with JSON-able data (``repr`` for
            the rest).
        env: the child's whole environment (default: this process's).
        args: the child's ``sys.argv[1:]``.
        cwd: the child's working directory (first on its ``sys.path``).
        timeout: seconds before the child is killed and this raises.
        emits: False for a snippet that only prints; the result is then None.

    Raises:
        FreshPythonError: non-zero exit, timeout, or no ``emit`` when ``emits``; the message
            has the child's stderr and stdout tails.
    """
    with tempfile.TemporaryDirectory(prefix="fresh-python-") as tmp:
        snippet = Path(tmp) / "snippet.py"
        snippet.write_text(textwrap.dedent(code), encoding="utf-8")
        out = Path(tmp) / "result.json"
        child_env = dict(os.environ if env is None else env)
        child_env[RESULT_VAR] = str(out)
        argv = [sys.executable, "-c", _BOOT, str(snippet), *args]
        try:
            proc = subprocess.run(
                argv, env=child_env, cwd=cwd, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as exc:
            raise FreshPythonError(
                f"fresh interpreter timed out after {timeout}s\n--- stderr ---\n"
                f"{_tail(exc.stderr)}\n--- stdout ---\n{_tail(exc.stdout)}"
            ) from None
        problem = None
        if proc.returncode != 0:
            problem = f"fresh interpreter exited with {proc.returncode}"
        elif emits and not out.exists():
            problem = "fresh interpreter exited without calling emit()"
        if problem:
            raise FreshPythonError(
                f"{problem}\n--- stderr ---\n{_tail(proc.stderr)}\n"
                f"--- stdout ---\n{_tail(proc.stdout)}"
            )
        result = json.loads(out.read_text(encoding="utf-8")) if out.exists() else None
    return Fresh(result=result, stdout=proc.stdout, stderr=proc.stderr)
