"""The checks jbench makes before a sweep without MLflow or a device: writable paths, a server's health,
and which errors mean "the server did not answer" (the switch to the spool)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
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


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _SlowServer:
    """A real HTTP server on loopback that answers /health and the store request like MLflow's, each after
    sleeping `delay` seconds (a loaded team server). `requests` lists the paths it was asked for."""

    def __init__(self, delay: float):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.delay = delay
        self.requests: list[str] = []
        self.stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests.append(self.path.split("?")[0])
                outer.stop.wait(outer.delay)
                body = b"OK" if self.path == "/health" else b'{"experiments": []}'
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the client gave up on this request
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def slow_server():
    made: list[_SlowServer] = []

    def make(delay: float) -> _SlowServer:
        made.append(_SlowServer(delay))
        return made[-1]

    yield make
    for server in made:
        server.close()


def test_server_problem_for_a_port_nothing_listens_on():
    # Down: refused at once, never retried whatever the wait, and the message says so.
    problem = server_problem(f"http://127.0.0.1:{_closed_port()}", timeout=2, wait_s=600)
    assert "does not answer" in problem and "connection was refused" in problem and "down" in problem
    assert "slow" not in problem
    assert server_problem("sqlite:///x.db") is None


def test_a_host_name_that_does_not_resolve_is_down_at_once():
    problem = server_problem("http://jbench-no-such-host.invalid:5000", timeout=2, wait_s=600)
    assert "does not resolve" in problem and "slow" not in problem


def test_a_slow_server_is_asked_again_and_used_when_it_answers_within_the_wait(slow_server):
    server = slow_server(0.6)  # slower than the first two timeouts (0.25 s, 0.5 s), not than the third (1 s)
    assert server_problem(server.uri, timeout=0.25, wait_s=30) is None
    # /health timed out twice at least (the server sleeps longer than 0.25 s and 0.5 s), then answered; then the store.
    health = server.requests.count("/health")
    assert health >= 3 and server.requests[:health] == ["/health"] * health, server.requests
    assert set(server.requests[health:]) == {"/api/2.0/mlflow/experiments/search"}, server.requests


def test_a_server_slower_than_the_wait_is_reported_as_slow_not_down(slow_server):
    server = slow_server(60)
    problem = server_problem(server.uri, timeout=0.5, wait_s=2)
    assert problem.startswith("it is up but too slow: no answer within 2 s")
    assert "timed out" in problem and "tracking.server_wait_s" in problem and "refused" not in problem
    assert server.requests and set(server.requests) == {"/health"}


def test_the_wait_is_a_tracking_setting_that_never_changes_a_trials_identity():
    import dataclasses

    from jbench.config import compose
    from jbench.core.schema import TrackingConfig, declaration
    from jbench.tracking.common import DEFAULT_SERVER_WAIT_S

    field = next(f for f in dataclasses.fields(TrackingConfig) if f.name == "server_wait_s")
    assert declaration(field) is False, field.metadata
    cfg, _ = compose(["tracking.server_wait_s=90"])
    assert cfg.tracking.server_wait_s == 90 and DEFAULT_SERVER_WAIT_S == TrackingConfig().server_wait_s


@pytest.mark.e2e
def test_the_sweep_tells_a_slow_server_from_a_down_one(slow_server, tmp_path):
    from .conftest import jbench_cli

    tiny = ["backend.n_prompt=8", "backend.n_gen=2", "backend.repetitions=1", "telemetry.source=none"]
    env = {"JBENCH_RESULTS_DIR": str(tmp_path / "r")}
    server = slow_server(60)
    res = jbench_cli(["sweep", f"tracking.uri={server.uri}", "tracking.server_wait_s=1", *tiny], env_extra=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"tracking server {server.uri}: it is up but too slow" in res.stderr and "refused" not in res.stderr
    assert "/health" in server.requests
    closed = f"http://127.0.0.1:{_closed_port()}"
    res = jbench_cli(["sweep", f"tracking.uri={closed}", *tiny], env_extra=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"tracking server {closed}: it does not answer: the connection was refused" in res.stderr
    assert "slow" not in res.stderr
    assert not (tmp_path / "r" / "mlflow.db").exists()


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
