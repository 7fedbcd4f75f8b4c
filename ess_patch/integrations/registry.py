"""Every host component ess-patch knows, one row each: the table the others derive from.

A row says what the component is called (and the other spellings users type), which
importable module says it is present, its pip distribution and supported range, where its
``patches/`` series live and how they are keyed, the upstream snapshot the series and tests are
cut from, and (through its :class:`~ess_patch.integrations.Integration`) the targets and
vendored decorator names. ``install.INTEGRATIONS``, ``ess-patch doctor``'s listing, the
patch tool's detectors and ``vendored.CALL_SITES`` are read from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import EssPatchKeyError
from . import Integration
from .megatron import MEGATRON
from .megatron_rl import MEGATRON_RL
from .miles import MILES
from .slime import SLIME
from .verl import VERL

__all__ = ["COMPONENTS", "DECORATORS", "Component", "by_folder", "component"]

#: how a component's ``patches/<folder>/`` series are named
RELEASE = "release"  # a release version, chosen from the tree's version (megatron-core)
COMMIT = "commit"  # an upstream commit prefix, written from the call sites (the frameworks)


@dataclass(frozen=True)
class Component:
    """One host component.

    ``detector``: the module whose presence means the component is here (``doctor``); its
    path (``megatron/core``) is what the patch tool looks for in a tree. ``folder``: its
    ``patches/`` folder, None without a series. Its distribution, supported range and
    snapshot (the upstream commit the newest series and the framework tests are cut from)
    are the integration's own fields: ``row.integration.snapshot``.
    """

    integration: Integration
    detector: str
    folder: str | None
    series: str = COMMIT
    aliases: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """``install()``'s integration name (``ESS_PATCH_INTEGRATIONS``)."""
        return self.integration.name

    @property
    def tree_package(self) -> str:
        """The detector as a path inside a source tree (``megatron/rl``)."""
        return self.detector.replace(".", "/")

    @property
    def decorators(self) -> tuple[str, ...]:
        """The ``ess_patch.vendored`` decorators its series put on its targets."""
        return tuple(dict.fromkeys(t.decorator for t in self.integration.targets if t.decorator))


COMPONENTS: tuple[Component, ...] = (
    Component(
        MEGATRON,
        detector="megatron.core",
        folder="megatron-core",
        series=RELEASE,
        aliases=("megatron-core",),
    ),
    Component(MILES, detector="miles", folder="miles"),
    Component(SLIME, detector="slime", folder="slime"),
    # Megatron-LM's own RL loop (train_rl.py); the tag core_v0.16.1
    Component(
        MEGATRON_RL,
        detector="megatron.rl",
        folder="megatron_rl",
        aliases=("megatron.rl",),
    ),
    Component(VERL, detector="verl", folder="verl"),
)

#: Every vendored decorator name, in the order the components declare them.
DECORATORS: tuple[str, ...] = tuple(dict.fromkeys(d for c in COMPONENTS for d in c.decorators))


def component(name: str) -> Component:
    """The row named ``name`` (an integration name, an alias or a ``patches/`` folder).

    Raises:
        KeyError: no such component (the message lists the names).
    """
    for row in COMPONENTS:
        if name in (row.name, row.folder, *row.aliases):
            return row
    raise EssPatchKeyError(
        f"unknown component {name!r}; known: {', '.join(c.name for c in COMPONENTS)}"
    )


def by_folder(folder: str) -> Component:
    """The row whose series live in ``patches/<folder>/``."""
    for row in COMPONENTS:
        if row.folder == folder:
            return row
    raise EssPatchKeyError(f"no component has patches/{folder}/")
