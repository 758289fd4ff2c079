"""MLflow access shared by the writer and the reader: the store's URI, checks that need no MLflow
(server health, writable paths), value conversions and the quiet switches for MLflow itself.

The `jbench.tracking` package is the only place that imports mlflow; this module does not import it,
so the checks before a sweep cost milliseconds.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import os
import shutil
import socket
import sqlite3
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional
from urllib.parse import unquote

from jbench.core.paths import cache_dir
from jbench.core.schema import TrackingConfig

# MLflow 3 sends usage telemetry of its own by default; jbench does not phone home for its users.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# MLflow's REST client retries 7 times with exponential backoff and a 120 s timeout (about 4 minutes before
# it gives up on a dead server). jbench spools to a local store instead, so it wants to know in seconds.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
# MLflow's own output never reaches jbench's terminal: no artifact progress bars, no "View run" lines,
# no logging configuration of its own (jbench's -v shows MLflow's logs through jbench's handler).
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")

# MLflow's limits on a param value and on batch sizes.
_MAX_PARAM_LEN = 6000
_BATCH = 100

STATUS_FINISHED = "FINISHED"
STATUS_FAILED = "FAILED"
STATUS_KILLED = "KILLED"

RUN_UID_TAG = "jbench.run_uid"  # jbench's identity of a run, the same on the server and in the spool
SYNCED_TAG = "jbench.synced_to"  # on a spool run once `jbench sync` uploaded it: the server's run id
SPOOL_DIR = "spool"  # under the results directory: a local store that holds what a server did not get
LOCAL_ARTIFACTS = "mlflow-artifacts:/"  # experiments of a local store keep artifacts beside the store


def resolve_uri(uri: Optional[str], results_dir: str | Path) -> str:
    """tracking.uri if set, else $MLFLOW_TRACKING_URI, else SQLite in results_dir."""
    if uri:
        return uri
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return local_uri(results_dir)


# A database URI (what `mlflow server --backend-store-uri` takes) given to jbench itself: refused with the fix.
# Controllers write through a tracking server: it holds the database credentials, proxies the artifacts
# (`--artifacts-destination`) and is what the spool fails over from; see docs/team-store.md.
DATABASE_SCHEMES = ("postgresql", "postgres", "mysql", "mssql")


def redact(uri: str) -> str:
    """`uri` with the password of its user part (and any `password=` query value) replaced by ***:
    what jbench prints, records in tags and puts in error messages."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(uri)
        password = parts.password
    except ValueError:
        return uri
    netloc = parts.netloc
    if password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.split(':', 1)[0]}:***@{host}"
    query = "&".join(f"{q.split('=', 1)[0]}=***" if q.lower().startswith(("password=", "sslpassword=")) else q
                     for q in parts.query.split("&")) if parts.query else parts.query
    if netloc == parts.netloc and query == parts.query:
        return uri
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def database_problem(uri: str, source: str = "the tracking URI") -> Optional[str]:
    """Why jbench does not write or read a database URI itself (with the fix), or None for any other URI."""
    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower() if "://" in uri else ""
    if scheme not in DATABASE_SCHEMES:
        return None
    return (f"{source} {redact(uri)} is a database, not a tracking server: jbench writes through an `mlflow server` "
            f"(it holds the database password, serves the artifacts, and a controller spools when it is down). "
            f"Start `mlflow server --backend-store-uri {redact(uri)} --artifacts-destination DIR` and set "
            f"tracking.uri / $MLFLOW_TRACKING_URI to http://HOST:PORT (docs/team-store.md)")


def local_uri(results_dir: str | Path) -> str:
    db = Path(results_dir).expanduser().resolve() / "mlflow.db"
    return f"sqlite:///{db}"


def spool_dir(results_dir: str | Path) -> Path:
    return Path(results_dir).expanduser().resolve() / SPOOL_DIR


DISK_FULL = "disk full"  # Tracker.spooling when a local store's disk filled


def disk_spool_dir(results_dir: str | Path) -> Path:
    """Where a local store's writes go when its disk is full: a spool in jbench's cache directory (another
    filesystem, usually: the user's home, not a results disk), one per results directory. The next sweep on that
    store uploads it first (`jbench sync` does too)."""
    key = hashlib.sha256(str(Path(results_dir).expanduser().resolve()).encode()).hexdigest()[:16]
    return cache_dir() / "spool" / key


def is_remote(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def local_path(uri: str) -> Optional[Path]:
    """The file or directory of a local store's URI (None for a server)."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):])
    if uri.startswith("file:"):
        from urllib.parse import urlparse

        return Path(urlparse(uri).path)
    if "://" not in uri:
        return Path(uri)
    return None


def artifacts_root(tracking_uri: str) -> Optional[Path]:
    """Where a local SQLite store keeps its `mlflow-artifacts:/` artifacts: `artifacts/` beside the database,
    wherever the store now lives (so a moved store finds them)."""
    if tracking_uri.startswith("sqlite:///"):
        return Path(tracking_uri[len("sqlite:///"):]).parent / "artifacts"
    return None


def param_value(value: Any) -> str:
    if value is None:
        text = "null"
    elif isinstance(value, (list, dict)):
        text = json.dumps(value, sort_keys=True)
    else:
        text = str(value)
    return text if len(text) <= _MAX_PARAM_LEN else text[: _MAX_PARAM_LEN - 3] + "..."

def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def store_exists(uri: str) -> bool:
    """False for a local SQLite or file store that was never created (reading must not create one);
    True for anything else (a server is asked, not guessed)."""
    path = local_path(uri)
    return True if path is None else path.exists()


# -- checks before anything runs (no MLflow import) ----------------------------------------------------

# How long a tracking server that is slow (a request timed out) is given at the start before it counts as not
# answering; tracking.server_wait_s sets it per sweep (TrackingConfig's default is this value). A server that refuses
# the connection, or a host name that does not resolve, is down at once: waiting would not help.
DEFAULT_SERVER_WAIT_S = TrackingConfig().server_wait_s
# The first request's timeout; each retry after a timeout doubles it, within what is left of the wait.
_FIRST_TIMEOUT_S = 3.0


class _Slow(Exception):
    """A request to the server timed out (it may only be slow)."""


def _timed_out(exc: BaseException) -> bool:
    reason = getattr(exc, "reason", None) if isinstance(exc, urllib.error.URLError) else exc
    return isinstance(reason, (TimeoutError, socket.timeout))


def _down(exc: BaseException) -> str:
    """What a request that failed without a timeout says about the server: it is down (or not there)."""
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, ConnectionRefusedError):
        return "it does not answer: the connection was refused (down: nothing listens there)"
    if isinstance(reason, socket.gaierror):
        return f"it does not answer: its host name does not resolve ({reason.strerror or reason})"
    return f"it does not answer ({reason})"


def _request(request: "urllib.request.Request", deadline: float, timeout: float, timed_out: list[float]) -> tuple[int, float]:
    """GET `request` and read its body; a timeout is retried with twice the timeout while `deadline` (monotonic) is
    not reached (the first attempt is always made, with `timeout`). Returns (HTTP status, the timeout that
    sufficed); raises _Slow when the time is spent, and HTTPError, URLError or OSError (other than a timeout) at once.
    `timed_out` gets the timeout of each attempt that timed out."""
    while True:
        left = deadline - time.monotonic()
        attempt = timeout if not timed_out or left >= timeout else max(left, 0.05)
        try:
            with urllib.request.urlopen(request, timeout=attempt) as resp:
                resp.read()  # within the same timeout: a server slow to send its answer is slow
                return resp.status, attempt
        except urllib.error.HTTPError:
            raise
        except (urllib.error.URLError, OSError) as exc:
            if not _timed_out(exc):
                raise
        timed_out.append(attempt)
        if deadline - time.monotonic() <= 0:
            raise _Slow()
        timeout *= 2


def server_problem(uri: str, timeout: float = _FIRST_TIMEOUT_S, *, wait_s: Optional[float] = None) -> Optional[str]:
    """Why the MLflow server at `uri` cannot be used, or None when its /health and its store answer (local stores:
    None).

    Slow is not down: a request that times out is asked again, each time with twice the timeout (the first:
    `timeout`), until `wait_s` seconds (None: DEFAULT_SERVER_WAIT_S, tracking.server_wait_s) have passed since the
    check began; a server that answers within them is used. A refused connection or a host name that does not
    resolve is down at once. The message says which it was."""
    if not is_remote(uri):
        return None
    from urllib.parse import urlsplit, urlunsplit

    wait = DEFAULT_SERVER_WAIT_S if wait_s is None else max(0.0, float(wait_s))
    deadline = time.monotonic() + wait
    timed_out: list[float] = []

    def slow() -> str:
        return (f"it is up but too slow: no answer within {max(wait, timed_out[0]):g} s ({len(timed_out)} request(s) "
                f"timed out, the last after {timed_out[-1]:g} s); tracking.server_wait_s=SECONDS gives it longer")

    try:
        parts = urlsplit(uri)
        request = urllib.request.Request(urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
                                         .rstrip("/") + "/health")
        if parts.username is not None:  # http://USER:PASSWORD@HOST: the same basic auth MLflow's client sends
            import base64

            token = base64.b64encode(f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        status, enough = _request(request, deadline, timeout, timed_out)
        if status != 200:
            return f"its /health answered HTTP {status}"
    except _Slow:
        return slow()
    except urllib.error.HTTPError as exc:
        return f"its /health answered HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        return _down(exc)
    # /health answers without the store: with its database down the server answers every store request with
    # HTTP 503 (measured, docs/team-store.md). Ask the store once; only a 5xx counts (auth is checked later).
    request.full_url = request.full_url[:-len("/health")] + "/api/2.0/mlflow/experiments/search?max_results=1"
    try:
        _request(request, deadline, enough, timed_out)  # with the timeout /health needed: no need to learn it again
        return None
    except _Slow:
        return slow()
    except urllib.error.HTTPError as exc:
        if exc.code < 500:
            return None
        try:
            code = json.loads(exc.read() or b"{}").get("error_code") or ""
        except ValueError:
            code = ""
        return f"it answers, but its store does not (HTTP {exc.code} {code}; is the server's database up?)"
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        return _down(exc)


def writable_problem(path: str | Path, *, directory: bool = True) -> Optional[str]:
    """Why `path` (a directory to create or fill, or a file to write) cannot be written, or None.
    Tries a real file in the nearest existing directory: permission bits lie for root and on read-only mounts."""
    path = Path(path).expanduser()
    try:
        path = path.resolve()
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    if path.exists():
        if directory and not path.is_dir():
            return f"{path} is a file, not a directory"
        if not directory and path.is_dir():
            return f"{path} is a directory, not a file"
        if not directory and not os.access(path, os.W_OK):
            return f"{path} is not writable"
    probe = path if path.is_dir() else path.parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, so {path} cannot be created"
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".jbench-write-check-"):
            pass
    except OSError as exc:
        where = f"{probe}" if probe == path else f"{path} cannot be created: {probe}"
        return f"{where} is not writable ({exc.strerror or exc})"
    return None


# What a store needs on disk, measured with the embedded default (MLflow 3, `jbench sweep +experiment=quant_ladder
# backend.n_prompt=16 backend.n_gen=32 backend.repetitions=3`): a new, empty mlflow.db is 954,368 bytes; each trial
# then added about 25 kB to the database (params, tags, metrics) and 20-24 kB of artifacts beside it. A Jetson's
# telemetry series add more, so the per-trial figure is a floor.
NEW_STORE_BYTES = 954_368
TRIAL_BYTES = 50_000


def disk_full(exc: Optional[BaseException]) -> bool:
    """True when `exc` (or what caused it) says the disk is full: ENOSPC/EDQUOT, or SQLite's "database or disk is
    full" (SQLAlchemy wraps it)."""
    import errno

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "database or disk is full" in str(exc) or "No space left on device" in str(exc):
            return True
        exc = getattr(exc, "orig", None) or exc.__cause__ or exc.__context__
    return False


def _existing(path: Path) -> Path:
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_space(path: str | Path) -> str:
    """How much room the filesystem holding `path` (or its nearest existing parent) has, in words."""
    try:
        free = shutil.disk_usage(_existing(Path(path))).free
    except OSError as exc:
        return f"free space unknown: {exc.strerror or exc}"
    return f"{_size(free)} free on the filesystem of {path}"


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def space_problem(db: Path, trials: int) -> Optional[str]:
    """Why the filesystem of a local store `db` has no room for a sweep of `trials` trials (a new store, if there is
    none yet, plus TRIAL_BYTES each), or None."""
    need = (0 if db.exists() else NEW_STORE_BYTES) + max(trials, 1) * TRIAL_BYTES
    try:
        free = shutil.disk_usage(_existing(db.parent)).free
    except OSError:
        return None  # nothing to measure with: the write checks still stand
    if free >= need:
        return None
    what = "a new results store and " if not db.exists() else ""
    return (f"only {_size(free)} free on the filesystem of {db.parent}; {what}{max(trials, 1)} trial(s) need about "
            f"{_size(need)} ({'a new store takes ' + _size(NEW_STORE_BYTES) + ', ' if not db.exists() else ''}"
            f"each trial at least {_size(TRIAL_BYTES)})")


def out_of_room(uri: str) -> Optional[str]:
    """Why a local store's filesystem cannot take one more trial (less than TRIAL_BYTES free), or None (a server, or
    room enough). Asked before each trial: the store's writes trail the measurements, so its own error comes late."""
    db = local_path(uri)
    if db is None:
        return None
    try:
        free = shutil.disk_usage(_existing(db.parent)).free
    except OSError:
        return None
    return f"only {_size(free)} free on the filesystem of {db.parent}" if free < TRIAL_BYTES else None


def _artifact_locations(db: Path) -> list[str]:
    """The `file:` artifact locations of a local store's experiments (read-only, no MLflow)."""
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT artifact_location FROM experiments WHERE experiment_id != '0'").fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return []
    return [r[0] for r in rows if r[0] and str(r[0]).startswith("file:")]


def store_problem(uri: str, results_dir: str | Path, trials: int = 1) -> Optional[str]:
    """Why a sweep of `trials` trials cannot write to a local store (the results directory, the database, the
    artifact locations of its experiments, the room on its filesystem), or None. A server is checked by
    `server_problem`."""
    db = local_path(uri)
    if db is None:
        return writable_problem(spool_dir(results_dir))  # where the spool would go if the server dies
    problem = writable_problem(db.parent)
    if problem is None and uri.startswith("sqlite:"):
        problem = space_problem(db, trials)
    if problem is None and db.exists() and uri.startswith("sqlite:"):
        problem = writable_problem(db, directory=False)
    if problem is None and uri.startswith("sqlite:"):
        root = artifacts_root(uri)
        problem = writable_problem(root) if root else None
        for location in _artifact_locations(db) if db.exists() else []:
            problem = problem or writable_problem(local_path(location) or location)
    return problem


def runs_view_url(server_url: str, experiment_id: str) -> str:
    """The link that opens an experiment on its runs table in the MLflow UI. MLflow 3.17's UI picks GenAI
    pages or model-training pages from its `workflowType` (URL parameter, else the browser's last choice,
    GenAI by default), not from the experiment's `mlflow.experimentKind` tag, so the link names it."""
    return f"{server_url.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
