"""No import cycle among moe_route's modules.

The graph is read from this checkout's sources with ``ast`` (nothing is imported). Every
``import`` / ``from ... import`` statement of every module of moe_route (function-level ones
included; relative imports resolved; those under ``if TYPE_CHECKING:`` left out, as they never
run) gives an edge from the module to each moe_route module it names: ``import a.b`` names
``a.b``; ``from P import n`` names ``P.n`` where that is a module (a package ``__init__``
re-exporting its submodule is such an edge), else ``P``. The import system runs a package's
``__init__`` before any of its submodules, but those implicit parent imports are not edges:
otherwise every submodule that a package's ``__init__`` re-exports would close a cycle with it.
A submodule that imports a name from its parent package's ``__init__`` (``from .. import
name``) is an edge to the package and may close such a cycle. The graph must have no cycle;
the failure names one. ``python tests/test_import_cycles.py`` prints the check;
``tests/test_structure.py`` (the walk of a ``fused_moe`` call through the package's layers)
uses this graph too.
"""

from __future__ import annotations

import ast
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """``moe_route/kernels/triton/moe.py`` -> ``moe_route.kernels.triton.moe``."""
    rel = path.resolve().relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imports(tree: ast.AST):
    """Every import statement of ``tree`` (any depth), those under ``if TYPE_CHECKING:`` left
    out."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking_block(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """moe_route module -> the moe_route modules its import statements name (module doc), read
    from this checkout's sources (nothing imported)."""
    root = Path(__file__).resolve().parents[1] / "moe_route"
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {mod: set() for mod in files}

    def known(name: str) -> str | None:
        """``name`` or its nearest enclosing module that is one of the package's."""
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names if a.name.startswith("moe_route")]
            else:
                if node.level:
                    base = mod.split(".")
                    base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if not source.startswith("moe_route"):
                    continue
                targets = [
                    f"{source}.{a.name}" if f"{source}.{a.name}" in files else known(source)
                    for a in node.names
                ]
            graph[mod].update(t for t in targets if t is not None and t != mod)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        state[start] = 1
        path, iters = [start], [iter(sorted(graph[start]))]
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 40 and graph["moe_route.moe"], "the package's modules were not found"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    """The check itself: a cycle through three modules is found, a chain is none."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


if __name__ == "__main__":
    graph = import_graph()
    cycle = find_cycle(graph)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} edges: "
          + ("no cycle" if cycle is None else "cycle: " + " -> ".join(cycle)))  # fmt: skip
