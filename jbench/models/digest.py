"""SHA-256 of model files, here or on a device, cached by (where, path, size, mtime): part of a trial's identity
(jbench.core.identity.trial_identity) and of a run's record (`model.sha256`)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

from jbench.core import paths
from jbench.core.schema import ModelSection
from jbench.models.store import ModelError, resolve_model_file, sha256_file

log = logging.getLogger("jbench")


def unchanged_local_digest(path: str, start_time_ms: Optional[float]) -> Optional[str]:
    """A local file's digest when it has not changed since a run started at start_time_ms (epoch ms), else None."""
    if start_time_ms is None or start_time_ms != start_time_ms:
        return None
    try:
        if os.stat(path).st_mtime * 1000 >= float(start_time_ms):
            return None  # changed (or written) after the run started: not the file it measured
        return file_digest(path)
    except OSError:
        return None




def _digest_cache_path() -> Path:
    return paths.cache_dir() / "digests.json"


def _load_cache() -> dict:
    try:
        return json.loads(_digest_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_cache_entry(key: str, entry: dict) -> None:
    path = _digest_cache_path()
    try:
        cache = _load_cache()
        cache[key] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:  # a read-only cache only costs hashing again
        log.debug("digest cache not written (%s)", exc)


def file_digest(path: str, conn: Any = None) -> Optional[str]:
    """SHA-256 of a file, cached in <cache_dir>/digests.json by (where, path, size, mtime): a file is read
    once until it changes. conn: the device Connection the path is on (None or a local one: this machine);
    on a remote device the digest is `sha256sum` run there. None when the file cannot be read."""
    if conn is None or getattr(conn, "is_local", False):
        try:
            real = os.path.realpath(os.path.expanduser(path))
            st = os.stat(real)
        except OSError:
            return None
        key, stamp = f"local:{real}", [st.st_size, st.st_mtime_ns, st.st_ino]
    else:
        res = conn.run(["stat", "-L", "-c", "%s %Y %i", path], timeout=30)
        if not res.ok:
            return None
        key, stamp = f"{getattr(conn, 'name', 'device')}:{path}", res.stdout.split()
    cached = _load_cache().get(key)
    if cached and cached.get("stamp") == stamp:
        return cached["sha256"]
    if conn is None or getattr(conn, "is_local", False):
        try:
            digest = sha256_file(Path(real))
        except OSError:
            return None
    else:
        res = conn.run(["sha256sum", "--", path], timeout=1800)
        if not res.ok or not res.stdout.split():
            return None
        digest = res.stdout.split()[0].lower()
    _save_cache_entry(key, {"stamp": stamp, "sha256": digest})
    return digest


def model_digest(model: ModelSection, conn: Any = None) -> Optional[str]:
    """SHA-256 of a trial's model file (the `model` section of its config).

    A bundled model: the store manifest's SHA-256 (recorded when `jbench setup` made the file; nothing
    is read). A user's file (model.files / model.path_template): file_digest() of the resolved path on the
    device. None when the file is not resolved or not readable (the trial then fails as missing_model)."""
    try:
        path, facts = resolve_model_file(model)
    except ModelError:
        return None
    if facts.get("model.sha256"):
        return facts["model.sha256"]
    return file_digest(path, conn)
