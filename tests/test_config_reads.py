"""No string-keyed config reads in jbench: product code reads schema objects by attribute (`trial.cfg`, a
backend's `self.config`, `typed(schema, section)`), so a renamed key fails where it is read, and a default lives
in its schema only, never restated at a read like `cfg.get("latency_requests", 8)`.

An AST walk finds `X["key"]`, `X.get("key", ...)` and `getattr(X, "key", default)` on names that hold config
sections. Data that only shares such a name (a tool's JSON reply, a run record) gets a name of its own; the
allowlist is for the few reads that must stay string-keyed, each entry saying why."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jbench"

# Names that hold a config section (or the whole config) wherever they appear, as a variable or an attribute.
CONFIG_NAMES = frozenset({
    "cfg", "config", "conf", "section", "sections", "device", "devices", "unit", "model", "backend", "profile",
    "prof", "power", "telemetry", "tele", "energy", "wall", "wall_power", "thermal", "sweep", "tracking", "farm",
    "experiment", "paths", "patterns", "settings",
})

# (file, name, key): reads that must stay string-keyed, each with its reason.
ALLOWED = {
    # A plain backend section's `name` picks the schema that types it: read before any typed view can exist.
    ("jbench/core/trial.py", "section", "name"),
}


class Read(NamedTuple):
    file: str
    line: int
    name: str
    key: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.name}[{self.key!r}]"


def _literal(node: ast.AST) -> Optional[str]:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _holder(node: ast.AST) -> Optional[str]:
    """The config-like name a value is read from (`cfg`, `self.config`, the `paths` of `device.get("paths")` or
    `config["paths"]`, through `(... or {})`), else None."""
    if isinstance(node, ast.BoolOp):  # `(section or {}).get(...)`
        node = node.values[0]
    if isinstance(node, ast.Name):
        name = node.id
    elif isinstance(node, ast.Attribute):
        name = node.attr
    elif isinstance(node, ast.Subscript):  # config["device"]["name"]: the inner key names the section
        name = _literal(node.slice)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        name = _literal(node.args[0])
    else:
        name = None
    return name if name in CONFIG_NAMES else None


def config_reads(source: str, file: str = "<string>") -> Iterator[Read]:
    """String-keyed reads of config-like names in Python source."""
    for node in ast.walk(ast.parse(source)):
        holder = key = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            holder, key = _holder(node.value), _literal(node.slice)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get":
                holder, key = _holder(func.value), _literal(node.args[0])
            elif isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) == 3:
                holder, key = _holder(node.args[0]), _literal(node.args[1])
        if holder is not None and key is not None:
            yield Read(file, node.lineno, holder, key)


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_walk_finds_the_reads_it_is_meant_to_find():
    source = '''
cfg.get("latency_requests", 8)
self.config.get("binary_dir")
trial.config["model"]["quant"]
(device.get("paths") or {}).get("sysfs_root", "/sys")
getattr(backend, "n_gpu_layers", 99)
profile["memory_bandwidth_gbs"]
'''
    found = {(r.name, r.key) for r in config_reads(source)}
    assert found == {("cfg", "latency_requests"), ("config", "binary_dir"), ("config", "model"), ("model", "quant"),
                     ("device", "paths"), ("paths", "sysfs_root"), ("backend", "n_gpu_layers"),
                     ("profile", "memory_bandwidth_gbs")}
    # Data that is not config, attribute reads, and a dynamic key are not flagged.
    quiet = '''
record.get("n_prompt", 0)
data["tokens"]
cfg.n_gen
getattr(cfg, "name")
section[key]
'''
    assert list(config_reads(quiet)) == []


def test_no_string_keyed_config_reads_in_jbench():
    found = []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        found += [r for r in config_reads(path.read_text(), rel) if (r.file, r.name, r.key) not in ALLOWED]
    assert not found, "read these through the typed config (trial.cfg, self.config, typed(...)):\n" + "\n".join(
        map(str, found))


def test_the_allowlist_has_no_stale_entries():
    seen = {(r.file, r.name, r.key) for path in _files()
            for r in config_reads(path.read_text(), path.relative_to(ROOT).as_posix())}
    assert ALLOWED <= seen, f"allowed reads that no longer exist: {sorted(ALLOWED - seen)}"
