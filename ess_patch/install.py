"""install() / uninstall(): the one lifecycle for every integration.

Modelled on OpenTelemetry's instrumentor: the public calls and the "already installed?"
flag live here, once; an integration only lists its targets. Targets are wrapped with
wrapt by dotted path, at once when their module is already imported and otherwise from a
post-import hook, so import order does not matter.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import ModuleType

import wrapt

from .config import EssLrConfig
from .errors import EssPatchValueError
from .integrations import Integration
from .integrations.registry import COMPONENTS
from .patching import FailClosedError, Patch, apply, revert, unwrap_copy
from .state import STATE, disarm

__all__ = [
    "INTEGRATIONS",
    "failed_integrations",
    "install",
    "installed_shapes",
    "installed_targets",
    "is_installed",
    "uninstall",
]

logger = logging.getLogger(__name__)

#: install()'s integrations by name, from the component registry.
INTEGRATIONS: dict[str, Integration] = {c.name: c.integration for c in COMPONENTS}

#: Comma-separated integration names, read when ``install(integrations=None)``.
ENV_INTEGRATIONS = "ESS_PATCH_INTEGRATIONS"


@dataclass
class _Installation:
    """What install() did in this process (the rollout state is ``state.STATE``)."""

    # integration name -> its patches; None when not installed
    patches: dict[str, list[Patch]] | None = None
    # post-import hooks cannot be unregistered: remember them
    hooks_registered: set[str] = field(default_factory=set)
    # what the start-up auto-install did (site may run the .pth twice)
    autoinstall: str | None = None
    # integrations rolled back after a late import lacked a symbol: name -> reason
    failures: dict[str, str] = field(default_factory=dict)
    # the auto-install's exception, for arm()'s report (state.py) and the doctor
    autoinstall_error: BaseException | None = None
    # install / uninstall / the post-import hook: one at a time, so that two threads never
    # both install (one record lost while its wraps stay) or uninstall half of a record.
    # Re-entrant: install() calls uninstall() on failure, and an import inside install()
    # can fire the post-import hook on the same thread.
    lock: threading.RLock = field(default_factory=threading.RLock)


INSTALLATION = _Installation()


def install(
    integrations: Iterable[str] | str | None = None,
    *,
    config: EssLrConfig | None = None,
) -> None:
    """Patch the host libraries so that optimizer steps use the armed ESS scale.

    Args:
        integrations: names from :data:`INTEGRATIONS` (default: ``$ESS_PATCH_INTEGRATIONS``
            or all of them). A library not imported yet is patched when it is imported.
        config: the estimator settings the framework hooks use where the host's args
            lack the ``--ess-lr-*`` flags (default: from the ``ESS_LR_*`` environment
            variables, else the defaults). Flags on the host's command line win.

    A second call warns and changes nothing. Nothing is scaled until a result is armed.

    Raises:
        ValueError: an unknown integration name (the message lists the valid ones).
        MissingTargetError: a required symbol is missing in an imported library (names the
            symbol and the supported versions); nothing stays patched.

    A library imported *later* that lacks a required symbol cannot raise here: that one
    integration is rolled back (its wraps removed, its later modules left alone), the host's
    import goes on, and the reason is logged and kept for :func:`failed_integrations` and
    ``ess-patch doctor``. The other integrations stay installed.
    """
    with INSTALLATION.lock:
        _install(integrations, config)


def _install(integrations: Iterable[str] | str | None, config: EssLrConfig | None) -> None:
    if INSTALLATION.patches is not None:
        logger.warning(
            "ess-patch is already installed (%s); call uninstall() first to change "
            "what is installed",
            ", ".join(INSTALLATION.patches),
        )
        return
    names = _select(integrations)
    STATE.config = config if config is not None else EssLrConfig.from_env()
    INSTALLATION.patches = {name: [] for name in names}
    INSTALLATION.failures = {}
    # what the fail-closed guard takes as proof that an armed scale reaches a step
    STATE.step_wrappers = {name for name in names if _wraps_steps(INTEGRATIONS[name])}
    try:
        for name in names:
            _check_version(INTEGRATIONS[name])
            for module in INTEGRATIONS[name].modules:
                if module in sys.modules:
                    _wrap(name, sys.modules[module])  # raises: install() fails as a whole
                elif module not in INSTALLATION.hooks_registered:
                    INSTALLATION.hooks_registered.add(module)
                    wrapt.register_post_import_hook(_on_import, module)
    except BaseException:
        uninstall()
        raise
    logger.info("ess-patch installed: %s", ", ".join(names))


def uninstall() -> None:
    """Put every patched attribute back exactly (identity) and disarm. Safe to call twice,
    and from any thread (install and uninstall run one at a time)."""
    with INSTALLATION.lock:
        _uninstall()


def _uninstall() -> None:
    if INSTALLATION.patches is None:
        logger.warning("ess-patch is not installed; nothing to uninstall")
        return
    for patches in INSTALLATION.patches.values():
        for patch in reversed(patches):
            revert(patch)
    INSTALLATION.patches = None
    INSTALLATION.failures = {}
    STATE.config = None
    STATE.step_wrappers = set()
    for integration in INTEGRATIONS.values():  # re-detected at the next install (the host
        if integration.history is not None:  # may have changed)
            integration.history.clear()
    disarm()
    logger.info("ess-patch uninstalled")


def is_installed() -> bool:
    """Whether ``install()`` is in effect in this process."""
    return INSTALLATION.patches is not None


def installed_targets() -> list[str]:
    """Dotted paths of the attributes wrapped so far (grows as libraries get imported)."""
    with INSTALLATION.lock:
        if INSTALLATION.patches is None:
            return []
        return [p.target.path for patches in INSTALLATION.patches.values() for p in patches]


def failed_integrations() -> dict[str, str]:
    """Integrations rolled back because a library imported after ``install()`` lacked a
    required symbol: name -> the reason (names the symbol and the supported versions)."""
    return dict(INSTALLATION.failures)


def installed_shapes() -> dict[str, str]:
    """Per installed framework with a history, the shapes chosen so far, in words (e.g.
    ``{"miles": "miles: groups from get_parallel_state().intra_dp; ...; metrics via
    log_train_step"}``); a shape is chosen when a module that needs it is imported."""
    if INSTALLATION.patches is None:
        return {}
    return {
        name: INTEGRATIONS[name].history.describe()
        for name in INSTALLATION.patches
        if INTEGRATIONS[name].history is not None
    }


def _wraps_steps(integration: Integration) -> bool:
    """Whether the integration wraps optimizer steps (what applies an armed scale)."""
    return any(t.decorator == "optimizer_step" for t in integration.targets)


def _select(integrations: Iterable[str] | str | None) -> list[str]:
    if integrations is None:
        integrations = os.environ.get(ENV_INTEGRATIONS) or list(INTEGRATIONS)
    if isinstance(integrations, str):
        integrations = [part.strip() for part in integrations.split(",") if part.strip()]
    names = list(dict.fromkeys(integrations))
    unknown = [n for n in names if n not in INTEGRATIONS]
    if unknown:
        raise EssPatchValueError(
            f"unknown ess-patch integration(s) {', '.join(map(repr, unknown))}; "
            f"valid: {', '.join(INTEGRATIONS)}"
        )
    return names


def _check_version(integration: Integration) -> None:
    """Compare the installed distribution with ``supported`` from metadata, not by import."""
    if integration.distribution is None:  # a source checkout: its symbols are checked
        return
    try:
        raw = importlib.metadata.version(integration.distribution)
    except importlib.metadata.PackageNotFoundError:
        logger.info(
            "ess-patch: no %s distribution installed (a vendored tree?); its symbols are "
            "checked when it is imported",
            integration.distribution,
        )
        return
    if not integration.supports(raw):
        logger.warning(
            "ess-patch: %s %s is outside the supported range %s; patching it anyway, "
            "and a missing symbol will raise",
            integration.distribution,
            raw,
            integration.supported,
        )


def _on_import(module: ModuleType) -> None:
    """Post-import hook: wrap the targets in ``module`` for every installed integration.

    Runs inside the host's ``import``: it never raises, but for a :class:`FailClosedError`
    (ESS-LR requested in this process, and the host fits no shape). An integration that
    cannot wrap this module is rolled back (see :func:`_roll_back`); the others go on.
    """
    with INSTALLATION.lock:
        # wrapt drops a post-import hook once it has fired: a module imported again (after
        # an import that raised) needs a new one from the next install()
        INSTALLATION.hooks_registered.discard(module.__name__)
        if INSTALLATION.patches is None:  # hook left over from an uninstalled install
            return
        for name in list(INSTALLATION.patches):
            try:
                _wrap(name, module)
            except Exception as exc:  # the host's import must not fail because of ess-patch
                _roll_back(name, exc)
                if isinstance(exc, FailClosedError):  # ... unless ESS-LR was requested
                    raise


def _wrap(name: str, module: ModuleType) -> None:
    """Wrap the targets of integration ``name`` that live in ``module`` (idempotent).

    A framework with a history first decides its shape from this module, if it is one that
    decides it.

    Raises:
        MissingTargetError: a required target is missing, or the host fits no known shape
            (its earlier wraps stay recorded).
    """
    integration = INTEGRATIONS[name]
    if integration.history is not None:
        integration.history.on_import(module.__name__)
    patches = INSTALLATION.patches[name]  # type: ignore[index]
    supported = " ".join(filter(None, (integration.distribution, integration.supported)))
    for target in integration.targets:
        if target.module == module.__name__:
            patch = apply(target, supported)
            if patch is not None:
                patches.append(patch)


def _roll_back(name: str, error: BaseException) -> None:
    """Take integration ``name`` out of this install: unwrap everything it wrapped (exact
    originals back), wrap none of its modules imported later, record and log why."""
    patches = INSTALLATION.patches.pop(name, []) if INSTALLATION.patches is not None else []
    for patch in reversed(patches):
        revert(patch)
    for target in INTEGRATIONS[name].targets:  # copies made by modules still mid-import
        unwrap_copy(target)
    reason = f"{name}: not installed: {error}"
    if not isinstance(error, ImportError):
        reason = f"{name}: not installed: {type(error).__name__}: {error}"
    if INTEGRATIONS[name].history is not None:
        INTEGRATIONS[name].history.clear()
    INSTALLATION.failures[name] = reason
    STATE.step_wrappers.discard(name)
    remaining = ", ".join(INSTALLATION.patches or {}) or "none"
    logger.error(
        "ess-patch %s (rolled back after a late import; still installed: %s)", reason, remaining
    )
