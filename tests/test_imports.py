"""The package's import graph has no cycle, counting imports made inside functions too
(imports under `if TYPE_CHECKING:` never run, so they are not edges)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvshard"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """kvshard module -> the kvshard modules it imports anywhere in its body."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                # `from pkg import sub` imports the submodule; `from mod import name` the module
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names)
        targets = {t for t in targets if t in files}
        graph[module] = {t for t in targets | _packages_entered(module, targets) if t != module}
    return graph


def _runtime_nodes(tree: ast.AST):
    """Every node of the module except the bodies of `if TYPE_CHECKING:` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield child
                yield from _runtime_nodes(child)
            continue
        yield node
        yield from _runtime_nodes(node)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _packages_entered(module: str, targets: set[str]) -> set[str]:
    """Importing kvshard.kv.layout from outside kvshard.kv first runs kvshard/kv/__init__.py: an edge too.
    (Packages that hold `module` itself are already being imported, so they add none.)"""
    own = {module.rsplit(".", n)[0] for n in range(module.count(".") + 1)}
    return {t.rsplit(".", n)[0] for t in targets for n in range(1, t.count(".") + 1)} - own


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search with colours)."""
    done: set[str] = set()
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(module: str) -> list[str] | None:
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target in on_stack:
                return stack[stack.index(target):] + [target]
            if target not in done and (cycle := visit(target)):
                return cycle
        stack.pop()
        on_stack.discard(module)
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done and (cycle := visit(module)):
            return cycle
    return None


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    # kvshard.entrypoints.cli imports the subcommand modules inside build_parser()
    assert "kvshard.entrypoints.serve" in graph["kvshard.entrypoints.cli"]
    # ... and reaching kvshard.bench.cli runs kvshard/bench/__init__.py first
    assert "kvshard.bench" in graph["kvshard.entrypoints.cli"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    # kv/cache.py names ModelConfig for type checking only: no edge back to the config
    assert "kvshard.config" not in graph["kvshard.kv.cache"]
    nested = ast.parse("import a\nif TYPE_CHECKING:\n    import b\nelse:\n    import c\ndef f():\n    import d\n")
    seen = {alias.name for n in _runtime_nodes(nested) if isinstance(n, ast.Import) for alias in n.names}
    assert seen == {"a", "c", "d"}


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
