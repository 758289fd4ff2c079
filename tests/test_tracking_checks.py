"""The checks jbench makes before a sweep without MLflow or a device: writable paths, a server's health,
and which errors mean "the server did not answer" (the switch to the spool)."""

from __future__ import annotations

import socket
from pathlib import Path

import requests
from mlflow.exceptions import MlflowException

from jbench.tracking.common import server_problem, store_problem, writable_problem
from jbench.tracking.writer import unreachable


def test_writable_problem_names_what_is_in_the_way(tmp_path):
    assert writable_problem(tmp_path / "new" / "deeper") is None
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "is a file" in writable_problem(blocker)
    assert "is a file" in writable_problem(blocker / "results")
    assert "is a directory" in writable_problem(tmp_path, directory=False)
    assert writable_problem("/proc/jbench-results") is not None  # root cannot write there either
    assert not list(tmp_path.glob(".jbench-write-check-*"))  # the probe leaves nothing behind
    assert not (tmp_path / "new").exists()  # checking creates nothing


def test_store_problem_checks_results_dir_and_spool(tmp_path):
    assert store_problem(f"sqlite:///{tmp_path}/r/mlflow.db", tmp_path / "r") is None
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert store_problem(f"sqlite:///{blocker}/mlflow.db", blocker) is not None
    # A server's store: the spool under the results directory must be writable.
    assert store_problem("http://127.0.0.1:1", blocker) is not None
    assert store_problem("http://127.0.0.1:1", tmp_path / "r") is None


def test_server_problem_for_a_port_nothing_listens_on():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert "does not answer" in server_problem(f"http://127.0.0.1:{port}", timeout=2)
    assert server_problem("sqlite:///x.db") is None


def test_unreachable_tells_a_dead_server_from_a_refused_request():
    refused = requests.exceptions.ConnectionError("Max retries exceeded with url: /api/2.0/mlflow/runs/create")
    wrapped = MlflowException("API request to http://h/api/2.0/mlflow/runs/log-batch failed")
    wrapped.__cause__ = refused
    assert unreachable(refused) and unreachable(wrapped)
    assert not unreachable(MlflowException("INVALID_PARAMETER_VALUE: Changing param values is not allowed"))
    assert not unreachable(ValueError("bad value"))


def test_uris_are_shown_without_passwords():
    from jbench.tracking.common import redact

    assert redact("postgresql://mlflow:pw@db:5432/mlflow") == "postgresql://mlflow:***@db:5432/mlflow"
    assert redact("http://alice:s3cr%40t@mlflow.lab:5000") == "http://alice:***@mlflow.lab:5000"
    assert redact("postgresql://mlflow@db/mlflow?password=pw&sslmode=require") == \
        "postgresql://mlflow@db/mlflow?password=***&sslmode=require"
    for uri in ("http://mlflow.lab:5000", "sqlite:////tmp/r/mlflow.db", "postgresql://mlflow@db/mlflow", "results"):
        assert redact(uri) == uri


def test_a_database_uri_is_refused_with_the_fix():
    from jbench.tracking.common import database_problem

    for uri in ("postgresql://u:pw@db/mlflow", "postgresql+psycopg://u:pw@db/m", "mysql://u:pw@db/m"):
        problem = database_problem(uri)
        assert problem and "pw" not in problem and "u:***@" in problem and "mlflow server" in problem
        assert "--artifacts-destination" in problem and "docs/team-store.md" in problem
    for uri in ("http://mlflow.lab:5000", "sqlite:////tmp/mlflow.db", "results"):
        assert database_problem(uri) is None


def test_resume_index_declines_anything_but_a_local_sqlite_store():
    from jbench.tracking.resume_index import finished_trials_sqlite

    for uri in ("postgresql://mlflow@127.0.0.1:1/mlflow", "http://127.0.0.1:1"):
        assert finished_trials_sqlite(uri, "adhoc") is None
