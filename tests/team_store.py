"""A team store for tests, started the way a team starts one (docs/team-store.md): a real PostgreSQL cluster
(Debian's `postgresql` binaries, run as the unprivileged `postgres` user: initdb and postgres refuse root) with a
private data and socket directory, a free TCP port on loopback and password (SCRAM) authentication for the
`mlflow` role, behind a real `mlflow server --backend-store-uri postgresql://mlflow@... --artifacts-destination
DIR` (proxied artifacts: clients read and write `mlflow-artifacts:` through the server). The database password
reaches the server through a `~/.pgpass`-style file (PGPASSFILE), never through a URI.

Use the `team_store` fixture (one store per test module) or `TeamStore` directly:

    from .team_store import team_store  # noqa: F401  (the fixture)

    def test_x(team_store):
        MlflowClient(team_store.uri) ...
        team_store.kill_server(); team_store.start_server()   # an outage of the tracking server
        team_store.pg.stop(); team_store.pg.start()           # an outage of the database

Tests that use it start servers: mark them `e2e` (tests/conftest.py's fast-tier guard knows postgres and mlflow).
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

PG_USER = "postgres"  # the unprivileged system user Debian's postgresql package creates


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_bindir() -> Path:
    """The newest installed PostgreSQL's binaries (Debian keeps them in /usr/lib/postgresql/<major>/bin)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    pytest.fail("PostgreSQL is not installed: `apt-get install postgresql` (.ci/run installs it)")


class Postgres:
    """One private PostgreSQL cluster: a data directory, a socket directory and a loopback TCP port."""

    def __init__(self, base: Path, *, database: str = "mlflow", role: str = "mlflow"):
        self.base = base
        self.bindir = pg_bindir()
        self.data = base / "data"
        self.sockets = base / "sockets"
        self.log = base / "postgres.log"
        self.port = free_port()
        self.database, self.role = database, role
        self.password = secrets.token_hex(16)
        self.passfile = base / "pgpass"  # read by libpq in the mlflow server (PGPASSFILE), mode 0600
        self._as_user = {}
        if os.geteuid() == 0:
            self._as_user = {"user": PG_USER, "group": PG_USER, "extra_groups": []}

    @property
    def uri(self) -> str:
        """The SQLAlchemy URI `mlflow server` takes: no password in it (libpq reads it from the passfile)."""
        return f"postgresql://{self.role}@127.0.0.1:{self.port}/{self.database}"

    def _run(self, name: str, *args: str, input: Optional[str] = None) -> subprocess.CompletedProcess:
        env = {"PATH": f"{self.bindir}:/usr/bin:/bin", "LC_ALL": "C", "HOME": str(self.base)}
        res = subprocess.run([str(self.bindir / name), *args], input=input, capture_output=True, text=True,
                             cwd=self.base, env=env, timeout=120, **self._as_user)
        assert res.returncode == 0, f"{name} {' '.join(args)}: {res.stdout}{res.stderr}"
        return res

    def init(self) -> None:
        self.sockets.mkdir(mode=0o700)
        if self._as_user:
            for path in (self.base, self.sockets):
                shutil.chown(path, PG_USER, PG_USER)
        # The superuser only over the private socket; every TCP client with a password.
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--no-locale", "-E", "UTF8",
                  "--auth-local=trust", "--auth-host=scram-sha-256")
        self.start()
        self.psql(f"CREATE ROLE {self.role} LOGIN PASSWORD '{self.password}';\n"
                  f"CREATE DATABASE {self.database} OWNER {self.role};\n")
        self.passfile.write_text(f"127.0.0.1:{self.port}:{self.database}:{self.role}:{self.password}\n")
        self.passfile.chmod(0o600)

    def start(self) -> None:
        self._run("pg_ctl", "start", "-w", "-t", "120", "-D", str(self.data), "-l", str(self.log),
                  "-o", f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1")

    def stop(self, mode: str = "fast") -> None:
        """`fast`: a clean shutdown; `immediate`: the database dies (no checkpoint, recovery at the next start)."""
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "stop", "-w", "-t", "120", "-D", str(self.data), "-m", mode)

    def psql(self, sql: str, database: str = "postgres") -> str:
        """SQL as the superuser over the private socket (the SQL on stdin, so no password shows in `ps`)."""
        return self._run("psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", str(self.sockets),
                         "-p", str(self.port), "-U", "postgres", "-d", database, "-f", "-", input=sql).stdout


class TeamStore:
    """PostgreSQL + `mlflow server` with proxied artifacts; `uri` is what controllers set as MLFLOW_TRACKING_URI."""

    def __init__(self, workers: int = 2):
        # Not pytest's tmp_path: its directories are private to root, and the cluster runs as `postgres`.
        self.base = Path(tempfile.mkdtemp(prefix="jbench-team-store-"))
        self.base.chmod(0o755)
        self.pg = Postgres(self.base / "pg")
        (self.base / "pg").mkdir()
        self.artifacts = self.base / "artifacts"  # --artifacts-destination
        self.server_log = self.base / "mlflow-server.log"
        self.port = free_port()
        self.workers = workers
        self.server: Optional[subprocess.Popen] = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "TeamStore":
        self.pg.init()
        self.start_server()
        return self

    def server_argv(self) -> list[str]:
        mlflow = Path(sys.executable).with_name("mlflow")
        return [str(mlflow), "server", "--backend-store-uri", self.pg.uri, "--artifacts-destination",
                str(self.artifacts), "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(self.workers)]

    def start_server(self, timeout: float = 300) -> None:
        env = {**os.environ, "PGPASSFILE": str(self.pg.passfile), "MLFLOW_DISABLE_TELEMETRY": "true"}
        env.pop("MLFLOW_TRACKING_URI", None)
        with open(self.server_log, "ab") as log:
            self.server = subprocess.Popen(self.server_argv(), stdout=log, stderr=subprocess.STDOUT, cwd=self.base,
                                           env=env, start_new_session=True, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                # /health answers before the store is opened: ask for an experiment list (the database's answer).
                urllib.request.urlopen(f"{self.uri}/api/2.0/mlflow/experiments/search?max_results=1", timeout=5)
                return
            except OSError:
                if self.server.poll() is not None:
                    raise AssertionError(f"mlflow server exited: {self.server_log.read_text()[-3000:]}")
                assert time.monotonic() < deadline, f"mlflow server did not answer: {self.server_log.read_text()[-3000:]}"
                time.sleep(0.5)

    def kill_server(self, sig: int = signal.SIGKILL) -> None:
        """The server and its workers (one process group) end; the database and the artifacts stay."""
        if self.server is None:
            return
        try:
            os.killpg(self.server.pid, sig)
        except ProcessLookupError:
            pass
        self.server.wait(timeout=60)
        self.server = None

    def stop(self) -> None:
        try:
            self.kill_server(signal.SIGTERM)
        finally:
            try:
                self.pg.stop()
            finally:
                shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="module")
def team_store():
    store = TeamStore()
    try:
        store.start()
        yield store
    finally:
        store.stop()
