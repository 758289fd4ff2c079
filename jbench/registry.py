"""Plug-in registries: backends, telemetry samplers and per-trial analyses are found the same way.

Each kind has an entry-point group (`jbench.backends`, `jbench.samplers`, `jbench.analyses`) and a
table of built-ins. A user's package adds one by declaring an entry point in its own pyproject.toml,
e.g. `[project.entry-points."jbench.analyses"] my_check = "my_pkg.checks:MyCheck"`; no jbench edit.
Built-ins are listed here too so that a source checkout works without an installed wheel.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from importlib.metadata import entry_points
from typing import Any

BACKENDS = "jbench.backends"
SAMPLERS = "jbench.samplers"
ANALYSES = "jbench.analyses"

BUILTIN: dict[str, dict[str, str]] = {
    BACKENDS: {
        "llamacpp": "jbench.backends.llamacpp.backend:LlamaCppBackend",
        "engine": "jbench.backends.engine.backend:EngineBackend",
        "trtllm": "jbench.backends.trtllm.backend:TrtllmBackend",
    },
    SAMPLERS: {
        "none": "jbench.device.telemetry.sources:no_telemetry",
        "tegrastats": "jbench.device.telemetry.sources:tegrastats",
        "sysfs": "jbench.device.telemetry.sources:sysfs",
        "jtop": "jbench.device.telemetry.sources:jtop",
        "nvml": "jbench.device.telemetry.sources:nvml",
        "auto": "jbench.device.telemetry.sources:auto",
    },
    # Run in this order after every measured trial (each a jbench.sweeps.stages.Stage).
    ANALYSES: {
        "phase_speed": "jbench.sweeps.analyses:PhaseSpeed",
        "roofline": "jbench.sweeps.analyses:Roofline",
        "noise": "jbench.sweeps.analyses:Noise",
    },
}


@lru_cache(maxsize=None)
def targets(group: str) -> dict[str, str]:
    """name -> "module:attribute" for a group: built-ins first, then installed entry points
    (an entry point cannot replace a built-in of the same name)."""
    out = dict(BUILTIN.get(group, {}))
    for ep in entry_points(group=group):
        out.setdefault(ep.name, ep.value)
    return out


def load(group: str, name: str) -> Any:
    """The object registered under name; KeyError names the valid choices."""
    found = targets(group)
    if name not in found:
        kind = group.rsplit(".", 1)[-1].rstrip("s") or group
        raise KeyError(f"unknown {kind} '{name}'. Valid: {', '.join(sorted(found))}")
    module_name, _, attr = found[name].partition(":")
    return getattr(importlib.import_module(module_name), attr)
