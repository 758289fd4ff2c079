"""pyproject.toml's dependencies are what jbench imports directly: every third-party module that jbench's own code
(the AST of jbench/**) imports is declared (not merely installed by something else), none declared is unused, the
farm's labgrid is an extra that only the coordinator imports, and every other command works without it.
constraints.txt pins every distribution the install brings, within pyproject.toml's ranges."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, packages_distributions, requires

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from .conftest import REPO

# The distribution that provides each top-level module jbench imports (PyPI names). A new third-party import needs an
# entry here and a declaration in pyproject.toml (the test says which).
IMPORT_TO_DIST = {
    "optuna": "optuna",
    "click": "click",
    "gguf": "gguf",
    "grpc": "grpcio",
    "hydra": "hydra-core",
    "labgrid": "labgrid",
    "matplotlib": "matplotlib",
    "mlflow": "mlflow",
    "numpy": "numpy",
    "omegaconf": "omegaconf",
    "pandas": "pandas",
    "paramiko": "paramiko",
    "pyarrow": "pyarrow",
    "pynvml": "nvidia-ml-py",
    "requests": "requests",
    "rich": "rich",
    "ruptures": "ruptures",
    "scipy": "scipy",
    "sqlalchemy": "sqlalchemy",
    "yaml": "pyyaml",
}
# Extras whose distributions only these files of jbench may import (everything else works without the extra).
EXTRA_ONLY = {"farm": {"jbench/farm/coordinator.py"}}
# Fast movers: each declared below its next major version (or, for a 0.x library, below 1).
BOUNDED = ("mlflow", "numpy", "pandas", "scipy", "gguf", "paramiko", "hydra-core", "matplotlib", "rich", "ruptures")


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _declared(specs: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, specs)}


def _imports() -> dict[str, set[str]]:
    """Top-level third-party modules imported by jbench's own code -> the files that import them."""
    out: dict[str, set[str]] = {}
    for f in sorted((REPO / "jbench").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
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


def test_every_direct_import_has_a_known_distribution():
    unknown = {mod: sorted(files) for mod, files in _imports().items() if mod not in IMPORT_TO_DIST}
    assert unknown == {}, (f"jbench imports {unknown}: add each module's distribution to IMPORT_TO_DIST and declare it "
                           "in pyproject.toml")


def test_the_import_to_distribution_map_is_what_is_installed():
    providers = packages_distributions()
    for mod, dist in IMPORT_TO_DIST.items():
        assert dist in {canonicalize_name(d) for d in providers.get(mod, [])}, (mod, dist, providers.get(mod))


def test_every_direct_import_is_declared_where_it_is_used():
    project = _project()
    core = _declared(project["dependencies"])
    extras = {name: _declared(specs) for name, specs in project["optional-dependencies"].items()}
    problems = []
    for mod, files in sorted(_imports().items()):
        dist = IMPORT_TO_DIST.get(mod)
        if dist is None:
            continue  # test_every_direct_import_has_a_known_distribution
        if dist in core:
            continue
        extra = next((e for e, only in EXTRA_ONLY.items() if dist in extras.get(e, {})), None)
        if extra is None:
            problems.append(f"{mod} ({dist}) is imported by {sorted(files)} but not declared in [project].dependencies")
        elif not files <= EXTRA_ONLY[extra]:
            problems.append(f"{mod} ({dist}) of the '{extra}' extra is imported by {sorted(files - EXTRA_ONLY[extra])}: "
                            f"only {sorted(EXTRA_ONLY[extra])} may (the rest of jbench works without the extra)")
    assert problems == []


def test_nothing_declared_goes_unimported():
    project = _project()
    imported = {IMPORT_TO_DIST[m] for m in _imports() if m in IMPORT_TO_DIST}
    unused = sorted(d for d in _declared(project["dependencies"]) if d not in imported)
    assert unused == [], f"declared in pyproject.toml but never imported by jbench: {unused}"
    for extra in EXTRA_ONLY:
        unused = sorted(d for d in _declared(project["optional-dependencies"][extra]) if d not in imported)
        assert unused == [], f"the '{extra}' extra declares what jbench never imports: {unused}"


def test_labgrid_is_the_farm_extra_not_a_dependency():
    project = _project()
    assert not {"labgrid", "grpcio"} & set(_declared(project["dependencies"]))
    assert {"labgrid", "grpcio"} <= set(_declared(project["optional-dependencies"]["farm"]))
    assert "fabric" not in _declared(project["dependencies"])


def test_fast_movers_are_bounded_below_their_next_major():
    """Each has an upper bound, no higher than the next major version of the one jbench is locked to (for a 0.x
    library: 1), and the locked version is inside it."""
    core = _declared(_project()["dependencies"])
    pins = _pins()
    for name in BOUNDED:
        uppers = [Version(s.version) for s in core[name].specifier if s.operator == "<"]
        assert uppers, f"{name} has no upper bound: {core[name]}"
        locked = pins[name]
        assert core[name].specifier.contains(locked), f"{name}: the locked {locked} is outside {core[name]}"
        assert min(uppers) <= Version(str(locked.major + 1)), f"{name}: {core[name]} allows more than {locked.major + 1}"


def test_the_metadata_uses_the_spdx_license_and_a_setuptools_that_reads_it():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert data["project"]["license"] == "Apache-2.0"
    assert not [c for c in data["project"].get("classifiers", []) if c.startswith("License ::")]
    setuptools = next(Requirement(r) for r in data["build-system"]["requires"] if r.startswith("setuptools"))
    assert Version("77") in setuptools.specifier and Version("76.9") not in setuptools.specifier


# -- constraints.txt -------------------------------------------------------------------------------------------------


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line.strip())
        assert m, f"constraints.txt: not an exact pin: {line!r}"
        pins[canonicalize_name(m.group(1))] = Version(m.group(2))
    return pins


def _closure(roots: list[Requirement]) -> set[str]:
    """The distributions installing `roots` brings (requirements of the installed metadata, extras followed)."""
    seen: set[tuple[str, frozenset]] = set()
    todo = [(r, frozenset(r.extras)) for r in roots if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        req, extras = todo.pop()
        key = (canonicalize_name(req.name), extras)
        if key in seen:
            continue
        seen.add(key)
        try:
            reqs = requires(req.name) or []
        except PackageNotFoundError:
            continue
        for text in map(Requirement, reqs):
            wanted = text.marker is None or any(text.marker.evaluate({"extra": e}) for e in ("", *extras))
            if wanted:
                todo.append((text, frozenset(text.extras)))
    return {name for name, _ in seen}


def test_constraints_pin_every_distribution_of_the_install_within_pyprojects_ranges():
    assert "make lock" in (REPO / "constraints.txt").read_text(), "constraints.txt says how to regenerate it"
    pins = _pins()
    assert "jbench" not in pins
    project = _project()
    specs = [*project["dependencies"], *[s for e in ("test", "farm") for s in project["optional-dependencies"][e]]]
    for req in map(Requirement, specs):
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is not pinned in constraints.txt: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), f"constraints.txt pins {name}=={pins[name]} outside {req}"
    missing = sorted(_closure(list(map(Requirement, specs))) - set(pins))
    assert missing == [], f"installed by `make install` but not pinned in constraints.txt: {missing}; run `make lock`"


def test_make_install_and_ci_install_from_the_constraints_with_the_farm_extra():
    out = subprocess.run(["make", "-n", "-B", "install", "VENV=/nonexistent-venv"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    installs = [line for line in out.splitlines() if " install " in line]
    assert installs and all("-c constraints.txt" in line for line in installs), out
    assert any("-e '.[test,farm]'" in line for line in installs), out
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in ci  # CI installs through the Makefile, so from the constraints too
    lock = subprocess.run(["make", "-n", "lock"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "mktemp -d" in lock and "-m venv" in lock and "pip freeze" in lock and "constraints.txt" in lock


# -- jbench without labgrid ------------------------------------------------------------------------------------------

_NO_LABGRID = '''
import sys
class _Gone:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("labgrid", "grpc"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Gone())
'''


def _without_labgrid(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NO_LABGRID + code], capture_output=True, text=True, cwd=tmp_path,
                          env={**__import__("os").environ, "JBENCH_RESULTS_DIR": str(tmp_path / "r"), "COLUMNS": "200"},
                          timeout=300)


@pytest.mark.slow
def test_every_module_but_the_farms_imports_and_every_other_command_runs_without_labgrid(tmp_path):
    res = _without_labgrid(
        "import importlib, pkgutil, jbench\n"
        "names = [m.name for m in pkgutil.walk_packages(jbench.__path__, 'jbench.')\n"
        "         if '.conf' not in m.name and not m.name.endswith('__main__')]\n"
        "for n in names: importlib.import_module(n)\n"
        "print(len(names), 'labgrid' in sys.modules, 'grpc' in sys.modules)\n", tmp_path)
    assert res.returncode == 0, res.stderr
    count, labgrid, grpc = res.stdout.split()
    assert int(count) > 50 and (labgrid, grpc) == ("False", "False")
    cli = "from jbench.cli import main\nsys.argv = ['jbench', *{args!r}]\nmain()\n"
    ok = _without_labgrid(cli.format(args=["run", "--cfg", "job", "-p", "backend.n_gen"]), tmp_path)
    assert ok.returncode == 0 and ok.stdout.strip() == "64", ok.stdout + ok.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["farm", "list", "--coordinator", "127.0.0.1:1"],
    ["sweep", "device=@orin_nano_8gb", "farm.coordinator=127.0.0.1:1", "--dry-run"],
])
def test_the_farm_says_in_one_line_how_to_install_its_extra(tmp_path, args):
    res = _without_labgrid(f"from jbench.cli import main\nsys.argv = ['jbench', *{args!r}]\nmain()\n", tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'jbench[farm]'" in lines[0] and "Traceback" not in res.stderr, res.stderr
