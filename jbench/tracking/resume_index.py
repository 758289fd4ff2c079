"""Which trials are already FINISHED, read straight from a local SQLite store without importing MLflow.

Resuming a sweep needs one small question answered (which trial identities have a FINISHED run in this
experiment), and importing MLflow and opening its store costs seconds. For a local SQLite store this
module answers it with the standard library's sqlite3, read-only, from MLflow's own tables. It answers
only when it can answer exactly: a schema it does not recognise, or runs written before trial identities
were recorded (hash version 1, which must be migrated from their params), return None, and the caller
asks MLflow (jbench.tracking.reader.finished_trials).
"""

from __future__ import annotations

import sqlite3
from typing import Optional
from urllib.parse import unquote

from jbench.core.trial import resume_key

# The tables and columns read here, checked before any query.
_NEEDS = {
    "experiments": {"experiment_id", "name"},
    "runs": {"run_uuid", "experiment_id", "status", "lifecycle_stage"},
    "tags": {"run_uuid", "key", "value"},
    "latest_metrics": {"run_uuid", "key", "value", "is_nan"},
}
_TAGS = ("jbench.kind", "jbench.identity", "jbench.config_hash", "jbench.round", "jbench.hash_version",
         "jbench.noisy", "quality.identity", "quality.status")


def sqlite_path(uri: str) -> Optional[str]:
    """The file of a `sqlite:///...` tracking URI, else None."""
    return unquote(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


def finished_trials_sqlite(uri: str, experiment_name: str, *, key: str = "identity") -> Optional[dict[str, dict]]:
    """{resume key: {"run_id", "wall_s", "metrics", "noisy"}} like reader.finished_trials, or None when this fast
    path cannot answer exactly (not a local SQLite store, an unknown schema, version-1 runs, any database error)."""
    path = sqlite_path(uri)
    if path is None:
        return None
    column = {"identity": "jbench.identity", "config_hash": "jbench.config_hash"}[key]
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error:
        return None
    try:
        for table, columns in _NEEDS.items():
            have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
            if not columns <= have:
                return None
        exp = db.execute("SELECT experiment_id FROM experiments WHERE name = ?", (experiment_name,)).fetchone()
        if exp is None:
            return {}
        tags: dict[str, dict[str, str]] = {}
        query = (f"SELECT t.run_uuid, t.key, t.value FROM tags t JOIN runs r ON r.run_uuid = t.run_uuid "
                 f"WHERE r.experiment_id = ? AND r.lifecycle_stage = 'active' AND r.status = 'FINISHED' "
                 f"AND t.key IN ({','.join('?' * len(_TAGS))}) "
                 # The reader's order (start time, run id): of two FINISHED runs of a trial both pick the first.
                 f"ORDER BY r.start_time, r.run_uuid")
        for run_id, k, v in db.execute(query, (exp[0], *_TAGS)):
            tags.setdefault(run_id, {})[k] = v
        # Every metric of the FINISHED runs: a resumed trial's summary row shows the earlier run's figures. MLflow
        # stores a NaN as 0 with is_nan set; a NaN is left out (missing), as reader.runs_frame reads it.
        metrics: dict[str, dict[str, float]] = {}
        for run_id, k, v, is_nan in db.execute(
                "SELECT m.run_uuid, m.key, m.value, m.is_nan FROM latest_metrics m JOIN runs r "
                "ON r.run_uuid = m.run_uuid WHERE r.experiment_id = ? AND r.lifecycle_stage = 'active' "
                "AND r.status = 'FINISHED'", (exp[0],)):
            if not is_nan and v is not None:
                metrics.setdefault(run_id, {})[k] = float(v)
    except sqlite3.Error:
        return None
    finally:
        db.close()
    found: dict[str, dict] = {}
    for run_id, t in tags.items():
        if t.get("jbench.kind") != "trial":
            continue
        if "jbench.hash_version" not in t or column not in t:
            return None  # a run from before identities were recorded: MLflow's reader migrates it
        m = metrics.get(run_id, {})
        found.setdefault(resume_key(t[column], t.get("jbench.round", "1")),
                         {"run_id": run_id, "wall_s": m.get("trial_wall_s"), "metrics": m,
                          "noisy": t.get("jbench.noisy") == "true",
                          "quality_identity": t.get("quality.identity"),
                          "quality_ok": t.get("quality.status") == "ok"})
    return found
