"""Buffers measured per configuration, kept on the controller: what the memory stage (jbench.runner.memory) saw a
backend allocate besides weights and KV cache (compute and output buffers, and the KV cache as it printed it), so
the planner's memory check (jbench.sweeps.plan.memory_check) and the next trial's prediction can count measured
figures where a formula has none.

One JSON file in jbench's cache directory: {"version": 1, "entries": {<configuration>: {<model SHA-256>: entry}}}.
A configuration is (backend, build, device, the backend's buffer settings: context as the backend computes it,
batch sizes, KV types, flash attention, GPU layers, extra arguments: `Backend.buffer_settings`), so a figure is only
reused for the same build on the same device with the same settings and model file. An entry: compute, output and
KV MiB, when (UTC) and on which device it was measured. A cache: an unreadable file is an empty one, a failed write
costs only the reuse.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping, Optional

from jbench.core import paths

log = logging.getLogger("jbench")
VERSION = 1


def cache_path() -> Path:
    return paths.cache_dir() / "memory_facts.json"


@dataclass(frozen=True)
class MemoryKey:
    """One configuration whose buffers were measured (module doc); the model file is the second level."""

    backend: str
    build: str
    device: str
    settings: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, backend: str, build: str, device: str, settings: Mapping[str, str]) -> "MemoryKey":
        return cls(backend, build, device, tuple(sorted((str(k), str(v)) for k, v in settings.items())))

    def text(self) -> str:
        return json.dumps({"backend": self.backend, "build": self.build, "device": self.device,
                           "settings": dict(self.settings)}, sort_keys=True)


@dataclass(frozen=True)
class MeasuredBuffers:
    compute_mib: float
    output_mib: float
    kv_mib: Optional[float] = None
    measured_at: str = ""  # ISO 8601, UTC
    device: str = ""

    def describe(self) -> str:
        """Where the figures come from, for a message or a tag."""
        return f"on {self.device or 'an unnamed device'} at {self.measured_at or 'an unknown time'}"


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _read_file() -> dict:
    """The entries in the file now; {} when it is missing, unreadable or of another version."""
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


_memo: dict[tuple, dict] = {}  # (path, inode, size, mtime_ns) -> entries: the planner asks once per trial
_writing = threading.Lock()  # a pool's units finish trials side by side in one process


def _load() -> dict:
    """The entries, for reading only (shared between calls while the file is unchanged)."""
    path = cache_path()
    try:
        st = path.stat()
    except OSError:
        return {}
    stamp = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)  # store() replaces the file: a new inode
    if stamp not in _memo:
        _memo.clear()
        _memo[stamp] = _read_file()
    return _memo[stamp]


def known(key: MemoryKey) -> bool:
    """Whether any model was measured in this configuration: a cheap test before computing a model's digest."""
    return bool(_load().get(key.text()))


def lookup(key: MemoryKey, model: str) -> Optional[MeasuredBuffers]:
    """The buffers measured for this configuration and model file (its SHA-256), or None."""
    entry = (_load().get(key.text()) or {}).get(model)
    if not isinstance(entry, dict):
        return None
    try:
        kv = entry.get("kv_mib")
        return MeasuredBuffers(compute_mib=float(entry["compute_mib"]), output_mib=float(entry["output_mib"]),
                               kv_mib=None if kv is None else float(kv), measured_at=str(entry.get("measured_at", "")),
                               device=str(entry.get("device", "")))
    except (KeyError, TypeError, ValueError):
        return None


def store(key: MemoryKey, model: str, buffers: MeasuredBuffers) -> None:
    """Keep (replace) the buffers of this configuration and model file."""
    path = cache_path()
    with _writing:
        entries = _read_file()  # fresh: another controller may have added entries since
        entries.setdefault(key.text(), {})[model] = asdict(buffers)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": VERSION, "entries": entries}, indent=1, sort_keys=True))
            tmp.replace(path)  # whole or not at all: a reader never sees half a file
        except OSError as exc:
            log.debug("measured-buffer cache not written (%s)", exc)
