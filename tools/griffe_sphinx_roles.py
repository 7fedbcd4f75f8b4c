"""Griffe extension for the docs site: the package's Sphinx roles become cross-references.

The docstrings say ``:func:`compute_ess_lr``` and ``:class:`~ess_patch.estimator.X```, which
read well in ``help()`` but which mkdocstrings would print as raw text. This rewrites each role
into an autorefs link to the object it names (resolved against the object's own module and
class, then the package), so the API reference renders them, and ``mkdocs build --strict`` fails
on a role whose target the site does not document (mkdocs.yml loads this file).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|class|data|meth|attr|mod|exc|obj):`(~?)([\w.]+)`")


def _candidates(obj: griffe.Object, target: str) -> list[str]:
    if target.startswith("ess_patch."):
        return [target]
    module = obj.module
    if target.startswith("."):  # relative to the object's package
        package = module.path if module.is_package else module.path.rpartition(".")[0]
        return [package + target]
    scopes = []
    parent: Any = obj if (obj.is_class or obj.is_module) else obj.parent
    while parent is not None:
        scopes.append(parent.path)
        parent = parent.parent
    return [f"{scope}.{target}" for scope in scopes]


def _exists(pkg: griffe.Module, path: str) -> bool:
    if path == pkg.path:
        return True
    try:
        pkg[path.removeprefix(pkg.path + ".")]
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return False
    return True


class SphinxRoles(griffe.Extension):
    """Rewrite ``:role:`target``` in every docstring of the package into ``[`name`][path]``."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._rewrite(pkg, pkg)

    def _rewrite(self, obj: griffe.Object, pkg: griffe.Module) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(lambda m: self._link(obj, pkg, m), obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias:
                self._rewrite(member, pkg)

    @staticmethod
    def _link(obj: griffe.Object, pkg: griffe.Module, match: re.Match[str]) -> str:
        short, target = match.group(1), match.group(2)
        shown = target.rsplit(".", 1)[-1] if short else target.lstrip(".")
        for path in _candidates(obj, target):
            if _exists(pkg, path):
                return f"[`{shown}`][{path}]"
        # unresolvable: a link autorefs cannot find, so the strict build names it
        return f"[`{shown}`][{target.lstrip('~.')}]"
