"""pyproject.toml's dependencies are what jbench imports: none unused (fabric was), none missing."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {_norm(re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0]): d for d in deps}


def _imports() -> dict[str, set[str]]:
    """Top-level third-party modules jbench imports -> files."""
    out: dict[str, set[str]] = {}
    for f in (REPO / "jbench").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "jbench":
                    out.setdefault(top, set()).add(str(f.relative_to(REPO)))
    return out


def _closure(dists: set[str]) -> set[str]:
    """Distributions installed with `dists` (their requirements, recursively, extras left out)."""
    seen: set[str] = set()
    todo = list(dists)
    while todo:
        d = todo.pop()
        if d in seen:
            continue
        seen.add(d)
        try:
            reqs = requires(d) or []
        except PackageNotFoundError:
            continue
        for r in reqs:
            if "extra ==" in r:
                continue
            todo.append(_norm(re.split(r"[<>=!~\[; (]", r, maxsplit=1)[0]))
    return seen


def test_every_declared_dependency_is_imported():
    providers = {mod: {_norm(d) for d in dists} for mod, dists in packages_distributions().items()}
    imported = {d for mod in _imports() for d in providers.get(mod, set())}
    unused = sorted(spec for name, spec in _declared().items() if name not in imported)
    assert unused == [], f"declared in pyproject.toml but never imported by jbench: {unused}"


def test_every_import_comes_with_a_declared_dependency():
    providers = {mod: {_norm(d) for d in dists} for mod, dists in packages_distributions().items()}
    installed = _closure(set(_declared()))
    missing = {mod: sorted(files) for mod, files in _imports().items() if not providers.get(mod, set()) & installed}
    assert missing == {}, f"imported but not installed by pyproject.toml's dependencies: {missing}"


def test_mlflow_is_pinned_below_its_next_major():
    spec = _declared()["mlflow"].replace(" ", "")
    assert re.search(r"<(\d+)", spec), spec  # jbench reads MLflow's tables on a fast path (with a fallback)
    assert "fabric" not in _declared()
