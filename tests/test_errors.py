"""One error base: every error ess-patch raises on purpose is an ``EssPatchError`` and keeps
the built-in base it always had; one fail-closed type."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import ess_patch
from ess_patch import errors
from ess_patch.errors import EssPatchError, FailClosedError

PACKAGE = Path(ess_patch.__file__).parent
BUILTIN_ERRORS = {
    name
    for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, BaseException)
}
#: ``raise`` of a built-in that is not ess-patch refusing anything: Python's own protocol.
ALLOWED = {
    ("__init__.py", "AttributeError"),  # module __getattr__: "no such attribute", as Python says
    ("demo/report.py", "AttributeError"),  # the same, where the moved names are aliases
}


def _modules():
    for info in pkgutil.walk_packages([str(PACKAGE)], "ess_patch."):
        try:
            yield importlib.import_module(info.name)
        except ImportError as exc:  # an optional dependency (torch-free envs, the demo extra)
            if "ess_patch" in str(exc):
                raise


def test_every_error_class_of_the_package_is_an_ess_patch_error():
    seen = []
    for module in _modules():
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
            ):
                seen.append(obj)
                assert issubclass(obj, EssPatchError), f"{module.__name__}.{name}"
    # the package's own classes, and each kept its built-in base
    names = {c.__name__ for c in seen}
    assert {
        "DemoConfigError",
        "ConfigMismatchError",
        "MissingTargetError",
        "PatchsetError",
    } <= names
    from ess_patch.demo.train import DemoConfigError
    from ess_patch.patching import MissingTargetError
    from ess_patch.reduction import ConfigMismatchError

    assert issubclass(DemoConfigError, ValueError) and issubclass(ConfigMismatchError, ValueError)
    assert issubclass(MissingTargetError, ImportError)


def test_no_bare_builtin_error_is_made_in_the_package():
    """No ``ValueError(...)`` (or another built-in error) is built in ess_patch/, raised at
    once or kept to raise later on every rank: each is an ess-patch type."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                name = node.func.id
                rel = str(path.relative_to(PACKAGE))
                if name in BUILTIN_ERRORS and (rel, name) not in ALLOWED:
                    found.append(f"{rel}:{node.lineno} {name}(...)")
    assert found == []


def test_one_fail_closed_type_and_the_old_names_are_it():
    from ess_patch import guard, patching

    assert guard.EssLrNotAppliedError is FailClosedError
    assert issubclass(patching.FailClosedError, FailClosedError)
    assert issubclass(patching.FailClosedError, ImportError)  # the host's import fails with it
    assert issubclass(errors.FailClosedNotImplementedError, (FailClosedError, NotImplementedError))


def test_except_ess_patch_error_catches_what_callers_caught_before(monkeypatch):
    torch = pytest.importorskip("torch")
    from ess_patch import guard

    with pytest.raises(EssPatchError) as info:
        ess_patch.EssLrConfig(floor=2.0)
    assert isinstance(info.value, ValueError)
    with pytest.raises(EssPatchError) as info:
        ess_patch.compute_ess_lr([torch.zeros(3)], [torch.zeros(2)], [torch.ones(3)])
    assert isinstance(info.value, ValueError)
    monkeypatch.delenv(guard.ALLOW_UNSCALED, raising=False)
    with pytest.raises(FailClosedError, match="ESS-LR was requested but nothing scales"):
        guard.refuse("host", "nothing scales", "Install it")
    with pytest.raises(EssPatchError):
        ess_patch.install(["no-such-framework"])
    assert not ess_patch.is_installed()
