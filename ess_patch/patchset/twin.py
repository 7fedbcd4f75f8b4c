"""Whether a patched tree is the exact twin of ``install()``, and which series fits a tree.

The "gaps" (:func:`gaps`) are where the functions a series decorates and the targets of the
runtime integration differ; they are found in the source with ``ast`` (never imported).
:func:`select_series` picks a tree's series: its own version's, else the closest one that
applies and leaves no gap.
"""

from __future__ import annotations

import ast
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from packaging.version import InvalidVersion, Version

from ..integrations.registry import COMPONENTS
from ..patching import Target
from .apply import PatchStatus, State, check_series, conflicting_files
from .series import Series, UnknownTreeError, discover, matches, patches_dir, version_key
from .trees import Tree, git_apply, scratch_copy

__all__ = [
    "INTEGRATION_OF",
    "class_defines",
    "defined_methods",
    "definition",
    "gaps",
    "module_path",
    "select_series",
    "series_gaps",
    "twin_files",
]

# Static symbol look-ups: classes, methods, functions, their decorators and imports.

Function = ast.FunctionDef | ast.AsyncFunctionDef


class _Attribute(Protocol):
    module: str
    owner: str
    attribute: str


def module_path(module: str) -> str:
    """``a.b.c`` -> ``a/b/c.py`` (relative to the tree root)."""
    return "/".join(module.split(".")) + ".py"


def _module_body(root: Path, module: str) -> list[ast.stmt] | None:
    path = Path(root, module_path(module))
    if not path.is_file():
        return None
    return ast.parse(path.read_text(encoding="utf-8")).body


def _find_class(body: list[ast.stmt], name: str) -> ast.ClassDef | None:
    return next((n for n in body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _methods(node: ast.ClassDef) -> list[Function]:
    return [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _class_node(root: Path, module: str, owner: str) -> ast.ClassDef | None:
    body = _module_body(Path(root), module)
    return None if body is None else _find_class(body, owner)


def defined_methods(root: Path, module: str, owner: str) -> set[str] | None:
    """Names of the functions defined in class ``owner``'s own body in ``module`` (parsed
    from the file under ``root``, never imported); None if the file or class is missing."""
    node = _class_node(root, module, owner)
    if node is None:
        return None
    return {n.name for n in _methods(node)}


def class_defines(root: Path, target: _Attribute) -> bool:
    """Whether ``target.owner``'s own body defines ``target.attribute`` (what ``install()``
    wraps of a megatron-core optimizer class)."""
    return target.attribute in (defined_methods(root, target.module, target.owner) or set())


def decorator_names(node: Function) -> set[str]:
    """The plain names among ``node``'s decorators (``@name``, not ``@a.b`` or ``@f()``)."""
    return {d.id for d in node.decorator_list if isinstance(d, ast.Name)}


def definition(
    root: Path, module: str, owner: str, name: str, depth: int = 0
) -> tuple[str, str, Function] | None:
    """Where ``module.owner.name`` is defined under ``root``: (file, owner, node), following
    module-level ``from X import name`` re-imports (absolute or relative); None if not found."""
    body = _module_body(root, module) if depth <= 8 else None
    if body is None:
        return None
    if owner:
        cls = _find_class(body, owner)
        if cls is None:
            return None
        body = cls.body
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return module_path(module), owner, node
    if owner:
        return None
    for node in body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    base = module.split(".")[: -node.level] if node.level else []
                    source = ".".join([*base, *filter(None, [node.module])])
                    return definition(root, source, "", alias.name, depth + 1)
    return None


def functions(root: Path, rel: str) -> Iterator[tuple[str, Function]]:
    """``(owner, node)`` for every function of file ``rel`` (owner "") and every method of its
    classes (owner: the class), at the top level of the file; nothing if it is missing."""
    path = Path(root, rel)
    if not path.is_file():
        return
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        members: list[tuple[ast.stmt, str]] = [(node, "")]
        if isinstance(node, ast.ClassDef):
            members = [(n, node.name) for n in node.body]
        for fn, owner in members:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield owner, fn


def vendored_imports(root: Path, rel: str) -> dict[str, str]:
    """``{local name: name}`` of what ``rel`` imports from ``ess_patch.vendored``."""
    path = Path(root, rel)
    if not path.is_file():
        return {}
    found = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "ess_patch.vendored":
            for alias in node.names:
                found[alias.asname or alias.name] = alias.name
    return found


# The gaps between a patched tree and install().

#: A ``patches/`` component -> the ``install()`` integration whose targets its series decorate.
INTEGRATION_OF = {row.folder: row.name for row in COMPONENTS if row.folder is not None}

_Site = tuple[str, str, str]  # (file, owner or "", function): where a definition is


def _targets(component: str) -> tuple[Target, ...]:
    from ..install import INTEGRATIONS  # install imports the integrations' hosts lazily too

    # install()-only targets (Target.vendored False) are no series' business
    return tuple(t for t in INTEGRATIONS[INTEGRATION_OF[component]].targets if t.vendored)


def _decorators(component: str) -> dict[_Site, str]:
    """The ``ess_patch.vendored`` decorator ``component``'s series put on each definition."""
    from ..install import INTEGRATIONS
    from ..vendored import call_sites

    sites = call_sites(INTEGRATIONS[INTEGRATION_OF[component]])
    return {(c.path, c.owner, c.function): c.decorator for c in sites}


def twin_files(component: str) -> tuple[str, ...]:
    """The files :func:`gaps` reads: those of the integration's targets."""
    return tuple(dict.fromkeys(module_path(t.module) for t in _targets(component)))


def gaps(component: str, root: Path) -> list[str]:
    """Where a (patched) ``component`` tree and ``install()`` disagree; empty: the diff is the
    exact twin of the monkeypatch.

    Per target of the integration, its definition (module-level re-imports followed; a class
    attribute in the class's own body): a required target that is not in the tree; a
    definition without the series' decorator ``_ess_<name>`` imported from
    ``ess_patch.vendored``. And a function of those files decorated with ``_ess_*`` that is no
    target's definition. (An optional target that is not in the tree is fine: install() skips
    it too.)
    """
    out = []
    wrapped: set[_Site] = set()
    decorators = _decorators(component)
    for t in _targets(component):
        found = definition(root, t.module, t.owner, t.attribute)
        if found is None:
            if t.required:
                out.append(f"{t.path}: install() wraps it, but it is not in the tree")
            continue
        rel, owner, node = found
        site = (rel, owner, node.name)
        if site in wrapped:  # another name for a definition already checked
            continue
        wrapped.add(site)
        label = f"{rel} {'.'.join(p for p in (owner, node.name) if p)}"
        decorator = decorators.get(site)
        alias = f"_ess_{decorator}"
        if decorator is None or alias not in decorator_names(node):
            out.append(f"{label}: install() wraps it, the series does not")
        elif vendored_imports(root, rel).get(alias) != decorator:
            out.append(
                f"{label}: decorated with {alias}, which is not ess_patch.vendored.{decorator}"
            )
    for rel in twin_files(component):
        for owner, fn in functions(root, rel):
            ours = any(d.startswith("_ess_") for d in decorator_names(fn))
            if ours and (rel, owner, fn.name) not in wrapped:
                label = ".".join(p for p in (owner, fn.name) if p)
                out.append(f"{rel} {label}: decorated, but install() does not wrap it")
    return out


def series_gaps(series: Series, root: Path) -> list[str]:
    """The :func:`gaps` that ``root`` would have once ``series`` is applied (computed on a
    scratch copy; patches that do not apply are left out). Empty for a component without an
    integration."""
    if series.component not in INTEGRATION_OF:
        return []
    with tempfile.TemporaryDirectory(prefix="ess-patch-gaps-") as tmp:
        scratch = Path(tmp)
        scratch_copy(Path(root), [*series.files(), *twin_files(series.component)], scratch)
        for patch in series.patches:
            if git_apply(scratch, patch, check=True).returncode == 0:
                git_apply(scratch, patch)
        return gaps(series.component, scratch)


# Choosing the series for a tree.


def _closeness(series_version: Version, mine: Version) -> tuple[int, ...]:
    a = (*series_version.release, 0, 0, 0)[:3]
    b = (*mine.release, 0, 0, 0)[:3]
    # distance in major, then minor, then patch; on a tie the older release first
    return (*(abs(x - y) for x, y in zip(a, b)), 0 if series_version <= mine else 1)


def _candidates(tree: Tree, series: list[Series]) -> list[Series]:
    """Series to try on ``tree``: its own version's, then by closeness of version."""
    exact = [s for s in series if tree.version and matches(s.version, tree.version)]
    rest = [s for s in series if s not in exact]
    try:
        mine = Version(tree.version) if tree.version else None
    except InvalidVersion:
        mine = None
    versioned = [(s, k[1]) for s in rest if (k := version_key(s.version))[0] == 0]
    other = [s for s in rest if version_key(s.version)[0] != 0]
    if mine is None:  # unknown version: newest first
        ordered = sorted(versioned, key=lambda sv: sv[1], reverse=True)
    else:
        ordered = sorted(versioned, key=lambda sv: _closeness(sv[1], mine))
    return exact + [s for s, _ in ordered] + other


def select_series(
    tree: Tree, version: str | None = None, *, root: Path | None = None
) -> tuple[Series, list[PatchStatus]]:
    """The series to use on ``tree`` and its per-patch status there.

    ``version`` names a series folder (``patches/<component>/<version>``). Without it: the
    series made for the tree's version if there is one (a conflict there is a hand edit: no
    fallback). Else the others by closeness of version (older first on a tie): the first
    that applies (or is applied, per ``git apply --check``) and leaves no gap with
    ``install()`` (:func:`series_gaps`) wins; else the first that applies (callers should
    check its gaps); else the one conflicting in the fewest files (the closest on a tie), with
    its conflicts (with one series per version of a framework, a hand edit is reported
    against its own version's series, not another version's).

    Raises:
        UnknownTreeError: no series for the component, or no folder named ``version``.
    """
    available = discover(tree.component, root)
    if not available:
        where = (root or patches_dir()) / tree.component
        raise UnknownTreeError(f"no patch series for {tree.component} (nothing in {where})")
    if version is not None:
        chosen = [s for s in available if matches(s.version, version)]
        if not chosen:
            raise UnknownTreeError(
                f"no {tree.component} series {version!r}; available: "
                f"{', '.join(s.version for s in available)}"
            )
        return chosen[0], check_series(chosen[0], tree.root)
    own = [s for s in available if tree.version and matches(s.version, tree.version)]
    if own:  # made for this very version: its conflicts are real (hand edits), no fallback
        return own[0], check_series(own[0], tree.root)
    least: tuple[Series, list[PatchStatus]] | None = None
    clean: tuple[Series, list[PatchStatus]] | None = None
    for candidate in _candidates(tree, available):
        statuses = check_series(candidate, tree.root)
        if least is None or len(conflicting_files(statuses)) < len(conflicting_files(least[1])):
            least = (candidate, statuses)
        if any(s.state is State.CONFLICTING for s in statuses):
            continue
        if not series_gaps(candidate, tree.root):
            return candidate, statuses
        clean = clean or (candidate, statuses)
    result = clean or least
    assert result is not None
    return result
