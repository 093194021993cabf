"""The server's layout: no import cycles among llmrt's modules, one default per knob, short server files."""
from __future__ import annotations

import ast
from pathlib import Path

import llmrt

ROOT = Path(llmrt.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str], lazy: bool) -> set[str]:
    """llmrt modules `path` imports (at module level; with `lazy`, inside functions too; never TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list) and (lazy or not isinstance(node, (ast.FunctionDef,
                                                                                    ast.AsyncFunctionDef))):
                    visit([c for c in children if isinstance(c, ast.stmt)] +
                          [s for h in children if isinstance(h, ast.ExceptHandler) for s in h.body])
    visit(tree.body)
    return {m for m in found if m in modules}


def _graph(lazy: bool) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: _imports(path, set(files), lazy) for name, path in files.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_module_level_import_cycles():
    graph = _graph(lazy=False)
    # (a package importing its own submodules is no cycle)
    cycles = sorted((m, d) for m in graph for d in graph[m] if d != m and m in _reachable(graph, d))
    assert not cycles, cycles


def test_plan_cli_and_launch_do_not_import_each_other_and_plan_not_bench():
    graph = _graph(lazy=True)
    plan = _reachable(graph, "llmrt.plan")
    assert not {m for m in plan if m.startswith(("llmrt.bench", "llmrt.cli", "llmrt.server"))}, plan
    assert "llmrt.cli" not in _reachable(graph, "llmrt.server.launch")


def test_server_files_are_short():
    long = {p.name: n for p in (ROOT / "server").glob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
