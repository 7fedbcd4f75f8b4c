"""Whether a patched tree is the exact twin of ``install()``: the "gaps" between the methods a
series decorates and the ones the runtime integration wraps (per component: :data:`TWINS`)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..integrations.megatron import MEGATRON
from ..vendored import CALL_SITES
from .apply import scratch_copy
from .git import git_apply
from .series import Series
from .symbols import (
    class_defines,
    decorated_methods,
    decorator_names,
    definition,
    functions,
    module_path,
    vendored_imports,
)

__all__ = [
    "TWINS",
    "VENDORED_DECORATOR",
    "Twin",
    "call_site_gaps",
    "megatron_core_gaps",
    "series_gaps",
]

#: The name the series give their call-site decorator (tools/megatron_core_series.py uses it).
VENDORED_DECORATOR = "_ess_optimizer_step"


def megatron_core_gaps(root: Path) -> list[str]:
    """Where a (patched) megatron-core tree and ``install()`` disagree: a method that
    ``install()`` would wrap (the class body defines it) without the series' decorator, or a
    decorated one that it would not wrap. Empty: the diff is the exact twin of the monkeypatch.
    """
    gaps = []
    for t in MEGATRON.targets:
        wraps = class_defines(root, t)
        decorated = t.attribute in decorated_methods(root, t.module, t.owner, VENDORED_DECORATOR)
        if wraps and not decorated:
            gaps.append(f"{t.owner}.{t.attribute}: install() wraps it, the series does not")
        elif decorated and not wraps:
            gaps.append(f"{t.owner}.{t.attribute}: decorated, but install() does not wrap it")
    return gaps


def call_site_gaps(component: str) -> Callable[[Path], list[str]]:
    """Gaps function for a framework series (miles, slime): where a patched tree and
    ``install(component)`` disagree. A call site of ``ess_patch.vendored.CALL_SITES`` without
    its decorator or its import; an ``install()`` target whose definition (re-imports
    followed) is not a call site; or a function decorated with ``_ess_*`` that is not one.
    """
    from ..install import INTEGRATIONS

    def gaps(root: Path) -> list[str]:
        sites = {(c.path, c.owner, c.function): c for c in CALL_SITES[component]}
        out = []
        for (rel, owner, name), site in sites.items():
            found = definition(root, rel[: -len(".py")].replace("/", "."), owner, name)
            if found is None:
                out.append(f"{site.label}: not defined in {rel}")
            elif site.alias not in decorator_names(found[2]):
                out.append(f"{rel} {site.label}: install() wraps it, the series does not")
            elif vendored_imports(root, rel).get(site.alias) != site.decorator:
                out.append(
                    f"{rel} {site.label}: decorated with {site.alias}, which is not "
                    f"ess_patch.vendored.{site.decorator}"
                )
        for t in INTEGRATIONS[component].targets:
            found = definition(root, t.module, t.owner, t.attribute)
            if found is None:
                out.append(f"{t.path}: install() wraps it, but it is not in the tree")
            elif found[:2] + (found[2].name,) not in sites:
                out.append(
                    f"{t.path}: install() wraps it (defined in {found[0]}), the series does not"
                )
        files = {*(c.path for c in sites.values())}
        files |= {module_path(t.module) for t in INTEGRATIONS[component].targets}
        for rel in sorted(files):
            for owner, fn in functions(root, rel):
                ours = {d for d in decorator_names(fn) if d.startswith("_ess_")}
                if ours and (rel, owner, fn.name) not in sites:
                    label = ".".join(p for p in (owner, fn.name) if p)
                    out.append(f"{rel} {label}: decorated, but install() does not wrap it")
        return out

    return gaps


def _twin_files(component: str) -> tuple[str, ...]:
    from ..install import INTEGRATIONS

    files = [c.path for c in CALL_SITES[component]]
    files += [module_path(m) for m in INTEGRATIONS[component].modules]
    return tuple(dict.fromkeys(files))


@dataclass(frozen=True)
class Twin:
    """How to compare a component's series with its runtime integration: the files holding
    the integration's targets, and a function listing the gaps on a patched tree."""

    files: tuple[str, ...]
    gaps: Callable[[Path], list[str]]


TWINS: dict[str, Twin] = {
    "megatron-core": Twin(
        files=tuple(module_path(m) for m in MEGATRON.modules),
        gaps=megatron_core_gaps,
    ),
    **{c: Twin(files=_twin_files(c), gaps=call_site_gaps(c)) for c in CALL_SITES},
}


def series_gaps(series: Series, root: Path) -> list[str]:
    """The gaps (see :func:`megatron_core_gaps`, :func:`call_site_gaps`) that ``root`` would
    have once ``series`` is applied (computed on a scratch copy; patches that do not apply are
    left out). Empty for a component without a registered twin."""
    twin = TWINS.get(series.component)
    if twin is None:
        return []
    with tempfile.TemporaryDirectory(prefix="ess-patch-gaps-") as tmp:
        scratch = Path(tmp)
        scratch_copy(Path(root), [*series.files(), *twin.files], scratch)
        for patch in series.patches:
            if git_apply(scratch, patch, check=True).returncode == 0:
                git_apply(scratch, patch)
        return twin.gaps(scratch)
