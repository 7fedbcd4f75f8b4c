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
from collections.abc import Iterable
from types import ModuleType

import wrapt
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .config import EssLrConfig
from .integrations import Integration
from .integrations.megatron import MEGATRON
from .integrations.megatron_rl import MEGATRON_RL
from .integrations.miles import MILES
from .integrations.slime import SLIME
from .patching import MissingTargetError, apply, revert
from .state import STATE, disarm

__all__ = [
    "INTEGRATIONS",
    "install",
    "installed_shapes",
    "installed_targets",
    "is_installed",
    "uninstall",
]

logger = logging.getLogger(__name__)

INTEGRATIONS: dict[str, Integration] = {i.name: i for i in (MEGATRON, MILES, SLIME, MEGATRON_RL)}

#: Comma-separated integration names, read when ``install(integrations=None)``.
ENV_INTEGRATIONS = "ESS_PATCH_INTEGRATIONS"


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
    """
    if STATE.installed is not None:
        logger.warning(
            "ess-patch is already installed (%s); call uninstall() first to change "
            "what is installed",
            ", ".join(STATE.installed),
        )
        return
    names = _select(integrations)
    STATE.config = config if config is not None else EssLrConfig.from_env()
    STATE.installed = {name: [] for name in names}
    try:
        for name in names:
            _check_version(INTEGRATIONS[name])
            for module in INTEGRATIONS[name].modules:
                if module in sys.modules:
                    _on_import(sys.modules[module])
                elif module not in STATE.hooks_registered:
                    STATE.hooks_registered.add(module)
                    wrapt.register_post_import_hook(_on_import, module)
    except BaseException:
        uninstall()
        raise
    logger.info("ess-patch installed: %s", ", ".join(names))


def uninstall() -> None:
    """Put every patched attribute back exactly (identity) and disarm. Safe to call twice."""
    if STATE.installed is None:
        logger.warning("ess-patch is not installed; nothing to uninstall")
        return
    for patches in STATE.installed.values():
        for patch in reversed(patches):
            revert(patch)
    STATE.installed = None
    STATE.config = None
    STATE.shapes = {}  # re-detected at the next install (the host may have changed)
    disarm()
    logger.info("ess-patch uninstalled")


def is_installed() -> bool:
    """Whether ``install()`` is in effect in this process."""
    return STATE.installed is not None


def installed_targets() -> list[str]:
    """Dotted paths of the attributes wrapped so far (grows as libraries get imported)."""
    if STATE.installed is None:
        return []
    return [p.target.path for patches in STATE.installed.values() for p in patches]


def installed_shapes() -> dict[str, str]:
    """Per installed framework with a history, the shapes chosen so far, in words (e.g.
    ``{"miles": "miles: groups from get_parallel_state().intra_dp; ...; metrics via
    log_train_step"}``); a shape is chosen when a module that needs it is imported."""
    if STATE.installed is None:
        return {}
    return {
        name: INTEGRATIONS[name].history.describe()
        for name in STATE.installed
        if INTEGRATIONS[name].history is not None
    }


def _roll_back(name: str) -> None:
    """Put back everything of integration ``name`` and stop patching it in this process."""
    patches = STATE.installed.pop(name, []) if STATE.installed is not None else []
    for patch in reversed(patches):
        revert(patch)
    STATE.shapes.pop(name, None)


def _select(integrations: Iterable[str] | str | None) -> list[str]:
    if integrations is None:
        integrations = os.environ.get(ENV_INTEGRATIONS) or list(INTEGRATIONS)
    if isinstance(integrations, str):
        integrations = [part.strip() for part in integrations.split(",") if part.strip()]
    names = list(dict.fromkeys(integrations))
    unknown = [n for n in names if n not in INTEGRATIONS]
    if unknown:
        raise ValueError(
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
    try:
        ok = Version(raw) in SpecifierSet(integration.supported, prereleases=True)
    except InvalidVersion:
        ok = False
    if not ok:
        logger.warning(
            "ess-patch: %s %s is outside the supported range %s; patching it anyway, "
            "and a missing symbol will raise",
            integration.distribution,
            raw,
            integration.supported,
        )


def _on_import(module: ModuleType) -> None:
    """Wrap the targets in ``module`` for every installed integration (idempotent)."""
    # wrapt drops a post-import hook once it has fired: a module imported again (after an
    # import that raised) needs a new one from the next install()
    STATE.hooks_registered.discard(module.__name__)
    if STATE.installed is None:  # hook left over from an uninstalled install
        return
    for name, patches in list(STATE.installed.items()):
        integration = INTEGRATIONS[name]
        try:
            if integration.history is not None:  # the host's shape, before wrapping anything
                integration.history.on_import(module.__name__)
            for target in integration.targets:
                if target.module == module.__name__:
                    supported = " ".join(
                        filter(None, (integration.distribution, integration.supported))
                    )
                    patch = apply(target, supported)
                    if patch is not None:
                        patches.append(patch)
        except MissingTargetError:
            _roll_back(name)  # nothing of a framework we cannot serve stays patched
            raise
