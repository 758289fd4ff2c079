"""The store format of an experiment (`jbench.store_format`, jbench.core.protocol): written on every experiment jbench
records to, read before jbench writes to or reads from it. An experiment written by a newer jbench is refused with
one message (StoreFormatError), never reinterpreted.

Reading it costs no MLflow import: a local SQLite store is read with sqlite3 (read-only), a tracking server through
its REST API; `check` is what a sweep calls before touching a device."""

from __future__ import annotations

import sqlite3
from typing import Optional

from jbench.core.errors import UserError
from jbench.core.protocol import STORE_FORMAT, STORE_FORMAT_TAG, newer_store_problem
from jbench.tracking.common import is_remote, redact
from jbench.tracking.resume_index import sqlite_path


class StoreFormatError(UserError):
    """The experiment was written by a newer jbench: nothing is read from or written to it."""


def sqlite_format(path: str, experiment: str) -> Optional[str]:
    """The experiment's store-format tag in a local SQLite store, or None (no such experiment or tag, no store)."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error:
        return None
    try:
        row = db.execute("SELECT t.value FROM experiment_tags t JOIN experiments e ON e.experiment_id = t.experiment_id "
                         "WHERE e.name = ? AND t.key = ?", (experiment, STORE_FORMAT_TAG)).fetchone()
    except sqlite3.Error:  # no store yet, or not MLflow's schema: nothing to refuse
        return None
    finally:
        db.close()
    return row[0] if row else None


def server_format(uri: str, experiment: str, timeout_s: float = 10.0) -> Optional[str]:
    """The experiment's store-format tag on a tracking server (REST), or None (no such experiment, no answer: the
    store checks say why elsewhere)."""
    import requests

    try:
        res = requests.get(uri.rstrip("/") + "/api/2.0/mlflow/experiments/get-by-name",
                           params={"experiment_name": experiment}, timeout=timeout_s)
    except requests.RequestException:
        return None
    if res.status_code != 200:
        return None
    reply = res.json().get("experiment") or {}
    tags = reply.get("tags") or []
    return next((t.get("value") for t in tags if t.get("key") == STORE_FORMAT_TAG), None)


def check(uri: str, experiment: str) -> None:
    """StoreFormatError when `experiment` in the store at `uri` was written by a newer jbench."""
    path = sqlite_path(uri)
    if path is not None:
        found = sqlite_format(path, experiment)
    elif is_remote(uri):
        found = server_format(uri, experiment)
    else:
        return
    check_tag(found, f"experiment '{experiment}' in {redact(uri)}")


def check_tag(found: Optional[str], where: str) -> None:
    """StoreFormatError for a store-format tag this jbench cannot read."""
    problem = newer_store_problem(found, where)
    if problem:
        raise StoreFormatError(problem)


def format_to_write(found: Optional[str]) -> Optional[str]:
    """The tag value to write on an experiment whose tag is `found` (None: leave it as it is)."""
    return str(STORE_FORMAT) if found != str(STORE_FORMAT) else None
