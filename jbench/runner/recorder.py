"""How runs are written: the only place that knows the run layout (a parent run per sweep, a child run per trial, their
tags and artifacts), behind a small tracker protocol (jbench.tracking.writer.Tracker implements it).

Writing happens behind the trials: every write is queued and one writer thread (started through the scheduler)
performs them in order, so a measurement never waits for the earlier trials' metrics, series and artifacts to be
written (or for a slow server). A trial's run is created before the trial starts (`start_trial` waits for that
alone: creations go ahead of queued writes), so a controller killed mid-trial leaves the run RUNNING for the next
start to mark KILLED. The tracker itself is made in the writer. `flush()` waits for every queued write and raises
what the writer could not do. While a measurement on this machine runs (`quiet()`), the writer starts
nothing new: MLflow's CPU time must not share the cores with the benchmark it records.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Protocol

from jbench.core.errors import UserError
from jbench.core.identity import HASH_VERSION, identity_params
from jbench.core.results import Result
from jbench.core.trial import Trial
from jbench.runner.scheduler import background

log = logging.getLogger("jbench")

SUMMARY_TABLE = "summary.json"  # the parent's per-trial table (MLflow table artifact)


class Tracker(Protocol):
    """What the recorder needs from a store (jbench.tracking.writer.Tracker)."""

    uri: str

    def experiment_id(self, name: str) -> str: ...
    def describe_experiment(self, experiment_id: str, description: str) -> None: ...
    def start_run(self, experiment_id: str, name: str, *, parent_run_id: Optional[str] = None,
                  params: Optional[dict] = None, tags: Optional[dict] = None) -> str: ...
    def log(self, run_id: str, *, params: Optional[dict] = None, tags: Optional[dict] = None,
            metrics: Optional[dict] = None, stepped: Optional[dict] = None) -> None: ...
    def log_series(self, run_id: str, series: dict) -> None: ...
    def log_texts(self, run_id: str, files: dict[str, str]) -> None: ...
    def log_table(self, run_id: str, rows: list[dict], artifact_file: str) -> None: ...
    def end_run(self, run_id: str, status: str) -> None: ...
    def running_runs(self, experiment_id: str) -> list[tuple[str, dict, dict]]: ...
    def run_record(self, run_id: str) -> dict[str, Any]: ...
    def reopen_run(self, run_id: str) -> None: ...


# -- who is recording: a controller that died leaves runs RUNNING; the next start marks them KILLED -----------


def _proc_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return ""


def controller_id() -> str:
    """This controller as host:pid:start, recorded on every run so a later start can tell it died."""
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{_proc_start(pid)}"


def controller_gone(owner: str) -> Optional[str]:
    """Why the controller named host:pid:start is gone, or None when it may be alive (or runs elsewhere)."""
    host, _, rest = owner.partition(":")
    pid_text, _, start = rest.partition(":")
    if host != socket.gethostname() or not pid_text.isdigit():
        return None
    pid = int(pid_text)
    if not os.path.exists(f"/proc/{pid}"):
        return f"process {pid} on {host} no longer exists"
    if start and _proc_start(pid) != start:
        return f"process {pid} on {host} is another program now"
    return None


# -- handles: what the writer fills in ------------------------------------------------------------------


@dataclass
class RunHandle:
    """A run as the trial path knows it; `run_id` is set once the writer has created it (after flush())."""

    run_id: Optional[str] = None
    killed: bool = False  # Ctrl-C ended it: nothing more is written to it
    # An interrupted trial's artifacts so far (config.yaml, trial.log, what its stages kept): written as it is KILLED.
    kept: dict[str, str] = field(default_factory=dict)


@dataclass
class SweepRecord:
    """What the writer learned while opening the sweep (valid after flush())."""

    experiment_id: Optional[str] = None
    parent: RunHandle = field(default_factory=RunHandle)
    record_id: str = ""  # the sweep id the runs carry: this sweep's, or the KILLED sweep's it resumes
    resumed: Optional[dict] = None  # the resumed parent's tags


class WriterError(RuntimeError):
    """A write the store refused (not a server that went away: the tracker spools those)."""


class Recorder:
    """Writes one sweep's runs (module doc). Not thread-bound: any scheduler worker may call it."""

    def __init__(self, tracker_factory: Callable[[], Tracker], *, experiment: str, sweep_id: str,
                 common_tags: dict[str, Any], write_behind: bool = True):
        self._factory = tracker_factory
        self.experiment = experiment
        self.sweep = SweepRecord(record_id=sweep_id)
        self.common_tags = dict(common_tags)
        self.tracker: Optional[Tracker] = None
        self._queue: collections.deque = collections.deque()  # writes to runs that exist, in order
        self._creates: collections.deque = collections.deque()  # run creations: done before any queued write
        self._cond = threading.Condition()
        self._quiet = 0  # measurements on this machine in progress
        self._busy = False
        self._error: Optional[BaseException] = None
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._write_behind = write_behind
        # Trial runs created (or queued for creation) and not finished: Ctrl-C kills each of them, also one whose
        # trial path has no handle back yet (the sweep's list of open runs lacks it).
        self._open: list[RunHandle] = []
        self._kill_reason: Optional[str] = None  # set by kill_sweep: a run created after it is killed at once

    # -- the writer ------------------------------------------------------------------------------------

    def _raise(self) -> None:
        """What the writer could not do, raised on the trial path: a UserError (a full disk) as itself (one line)."""
        if isinstance(self._error, UserError):
            raise self._error
        raise WriterError(f"the results store failed: {self._error}") from self._error

    @property
    def disk_full(self) -> bool:
        """The store's disk filled: what is measured goes to the spool, and a workflow starts no further trial."""
        return bool(getattr(self.tracker, "disk_full", False))

    def _submit(self, fn: Callable[[Tracker], None], *, create: bool = False) -> None:
        if self._error is not None:
            self._raise()
        if not self._write_behind:
            self._run_one(fn)
            if self._error is not None:
                self._raise()
            return
        with self._cond:
            if self._thread is None:
                self._thread = background(self._loop, "jbench-recorder")
            (self._creates if create else self._queue).append(fn)
            self._cond.notify_all()

    def _tracker(self) -> Tracker:
        if self.tracker is None:
            self.tracker = self._factory()
        return self.tracker

    def _run_one(self, fn: Callable[[Tracker], None]) -> None:
        try:
            fn(self._tracker())
        except BaseException as exc:  # kept for flush(): the trial path learns of it at its next write
            log.error("recording failed: %s", exc)
            self._error = exc

    def _loop(self) -> None:
        while True:
            with self._cond:
                # While quiet, only run creations go on (small, and a trial on another device may wait for one).
                while not self._closed and not (self._creates or (self._queue and not self._quiet)):
                    self._cond.wait()
                if not (self._creates or self._queue):
                    return
                fn = (self._creates or self._queue).popleft()
                self._busy = True
            if self._error is None:
                self._run_one(fn)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every queued write is done; raise WriterError when one failed."""
        with self._cond:
            while self._creates or self._queue or self._busy:
                if self._quiet:  # a measurement holds the writer: its writes wait for it, not for us
                    raise RuntimeError("flush() while a quiet() measurement is in progress")
                self._cond.wait(0.5)
        if self._error is not None:
            self._raise()

    def close(self) -> None:
        """Finish the queued writes, end the writer (errors stay for flush())."""
        with self._cond:
            self._closed = True
            self._quiet = 0
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """No write starts while this is held (a measurement on this machine); one already running is finished
        first, so the measurement starts on idle cores."""
        with self._cond:
            self._quiet += 1
            while self._busy:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._quiet -= 1
                self._cond.notify_all()

    # -- the sweep's parent run ------------------------------------------------------------------------

    def open_sweep(self, *, run_name: str, params: dict[str, Any], tags: dict[str, Any], description: str,
                   resume: Callable[[Tracker], Optional[tuple[str, str, dict]]],
                   leased: set[str]) -> None:
        """Queue the sweep's start: the experiment (its description), runs left RUNNING by dead controllers marked
        KILLED, then the parent run: a KILLED sweep's parent reopened when `resume` finds one (its sweep id is kept:
        one sweep, one parent run), else a new one."""
        sweep = self.sweep

        def open_(t: Tracker) -> None:
            sweep.experiment_id = exp_id = t.experiment_id(self.experiment)
            t.describe_experiment(exp_id, description)
            self._reap_dead_runs(t, exp_id, leased)
            found = resume(t)
            if found is not None:
                parent, sweep.record_id, earlier = found
                sweep.resumed = earlier
                t.reopen_run(parent)
                t.log(parent, tags={**self._common(), "jbench.status": "RUNNING",
                                    "jbench.resumes": int(earlier.get("jbench.resumes", 0) or 0) + 1,
                                    "jbench.resumed_after": earlier.get("jbench.failure_reason") or "KILLED"})
                log.info("resuming sweep %s (parent run %s)", sweep.record_id, parent)
            else:
                parent = t.start_run(exp_id, run_name, params=params, tags={**self._common(), **tags})
            sweep.parent.run_id = parent

        self._submit(open_, create=True)

    def _common(self) -> dict[str, Any]:
        return {**self.common_tags, "jbench.sweep_id": self.sweep.record_id}

    def _reap_dead_runs(self, t: Tracker, exp_id: str, leased: set[str]) -> None:
        """Runs a dead controller left RUNNING become KILLED with the reason, never stay RUNNING: its controller ran
        on this host and is gone, or the run's device is now leased by us (so its controller lost it). A class
        sweep's run names the class as its device: its unit (tag device.unit) is the device leased."""
        me = controller_id()
        dead_sweeps: set[str] = set()
        running = t.running_runs(exp_id)
        for run_id, tags, params in running:
            owner = tags.get("jbench.controller", "")
            reason = controller_gone(owner) if owner and owner != me else None
            device = tags.get("device.unit") or params.get("device.name")
            if reason is None and tags.get("jbench.kind") == "trial" \
                    and tags.get("jbench.sweep_id") != self.sweep.record_id and device in leased:
                reason = f"device '{device}' was leased by sweep {self.sweep.record_id}: its controller was gone"
            if reason:
                dead_sweeps.add(tags.get("jbench.sweep_id", ""))
                t.log(run_id, tags={"jbench.status": "KILLED", "jbench.failure_reason": f"controller died: {reason}"})
                t.end_run(run_id, "KILLED")
                log.warning("marked run %s of a dead controller KILLED (%s)", run_id, reason)
        for run_id, tags, _ in running:
            if tags.get("jbench.kind") == "sweep" and tags.get("jbench.sweep_id") in dead_sweeps - {""} \
                    and tags.get("jbench.controller") != me:
                t.log(run_id, tags={"jbench.status": "KILLED", "jbench.failure_reason": "controller died"})
                t.end_run(run_id, "KILLED")

    def end_sweep(self, status: str, tags: dict[str, Any], rows: Optional[Callable[[Tracker], list[dict]]]) -> None:
        """Queue the parent's end: its counts and status, and the per-trial summary table when `rows` is given
        (rows built in the writer: a trial finished earlier shows that run's figures, read back from the store)."""
        parent = self.sweep.parent

        def end(t: Tracker) -> None:
            t.log(parent.run_id, tags={**tags, "jbench.status": status})
            try:
                if rows is not None:
                    t.log_table(parent.run_id, rows(t), SUMMARY_TABLE)
            except Exception as exc:  # the table is a convenience: never lose the sweep's end over it
                log.warning("the sweep's summary table was not logged: %s", exc)
            t.end_run(parent.run_id, status)

        self._submit(end)

    def kill_sweep(self, handles: list[RunHandle], reason: str) -> None:
        """Ctrl-C: the open trial runs and the parent end KILLED with what each kept (RunHandle.kept); nothing more is
        written to them."""
        with self._cond:
            # A run whose creation is queued (its trial path still waits for the id) is killed too: the writer creates
            # runs before any queued write, so it has its id when this kill is written.
            handles = [*handles, *(h for h in self._open if all(h is not k for k in handles))]
            self._kill_reason = reason
        self._kill_trials(handles, reason, parent=True)

    def _kill_trials(self, handles: list[RunHandle], reason: str, *, parent: bool = False) -> None:
        for h in handles:
            h.killed = True
        sweep = self.sweep.parent

        def kill(t: Tracker) -> None:
            for h in handles:
                if h.run_id:
                    t.log(h.run_id, tags={"jbench.status": "KILLED", "jbench.failure_reason": reason})
                    t.log_texts(h.run_id, {k: v for k, v in h.kept.items() if v})
                    t.end_run(h.run_id, "KILLED")
            if parent and sweep.run_id:  # the reason: what a resume records as jbench.resumed_after
                t.log(sweep.run_id, tags={"jbench.status": "KILLED", "jbench.failure_reason": reason})
                t.end_run(sweep.run_id, "KILLED")

        self._submit(kill)

    # -- a trial's child run ---------------------------------------------------------------------------

    def start_trial(self, trial: Trial, tags: dict[str, Any], *, name: Optional[str] = None) -> RunHandle:
        """Queue a child run of the sweep for `trial` (run as `trial.config`): params are the trial's identity keys
        that have a value (the whole resolved config is the config.yaml artifact); `tags` add to the layout's."""
        handle = RunHandle()
        params = identity_params(trial.config)
        run_tags = {"jbench.kind": "trial", "jbench.config_hash": trial.config_hash, "jbench.hash_version": HASH_VERSION,
                    "jbench.trial_index": trial.index, "jbench.trial_label": trial.label,
                    **{f"jbench.choice.{k}": v for k, v in trial.choices.items()}, **tags}
        if trial.rounds > 1:
            run_tags["jbench.round"] = trial.round
        parent = self.sweep.parent
        run_name = name or trial.short_label

        def start(t: Tracker) -> None:
            handle.run_id = t.start_run(self.sweep.experiment_id, run_name, parent_run_id=parent.run_id,
                                        params=params, tags={**self._common(), **run_tags})

        # The run exists before its trial starts (a controller killed mid-trial leaves it RUNNING, for the next
        # start to mark KILLED): creations go before any queued write, so this waits for the store's start (the
        # first time) and the write under way, never for the earlier trials' queued metrics and artifacts.
        with self._cond:  # in the list and in the queue at once: a kill_sweep sees both or neither
            self._open.append(handle)
            self._submit(start, create=True)
            while handle.run_id is None and self._error is None:
                self._cond.wait(0.5)
            late = self._kill_reason is not None and not handle.killed and handle.run_id is not None
        if self._error is not None:
            self._raise()
        if late:  # created just after Ctrl-C was recorded: ended KILLED with the sweep, never left RUNNING
            self._kill_trials([handle], str(self._kill_reason))
        return handle

    def measured(self, handle: RunHandle, record: Result) -> None:
        """Queue what the stages measured: metrics, per-repetition series, telemetry series, tags, findings."""
        tags = dict(record.tags)
        tags.update({f"finding.{f.code}": f.message for f in record.findings})
        metrics, stepped, series = dict(record.metrics), dict(record.stepped), dict(record.series)
        if record.findings:
            record.artifacts["findings.json"] = json.dumps([f.as_dict() for f in record.findings], indent=2,
                                                           default=str)

        def write(t: Tracker) -> None:
            if handle.killed:
                return
            t.log(handle.run_id, metrics=metrics, stepped=stepped, tags=tags)
            if series:
                t.log_series(handle.run_id, series)

        self._submit(write)

    def tag(self, handle: RunHandle, tags: dict[str, Any]) -> None:
        def write(t: Tracker) -> None:
            if not handle.killed:
                t.log(handle.run_id, tags=tags)

        self._submit(write)

    def finish(self, handle: RunHandle, status: str, tags: dict[str, Any], artifacts: dict[str, str]) -> None:
        """Queue the run's end: its status tags, its artifacts (config.yaml, raw output, trial.log, ...)."""
        with self._cond:
            self._open = [h for h in self._open if h is not handle]
        texts = {k: v for k, v in artifacts.items() if v}

        def write(t: Tracker) -> None:
            if handle.killed:
                return
            t.log(handle.run_id, tags={"jbench.status": status, **tags})
            t.log_texts(handle.run_id, texts)
            t.end_run(handle.run_id, status)

        self._submit(write)

    def read(self, fn: Callable[[Tracker], Any]) -> Any:
        """A read from the store, in order after the queued writes (blocks until done)."""
        box: list = []
        self._submit(lambda t: box.append(fn(t)))
        self.flush()
        return box[0]


def preload(module: str = "jbench.tracking.writer") -> None:
    """Import the store's writer (MLflow, ~1.5 CPU-s) in the background while the caller plans and checks devices:
    no store is opened or created, so a sweep that ends up running nothing leaves nothing behind."""
    import importlib

    background(lambda: importlib.import_module(module), "jbench-preload")


def source_tags(argv: list[str], git_sha: str) -> dict[str, str]:
    """MLflow's standard who/what fields: the user, the command that ran, jbench's commit."""
    import getpass

    tags = {"mlflow.source.type": "LOCAL",
            "mlflow.source.name": " ".join([os.path.basename(argv[0]) if argv else "jbench", *argv[1:]])[:500]}
    try:
        tags["mlflow.user"] = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers): MLflow's own default then
        pass
    sha = git_sha.split("-")[0]
    if len(sha) == 40:
        tags["mlflow.source.git.commit"] = sha
    return tags


def wall_time() -> str:
    return time.strftime("%Y-%m-%d %H:%M")
