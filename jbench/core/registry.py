"""Plug-in registries: backends, telemetry sources and per-trial analyses are found the same way.

Each kind is an entry-point group (`jbench.backends`, `jbench.samplers`, `jbench.analyses`). jbench's own
plug-ins are declared in its pyproject.toml exactly like a user's: a user's package adds one with an entry
point in its own pyproject.toml, e.g. `[project.entry-points."jbench.analyses"] my_check =
"my_pkg.checks:MyCheck"`, and no jbench file changes. There is no second, hard-coded list.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from importlib.metadata import entry_points
from typing import Any

BACKENDS = "jbench.backends"
SAMPLERS = "jbench.samplers"
ANALYSES = "jbench.analyses"

@lru_cache(maxsize=None)
def targets(group: str) -> dict[str, str]:
    """name -> "module:attribute" of every installed entry point of a group (jbench's own first: a
    plug-in cannot replace a built-in of the same name)."""
    eps = sorted(entry_points(group=group), key=lambda ep: (ep.value.split(".", 1)[0] != "jbench", ep.name))
    out: dict[str, str] = {}
    for ep in eps:
        out.setdefault(ep.name, ep.value)
    if not out and group in (BACKENDS, SAMPLERS):
        raise RuntimeError(f"no {group} entry points found: jbench is not installed in this Python "
                           "(run `make install` or `pip install -e .` in the checkout)")
    return out


def load(group: str, name: str) -> Any:
    """The object registered under name; KeyError names the valid choices."""
    found = targets(group)
    if name not in found:
        kind = group.rsplit(".", 1)[-1].rstrip("s") or group
        raise KeyError(f"unknown {kind} '{name}'. Valid: {', '.join(sorted(found))}")
    module_name, _, attr = found[name].partition(":")
    return getattr(importlib.import_module(module_name), attr)


def backend_schemas() -> dict[str, type]:
    """name -> config dataclass (`CONFIG`) of every registered backend that imports; a broken third-party
    backend is left out with a warning instead of breaking every command."""
    import logging

    out = {}
    for name in targets(BACKENDS):
        try:
            out[name] = load(BACKENDS, name).CONFIG
        except Exception as exc:  # ImportError, AttributeError from a plugin
            logging.getLogger("jbench").warning("backend '%s' is registered but cannot be loaded: %s", name, exc)
    return out
