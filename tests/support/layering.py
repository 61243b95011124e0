"""The import-layering checker behind tests/unit/test_layering.py.

It owns the mechanism only: reading every module of a package with `ast`, listing each import
of the package's own modules (top-level, lazy inside a function, or under `if TYPE_CHECKING:`,
since all of them tie two modules together), and finding the imports that break a layer table
or close a cycle. The policy (the table, the allowed exceptions) lives in the test, so that the
test file is where a newcomer reads the layout. The package root is a parameter so the test can
run the checker on a doctored copy of hookprof and watch it fail.

Standard library only, and no module of the checked package is imported: a broken import
graph must still be reported, never crash the checker.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

TOP = "top-level"
LAZY = "lazy (inside a function)"
TYPE_ONLY = "under TYPE_CHECKING"


@dataclass(frozen=True)
class Import:
    """One import of a package module by another, with where it is written."""

    importer: str
    imported: str
    file: str  # relative to the directory that holds the package
    line: int
    kind: str

    @property
    def edge(self) -> tuple[str, str]:
        return (self.importer, self.imported)

    def where(self) -> str:
        return f"{self.file}:{self.line}, {self.kind}"


@dataclass(frozen=True)
class Layer:
    """One row of the table. `members` are top-level module names ("config") or subpackage
    names ("device"); a subpackage's modules, at any depth, belong to its layer. When
    `independent` is set the layer's packages may not import one another (the feature
    packages); otherwise any member may import any other member of the same layer."""

    name: str
    members: tuple[str, ...]
    independent: bool = False


# ---------------------------------------------------------------- reading the package


def module_names(root: Path) -> dict[str, Path]:
    """Every module under `root` (the package directory), by dotted name."""
    package = root.name
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((package, *parts))] = path
    return found


def collect_imports(root: Path) -> list[Import]:
    """All imports of `root`'s own modules written anywhere in `root`'s modules."""
    modules = module_names(root)
    package = root.name
    imports: list[Import] = []
    for name, path in modules.items():
        rel = str(path.relative_to(root.parent))
        is_package = path.name == "__init__.py"
        for node, kind in _statements(rel, path.read_text(encoding="utf-8")):
            for target in _targets(node, name, is_package, package, modules):
                if target != name:
                    imports.append(Import(name, target, rel, node.lineno, kind))
    return imports


@functools.cache
def _statements(rel: str, source: str) -> tuple[tuple[ast.Import | ast.ImportFrom, str], ...]:
    # by text: the tests check doctored copies of the package, where all but one file are the same
    return tuple(_walk(ast.parse(source, filename=rel), TOP))


def _walk(node: ast.AST, kind: str) -> Iterable[tuple[ast.Import | ast.ImportFrom, str]]:
    """Import statements under `node` with the strongest reason they are not top-level:
    a TYPE_CHECKING block inside a function still reads as TYPE_CHECKING."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, kind
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk_stmt(stmt, TYPE_ONLY)
            for stmt in child.orelse:
                yield from _walk_stmt(stmt, kind)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _walk(child, kind if kind == TYPE_ONLY else LAZY)
        elif not isinstance(child, ast.expr):  # an import is a statement: skip expressions
            yield from _walk(child, kind)


def _walk_stmt(stmt: ast.stmt, kind: str) -> Iterable[tuple[ast.Import | ast.ImportFrom, str]]:
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        yield stmt, kind
    else:
        yield from _walk(stmt, kind)


def _is_type_checking(test: ast.expr) -> bool:
    # `if TYPE_CHECKING:` and `if typing.TYPE_CHECKING:`
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _targets(
    node: ast.Import | ast.ImportFrom,
    importer: str,
    is_package: bool,
    package: str,
    modules: Mapping[str, Path],
) -> list[str]:
    """The package modules one import statement ties `importer` to."""
    if isinstance(node, ast.Import):
        return [_known(a.name, modules) for a in node.names if _inside(a.name, package)]
    base = _absolute(node, importer, is_package)
    if base is None or not _inside(base, package):
        return []
    targets = []
    for alias in node.names:
        # `from hookprof.x import y` names the submodule y when hookprof/x/y.py exists,
        # otherwise an attribute of hookprof.x
        sub = f"{base}.{alias.name}"
        targets.append(sub if sub in modules else _known(base, modules))
    return list(dict.fromkeys(targets))


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    # a relative import counts from the importer's package (the package itself for __init__)
    parts = importer.split(".")
    if not is_package:
        parts = parts[:-1]
    up = node.level - 1
    if up >= len(parts):
        return None
    parts = parts[: len(parts) - up]
    return ".".join(parts + ([node.module] if node.module else []))


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _known(name: str, modules: Mapping[str, Path]) -> str:
    # `import hookprof.x.y.attr`-like names that are not modules fall back to the nearest module
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


# ---------------------------------------------------------------- the checks


def layer_of(module: str, table: Sequence[Layer]) -> tuple[int, Layer, str] | None:
    """(rank, layer, unit) for a module, or None when the table does not classify it. The unit
    is what the module belongs to inside its layer: the subpackage, or the module itself."""
    parts = module.split(".")
    # the package's own __init__ is named by the package itself ("hookprof")
    unit = parts[1] if len(parts) > 1 else "__init__"
    for rank, layer in enumerate(table):
        if unit in layer.members:
            return rank, layer, unit
    return None


def unclassified(root: Path, table: Sequence[Layer]) -> list[str]:
    return [m for m in module_names(root) if layer_of(m, table) is None]


def upward(
    imports: Iterable[Import], table: Sequence[Layer], allowed: Iterable[tuple[str, str]]
) -> list[tuple[Import, str]]:
    """Imports of a higher layer, or of a sibling in an independent layer, with the reason."""
    allowed = set(allowed)
    found = []
    for imp in imports:
        if imp.edge in allowed:
            continue
        src, dst = layer_of(imp.importer, table), layer_of(imp.imported, table)
        if src is None or dst is None:
            continue  # reported by unclassified()
        (src_rank, src_layer, src_unit), (dst_rank, dst_layer, dst_unit) = src, dst
        if dst_rank > src_rank:
            why = f"layer '{src_layer.name}' imports the higher layer '{dst_layer.name}'"
            found.append((imp, why))
        elif dst_rank == src_rank and src_layer.independent and src_unit != dst_unit:
            found.append(
                (
                    imp,
                    f"'{src_unit}' and '{dst_unit}' are both in layer '{src_layer.name}', "
                    "whose packages must not import one another",
                )
            )
    return found


def cycles(imports: Iterable[Import], allowed: Iterable[tuple[str, str]]) -> list[list[Import]]:
    """One shortest cycle per group of modules that import one another, directly or not, as
    the imports that make it, in order."""
    graph, edges = _graph(imports, allowed)
    # a few dozen modules: the reachable set of each is cheap, and plainer than Tarjan's
    reach = {node: _reachable(graph, node) for node in graph}
    found: list[list[Import]] = []
    placed: set[str] = set()
    for start in sorted(graph):
        if start in placed or start not in reach[start]:
            continue
        placed |= {node for node in reach[start] if start in reach[node]}
        path = _shortest_cycle(start, graph)
        found.append([edges[(a, b)] for a, b in zip(path, path[1:])])
    return found


def reaches(
    imports: Iterable[Import], src: str, dst: str, allowed: Iterable[tuple[str, str]]
) -> bool:
    """Does a chain of imports lead from `src` to `dst`, leaving out the `allowed` edges?"""
    graph, _ = _graph(imports, allowed)
    return dst in _reachable(graph, src)


def _graph(
    imports: Iterable[Import], allowed: Iterable[tuple[str, str]]
) -> tuple[dict[str, set[str]], dict[tuple[str, str], Import]]:
    allowed = set(allowed)
    graph: dict[str, set[str]] = {}
    edges: dict[tuple[str, str], Import] = {}
    for imp in imports:
        if imp.edge in allowed:
            continue
        edges.setdefault(imp.edge, imp)  # the first place it is written is enough to point at
        graph.setdefault(imp.importer, set()).add(imp.imported)
        graph.setdefault(imp.imported, set())
    return graph, edges


def _reachable(graph: Mapping[str, set[str]], src: str) -> set[str]:
    # src itself is in the result only when a chain of imports leads back to it
    seen: set[str] = set()
    todo = [src]
    while todo:
        for child in graph.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def _shortest_cycle(start: str, graph: Mapping[str, set[str]]) -> list[str]:
    # breadth-first from start until an edge leads back to start
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    chain = [node]
                    while chain[-1] != start:
                        chain.append(parent[chain[-1]])
                    return [*reversed(chain), start]
                if child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no chain of imports leads from {start} back to it")
