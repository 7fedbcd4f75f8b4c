"""Shared fixtures: a single-process Megatron world on CPU, and a clean ess-patch state."""

from __future__ import annotations

import pytest


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
