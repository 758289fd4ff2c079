"""Run a validated plan: one MLflow parent run per sweep, one child run per trial.

A Sweep owns what lives as long as the sweep: the device connections, their fingerprints and power
strategies, one backend instance per backend config, the tracker. Each trial is a TrialContext passed
through the stage list (jbench.runner.stages). A trial that fails (backend crash, unparseable output,
timeout, missing file, lost connection after retries) becomes a FAILED run with its category and logs,
and the sweep goes on. Ctrl-C marks the current trial and the sweep KILLED before re-raising; the power
state of every device is restored whatever happens.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import yaml

from jbench.core.provenance import JBENCH_VERSION as __version__, git_sha
from jbench.backends.base import Backend, BackendError, backend_class
from jbench.device.connect import connect
from jbench.device.connection import Connection, ConnectionLost, DeviceError
from jbench.device.fingerprint import host_fingerprint
from jbench.device.jetson import jetson_fingerprint
from jbench.device.lease import DeviceLease
from jbench.device.power import PowerStateError, PowerStrategy
from jbench.models.store import ModelError, resolve_model_file
from jbench.core.results import Category, Finding, Result, Status
from jbench.runner.context import TrialContext, TrialLog, typed_config
from jbench.sweeps.plan import Plan
from jbench.runner.stages import Stage, default_stages
from jbench.core.identity import HASH_VERSION, identity_params, trial_identity
from jbench.models.digest import model_digest
from jbench.core.trial import Trial, resume_key

log = logging.getLogger("jbench")


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


def profile_mismatch(profile: Optional[dict], module: Optional[str]) -> Optional[str]:
    """Why the device's device-tree model does not fit its profile, or None (no model or no rule: no verdict)."""
    if not profile or not module or not profile.get("model_match"):
        return None
    if any(m.lower() in module.lower() for m in profile["model_match"]):
        return None
    return (f"its device-tree model is '{module}', but its profile '{profile.get('name')}' is for "
            f"{profile.get('module')} (model_match {list(profile['model_match'])})")


class TrialIdentity(NamedTuple):
    """What resume matches a trial on: the identity hash and the two values beside the config in it."""

    hash: str
    build: Optional[str]
    model_digest: Optional[str]


class PreflightError(Exception):
    """Problems found on the devices before any trial ran; nothing was recorded."""


@dataclass
class TrialOutcome:
    trial: Trial
    status: Status
    run_id: Optional[str] = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: Optional[str] = None
    category: Optional[Category] = None
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)  # e.g. why energy was not measured
    findings: list[Finding] = field(default_factory=list)
    noisy: bool = False
    retries: int = 0  # reconnections after a lost connection, inside this one run
    device: Optional[str] = None  # the unit that ran it, in a sweep over a device class (device=@CLASS)


@dataclass
class SweepOutcome:
    sweep_id: str
    experiment: str
    parent_run_id: Optional[str]
    tracking_uri: str
    outcomes: list[TrialOutcome]
    notes: list[str] = field(default_factory=list)  # trials dropped (plan rules, preflight)

    @property
    def failed(self) -> list[TrialOutcome]:
        return [o for o in self.outcomes if o.status in (Status.FAILED, Status.KILLED)]


def _failure(exc: Exception) -> tuple[Category, dict[str, str]]:
    """The category of a stage's exception and the raw output it carries."""
    if isinstance(exc, PowerStateError):
        return Category.POWER_STATE, {}
    if isinstance(exc, BackendError):
        return Category(exc.category), {"raw/stdout.txt": exc.raw_output, "raw/stderr.txt": exc.raw_stderr}
    if isinstance(exc, ConnectionLost):
        return Category.CONNECTION_LOST, {}
    return Category.DEVICE, {}


_STAGE_ERRORS = (PowerStateError, BackendError, DeviceError)  # ConnectionLost is a DeviceError


class Sweep:
    """One sweep over a plan's trials; use `run()` (it always restores power states and closes connections)."""

    def __init__(
        self,
        plan: Plan,
        tracker_factory: Callable[[], Any],
        *,
        stages: Optional[list[Stage]] = None,
        on_trial_start: Callable[[Trial], None] = lambda t: None,
        on_trial_end: Callable[[TrialOutcome], None] = lambda o: None,
        every_unit: bool = False,
    ):
        self.plan = plan
        # device=@CLASS: every unit runs every trial (a nightly compares each unit with its own history), instead
        # of the units sharing one queue.
        self.every_unit = every_unit
        self.tracker_factory = tracker_factory
        self.stages = stages if stages is not None else default_stages()
        self.on_trial_start = on_trial_start
        self.on_trial_end = on_trial_end
        self.sweep_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        # The sweep id its runs record: this one, or the KILLED sweep it resumes (sweep_id stays this
        # controller's own: leases and power-state files name it).
        self.record_id = self.sweep_id
        self.notes: list[str] = list(plan.notes)
        self.connections: dict[str, Connection] = {}
        self.fingerprints: dict[str, dict[str, str]] = {}
        self.strategies: dict[str, PowerStrategy] = {}
        self._backends: dict[str, Backend] = {}
        self._saved: list[PowerStrategy] = []
        self.leases: dict[str, DeviceLease] = {}
        self._profiles: dict[str, Optional[dict]] = {}
        self._builds: dict[tuple, Optional[str]] = {}  # (device, backend config) -> build id
        self._digests: dict[tuple, Optional[str]] = {}  # (device, model section) -> model file SHA-256
        self.identities: dict[int, TrialIdentity] = {}  # trial index -> its identity, from preflight
        self._model_found: dict[tuple, bool] = {}  # (device, model path) -> the file is there
        # device=@CLASS: the units (device config dicts), their farm places, and each planned trial's config
        # (its device is the class: what identity and params are made of, whichever unit runs it).
        self.pool = plan.pool
        self.units: list[dict] = []
        self.places: dict[str, str] = {}
        self._farm: Any = None
        self._planned: dict[int, dict] = {t.index: t.config for t in plan.trials} if plan.pool else {}
        self._lock = threading.RLock()  # the tracker and the progress callbacks, shared by the pool's workers
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []  # a class sweep's unit workers
        self._current: dict[Optional[str], TrialOutcome] = {}  # unit (None: no pool) -> its trial with an open run
        self._idle = threading.Condition(self._lock)  # the pool's queue changed (a group taken or given back)
        self._busy = 0  # workers holding a group: until none does, an empty queue may still get trials back

    # -- the whole sweep -------------------------------------------------------------------------

    def run(self) -> SweepOutcome:
        from jbench.tracking.common import resolve_uri

        uri = resolve_uri(self.plan.tracking.get("uri"), self.plan.tracking["results_dir"])
        exp_name = self.plan.tracking.get("experiment_name") or self.plan.experiment
        with contextlib.ExitStack() as stack:  # a farm lease is released after the devices are restored
            if self.pool is not None:
                self._take_units(stack)
            return self._run(uri, exp_name)

    def _run(self, uri: str, exp_name: str) -> SweepOutcome:
        from jbench.tracking.common import store_exists

        try:
            runnable = self._preflight_pool(self.plan.trials) if self.pool else self.preflight(self.plan.trials)
            done = {} if self.plan.sweep.get("rerun") or not store_exists(uri) else self._finished(uri, exp_name)
            todo = [t for t in runnable if self.resume_key(t) not in done]
            if not todo:
                # Nothing to do: no power state is touched and no empty sweep run is recorded.
                outcomes = [_skipped(t, self.resume_key(t), done, []) for t in runnable]
                for outcome in outcomes:
                    self.on_trial_end(outcome)
                return SweepOutcome(self.record_id, exp_name, None, uri, outcomes, self.notes)
            self.lease_devices(self._device_trials(todo))  # before anything changes: one controller per device
            tracker = self.tracker_factory()  # the store is created only once the devices are ready
            self.save_power_states(self._device_trials(todo))
            return self._run_trials(runnable, tracker, exp_name, done)
        finally:
            self.release_devices()

    def release_devices(self) -> None:
        """Restore every saved power state, release the on-device leases, close the connections."""
        self.restore_power_states()
        for lease in self.leases.values():
            try:
                lease.release()
            except Exception as exc:  # a dead link: the lease goes stale and is taken over later
                log.warning("releasing the lease of %s failed: %s", lease.device["name"], exc)
        for conn in self.connections.values():
            conn.close()

    @staticmethod
    def _finished(uri: str, exp_name: str) -> dict[str, dict]:
        """FINISHED trials by identity: from the SQLite file directly when that answers exactly (no MLflow
        import: a sweep with nothing to do returns in about a second), else through MLflow."""
        from jbench.tracking.resume_index import finished_trials_sqlite

        fast = finished_trials_sqlite(uri, exp_name, key="identity")
        if fast is not None:
            return fast
        from jbench.tracking.reader import finished_trials  # imports mlflow

        return finished_trials(uri, exp_name, key="identity")

    def resume_key(self, trial: Trial) -> str:
        """The trial's identity (config, backend build, model file) and round: what resume matches on."""
        return resume_key(self.identities[trial.index].hash, trial.round)

    # -- a device class (device=@CLASS) ------------------------------------------------------------

    def _take_units(self, stack: contextlib.ExitStack) -> None:
        """The pool's units: the leased places matching the class (farm.coordinator set), else the device entries
        whose device_class is the class. Each unit is still guarded by its on-device lease."""
        pool = self.pool
        if not pool.coordinator:
            self.units = [dict(m) for m in pool.members]
            return
        from jbench.farm.coordinator import CoordinatorError
        from jbench.farm.places import FarmError

        try:
            self._lease_units(stack)
        except (FarmError, CoordinatorError) as exc:  # no coordinator, no free place in time: nothing ran
            raise PreflightError(f"the farm gave no unit of {pool.name}: {exc}") from None

    def _lease_units(self, stack: contextlib.ExitStack) -> None:
        pool = self.pool
        from jbench import farm
        from jbench.farm.coordinator import Coordinator, iter_places

        count = pool.count
        if count is None:  # "all": every healthy place of the class the coordinator knows now
            probe = Coordinator(pool.coordinator)
            try:
                probe.open()
                count = len(list(iter_places(probe, {**pool.selector, "jbench_health": "ok"})))
            finally:
                probe.close()
            if count == 0:
                raise PreflightError(f"no healthy farm place matches {pool.selector} on {pool.coordinator} "
                                     "(see `jbench farm list`)")
        f = pool.farm
        leased = stack.enter_context(farm.lease(
            pool.coordinator, pool.selector, count=count, priority=float(f.get("priority") or 0.0),
            sweep_id=self.sweep_id, config_dirs=pool.config_dirs, heartbeat_s=float(f.get("heartbeat_s") or 10.0),
            stale_after_s=float(f.get("stale_after_s") or 300.0), reserve_timeout_s=f.get("reserve_timeout_s"),
            on_wait=lambda msg: log.warning("farm: %s", msg)))
        self._farm = leased
        self.units = [dict(d) for d in leased.devices]
        self.places = {d["name"]: p for p, d in zip(leased.places, leased.devices)}

    def on_unit(self, trial: Trial, unit: dict) -> Trial:
        """The planned trial as it runs on one unit: the unit's device section in place of the class."""
        return dataclasses.replace(trial, config={**trial.config, "device": unit})

    def _device_trials(self, trials: list[Trial]) -> list[Trial]:
        """Trials as the devices see them: a pool trial once on every unit."""
        if self.pool is None:
            return trials
        return [self.on_unit(t, u) for u in self.units for t in trials]

    def _preflight_pool(self, trials: list[Trial]) -> list[Trial]:
        """preflight on every unit; a trial runs when every unit can run it (any unit may get it)."""
        problems: list[str] = []
        kept: Optional[set[int]] = None
        if not self.units:
            raise PreflightError(f"no unit of {self.pool.name} to run on")
        for unit in self.units:
            try:
                keep = self.preflight([self.on_unit(t, unit) for t in trials])
            except PreflightError as exc:
                problems.append(str(exc))
                continue
            idx = {t.index for t in keep}
            kept = idx if kept is None else kept & idx
        if problems:
            raise PreflightError("\n".join(problems))
        return [t for t in trials if t.index in (kept or set())]

    def _unit_tags(self, name: str) -> dict[str, str]:
        """Who ran a pool trial: the unit, its serial when the fingerprint has one, its farm place."""
        if self.pool is None:
            return {}
        unit = next((u for u in self.units if u["name"] == name), {})
        tags = {"device.unit": name, "device.class": self.pool.device_class}
        if unit.get("host"):
            tags["device.host"] = f"{unit['host']}:{unit.get('port', 22)}"
        serial = self.fingerprints.get(name, {}).get("jetson.serial")
        if serial:
            tags["device.serial"] = serial
        if name in self.places:
            tags["farm.place"] = self.places[name]
        return tags

    def backend(self, trial: Trial) -> Backend:
        """One backend instance per device and distinct backend config within the sweep (a pool's workers
        never share one)."""
        key = trial.config["device"]["name"] + repr(sorted(trial.config["backend"].items()))
        if key not in self._backends:
            self._backends[key] = backend_class(trial.config["backend"]["name"])(trial.config["backend"])
        return self._backends[key]

    def preflight(self, trials: list[Trial]) -> list[Trial]:
        """Reach every device and check every backend and power request before the first trial.

        Returns the trials to run (sweep.skip_unavailable_backends drops those whose backend is missing,
        with a note); raises PreflightError listing every problem found."""
        problems: list[str] = []
        checked: dict[tuple, list[str]] = {}  # one backend preflight per device and backend config
        keep: list[Trial] = []

        def problem(msg: str) -> None:
            if msg not in problems:
                problems.append(msg)

        skip_unavailable = bool(self.plan.sweep.get("skip_unavailable_backends"))
        for trial in trials:
            name = trial.config["device"]["name"]
            self._profiles.setdefault(name, trial.config.get("profile"))
            if not self.open_device(trial.config["device"], problem):
                continue
            key = (name, repr(sorted(trial.config["backend"].items())))
            if key not in checked:
                checked[key] = self.backend(trial).preflight(self.connections[name])
            msgs = checked[key]
            if msgs and skip_unavailable:
                note = (f"dropped {trial.label}: backend {trial.config['backend']['name']} not available on "
                        f"'{name}': {msgs[0]}")
                if note not in self.notes:
                    self.notes.append(note)
                continue
            for msg in msgs:
                problem(msg)
            if not msgs:
                ident = self._identity(trial, key)
                seen = self.identities.setdefault(trial.index, ident)
                if seen != ident:  # a pool's trial must be one trial whichever unit runs it
                    problem(f"device '{name}' differs from the other units of {self.pool.name if self.pool else name}: "
                            f"backend build {ident.build} / model file {ident.model_digest} against {seen.build} / "
                            f"{seen.model_digest}. Make the units the same, or pin one with device=NAME")
                if (msg := self.remote_model_missing(trial)) is not None:
                    problem(msg)
            if trial.wants_power_control:
                strategy = self.strategies.get(name)
                if strategy is None:
                    problem(f"trial {trial.label} sets power.* but device '{name}' has no Jetson profile "
                            "(set device.profile)")
                    continue
                if trial.config["power"].get("mode") is not None:
                    try:
                        strategy.mode_id(trial.config["power"]["mode"])
                    except DeviceError as exc:
                        problem(str(exc))
            keep.append(trial)
        if not problems:
            for name in dict.fromkeys(t.config["device"]["name"] for t in keep if t.wants_power_control):
                try:
                    self.strategies[name].check_sudo()
                except DeviceError as exc:
                    problem(str(exc))
        if skip_unavailable and not keep and not problems:
            problem("no backend of the sweep is available on the device: " + "; ".join(self.notes))
        if problems:
            raise PreflightError("\n".join(problems))
        return keep

    def _identity(self, trial: Trial, backend_key: tuple) -> "TrialIdentity":
        """trial_identity with the backend build and the model file's digest, each read once per device."""
        conn = self.connections[trial.config["device"]["name"]]
        if backend_key not in self._builds:
            self._builds[backend_key] = self.backend(trial).build_id(conn)
        model = trial.config["model"]
        model_key = (conn.name, repr(sorted((k, repr(v)) for k, v in model.items())))
        if model_key not in self._digests:
            self._digests[model_key] = model_digest(model, conn)
        build, digest = self._builds[backend_key], self._digests[model_key]
        config = self._planned.get(trial.index, trial.config)  # a pool trial: the class, not the unit
        return TrialIdentity(trial_identity(config, build=build, model_digest=digest), build, digest)

    def remote_model_missing(self, trial: Trial) -> Optional[str]:
        """A model file missing on a remote device, found before anything runs (a local one: at planning)."""
        conn = self.connections[trial.config["device"]["name"]]
        if conn.is_local or not self.backend(trial).reads_model_file(trial):
            return None
        try:
            path, _ = resolve_model_file(trial.config["model"])
        except ModelError:
            return None  # validation reported it
        key = (conn.name, path)
        if key not in self._model_found:
            self._model_found[key] = conn.exists(conn.expand_path(path))
        if self._model_found[key]:
            return None
        return f"model file {path} not found on device '{conn.name}': copy it there or fix model.files / model.path_template"

    def open_device(self, device: dict, problem: Callable[[str], None], profile: Optional[dict] = None) -> bool:
        """Connect, fingerprint and (for a Jetson profile) make the power strategy; problems go to `problem`.
        `profile`: the trial's profile section when the caller has no preflight (jbench bisect)."""
        name = device["name"]
        if profile is not None:
            self._profiles.setdefault(name, profile)
        if name in self.connections:
            return True
        try:
            conn = connect(device)
        except DeviceError as exc:
            problem(str(exc))
            return False
        self.connections[name] = conn
        try:
            self.fingerprints[name] = host_fingerprint(conn)
            if device.get("profile"):
                self.fingerprints[name].update(jetson_fingerprint(conn, device["paths"]))
                self.strategies[name] = PowerStrategy(conn, device, log, sweep_id=self.sweep_id,
                                                      profile=self._profiles.get(name))
                mismatch = profile_mismatch(self._profiles.get(name), self.fingerprints[name].get("jetson.module"))
                if mismatch and not device.get("allow_profile_mismatch"):
                    problem(f"device '{name}': {mismatch}. Fix device.profile, or set "
                            f"device.allow_profile_mismatch=true to run it anyway")
                elif mismatch:
                    self.fingerprints[name]["jetson.profile_mismatch"] = mismatch
        except DeviceError as exc:
            problem(str(exc))
            conn.close()
            del self.connections[name]
            return False
        return True

    def lease_devices(self, trials: list[Trial]) -> None:
        """Hold every device of the sweep (an on-device lease with a heartbeat) or stop before touching any."""
        devices = {t.config["device"]["name"]: t.config["device"] for t in reversed(trials)}

        def take(name: str) -> None:
            device = devices[name]
            lease = DeviceLease(self.connections[name], device, self.sweep_id,
                                stale_s=float(device.get("lease_stale_s") or 120.0), log=log)
            try:
                lease.acquire(float(device.get("lease_wait_s") or 0.0))
            except DeviceError as exc:
                raise PreflightError(str(exc)) from None
            with self._lock:
                self.leases[name] = lease

        _on_each(take, list(dict.fromkeys(t.config["device"]["name"] for t in trials)))

    def _reap_dead_runs(self, tracker: Any, exp_id: str) -> None:
        """Runs a dead controller left RUNNING become KILLED with the reason, never stay RUNNING: its controller
        ran on this host and is gone, or the run's device is now leased by us (so its controller lost it). A class
        sweep's run names the class as its device: its unit (tag device.unit) is the device leased."""
        me = controller_id()
        dead_sweeps: set[str] = set()
        running = tracker.running_runs(exp_id)
        for run_id, tags, params in running:
            owner = tags.get("jbench.controller", "")
            reason = controller_gone(owner) if owner and owner != me else None
            device = tags.get("device.unit") or params.get("device.name")
            if reason is None and tags.get("jbench.kind") == "trial" and tags.get("jbench.sweep_id") != self.sweep_id \
                    and device in self.leases:
                reason = f"device '{device}' was leased by sweep {self.sweep_id}: its controller was gone"
            if reason:
                dead_sweeps.add(tags.get("jbench.sweep_id", ""))
                tracker.log(run_id, tags={"jbench.status": "KILLED", "jbench.failure_reason": f"controller died: {reason}"})
                tracker.end_run(run_id, "KILLED")
                log.warning("marked run %s of a dead controller KILLED (%s)", run_id, reason)
        for run_id, tags, _ in running:
            if tags.get("jbench.kind") == "sweep" and tags.get("jbench.sweep_id") in dead_sweeps - {""} \
                    and tags.get("jbench.controller") != me:
                tracker.log(run_id, tags={"jbench.status": "KILLED", "jbench.failure_reason": "controller died"})
                tracker.end_run(run_id, "KILLED")

    def _reboot_consent(self, name: str) -> bool:
        """Reboots of a device only with consent: some trial of this sweep on it set power.allow_reboot=true."""
        names = {name} | ({self.pool.name} if self.pool and any(u["name"] == name for u in self.units) else set())
        return any(bool(t.config["power"].get("allow_reboot")) for t in self.plan.trials
                   if t.config["device"]["name"] in names and t.config.get("power"))

    def save_power_states(self, trials: list[Trial]) -> None:
        # A controller that died earlier may have left a device in a changed state: put it back first
        # (we hold the device's lease, so its owner is gone). What cannot be restored stays the original.
        _on_each(lambda name: self.strategies[name].recover_leftover(allow_reboot=self._reboot_consent(name)),
                 [name for name in self.strategies if name in self.leases])
        names = list(dict.fromkeys(t.config["device"]["name"] for t in trials if t.wants_power_control))

        def save(name: str) -> None:
            self.strategies[name].save_original()
            with self._lock:
                self._saved.append(self.strategies[name])

        _on_each(save, names)

    def restore_power_states(self) -> None:
        for strategy in self._saved:
            try:
                strategy.log = log
                if not strategy.restore(allow_reboot=self._reboot_consent(strategy.device["name"])):
                    log.error("the power state of %s was not fully restored (see above); the state file stays on "
                              "the device and jbench finishes the job at its next start there", strategy.conn.name)
            except Exception as exc:  # keep restoring the other devices
                log.error("restoring the power state of %s failed: %s", strategy.conn.name, exc)
        self._saved.clear()

    def _run_trials(self, trials: list[Trial], tracker: Any, exp_name: str, done: dict[str, dict]) -> SweepOutcome:
        plan = self.plan
        exp_id = tracker.experiment_id(exp_name)
        experiment = (trials[0].config.get("experiment") or {}) if trials else {}
        tracker.describe_experiment(exp_id, str(experiment.get("description") or ""))
        self._reap_dead_runs(tracker, exp_id)
        # A sweep resumed after Ctrl-C (or its controller's death) goes on under the parent it left KILLED:
        # one sweep id, one parent run with all its trials, so `report --sweep` and `compare` see them all.
        resumed = self._killed_parent(tracker, trials, done)
        if resumed is not None:
            parent, self.record_id, earlier = resumed
        common_tags = {"jbench.sweep_id": self.record_id, "jbench.version": __version__, "jbench.git_sha": git_sha(),
                       "jbench.controller": controller_id(), **_source_tags()}
        if resumed is not None:
            tracker.reopen_run(parent)
            tracker.log(parent, tags={**common_tags, "jbench.status": "RUNNING",
                                      "jbench.resumes": int(earlier.get("jbench.resumes", 0) or 0) + 1,
                                      "jbench.resumed_after": earlier.get("jbench.failure_reason") or "KILLED"})
            log.info("resuming sweep %s (parent run %s)", self.record_id, parent)
        else:
            parent = tracker.start_run(
                exp_id, f"{plan.experiment} {time.strftime('%Y-%m-%d %H:%M')}",
                params={"sweep.overrides": " ".join(plan.overrides), "sweep.n_trials": len(trials),
                        **{f"sweep.dim.{k}": v for k, v in plan.dims.items()}},
                tags={**common_tags, "jbench.kind": "sweep", "jbench.experiment": plan.experiment,
                      "mlflow.note.content": _sweep_note(plan, trials, experiment, self.record_id)},
            )
        ooms: list[tuple[tuple, int, str]] = []  # (model/KV/device key, context that failed, run id)
        outcomes: list[TrialOutcome] = []
        recorder = _Recorder(tracker, exp_id, parent, common_tags, plan.experiment, lock=self._lock)
        try:
            if self.pool is not None:
                self._run_pool(trials, recorder, done, ooms, outcomes)
            else:
                for trial in trials:
                    self.on_trial_start(trial)
                    outcome = _skipped(trial, self.resume_key(trial), done, ooms) or \
                        self._attempts(trial, trial, recorder, outcomes, ooms, None)
                    outcomes.append(outcome)
                    self.on_trial_end(outcome)
        except KeyboardInterrupt:
            self._stop.set()
            with self._lock:  # no worker starts or finishes a run after this
                recorder.closed = True
                for running in list(self._current.values()):  # the trials whose runs are open
                    if running.run_id:
                        recorder.killed.add(running.run_id)
                        tracker.log(running.run_id, tags={"jbench.status": "KILLED",
                                                          "jbench.failure_reason": "interrupted (Ctrl-C)"})
                        tracker.end_run(running.run_id, "KILLED")
                        running.status = Status.KILLED
                        outcomes.append(running)
                self._current.clear()
                tracker.log(parent, tags={"jbench.status": "KILLED"})
                tracker.end_run(parent, "KILLED")
            self._wait_for_workers()
            raise
        n_failed = sum(o.status == Status.FAILED for o in outcomes)
        # Under a resumed sweep's parent, its trials done before the interruption count as its finished ones.
        n_skipped = sum(o.status == Status.SKIPPED and not (resumed and o.category == Category.RESUMED)
                        for o in outcomes)
        tracker.log(parent, tags={"jbench.failed_trials": n_failed, "jbench.skipped_trials": n_skipped,
                                  "jbench.finished_trials": len(outcomes) - n_failed - n_skipped,
                                  "jbench.status": "FAILED" if n_failed else "FINISHED",
                                  **({"jbench.dropped": "; ".join(self.notes)[:5000]} if self.notes else {})})
        try:
            tracker.log_table(parent, _summary_rows(outcomes, plan.dims, tracker, done), SUMMARY_TABLE)
        except Exception as exc:  # the table is a convenience: never lose the sweep's end over it
            log.warning("the sweep's summary table was not logged: %s", exc)
        tracker.end_run(parent, "FAILED" if n_failed else "FINISHED")
        return SweepOutcome(self.record_id, exp_name, parent, tracker.uri, outcomes, self.notes)

    def _killed_parent(self, tracker: Any, trials: list[Trial], done: dict[str, dict]
                       ) -> Optional[tuple[str, str, dict]]:
        """(parent run id, sweep id, its tags) of the KILLED sweep this one resumes: the parent of trials of
        this plan already FINISHED, left KILLED, with the same overrides. None: a new sweep."""
        overrides = " ".join(self.plan.overrides)
        seen: set[str] = set()
        for trial in trials:
            entry = done.get(self.resume_key(trial))
            if entry is None:
                continue
            parent = tracker.run_record(entry["run_id"])["tags"].get("mlflow.parentRunId")
            if not parent or parent in seen:
                continue
            seen.add(parent)
            rec = tracker.run_record(parent)
            if rec["status"] == "KILLED" and rec["params"].get("sweep.overrides") == overrides \
                    and rec["tags"].get("jbench.sweep_id"):
                return parent, rec["tags"]["jbench.sweep_id"], rec["tags"]
        return None

    # -- workers over a device class ----------------------------------------------------------------

    def _run_pool(self, trials: list[Trial], recorder: "_Recorder", done: dict[str, dict],
                  ooms: list[tuple[tuple, int, str]], outcomes: list[TrialOutcome]) -> None:
        """One worker thread per unit takes groups of trials (same power state and model, in plan order) from a
        shared queue. A unit that keeps failing for device reasons (or that the farm quarantines) is dropped and
        the rest of its group goes back to the queue: every trial taken is recorded or given back, never run
        twice."""
        groups: collections.deque = collections.deque()
        for trial in trials:
            skipped = _skipped(trial, self.resume_key(trial), done, [])
            if skipped is not None:  # already FINISHED, whichever unit ran it
                outcomes.append(skipped)
                self.on_trial_start(trial)
                self.on_trial_end(skipped)
            elif groups and _group_key(groups[-1][-1]) == _group_key(trial):
                groups[-1].append(trial)
            else:
                groups.append([trial])
        # A group is at most an even share of the work, so a sweep of one model and power state still spreads.
        share = max(1, -(-sum(map(len, groups)) // max(1, len(self.units))))
        groups = collections.deque(g[i:i + share] for g in groups for i in range(0, len(g), share))
        queues = {u["name"]: collections.deque(groups) if self.every_unit else groups for u in self.units}
        workers = [threading.Thread(target=self._worker, args=(unit, queues[unit["name"]], recorder, ooms, outcomes),
                                    name=f"jbench-{unit['name']}", daemon=True) for unit in self.units]
        self._workers = workers
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers):
            for w in workers:
                w.join(0.2)  # short joins: Ctrl-C reaches the main thread
        for name, queue in queues.items():  # what is left (no unit to take it) is recorded as not run
            why = f"'{name}' was dropped" if self.every_unit else f"no unit of {self.pool.name} was left"
            for trial in (t for group in queue for t in group):
                outcome = TrialOutcome(trial, Status.FAILED, category=Category.DEVICE,
                                       error=f"not run: {why} (see the notes)", device=name if self.every_unit else None)
                outcomes.append(outcome)
                self.on_trial_end(outcome)
            if not self.every_unit:  # one shared queue
                break

    def _wait_for_workers(self, timeout_s: float = 60.0) -> None:
        """Ctrl-C of a class sweep: end the units' running commands (closing a connection makes the device-side
        guard end them) and wait for the workers, so that none is still applying a power state while the
        power states are restored. A second Ctrl-C stops the wait."""
        alive = [w for w in self._workers if w.is_alive()]
        if not alive:
            return
        for unit in self.units:
            conn = self.connections.get(unit["name"])
            if conn is not None:
                try:
                    conn.close()  # the restore reconnects
                except Exception as exc:
                    log.debug("closing %s: %s", unit["name"], exc)
        deadline = time.monotonic() + timeout_s
        while alive and time.monotonic() < deadline:
            alive[0].join(0.2)
            alive = [w for w in alive if w.is_alive()]
        if alive:
            log.warning("%d unit worker(s) still busy after %.0f s: restoring the power states anyway",
                        len(alive), timeout_s)

    def _worker(self, unit: dict, groups: collections.deque, recorder: "_Recorder",
                ooms: list[tuple[tuple, int, str]], outcomes: list[TrialOutcome]) -> None:
        streak = [0]
        while not self._stop.is_set():
            with self._idle:
                # An empty queue ends this worker only when no other holds a group it may give back.
                while not groups and self._busy and not self._stop.is_set():
                    self._idle.wait(0.5)
                if not groups or self._stop.is_set():
                    return
                group = groups.popleft()
                self._busy += 1
            try:
                if not self._run_group(unit, group, groups, recorder, ooms, outcomes, streak):
                    return
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    def _run_group(self, unit: dict, group: list[Trial], groups: collections.deque, recorder: "_Recorder",
                   ooms: list[tuple[tuple, int, str]], outcomes: list[TrialOutcome], streak: list[int]) -> bool:
        """Run one group on the unit; False when its worker must stop (interrupted, or the unit dropped and the
        rest of the group given back). streak: the unit's run of device failures, carried across groups."""
        name = unit["name"]
        for i, trial in enumerate(group):
            if self._stop.is_set():
                return False
            run_as = self.on_unit(trial, unit)
            with self._lock:
                self.on_trial_start(run_as)
                outcome = _skipped(run_as, self.resume_key(trial), {}, ooms)
            try:
                if outcome is None:
                    outcome = self._attempts(trial, run_as, recorder, outcomes, ooms, name)
            except _Stopped:
                return False
            except Exception as exc:  # a fault of the controller's side: this unit stops, its trials go on
                log.exception("worker of %s failed", name)
                outcome = self._current.pop(name, None) or TrialOutcome(trial, Status.FAILED)
                outcome.status, outcome.category, outcome.error = Status.FAILED, Category.DEVICE, str(exc)
                if outcome.run_id:
                    try:
                        recorder.finish(outcome, {})
                    except Exception:  # the run stays for the next start's reaper
                        log.exception("recording the failed run of %s failed", name)
                streak[0] = 1 << 30
            outcome.device = name
            with self._lock:
                if self._stop.is_set():
                    return False
                outcomes.append(outcome)
                self.on_trial_end(outcome)
            streak[0], reason = self._unit_unfit(unit, outcome, streak[0])
            if reason:
                with self._idle:
                    if group[i + 1:]:
                        groups.appendleft(group[i + 1:])
                    rest = "its other trials were not run" if self.every_unit else "its trials went to the other units"
                    note = f"device '{name}' dropped from {self.pool.name}: {reason}; {rest}"
                    self.notes.append(note)
                log.warning("%s", note)
                return False
        return True

    def _unit_unfit(self, unit: dict, outcome: TrialOutcome, streak: int) -> tuple[int, Optional[str]]:
        """(the unit's run of device failures, why it must stop or None) after one of its trials."""
        name = unit["name"]
        device_failure = outcome.status == Status.FAILED and outcome.category in (Category.CONNECTION_LOST,
                                                                                  Category.DEVICE)
        streak = streak + 1 if device_failure else 0
        if self._farm is not None and outcome.status in (Status.FINISHED, Status.FAILED):
            after = int(self.pool.farm.get("quarantine_after_failures") or 0)
            try:
                with self._lock:
                    if self._farm.record_trial(name, device_failure=device_failure, quarantine_after=after):
                        return streak, f"quarantined by the farm after {after} device failure(s) in a row"
            except Exception as exc:  # the coordinator's trouble is not the unit's
                log.warning("farm: recording the trial of %s failed: %s", name, exc)
        if device_failure:  # a unit that no longer answers gets no further trial
            try:
                self.connections[name].reconnect(float(unit.get("connect_timeout_s") or 10.0))
            except DeviceError as exc:
                return streak, f"unreachable ({exc})"
        limit = max(1, int(self.plan.sweep.get("drop_device_after", 2)))
        if streak >= limit:
            return streak, f"{min(streak, limit)} trial(s) in a row failed for device reasons (last: {outcome.error})"
        return streak, None

    # -- one trial --------------------------------------------------------------------------------

    def _attempts(self, trial: Trial, run_as: Trial, recorder: "_Recorder", outcomes: list[TrialOutcome],
                  ooms: list[tuple[tuple, int, str]], unit: Optional[str]) -> TrialOutcome:
        """Run the trial (once more when noisy and sweep.rerun_noisy); its open run is in _current for Ctrl-C."""
        runs = 2 if self.plan.sweep.get("rerun_noisy") else 1
        for attempt in range(runs):
            outcome = TrialOutcome(trial, Status.RUNNING, device=unit)
            self._current[unit] = outcome
            self._run_trial(trial, outcome, recorder, run_as)
            if not (outcome.status == Status.FINISHED and outcome.noisy) or attempt == runs - 1:
                break
            log.info("trial %d is noisy (CV over sweep.max_cv): running it once more", trial.index)
            with self._lock:
                outcomes.append(outcome)
        self._current.pop(unit, None)
        if outcome.category == Category.OUT_OF_MEMORY:
            with self._lock:
                ooms.append((_oom_key(run_as), trial.context_tokens, outcome.run_id or ""))
        return outcome

    def _run_trial(self, trial: Trial, outcome: TrialOutcome, recorder: "_Recorder",
                   run_as: Optional[Trial] = None) -> None:
        """The trial's stages inside one run; a lost connection is retried in the same run with backoff
        (1, 2, 4 ... s) before the trial counts as failed. `run_as`: the trial on a pool's unit (the run
        records `trial`, the class's, and the unit in tags)."""
        run_as = run_as or trial
        dev_name = run_as.config["device"]["name"]
        conn = self.connections[dev_name]
        outcome.run_id = recorder.start(trial, {**self.fingerprints[dev_name], **self._unit_tags(dev_name)},
                                        self.identities.get(trial.index))
        tlog = TrialLog(trial)
        started = time.monotonic()
        tlog.logger.info("trial %d: %s (config %s)%s", trial.index, trial.label, trial.config_hash,
                         f" on {dev_name}" if run_as is not trial else "")
        retries = int(self.plan.sweep.get("connection_retries", 3))
        cfg = typed_config(run_as.config)
        artifacts = {"config.yaml": yaml.safe_dump(run_as.config, sort_keys=False)}
        while True:
            ctx = TrialContext(run_as, cfg, conn, self.backend(run_as), self.strategies.get(dev_name), tlog.logger,
                               max_cv=self.plan.sweep.get("max_cv"))
            try:
                for stage in self.stages:
                    if stage.applies(ctx):
                        stage.run(ctx)
            except _STAGE_ERRORS as exc:
                category, raw = _failure(exc)
                if self._stop.is_set():  # Ctrl-C closed the unit's connection: no retry, nothing re-applied
                    raise _Stopped() from exc
                if category == Category.CONNECTION_LOST and outcome.retries < retries:
                    outcome.retries += 1
                    delay = 2 ** (outcome.retries - 1)
                    tlog.logger.warning("connection lost (%s); reconnecting in %d s (retry %d of %d)", exc, delay,
                                        outcome.retries, retries)
                    time.sleep(delay)
                    try:
                        conn.reconnect(60)
                    except DeviceError as again:
                        tlog.logger.warning("reconnect failed: %s", again)
                    continue
                outcome.status, outcome.error, outcome.category = Status.FAILED, str(exc), category
                tlog.logger.error("FAILED (%s): %s", category, exc)
                artifacts.update(ctx.record.artifacts)
                artifacts.update(raw)
                break
            outcome.status = Status.FINISHED
            record = ctx.record
            record.metrics["trial_wall_s"] = time.monotonic() - started
            outcome.metrics, outcome.findings, outcome.noisy = record.metrics, record.findings, ctx.noisy
            outcome.notes = ctx.notes
            for f in record.findings:
                tlog.logger.warning("finding %s: %s", f.code, f.message)
            tlog.logger.info("FINISHED: %s", ", ".join(f"{k}={v:.4g}" for k, v in record.metrics.items()
                                                        if k.endswith("_tps")))
            recorder.measured(outcome.run_id, record)
            artifacts.update(record.artifacts)
            break
        outcome.wall_s = time.monotonic() - started
        artifacts["trial.log"] = tlog.text()
        tlog.close()
        recorder.finish(outcome, artifacts)


def _on_each(fn: Callable[[str], None], names: list[str], max_threads: int = 16) -> None:
    """fn(name) for every device, side by side when there are several (a class sweep's units: taking 64 leases one
    after the other kept the first unit idle for ~10 s); every call ends before the first error is raised."""
    if len(names) <= 1:
        for name in names:
            fn(name)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(max_threads, len(names)), thread_name_prefix="jbench-units") as pool:
        futures = [pool.submit(fn, name) for name in names]
    for future in futures:
        future.result()  # the first failure, in device order


class _Stopped(Exception):
    """The sweep was interrupted: a worker starts no further run."""


def _locked(method: Callable) -> Callable:
    # A pool's workers share the tracker (its journal, spool switch and MLflow client): one call at a time, and
    # never a write to a run that Ctrl-C has already marked KILLED.
    def wrapper(self: "_Recorder", *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return wrapper


class _Recorder:
    """How a trial's run is written to the tracker (the only place that knows the run's layout)."""

    def __init__(self, tracker: Any, exp_id: str, parent: str, common_tags: dict[str, str], experiment: str = "",
                 lock: Optional[threading.RLock] = None):
        self.tracker, self.exp_id, self.parent, self.common_tags = tracker, exp_id, parent, common_tags
        self.experiment = experiment
        self.lock = lock or threading.RLock()
        self.closed = False  # Ctrl-C: no new run
        self.killed: set[str] = set()  # runs Ctrl-C ended as KILLED: their workers write nothing more

    @_locked
    def start(self, trial: Trial, fingerprint: dict[str, str], identity: Optional["TrialIdentity"]) -> str:
        if self.closed:
            raise _Stopped()
        cfg = trial.config
        # Params are the inputs that define the trial (its identity keys that have a value); the whole
        # resolved config is the config.yaml artifact.
        params = identity_params(cfg)
        tags = {
            **self.common_tags, **fingerprint,
            "jbench.kind": "trial",
            "jbench.config_hash": trial.config_hash,
            "jbench.hash_version": HASH_VERSION,
            "jbench.trial_index": trial.index,
            "jbench.trial_label": trial.label,
            **{f"jbench.choice.{k}": v for k, v in trial.choices.items()},
            "mlflow.note.content": _trial_note(trial, self.experiment),
        }
        if trial.rounds > 1:
            tags["jbench.round"] = trial.round
        if identity is not None:
            tags.update({k: v for k, v in (("jbench.identity", identity.hash), ("jbench.build", identity.build),
                                           ("jbench.model_digest", identity.model_digest)) if v})
        try:
            _, model_facts = resolve_model_file(cfg["model"])
            tags.update(model_facts)
        except ModelError:  # the backend reports a missing model as the trial's failure
            pass
        if identity is not None and identity.model_digest:
            tags["model.sha256"] = identity.model_digest  # the file benchmarked, as its identity counts it
        return self.tracker.start_run(self.exp_id, trial.short_label, parent_run_id=self.parent,
                                      params=params, tags=tags)

    @_locked
    def measured(self, run_id: str, record: Result) -> None:
        if run_id in self.killed:
            return
        tags = dict(record.tags)
        tags.update({f"finding.{f.code}": f.message for f in record.findings})
        self.tracker.log(run_id, metrics=record.metrics, stepped=record.stepped, tags=tags)
        if record.series:
            self.tracker.log_series(run_id, record.series)
        if record.findings:
            import json

            record.artifacts["findings.json"] = json.dumps([f.as_dict() for f in record.findings], indent=2,
                                                           default=str)

    @_locked
    def finish(self, outcome: TrialOutcome, artifacts: dict[str, str]) -> None:
        if outcome.run_id in self.killed:
            return
        tags: dict[str, Any] = {"jbench.status": str(outcome.status)}
        if outcome.retries:
            tags["jbench.retries"] = outcome.retries
        if outcome.error:
            tags.update({"jbench.failure_reason": outcome.error[:5000], "jbench.failure_category": str(outcome.category)})
        self.tracker.log(outcome.run_id, tags=tags)
        self.tracker.log_texts(outcome.run_id, {k: v for k, v in artifacts.items() if v})
        self.tracker.end_run(outcome.run_id, str(outcome.status))


SUMMARY_TABLE = "summary.json"  # the parent's per-trial table (MLflow table artifact)


def _source_tags() -> dict[str, str]:
    """MLflow's standard who/what fields: the user, the command that ran, jbench's commit."""
    import getpass
    import sys

    tags = {"mlflow.source.type": "LOCAL",
            "mlflow.source.name": " ".join([os.path.basename(sys.argv[0]) or "jbench", *sys.argv[1:]])[:500]}
    try:
        tags["mlflow.user"] = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers): MLflow's own default then
        pass
    sha = git_sha().split("-")[0]
    if len(sha) == 40:
        tags["mlflow.source.git.commit"] = sha
    return tags


def _sweep_note(plan: Plan, trials: list[Trial], experiment: dict, sweep_id: str) -> str:
    """The parent run's description (markdown, the run page's Description)."""
    desc = str(experiment.get("description") or "").strip()
    lines = [f"**{plan.experiment}**" + (f": {desc}" if desc else ""), ""]
    dims = ", ".join(f"`{k}` = {', '.join(map(str, v))}" for k, v in plan.dims.items()) or "none (one trial)"
    lines += [f"- sweep `{sweep_id}`: {len(trials)} trial(s); varying: {dims}",
              f"- overrides: `{' '.join(plan.overrides) or '(none)'}`",
              f"- per-trial summary: `{SUMMARY_TABLE}`; `jbench report --sweep {sweep_id}` attaches a report here"]
    return "\n".join(lines)


def _trial_note(trial: Trial, experiment: str) -> str:
    """A child run's description: what ran, in words."""
    b, m, d = trial.config["backend"], trial.config["model"], trial.config["device"]
    what = (f"{m.get('display_name') or m['name']} {m['quant']} with {b['name']} on device '{d['name']}': "
            f"prompt {b.get('n_prompt')} tokens, {b.get('n_gen')} generated")
    if b.get("depth"):
        what += f", at depth {b['depth']}"
    what += f", {b.get('repetitions')} repetition(s)"
    if trial.rounds > 1:
        what += f" (round {trial.round} of {trial.rounds})"
    return f"Trial {trial.index} of {experiment or 'the sweep'}: {trial.short_label}. {what}."


def _summary_rows(outcomes: list[TrialOutcome], dims: dict, tracker: Any, done: dict[str, dict]) -> list[dict]:
    """One row per trial: run name, the varying dimensions, status, prefill/decode tok/s, tokens per joule.
    A trial skipped as already FINISHED shows that run's figures (read back from the store)."""
    rows = []
    seen: set[tuple] = set()
    for o in outcomes:
        key = (o.trial.index, o.run_id)
        if key in seen:
            continue
        seen.add(key)
        metrics = o.metrics
        if o.status == Status.SKIPPED and o.category == Category.RESUMED and o.run_id:
            metrics = tracker.run_record(o.run_id)["metrics"]
        row: dict[str, Any] = {"run": o.trial.short_label, "run_id": o.run_id or ""}
        if o.device:
            row["device"] = o.device
        row.update({k: str(o.trial.point.get(k, "")) for k in dims})
        row["status"] = str(o.status) if o.category != Category.RESUMED else "FINISHED (earlier)"
        for col in ("prefill_tps", "decode_tps", "decode_tokens_per_joule"):
            v = metrics.get(col)
            row[col] = round(float(v), 3) if v is not None and v == v else None
        if "decode_wall_tokens_per_joule" in metrics:  # a wall meter ran (wall_power.source): its figure beside the board's
            v = metrics["decode_wall_tokens_per_joule"]
            row["decode_wall_tokens_per_joule"] = round(float(v), 3) if v == v else None
        rows.append(row)
    return rows


def _group_key(trial: Trial) -> tuple:
    """Trials a pool's unit runs back to back: the same power state and model (one switch, one load)."""
    p, m = trial.config.get("power") or {}, trial.config["model"]
    return (p.get("mode"), p.get("jetson_clocks"), p.get("fan"), m["name"], m["quant"], trial.round)


def _oom_key(trial: Trial) -> tuple:
    b, m = trial.config["backend"], trial.config["model"]
    return (trial.config["device"]["name"], m["name"], m["quant"], b.get("cache_type_k"), b.get("cache_type_v"))


def _skipped(trial: Trial, key: str, done: dict[str, dict], ooms: list[tuple[tuple, int, str]]) -> Optional[TrialOutcome]:
    """A trial that need not run: already FINISHED in the experiment (resume key `key`), or a larger context
    of a model and KV type that already ran out of memory on the device."""
    if key in done:
        return TrialOutcome(trial, Status.SKIPPED, run_id=done[key]["run_id"],
                            error="already FINISHED in this experiment (sweep.rerun=true runs it again)",
                            category=Category.RESUMED)
    for key, context, run_id in ooms:
        if key == _oom_key(trial) and trial.context_tokens >= context:
            return TrialOutcome(trial, Status.SKIPPED, category=Category.OOM_SKIP,
                                error=(f"skipped: the same model and KV type ran out of memory at context {context} "
                                       f"(run {run_id[:12]}); this trial needs {trial.context_tokens}"))
    return None
