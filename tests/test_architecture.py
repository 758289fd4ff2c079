"""The shape of the code, checked: the import-linter contracts of pyproject.toml (layers, what may import mlflow
and labgrid, workflows holding devices only through the run layer), no import cycles between modules, and threads
started only by the run layer's scheduler."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "jbench"


def test_the_import_linter_contracts_hold():
    # In a process of its own: import-linter reconfigures logging, which the other tests' log capture relies on.
    res = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "BROKEN" not in res.stdout and " 0 broken" in res.stdout, res.stdout


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the cycles of a module graph as components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_module_imports_itself_through_others():
    """Every import counts, also those inside functions: a cycle hidden behind a function-level import is a cycle."""
    import grimp

    g = grimp.build_graph("jbench")
    graph = {m: {i for i in g.find_modules_directly_imported_by(m) if i.startswith("jbench")} for m in g.modules}
    assert _strongly_connected(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _thread_starts(path: Path) -> list[int]:
    tree = ast.parse(path.read_text())
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("Thread", "ThreadPoolExecutor", "ProcessPoolExecutor", "start_new_thread"):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("package", ["runner", "sweeps"])
def test_only_the_scheduler_starts_threads_in_the_run_layer_and_the_workflows(package):
    found = {str(p.relative_to(REPO)): lines for p in sorted((PACKAGE / package).rglob("*.py"))
             if (lines := _thread_starts(p)) and p.name != "scheduler.py"}
    assert found == {}
    assert _thread_starts(PACKAGE / "runner" / "scheduler.py"), "the scheduler is where threads start"


# What makes a function-level import worth it: importing these costs a command's start-up time (MLflow alone is
# about 1.5 CPU-s), so a module that pulls one in may be imported where it is used. Any other import of a jbench
# module belongs at the top of the file, where a newcomer sees the module's dependencies.
HEAVY = {"mlflow", "matplotlib", "pandas", "scipy", "labgrid", "grpc", "sqlalchemy", "paramiko", "hydra", "omegaconf",
         "numpy", "gguf", "pyarrow", "ruptures", "pynvml", "requests", "yaml", "rich"}


def test_a_function_level_import_of_a_jbench_module_is_only_for_a_heavy_one():
    import grimp

    g = grimp.build_graph("jbench", include_external_packages=True)

    def heavy(module: str) -> bool:
        return module in g.modules and any(u.split(".")[0] in HEAVY for u in g.find_upstream_modules(module))

    light = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jbench"):
                    targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                    if not any(heavy(t) for t in targets):
                        light.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.module}")
    assert light == [], "import these at the top of their module:\n" + "\n".join(light)
