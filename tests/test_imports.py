"""colo_rl's import graph, function-level imports included: no module reaches itself again."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "colo_rl"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, name: str, modules: set[str], is_package: bool) -> set[str]:
    """The colo_rl modules `name`'s code imports anywhere in it (a package's __init__ runs first:
    importing colo_rl.a.b from outside colo_rl.a imports colo_rl.a too)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[:len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            # a package's __init__ runs before its submodule; inside that package it already runs
            found |= {prefix for prefix in (".".join(parts[:k]) for k in range(2, len(parts) + 1))
                      if prefix == target or not name.startswith(prefix + ".")} & modules
    return found - {name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported(ast.parse(p.read_text()), module_name(p), modules, p.name == "__init__.py")
            for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_colo_rl_has_no_import_cycle():
    graph = import_graph()
    assert "colo_rl.trainer.grpo" in graph["colo_rl.run"] or "colo_rl.trainer" in graph["colo_rl.run"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_walker_sees_function_level_imports_and_finds_a_planted_cycle():
    """The check itself: b's import inside a function closes a -> b -> a."""
    a = ast.parse("from colo_rl.b import x\n")
    b = ast.parse("def f():\n    from colo_rl.a import y\n")
    modules = {"colo_rl.a", "colo_rl.b"}
    graph = {"colo_rl.a": imported(a, "colo_rl.a", modules, False),
             "colo_rl.b": imported(b, "colo_rl.b", modules, False)}
    assert find_cycle(graph) == ["colo_rl.a", "colo_rl.b", "colo_rl.a"]


def test_the_training_loop_fits_on_one_screen():
    """Run.train, the step loop, is at most 40 lines (docstring included)."""
    import inspect

    from colo_rl.run import Run

    lines = inspect.getsource(Run.train).splitlines()
    assert len(lines) - 1 <= 40, len(lines) - 1
