"""Writing results to MLflow: experiments, parent and child runs, params, metrics, tags, artifacts.

Layout in MLflow: one experiment per jbench experiment name; one parent run per sweep (tag
jbench.sweep_id); one child run per trial (tag mlflow.parentRunId). Everything is written through
MlflowClient batches, so a trial costs a handful of store round trips.

Nothing measured is lost when a tracking server dies: every run gets a jbench identity (tag
jbench.run_uid) and the Tracker keeps a journal of the writes of each open run. When the server stops
answering, the Tracker switches to a local spool store (results/spool/, a SQLite MLflow store), replays the
journal of every open run there (so a run half-written on the server is complete in the spool), and
sends every later write there. `jbench sync` (tracking.sync) uploads the spool once the server is back.

A new write method takes the run id (as the caller knows it) first and is decorated with `@run_write`;
it writes through `self.client` with the run id it is given and takes its timestamps from `self.now_ms()`
(a replay in the spool then records the original time, so `jbench sync` can tell a metric point the server
already has). That is all it takes to be journaled and spooled. A write to an experiment takes the experiment id first and is decorated with
`@experiment_write`.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sqlite3
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import sqlalchemy
from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

import jbench.tracking.artifacts  # noqa: F401  (local stores' mlflow-artifacts:/ locations)
from jbench.core.errors import UserError
from jbench.core.protocol import STORE_FORMAT_TAG
from jbench.tracking.format import check_tag, format_to_write
from jbench.tracking.resume_index import sqlite_path
from jbench.tracking.common import (
    _BATCH, DISK_FULL, LOCAL_ARTIFACTS, RUN_UID_TAG, _finite, disk_full, disk_spool_dir, free_space, is_remote,
    local_uri, param_value, redact, resolve_uri, spool_dir,
)

log = logging.getLogger("jbench")
# MLflow's SQL store logs every database error with its traceback before raising it; jbench handles what it raises
# (a full disk: the spool and one line), so that log stays quiet unless -v asks for MLflow's debug logs.
if not logging.getLogger("mlflow").isEnabledFor(logging.DEBUG):
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)

PARENT_UID_TAG = "jbench.parent_uid"  # the parent's identity: sync links a child to its parent on the server
SPOOLED_FOR_TAG = "jbench.spooled_for"  # on a spool run: the server it was meant for
_SPOOL_PREFIX = "spool:"  # experiment ids handed out while spooling (never confused with the server's)

_DOWN_MARKERS = ("Max retries exceeded", "Connection refused", "Failed to establish", "Connection aborted",
                 "RemoteDisconnected", "Read timed out", "too many 50", "Connection reset", "timed out")


class StoreError(UserError):
    """The results store cannot be created, completed or written (a full disk): one line naming the fix, exit 2."""


def _why(exc: BaseException) -> str:
    """What a failed store write says, in a few words: "no space left on the device" for a full disk."""
    if disk_full(exc):
        return "no space left on the device"
    return str(getattr(exc, "orig", None) or exc).splitlines()[0][:300]


def create_sqlite_store(path: Path) -> None:
    """A new SQLite store, made whole or not at all: MLflow creates its tables and runs its migrations in a file
    beside `path`, which is then linked into place. A controller killed meanwhile (SIGKILL, power loss) or a disk that
    fills leaves a stray temporary file at most, never a half-migrated store on which every later command fails (a
    full disk: StoreError, the temporary file removed). Two controllers creating the same store at once: the first
    link wins, the other's file is dropped."""
    from mlflow.tracking._tracking_service.utils import _get_store

    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.creating")
    try:
        store = _get_store(f"sqlite:///{tmp}")  # MLflow's own store for a URI: tables, migrations, Default
        store.engine.dispose()  # the file is complete and closed before it is linked
        try:
            os.link(tmp, path)  # no overwrite: a store someone else finished first stays
        except FileExistsError:
            pass
    except Exception as exc:
        if not disk_full(exc) and not isinstance(exc, OSError):
            raise
        tmp.unlink(missing_ok=True)  # before the free space is measured for the message
        raise StoreError(f"cannot create the results store {path}: {_why(exc)} ({free_space(path.parent)}); "
                         "nothing was recorded. Free some space there, or set tracking.results_dir (or "
                         "$JBENCH_RESULTS_DIR) to a directory with room") from None
    finally:
        tmp.unlink(missing_ok=True)


def complete_sqlite_store(path: Path) -> None:
    """An existing SQLite store whose schema is behind what MLflow needs (its creation or an upgrade stopped part
    way, e.g. by a full disk under an earlier jbench or MLflow) is completed on a copy beside it, which then replaces
    it: the store is whole before and after, never half. StoreError (one line) when it cannot be completed; a store
    of a newer MLflow is refused the same way."""
    from mlflow.store.db import utils as db_utils

    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            row = con.execute("SELECT version_num FROM alembic_version").fetchone() \
                if "alembic_version" in tables else None
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"the results store {path} is not an SQLite database MLflow can read ({exc}): move it away "
                         "(a new store is made in its place) or point tracking.results_dir elsewhere") from None
    current, head = (row[0] if row else None), db_utils._get_latest_schema_revision()
    if current == head:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.completing")
    try:
        shutil.copy2(path, tmp)
        engine = sqlalchemy.create_engine(f"sqlite:///{tmp}")
        try:
            if db_utils._all_tables_exist(engine):
                db_utils._upgrade_db(engine)
            else:
                db_utils._initialize_tables(engine)  # the tables a stopped creation lacks, then the migrations
        finally:
            engine.dispose()
        os.replace(tmp, path)
    except Exception as exc:
        tmp.unlink(missing_ok=True)  # before the free space is measured for the message
        if "Can't locate revision" in str(exc):
            import mlflow

            raise StoreError(f"the results store {path} was written by a newer MLflow (schema {current}, unknown to "
                             f"MLflow {mlflow.__version__} here): read it with the jbench that wrote it") from None
        raise StoreError(f"the results store {path} is incomplete (its creation or upgrade stopped at schema "
                         f"{current or 'none'}; MLflow needs {head}) and could not be completed: {_why(exc)} "
                         f"({free_space(path.parent)}). Free some space there and run jbench again (it completes the "
                         "store), or move the store away") from None
    finally:
        tmp.unlink(missing_ok=True)
    log.warning("completed the results store %s (schema %s -> %s)", path, current, head)


def open_sqlite_store(path: Path) -> None:
    """The local store at `path` made (whole) when missing, completed when an earlier creation stopped part way."""
    if os.path.exists(path):
        complete_sqlite_store(path)
    else:
        create_sqlite_store(path)


def unreachable(exc: BaseException) -> bool:
    """True when `exc` (or what caused it) says the tracking server did not answer, not that it refused a request.
    A 5xx answer counts as no answer: MLflow's client retries 500/502/503/504 and then fails with "too many 5xx
    error responses"; an `mlflow server` whose database is down answers every store request with HTTP 503
    (measured, docs/team-store.md) and comes back by itself with the database."""
    import requests

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError,
                            TimeoutError)):
            return True
        if any(m in str(exc) for m in _DOWN_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def run_write(fn: Callable) -> Callable:
    """A write to one run, run id first: journaled while the run is open, spooled once the server is gone."""

    @functools.wraps(fn)
    def wrapper(self: "Tracker", run_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._dispatch(fn, run_id, args, kwargs)

    return wrapper


def experiment_write(fn: Callable) -> Callable:
    """A write to one experiment, experiment id first: goes to the spool's experiment once the server is gone
    (`jbench sync` copies experiment tags)."""

    @functools.wraps(fn)
    def wrapper(self: "Tracker", experiment_id: str, *args: Any, **kwargs: Any) -> Any:
        if self.spooling is None:
            try:
                return fn(self, experiment_id, *args, **kwargs)
            except Exception as exc:
                if not self._lost(exc):
                    raise
                self._fail_over(exc)
        return fn(self, self._spool_experiment(experiment_id), *args, **kwargs)

    return wrapper


class Tracker:
    def __init__(self, uri: Optional[str] = None, results_dir: str | Path = "results", *, spool: bool = False,
                 notify: Callable[[str], None] = lambda message: None):
        self.results_dir = Path(results_dir).expanduser().resolve()
        self.uri = resolve_uri(uri, self.results_dir)
        self.notify = notify
        self._remote = is_remote(self.uri)
        self.spooling: Optional[str] = None  # why writes go to the spool (None: to self.uri)
        self.spool_uri = local_uri(spool_dir(self.results_dir))
        self._journal: dict[str, list[tuple]] = {}  # open run id -> its creation, then its writes
        self._run_ids: dict[str, str] = {}  # run id on the server -> the same run in the spool
        self._experiments: dict[str, str] = {}  # experiment id on the server -> its name
        self._uids: dict[str, str] = {}  # run id (server or spool) -> its jbench.run_uid
        self._spool_runs: set[str] = set()  # runs created in the spool
        self._clock: Optional[int] = None  # the original time of the write being replayed
        if self.uri.startswith("sqlite:"):
            path = sqlite_path(self.uri)
            try:
                self.results_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot create {self.results_dir}: {_why(exc)}") from None
            if path is not None:
                open_sqlite_store(Path(path))
        self.client = MlflowClient(tracking_uri=self.uri)
        self._local_store = self.uri.startswith(("sqlite:", "file:")) or "://" not in self.uri
        if spool:
            self._fail_over(None)

    @property
    def shown_uri(self) -> str:
        """The tracking URI as jbench prints and records it: a password in it is ***."""
        return redact(self.uri)

    @property
    def target_uri(self) -> str:
        """Where writes go now: the tracking URI, or the spool once the server is gone."""
        return self.spool_uri if self.spooling is not None else self.uri

    # -- experiments and runs ------------------------------------------------------------------

    def experiment_id(self, name: str) -> str:
        if self.spooling is None:
            try:
                exp_id = self._experiment_id(name)
                self._experiments[exp_id] = name
                return exp_id
            except Exception as exc:
                if not self._lost(exc):
                    raise
                self._fail_over(exc)
        return _SPOOL_PREFIX + self._experiment_id(name)

    def _experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            return exp.experiment_id
        location = None
        if self._local_store or self.spooling is not None:
            # Not an absolute path: artifacts live in artifacts/ beside the store, wherever it is moved
            # (jbench.tracking.artifacts), never in ./mlruns of whatever the cwd is.
            location = LOCAL_ARTIFACTS + name
        return self.client.create_experiment(name, artifact_location=location)

    def _spool_experiment(self, experiment_id: str) -> str:
        if experiment_id.startswith(_SPOOL_PREFIX):
            return experiment_id[len(_SPOOL_PREFIX):]
        return self._experiment_id(self._experiments[experiment_id])

    def start_run(
        self,
        experiment_id: str,
        name: str,
        *,
        parent_run_id: Optional[str] = None,
        params: Optional[dict[str, Any]] = None,
        tags: Optional[dict[str, Any]] = None,
    ) -> str:
        """A new run with its jbench identity (tag jbench.run_uid), created in one call with its name and parent."""
        creation = (experiment_id, name, parent_run_id, uuid.uuid4().hex, int(time.time() * 1000))
        run_id = None
        if self.spooling is None:
            try:
                run_id = self._create(*creation)
            except Exception as exc:
                if not self._lost(exc):
                    raise
                self._fail_over(exc)
        if run_id is None:
            run_id = self._create(*creation)
        else:
            self._journal[run_id] = [creation]
        self.log(run_id, params=params, tags=tags)
        return run_id

    def _create(self, experiment_id: str, name: str, parent_run_id: Optional[str], uid: str, start: int) -> str:
        run_tags = {MLFLOW_RUN_NAME: name, RUN_UID_TAG: uid}
        if self.spooling is not None:
            experiment_id = self._spool_experiment(experiment_id)
            run_tags[SPOOLED_FOR_TAG] = self.shown_uri  # never a password: `jbench sync` asks for the URI then
        if parent_run_id:
            run_tags[MLFLOW_PARENT_RUN_ID] = self._run_ids.get(parent_run_id, parent_run_id)
            parent_uid = self._uids.get(parent_run_id)
            if parent_uid:
                run_tags[PARENT_UID_TAG] = parent_uid
        run = self.client.create_run(experiment_id, start_time=start, run_name=name, tags=run_tags)
        self._uids[run.info.run_id] = uid
        if self.spooling is not None:
            self._spool_runs.add(run.info.run_id)
        return run.info.run_id

    def now_ms(self) -> int:
        """The time of the write being made (its original time while it is replayed into the spool)."""
        return self._clock if self._clock is not None else int(time.time() * 1000)

    def _dispatch(self, fn: Callable, run_id: str, args: tuple, kwargs: dict) -> Any:
        self._clock = at = int(time.time() * 1000)
        try:
            if self.spooling is None:
                try:
                    result = fn(self, run_id, *args, **kwargs)
                except Exception as exc:
                    if not self._lost(exc):
                        raise
                    self._fail_over(exc)  # replays the journal; this write follows in the spool
                    self._clock = at
                else:
                    if run_id in self._journal:
                        if fn.__name__ == "end_run":
                            del self._journal[run_id]  # complete on the server: nothing to replay
                        else:
                            self._journal[run_id].append((at, fn, args, kwargs))
                    return result
            target = self._run_ids.get(run_id, run_id)
            if target not in self._spool_runs:
                raise RuntimeError(f"run {run_id} is on {self.shown_uri}, which does not answer, and was not opened "
                                   "by this sweep: it cannot be spooled; retry once the server is back")
            return fn(self, target, *args, **kwargs)
        finally:
            self._clock = None

    def _lost(self, exc: BaseException) -> bool:
        """The store stopped taking writes in a way the spool covers: a server that does not answer, or a local store
        whose disk is full (its spool then lives on another filesystem: disk_spool_dir)."""
        return (self._remote and unreachable(exc)) or (self._local_store and disk_full(exc))

    @property
    def disk_full(self) -> bool:
        """The local store's disk filled: writes go to the spool in jbench's cache (the workflow stops)."""
        return self.spooling == DISK_FULL

    def _fail_over(self, exc: Optional[BaseException]) -> None:
        """Send every write to the spool from now on, and re-create there every run still open on the server (or on
        the local store whose disk is full)."""
        full = exc is not None and not self._remote and disk_full(exc)
        self.spooling = DISK_FULL if full else "at start" if exc is None else f"{type(exc).__name__}"
        spool = disk_spool_dir(self.results_dir) if full else spool_dir(self.results_dir)
        self.spool_uri = local_uri(spool)
        try:
            spool.mkdir(parents=True, exist_ok=True)
            path = sqlite_path(self.spool_uri)
            if path is not None and not os.path.exists(path):
                create_sqlite_store(Path(path))
        except (StoreError, OSError) as again:
            if not full:
                raise
            raise StoreError(f"disk full: the results store {self.shown_uri} has no space left ("
                             f"{free_space(self.results_dir)}) and the spool {spool} cannot take what was measured "
                             f"either ({_why(again)}). Free some space and run the same command again: it resumes"
                             ) from None
        self.client = MlflowClient(tracking_uri=self.spool_uri)
        for run_id, entries in list(self._journal.items()):
            self._run_ids[run_id] = self._create(*entries[0])
            for at, fn, args, kwargs in entries[1:]:
                self._clock = at
                fn(self, self._run_ids[run_id], *args, **kwargs)
        self._clock = None
        self._journal.clear()
        if full:
            self.notify(f"disk full: {self.shown_uri} has no space left ({free_space(self.results_dir)}); what was "
                        f"measured is kept in the spool {spool} and no further trial starts")
        else:
            self.notify(f"tracking server {self.shown_uri} does not answer; measuring on into the spool {spool} "
                        f"(`jbench sync` uploads it once the server is back)")

    @run_write
    def log(
        self,
        run_id: str,
        *,
        params: Optional[dict[str, Any]] = None,
        tags: Optional[dict[str, Any]] = None,
        metrics: Optional[dict[str, float]] = None,
        stepped: Optional[dict[str, Iterable[float]]] = None,
    ) -> None:
        """Params, tags and metrics in as few batches as MLflow allows. NaN metrics are skipped:
        a missing measurement stays missing (its reason is a tag), it is never logged as a number."""
        now = self.now_ms()
        p = [Param(k, param_value(v)) for k, v in (params or {}).items()]
        t = [RunTag(k, param_value(v)) for k, v in (tags or {}).items()]
        m = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items() if _finite(v)]
        for key, values in (stepped or {}).items():
            m += [Metric(key, float(v), now, step) for step, v in enumerate(values) if _finite(v)]
        while p or t or m:
            self.client.log_batch(run_id, metrics=m[:1000], params=p[:_BATCH], tags=t[:_BATCH])
            p, t, m = p[_BATCH:], t[_BATCH:], m[1000:]

    @run_write
    def log_series(self, run_id: str, series: dict[str, list[tuple[float, float]]]) -> None:
        """Time series as metrics with their own timestamps (epoch seconds), one step per sample,
        so the MLflow UI charts them against wall time (e.g. system/device/power_w)."""
        metrics = [Metric(key, float(v), int(t * 1000), step)
                   for key, points in series.items() for step, (t, v) in enumerate(points) if _finite(v)]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(run_id, metrics=metrics[i:i + 1000])

    @run_write
    def log_files(self, run_id: str, files: Iterable[tuple[str, Path]]) -> None:
        """Existing files as artifacts: (artifact dir, '' for the root; local path) pairs."""
        for artifact_dir, path in files:
            self.client.log_artifact(run_id, str(path), artifact_path=artifact_dir or None)

    @run_write
    def log_texts(self, run_id: str, files: dict[str, str]) -> None:
        """Artifacts given as {relative path: text}, uploaded in one call."""
        if not files:
            return
        with tempfile.TemporaryDirectory(prefix="jbench-artifacts-") as tmp:
            for rel, text in files.items():
                path = Path(tmp) / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            self.client.log_artifacts(run_id, tmp)

    def running_runs(self, experiment_id: str) -> list[tuple[str, dict[str, str], dict[str, str]]]:
        """(run id, tags, params) of the experiment's runs still marked RUNNING."""
        if self.spooling is None:
            try:
                return self._running_runs(experiment_id)
            except Exception as exc:
                if not self._lost(exc):
                    raise
                self._fail_over(exc)
        return self._running_runs(self._spool_experiment(experiment_id))

    def _running_runs(self, experiment_id: str) -> list[tuple[str, dict[str, str], dict[str, str]]]:
        runs = self.client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'",
                                       max_results=10000)
        return [(r.info.run_id, dict(r.data.tags), dict(r.data.params)) for r in runs]

    @run_write
    def end_run(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status=RunStatus.to_string(RunStatus.from_string(status)),
                                   end_time=self.now_ms())

    # -- the record as MLflow users read it (run id first) -----------------------------------------

    @experiment_write
    def describe_experiment(self, experiment_id: str, description: str) -> None:
        """The experiment's description (the UI's About panel), its kind (MLflow 3 opens an experiment on its GenAI
        pages, "Traces 0", unless `mlflow.experimentKind` says it holds model runs) and jbench's store format;
        StoreFormatError when a newer jbench wrote it."""
        tags = {"mlflow.experimentKind": "custom_model_development"}
        if description:
            tags["mlflow.note.content"] = description
        exp = self.client.get_experiment(experiment_id)
        found = exp.tags.get(STORE_FORMAT_TAG)
        check_tag(found, f"experiment '{exp.name}' in {self.shown_uri}")  # never write into a newer jbench's record
        if format_to_write(found):
            tags[STORE_FORMAT_TAG] = format_to_write(found)
        for key, value in tags.items():
            if exp.tags.get(key) != value:
                self.client.set_experiment_tag(experiment_id, key, value)

    @run_write
    def log_table(self, run_id: str, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Rows as an MLflow table artifact (the UI's artifact view and Evaluation tab show it as a table)."""
        import pandas as pd

        self.client.log_table(run_id, data=pd.DataFrame(rows), artifact_file=artifact_file)

    def run_record(self, run_id: str) -> dict[str, Any]:
        """{"status", "params", "tags", "metrics"} of a run; empty when the server does not answer (the
        Tracker then spools) or, while spooling, for a run that lives only on the server."""
        empty: dict[str, Any] = {"status": "", "params": {}, "tags": {}, "metrics": {}}
        try:
            run = self.client.get_run(self._run_ids.get(run_id, run_id))
        except Exception as exc:
            if self.spooling is not None:
                return empty
            if not self._lost(exc):
                raise
            self._fail_over(exc)
            return empty
        return {"status": run.info.status, "params": dict(run.data.params), "tags": dict(run.data.tags),
                "metrics": dict(run.data.metrics)}

    def reopen_run(self, run_id: str) -> None:
        """A KILLED sweep's parent back to RUNNING: a resumed sweep records its trials under it. Its failure
        reason goes (the caller records what it was as jbench.resumed_after). The reopened run is journaled
        like a new one, so a server outage from here on re-creates it in the spool under its own jbench.run_uid
        and `jbench sync` completes the server's copy."""
        run = self.client.get_run(run_id)
        self.client.update_run(run_id, status="RUNNING")
        if "jbench.failure_reason" in run.data.tags:
            self.client.delete_tag(run_id, "jbench.failure_reason")
        uid = run.data.tags.get(RUN_UID_TAG)
        if not uid:  # recorded before runs had an identity
            uid = uuid.uuid4().hex
            self.client.set_tag(run_id, RUN_UID_TAG, uid)
        self._uids[run_id] = uid
        self._journal[run_id] = [(run.info.experiment_id, run.info.run_name, None, uid, run.info.start_time)]

