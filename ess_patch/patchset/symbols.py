"""Static symbol look-ups in a source tree: classes, methods, functions, their decorators and
imports, parsed from the files with ``ast`` (never imported)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

__all__ = [
    "class_defines",
    "decorated_methods",
    "decorator_names",
    "defined_methods",
    "definition",
    "functions",
    "module_path",
    "vendored_imports",
]

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


def decorated_methods(root: Path, module: str, owner: str, decorator: str) -> set[str]:
    """Methods of ``owner`` whose decorators include the plain name ``decorator``."""
    node = _class_node(root, module, owner)
    if node is None:
        return set()
    return {n.name for n in _methods(node) if decorator in decorator_names(n)}


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
