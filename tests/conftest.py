"""Shared fixtures: a single-process Megatron world on CPU, a clean ess-patch state, and a
fresh interpreter for a snippet."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fresh import Fresh
from fresh import fresh_python as _fresh_python


@pytest.fixture
def world(tmp_path):
    """gloo world of one + real megatron parallel_state, with the test-only CPU shim."""
    pytest.importorskip("megatron.core")
    from megatron_cpu import megatron_world

    from ess_patch.demo.cpu import megatron_on_cpu

    with megatron_on_cpu(), megatron_world(tmp_path):
        yield


@pytest.fixture
def clean_ess():
    """ess-patch uninstalled and disarmed before and after the test."""
    import ess_patch
    from ess_patch.state import reset

    if ess_patch.is_installed():
        ess_patch.uninstall()
    reset()
    yield
    if ess_patch.is_installed():
        ess_patch.uninstall()
    reset()


@pytest.fixture(scope="session")
def fresh_python() -> Callable[..., Fresh]:
    """``fresh_python(code, env=None, *, args=(), cwd=None, timeout=180, emits=True)``: run a
    snippet in a new interpreter; it hands its result back with ``emit(obj)`` (tests/fresh.py).
    Session-scoped (it holds nothing) so module-scoped fixtures can use it."""
    return _fresh_python
