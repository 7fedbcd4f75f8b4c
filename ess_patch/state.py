"""The one per-process state holder: what is armed, what is installed, who is the policy.

Everything mutable in ess-patch lives in :data:`STATE`; :func:`reset` puts it back to a
fresh process's state (for tests).
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from .result import EssLrResult, check_scale

__all__ = ["ROLES", "STATE", "arm", "armed", "disarm", "exclude", "reset", "set_role"]

logger = logging.getLogger(__name__)

#: "policy": optimizers in this process are scaled when a result is armed (default).
#: "critic": never scaled, even if something arms a result.
ROLES = ("policy", "critic")


@dataclass
class _EssState:
    armed: EssLrResult | None = None
    # shadow mode's last result: logged, never read by the optimizer wrappers
    shadow: EssLrResult | None = None
    role: str = "policy"
    excluded: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    # install bookkeeping, owned by ess_patch.install: integration name -> its patches;
    # None when not installed. Post-import hooks cannot be unregistered: remember them.
    installed: dict[str, list[Any]] | None = None
    hooks_registered: set[str] = field(default_factory=set)
    config: Any = None
    # what the start-up auto-install did in this process (site may run the .pth twice)
    autoinstall: str | None = None
    # per host framework, the shape chosen for each aspect (integrations.shapes); cleared by
    # uninstall() and reset(), since tests change the host modules between installs
    shapes: dict[str, dict[str, Any]] = field(default_factory=dict)
    # inspect.Signature per wrapped host function (integrations.binding)
    signatures: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    local: threading.local = field(default_factory=threading.local)


STATE = _EssState()


def reset() -> None:
    """Forget everything armed or marked (does not unwrap patches: use ``uninstall``)."""
    STATE.armed = None
    STATE.shadow = None
    STATE.role = "policy"
    STATE.excluded = weakref.WeakSet()
    STATE.local = threading.local()
    STATE.autoinstall = None
    STATE.shapes = {}
    STATE.signatures = weakref.WeakKeyDictionary()


def arm(result_or_scale: EssLrResult | float) -> EssLrResult:
    """Arm a rollout's result (or a bare scale in (0, 1]) for the coming optimizer steps.

    It stays armed until the next ``arm`` or ``disarm``: every step of the rollout uses it.
    """
    if isinstance(result_or_scale, EssLrResult):
        check_scale(result_or_scale.scale)
        result = result_or_scale
    else:
        result = EssLrResult.from_scale(result_or_scale)
    STATE.armed = result
    logger.debug(
        "armed ESS-LR scale %.6g (rho %.6g, status %s)", result.scale, result.rho, result.status
    )
    return result


def armed() -> EssLrResult | None:
    """What the next optimizer step will use, or None (no-op)."""
    return STATE.armed


def disarm() -> None:
    """Reset to the no-op: the coming optimizer steps use the scheduled LR unchanged."""
    STATE.armed = None


def set_role(role: str) -> None:
    """Declare this process's role; a ``"critic"`` process is never scaled."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    STATE.role = role


def exclude(optimizer: Any) -> None:
    """Never scale this optimizer instance (e.g. a critic's optimizer in a shared process)."""
    STATE.excluded.add(optimizer)


def scale_for(optimizer: Any) -> float | None:
    """The scale to apply to ``optimizer``'s step now, or None to leave it untouched."""
    result = STATE.armed
    if result is None or STATE.role != "policy":
        return None
    try:
        if optimizer in STATE.excluded:
            return None
    except TypeError:  # not weak-referenceable: cannot have been excluded
        pass
    return result.scale
