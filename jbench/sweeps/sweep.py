"""A sweep: a validated plan run on its devices, one MLflow parent run per sweep, one child run per trial.

`run_sweep(plan, tracker_factory)` is `jbench sweep` as a Python call; it returns a SweepOutcome. It composes the
run layer (jbench.runner): a DeviceSession per device (or per unit of a device class), `preflight` on each before
anything changes there, resume (trials FINISHED before with the same identity are skipped), the on-device leases,
the saved power states, a Recorder for the runs, a TrialRunner for the trials and the Scheduler to spread them.
What is the sweep's own: which trials need not run (already FINISHED; a larger context of a model and KV type that
ran out of memory), when a pool's unit is dropped, and the summary it records. A trial that fails is a FAILED
run and the sweep goes on; Ctrl-C (SIGTERM, SIGHUP) marks the running trials and the sweep KILLED before it
propagates; the power state of every device is restored whatever happens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional
from urllib.parse import urlparse

from jbench.core.errors import UserError
from jbench.core.exitcodes import ExitCode
from jbench.core.protocol import PROTOCOL_VERSION
from jbench.core.provenance import JBENCH_VERSION, git_sha
from jbench.core.results import Category, Status
from jbench.core.trial import Trial, resume_key
from jbench.device.connection import DeviceError
from jbench.runner import scheduler as sched
from jbench.runner.recorder import Recorder, SUMMARY_TABLE, Tracker, controller_id, source_tags, wall_time
from jbench.runner.scheduler import Scheduler, Stopped, Unit, group_runs
from jbench.models.store import ModelError
from jbench.runner.quality import quality_request
from jbench.runner.session import DeviceSession
from jbench.runner.stages import Stage, default_stages
from jbench.runner.trials import (Preflight, PreflightError, TrialIdentity, TrialOutcome, TrialRunner,
                                  preflight)
from jbench.runner.units import Units, UnitsError, take_units
from jbench.sweeps.plan import Plan
from jbench.tracking.common import (database_problem, disk_spool_dir, local_path, out_of_room, redact, resolve_uri,
                                    server_problem, spool_dir, store_exists, store_problem)
from jbench.tracking.resume_index import finished_trials_sqlite

log = logging.getLogger("jbench")

__all__ = ["PreflightError", "SweepOutcome", "TrialOutcome", "run_sweep"]


@dataclass
class SweepOutcome:
    sweep_id: str
    experiment: str
    parent_run_id: Optional[str]
    tracking_uri: str
    outcomes: list[TrialOutcome]
    notes: list[str] = field(default_factory=list)  # trials dropped (plan rules, preflight)
    tracker: Optional[Tracker] = None  # the store written (None: nothing ran)

    @property
    def failed(self) -> list[TrialOutcome]:
        return [o for o in self.outcomes if o.status in (Status.FAILED, Status.KILLED)]

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.TRIALS_FAILED if self.failed else ExitCode.OK


def run_sweep(plan: Plan, tracker_factory: Callable[[], Tracker], *, every_unit: bool = False,
              stages: Optional[list[Stage]] = None, on_trial_start: Callable[[Trial], None] = lambda t: None,
              on_trial_end: Callable[[TrialOutcome], None] = lambda o: None,
              on_unit_dropped: Callable[[str], None] = lambda note: None,
              on_resume: Callable[[list[Trial]], None] = lambda trials: None,
              order: Optional[Callable[[list[Trial]], Iterable[Trial]]] = None) -> SweepOutcome:
    """Run the plan (module doc). `every_unit`: over a device class, every unit runs every trial (a nightly);
    else the units share one queue. `on_resume`: the trials resume will skip, once that is decided (a progress
    bar's time left). `order`: which of the plan's trials run, one at a time (`sweep --search`: it may look at each
    outcome, through on_trial_end, before it yields the next); one device only. Raises PreflightError when a device is
    not ready (nothing ran), KeyboardInterrupt after recording the interruption."""
    return _Sweep(plan, tracker_factory, every_unit=every_unit, stages=stages, on_trial_start=on_trial_start,
                  on_trial_end=on_trial_end, on_unit_dropped=on_unit_dropped, on_resume=on_resume, order=order).run()


def _group_key(trial: Trial) -> tuple:
    """Trials a pool's unit runs back to back: the same power state and model (one switch, one load)."""
    p, m = trial.cfg.power, trial.cfg.model
    return (p.mode, p.jetson_clocks, p.fan, m.name, m.quant, trial.round)


def _oom_key(trial: Trial) -> tuple:
    """What an out-of-memory failure says about other trials: the device, the model file, the KV-cache types (a
    backend without KV-type settings has none)."""
    b, m = trial.cfg.backend, trial.cfg.model
    kv = (b.cache_type_k, b.cache_type_v) if hasattr(b, "cache_type_k") else (None, None)
    return (trial.cfg.device.name, m.name, m.quant, *kv)


def skipped(trial: Trial, key: str, done: dict[str, dict], ooms: list[tuple[tuple, int, str]],
            run_as: Optional[Trial] = None) -> Optional[TrialOutcome]:
    """A trial that need not run: already FINISHED in the experiment (its resume key `key` in `done`), or a larger
    context of a model and KV type that already ran out of memory on the device (`ooms`: (key, context, run id);
    `run_as`: the trial on a pool's unit)."""
    if key in done:
        # The earlier run's figures go with it: the sweep's summary shows every trial's numbers, marked earlier.
        earlier = done[key]
        return TrialOutcome(trial, Status.SKIPPED, earlier_run_id=earlier["run_id"],
                            metrics=dict(earlier.get("metrics") or {}), noisy=bool(earlier.get("noisy")),
                            error="already FINISHED in this experiment (sweep.rerun=true runs it again)",
                            category=Category.RESUMED)
    for oom_key, context, run_id in ooms:
        # A serving backend's trial holds no fixed context (0): one server running out of memory says nothing
        # about the next declaration's.
        if trial.context_tokens and oom_key == _oom_key(run_as or trial) and trial.context_tokens >= context:
            return TrialOutcome(trial, Status.SKIPPED, category=Category.OOM_SKIP,
                                error=(f"skipped: the same model and KV type ran out of memory at context {context} "
                                       f"(run {run_id[:12]}); this trial needs {trial.context_tokens}"))
    return None


def sweep_note(plan: Plan, trials: list[Trial], description: str, sweep_id: str) -> str:
    """The parent run's description (markdown, the run page's Description)."""

    lines = [f"**{plan.experiment}**" + (f": {description}" if description else ""), ""]
    dims = ", ".join(f"`{k}` = {', '.join(map(str, v))}" for k, v in plan.dims.items()) or "none (one trial)"
    lines += [f"- sweep `{sweep_id}`: {len(trials)} trial(s); varying: {dims}",
              f"- overrides: `{' '.join(plan.overrides) or '(none)'}`",
              f"- per-trial summary: `{SUMMARY_TABLE}`; `jbench report --sweep {sweep_id}` attaches a report here"]
    return "\n".join(lines)


def summary_column(dimension: str) -> str:
    """A sweep dimension's column in the summary table: `model.quant` -> `model_quant`. MLflow's table view reads a
    dotted column name as a path into each row (row.model.quant), so the column would show empty."""
    return dimension.replace(".", "_")


def summary_rows(outcomes: list[TrialOutcome], dims: dict, earlier: Callable[[str], dict]) -> list[dict]:
    """One row per run: run name, the varying dimensions, status, prefill/decode tok/s, tokens per joule. A trial
    skipped as already FINISHED shows that run's figures (`earlier(run_id)`: its metrics, read from the store)."""
    rows = []
    for o in outcomes:
        metrics = o.metrics
        resumed = o.status == Status.SKIPPED and o.category == Category.RESUMED
        if resumed and o.run_id and not metrics:  # figures not read with the resume index: ask the store
            metrics = earlier(o.run_id)
        row: dict[str, Any] = {"run": o.trial.short_label, "run_id": o.run_id or ""}
        if o.device:
            row["device"] = o.device
        if o.attempt > 1:
            row["attempt"] = o.attempt
        row.update({summary_column(k): str(o.trial.point.get(k, "")) for k in dims})
        row["status"] = "FINISHED (earlier)" if resumed else str(o.status)
        for col in ("prefill_tps", "decode_tps", "decode_tokens_per_joule"):
            v = metrics.get(col)
            row[col] = round(float(v), 3) if v is not None and v == v else None
        if "decode_wall_tokens_per_joule" in metrics:  # a wall meter ran: its figure beside the board's
            v = metrics["decode_wall_tokens_per_joule"]
            row["decode_wall_tokens_per_joule"] = round(float(v), 3) if v == v else None
        rows.append(row)
    return rows


class _Sweep:
    def __init__(self, plan: Plan, tracker_factory: Callable[[], Tracker], *, every_unit: bool,
                 stages: Optional[list[Stage]], on_trial_start: Callable[[Trial], None],
                 on_trial_end: Callable[[TrialOutcome], None], on_unit_dropped: Callable[[str], None],
                 on_resume: Callable[[list[Trial]], None] = lambda trials: None,
                 order: Optional[Callable[[list[Trial]], Iterable[Trial]]] = None):
        if order is not None and plan.pool is not None:
            raise ValueError("a chosen trial order runs on one device, not a device class")
        self.plan, self.tracker_factory, self.every_unit = plan, tracker_factory, every_unit
        self.order = order
        self.on_resume = on_resume
        self.stages = stages if stages is not None else default_stages()
        self.on_trial_start, self.on_trial_end, self.on_unit_dropped = on_trial_start, on_trial_end, on_unit_dropped
        # This controller's own id: leases and power-state files name it (a resumed sweep's runs carry the old one).
        self.sweep_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        self.notes: list[str] = list(plan.notes)
        self.sessions: dict[str, DeviceSession] = {}
        self.units = Units()
        self.identities: dict[int, TrialIdentity] = {}
        self.quality_ids: dict[int, str] = {}  # trial index -> its quality identity (quality.enabled)
        self.scheduler: Scheduler = Scheduler()
        self.outcomes: list[TrialOutcome] = []
        self.ooms: list[tuple[tuple, int, str]] = []  # (model/KV/device key, context that failed, run id)
        self.uri = ""  # the store written (set by _run)

    # -- the whole sweep -----------------------------------------------------------------------------

    def run(self) -> SweepOutcome:

        uri = resolve_uri(self.plan.tracking.uri, self.plan.tracking.results_dir)
        exp_name = self.plan.tracking.experiment_name or self.plan.experiment
        with contextlib.ExitStack() as stack:  # a farm lease is released after the devices' sessions closed
            if self.plan.pool is not None:
                try:
                    self.units = take_units(self.plan.pool, stack, self.sweep_id)
                except UnitsError as exc:
                    raise PreflightError(str(exc)) from None
            try:
                return self._run(uri, exp_name)
            finally:
                sched.each(lambda s: s.close(), list(self.sessions.values()))

    def _device_trials(self, trials: list[Trial]) -> dict[str, list[Trial]]:
        """Trials as each device runs them: a pool's trial once on every unit (its device section the unit's)."""
        if self.plan.pool is None:
            out: dict[str, list[Trial]] = {}
            for t in trials:
                out.setdefault(t.cfg.device.name, []).append(t)
            return out
        return {u["name"]: [self._on_unit(t, u) for t in trials] for u in self.units.devices}

    @staticmethod
    def _on_unit(trial: Trial, unit: dict) -> Trial:
        """The planned trial as it runs on one unit: the unit's device section in place of the class."""
        return dataclasses.replace(trial, config={**trial.config, "device": unit})

    def _reboot_consent(self, device_trials: list[Trial]) -> bool:
        return any(t.cfg.power.allow_reboot for t in device_trials)

    def _open_sessions(self, by_device: dict[str, list[Trial]]) -> list[str]:
        """Connect every device (side by side for a pool's units); the problems found."""
        problems: list[str] = []
        for name, trials in by_device.items():
            first = trials[0].cfg
            self.sessions[name] = DeviceSession(first.device, first.profile, owner=self.sweep_id,
                                                reboot_consent=self._reboot_consent(trials))

        def open_(session: DeviceSession) -> None:
            found = session.connect()
            with self.scheduler.lock:
                problems.extend(p for p in found if p not in problems)

        sched.each(open_, list(self.sessions.values()))
        if self.plan.pool is not None:
            for name, session in self.sessions.items():
                session.extra_tags = self.units.tags(self.plan.pool, name, session.fingerprint)
        return problems

    def _preflight(self, trials: list[Trial]) -> list[Trial]:
        """Every device checked before anything changes; the trials to run (a pool's trial: when every unit can run
        it). PreflightError lists every problem found."""
        if self.plan.pool is not None and not self.units.devices:
            raise PreflightError(f"no unit of {self.plan.pool.name} to run on")
        by_device = self._device_trials(trials)
        problems = self._open_sessions(by_device)
        if problems:
            raise PreflightError("\n".join(problems))
        planned = {t.index: t.config for t in trials}
        kept: list[set[int]] = []
        for name, device_trials in by_device.items():
            found: Preflight = preflight(self.sessions[name], device_trials,
                                         skip_unavailable=self.plan.sweep.skip_unavailable_backends,
                                         identity_config=lambda t: planned[t.index])
            problems += [p for p in found.problems if p not in problems]
            self.notes += [n for n in found.notes if n not in self.notes]
            for index, ident in found.identities.items():
                seen = self.identities.setdefault(index, ident)
                if seen != ident:  # a pool's trial must be one trial whichever unit runs it
                    problems.append(f"device '{name}' differs from the other units of {self.plan.pool.name}: backend "
                                    f"build {ident.build} / model file {ident.model_digest} against {seen.build} / "
                                    f"{seen.model_digest}. Make the units the same, or pin one with device=NAME")
            kept.append({t.index for t in found.keep})
        if problems:
            raise PreflightError("\n".join(problems))
        self._quality_identities(by_device)
        # A pool's trial runs when every unit can run it (any unit may get it); else each device keeps its own.
        runnable = set.intersection(*kept) if self.plan.pool is not None else set().union(*kept)
        return [t for t in trials if t.index in runnable]

    def _quality_identities(self, by_device: dict[str, list[Trial]]) -> None:
        """Each quality trial's quality identity (the same on every unit of a pool: the device in it is the
        class). A reference file missing on the device is a problem found before anything runs."""
        problems: list[str] = []
        for name, device_trials in by_device.items():
            for trial in device_trials:
                if not trial.cfg.quality.enabled or trial.index in self.quality_ids:
                    continue
                try:
                    self.quality_ids[trial.index] = quality_request(trial, self.sessions[name]).identity
                except (ModelError, UserError) as exc:
                    problems.append(f"quality of {trial.label}: {exc}")
        if problems:
            raise PreflightError("\n".join(dict.fromkeys(problems)))

    def resume_key(self, trial: Trial) -> str:
        """The trial's identity (config, backend build, model file) and round: what resume matches on."""
        return resume_key(self.identities[trial.index].hash, trial.round)

    def _finished(self, uri: str, exp_name: str) -> dict[str, dict]:
        """FINISHED trials by identity: from the SQLite file directly when that answers exactly (no MLflow import),
        else through MLflow. Nothing when the store does not exist or sweep.rerun is set."""

        if self.plan.sweep.rerun or not store_exists(uri):
            return {}

        found = finished_trials_sqlite(uri, exp_name, key="identity")
        if found is None:
            from jbench.tracking.reader import finished_trials  # imports mlflow

            found = finished_trials(uri, exp_name, key="identity")
        return self._with_quality(found)

    def _with_quality(self, done: dict[str, dict]) -> dict[str, dict]:
        """Quality the store holds goes to the sessions (a trial of a known quality identity reuses it); a trial
        that asks for quality is done only when its FINISHED run has that quality."""
        known = {e["quality_identity"]: (f"run {e['run_id']}", {k: v for k, v in (e.get("metrics") or {}).items()
                                                                if k.startswith("quality_") and k != "quality_wall_s"})
                 for e in done.values() if e.get("quality_identity") and e.get("quality_ok")}
        for session in self.sessions.values():
            for ident, value in known.items():
                session.known_quality.setdefault(ident, value)
        for trial in self.plan.trials:
            wanted = self.quality_ids.get(trial.index)
            if wanted is None or trial.index not in self.identities:
                continue
            entry = done.get(self.resume_key(trial))
            if entry is not None and entry.get("quality_identity") != wanted:
                del done[self.resume_key(trial)]
        return done

    def _upload_disk_spool(self, uri: str) -> None:
        """Trials a full disk sent to the spool in jbench's cache go into their local store first, so resume sees
        them (finished: not measured again; their parent: the KILLED sweep to go on with)."""
        if local_path(uri) is None or not (disk_spool_dir(self.plan.tracking.results_dir) / "mlflow.db").exists():
            return
        from jbench.tracking.sync import sync_disk_spool  # imports mlflow: only when there is such a spool

        result = sync_disk_spool(self.plan.tracking.results_dir)
        if result is not None and result.uploaded:
            self.notes.append(f"{len(result.uploaded)} run(s) measured while the disk was full were uploaded from "
                              f"the spool into {redact(uri)}")

    def _run(self, uri: str, exp_name: str) -> SweepOutcome:
        self.uri = uri
        runnable = self._preflight(self.plan.trials)
        self._upload_disk_spool(uri)
        done = self._finished(uri, exp_name)
        if not [t for t in runnable if self.resume_key(t) not in done]:
            # Nothing to do: no lease taken, no power state touched, no empty sweep run recorded.
            outcomes = [self._skipped(t, done) for t in runnable]
            for outcome in outcomes:
                self.on_trial_end(outcome)
            return SweepOutcome(self.sweep_id, exp_name, None, uri, outcomes, self.notes)
        sessions = list(self.sessions.values())

        def lease(session: DeviceSession) -> None:
            try:
                session.lease(session.cfg.lease_wait_s)
            except DeviceError as exc:
                raise PreflightError(str(exc)) from None

        sched.each(lease, sessions)  # before anything changes: one controller per device
        # Planned again now that the devices are ours: a sweep that waited for a lease resumes what the holder
        # finished meanwhile instead of measuring it again.
        done = self._finished(uri, exp_name)
        self.on_resume([t for t in runnable if self.resume_key(t) in done])
        by_device = self._device_trials(runnable)
        sched.each(lambda s: s.save(any(t.cfg.wants_power_control for t in by_device[s.name])), sessions)
        return self._record(runnable, done, exp_name, uri)

    def _record(self, trials: list[Trial], done: dict[str, dict], exp_name: str, uri: str) -> SweepOutcome:
        plan = self.plan
        description = trials[0].cfg.experiment.description.strip() if trials else ""
        common = {"jbench.version": JBENCH_VERSION, "jbench.git_sha": git_sha(),
                  "jbench.protocol_version": PROTOCOL_VERSION, "jbench.controller": controller_id(),
                  **source_tags(sys.argv, git_sha())}
        recorder = Recorder(self.tracker_factory, experiment=exp_name, sweep_id=self.sweep_id, common_tags=common)
        overrides = " ".join(plan.overrides)

        def resume(t: Tracker) -> Optional[tuple[str, str, dict]]:
            """(parent run id, sweep id, its tags) of the KILLED sweep this one resumes: the parent of trials of this
            plan already FINISHED, left KILLED, with the same overrides. None: a new sweep."""
            seen: set[str] = set()
            for trial in trials:
                entry = done.get(self.resume_key(trial))
                if entry is None:
                    continue
                parent = t.run_record(entry["run_id"])["tags"].get("mlflow.parentRunId")
                if not parent or parent in seen:
                    continue
                seen.add(parent)
                rec = t.run_record(parent)
                if rec["status"] == "KILLED" and rec["params"].get("sweep.overrides") == overrides \
                        and rec["tags"].get("jbench.sweep_id"):
                    return parent, rec["tags"]["jbench.sweep_id"], rec["tags"]
            return None

        units = {s.name for s in self.sessions.values() if s.lease_ is not None}
        recorder.open_sweep(
            run_name=f"{plan.experiment} {wall_time()}",
            params={"sweep.overrides": overrides, "sweep.n_trials": len(trials),
                    **{f"sweep.dim.{k}": v for k, v in plan.dims.items()}},
            tags={"jbench.kind": "sweep", "jbench.experiment": plan.experiment,
                  "mlflow.note.content": sweep_note(plan, trials, description, self.sweep_id)},
            description=description, resume=resume, leased=units)
        runner = TrialRunner(recorder, self.stages, experiment=plan.experiment, retries=plan.sweep.connection_retries,
                             max_cv=plan.sweep.max_cv, rerun_noisy=plan.sweep.rerun_noisy, stop=self.scheduler.stop)
        try:
            if self.plan.pool is not None:
                self._run_pool(trials, done, runner)
            else:
                chosen = self.order(trials) if self.order is not None else trials
                self.scheduler.serial(chosen, lambda t: self._one(t, t, done, runner, None))
        except (KeyboardInterrupt, Stopped) as exc:
            self.scheduler.stop.set()
            reason = str(exc) if isinstance(exc, StoreFull) else interrupted_by(exc)
            with self.scheduler.lock:  # no worker starts or finishes a run after this
                running = [o for o in runner.running.values()]
                recorder.kill_sweep([o.run for o in running if o.run is not None], reason)
                for o in running:
                    o.status = Status.KILLED
                    self.outcomes.append(o)
            self.scheduler.wait_for_workers(lambda: [s.interrupt() for s in self.sessions.values()])
            recorder.close()
            if isinstance(exc, StoreFull):
                with contextlib.suppress(Exception):  # the writes of the trials so far: into the store, or the spool
                    recorder.flush()
                kept = (f"what was measured is kept in the spool {recorder.tracker.spool_uri}"
                        if recorder.disk_full else "every trial measured so far is recorded")
                raise StoreFull(f"{exc}; the sweep stopped and {kept}. Free some space and run the same command "
                                "again: it resumes the sweep") from None
            raise KeyboardInterrupt() from None
        record = recorder.sweep  # filled in by the writer: read once flushed
        n_failed = sum(o.status == Status.FAILED for o in self.outcomes)
        recorder.flush()
        # Under a resumed sweep's parent, its trials done before the interruption count as its finished ones.
        n_skipped = sum(o.status == Status.SKIPPED and not (record.resumed and o.category == Category.RESUMED)
                        for o in self.outcomes)
        status = "FAILED" if n_failed else "FINISHED"
        outcomes = list(self.outcomes)
        recorder.end_sweep(status, {"jbench.failed_trials": n_failed, "jbench.skipped_trials": n_skipped,
                                    "jbench.finished_trials": len(outcomes) - n_failed - n_skipped,
                                    **({"jbench.dropped": "; ".join(self.notes)[:5000]} if self.notes else {})},
                           lambda t: summary_rows(outcomes, plan.dims, lambda rid: t.run_record(rid)["metrics"]))
        recorder.flush()
        recorder.close()
        return SweepOutcome(record.record_id, exp_name, record.parent.run_id, uri, outcomes, self.notes,
                            recorder.tracker)

    # -- one trial, the sweep's policy around it --------------------------------------------------------

    def _skipped(self, trial: Trial, done: dict[str, dict], run_as: Optional[Trial] = None) -> Optional[TrialOutcome]:
        with self.scheduler.lock:
            ooms = list(self.ooms)
        return skipped(trial, self.resume_key(trial), done, ooms, run_as)

    def _one(self, trial: Trial, run_as: Trial, done: dict[str, dict], runner: TrialRunner,
             unit: Optional[str]) -> TrialOutcome:
        """Run (or skip) one trial on its device; report it; remember an out-of-memory failure."""
        # Nothing more can be recorded where it belongs: stop before measuring (the store's own error may come later).
        full = "no space left" if runner.recorder.disk_full else out_of_room(self.uri)
        if full:
            raise StoreFull(f"disk full: {redact(self.uri)}: {full}")
        with self.scheduler.lock:
            self.on_trial_start(run_as)
        skipped = self._skipped(trial, done if unit is None else {}, run_as)
        if skipped is not None:
            skipped.device = unit
            attempts = [skipped]
        else:
            session = self.sessions[run_as.cfg.device.name]
            attempts = runner.run(trial, session, identity=self.identities.get(trial.index), run_as=run_as,
                                  unit=unit)
        last = attempts[-1]
        with self.scheduler.lock:
            if last.category == Category.OUT_OF_MEMORY:
                self.ooms.append((_oom_key(run_as), trial.context_tokens, last.run_id or ""))
            if self.scheduler.stop.is_set():
                raise Stopped()
            self.outcomes.extend(attempts)
            self.on_trial_end(last)
        return last

    # -- a device class ---------------------------------------------------------------------------------

    def _run_pool(self, trials: list[Trial], done: dict[str, dict], runner: TrialRunner) -> None:
        todo = []
        for trial in trials:
            skipped = self._skipped(trial, done)
            if skipped is not None:  # already FINISHED, whichever unit ran it
                self.outcomes.append(skipped)
                self.on_trial_start(trial)
                self.on_trial_end(skipped)
            else:
                todo.append(trial)
        units = [Unit(name, self.units_by_name[name]) for name in self.sessions]
        groups = group_runs(todo, _group_key, len(units))

        def run(unit: Unit, trial: Trial) -> Optional[str]:
            try:
                outcome = self._one(trial, self._on_unit(trial, unit.value), done, runner, unit.name)
            except Stopped:
                raise
            except Exception as exc:  # a fault of the controller's side: this unit stops, its trials go on
                log.exception("worker of %s failed", unit.name)
                outcome = TrialOutcome(trial, Status.FAILED, category=Category.DEVICE, error=str(exc),
                                       device=unit.name)
                with self.scheduler.lock:
                    self.outcomes.append(outcome)
                    self.on_trial_end(outcome)
                unit.failures = 1 << 30
            reason = self._unit_unfit(unit, outcome)
            if reason:
                rest = "its other trials were not run" if self.every_unit else "its trials went to the other units"
                note = f"device '{unit.name}' dropped from {self.plan.pool.name}: {reason}; {rest}"
                with self.scheduler.lock:
                    self.notes.append(note)
                log.warning("%s", note)
                self.on_unit_dropped(note)
            return reason

        for left in self.scheduler.pool(units, groups, run, every_unit=self.every_unit):
            why = f"'{left.unit}' was dropped" if left.unit else f"no unit of {self.plan.pool.name} was left"
            for trial in left.items:
                outcome = TrialOutcome(trial, Status.FAILED, category=Category.DEVICE,
                                       error=f"not run: {why} (see the notes)", device=left.unit)
                self.outcomes.append(outcome)
                self.on_trial_end(outcome)

    @property
    def units_by_name(self) -> dict[str, dict]:
        return {u["name"]: u for u in self.units.devices}

    def _unit_unfit(self, unit: Unit, outcome: TrialOutcome) -> Optional[str]:
        """Why the unit must stop after one of its trials, or None. unit.failures: its run of device failures."""
        device_failure = outcome.status == Status.FAILED and outcome.category in (Category.CONNECTION_LOST,
                                                                                  Category.DEVICE)
        unit.failures = unit.failures + 1 if device_failure else 0
        farm = self.units.farm
        if farm is not None and outcome.status in (Status.FINISHED, Status.FAILED):
            after = self.plan.pool.farm.quarantine_after_failures
            try:
                with self.scheduler.lock:
                    if farm.record_trial(unit.name, device_failure=device_failure, quarantine_after=after):
                        return f"quarantined by the farm after {after} device failure(s) in a row"
            except Exception as exc:  # the coordinator's trouble is not the unit's
                log.warning("farm: recording the trial of %s failed: %s", unit.name, exc)
        if device_failure:  # a unit that no longer answers gets no further trial
            try:
                session = self.sessions[unit.name]
                session.reconnect(session.cfg.connect_timeout_s)
            except DeviceError as exc:
                return f"unreachable ({exc})"
        limit = max(1, self.plan.sweep.drop_device_after)
        if unit.failures >= limit:
            return f"{min(unit.failures, limit)} trial(s) in a row failed for device reasons (last: {outcome.error})"
        return None


class StoreFull(Stopped, UserError):
    """The results store's disk filled mid-sweep: the trials measured so far are in the spool (disk_spool_dir), no
    further trial starts, and the command ends with one line (exit 2)."""


def interrupted_by(exc: BaseException) -> str:
    """The failure reason of a run ended by an interruption: the signal when one was named (SIGTERM, SIGHUP)."""
    name = exc.args[0] if isinstance(exc, KeyboardInterrupt) and exc.args else "Ctrl-C"
    return f"interrupted ({name})"


# -- what the CLI and other callers use before and around a sweep ---------------------------------------------


class SweepInputError(Exception):
    """Bad input found before anything ran (the config, the store): one message naming the fix."""


def plan_sweep(overrides: list[str], config_dirs: list[str], *, use_grid: bool = True) -> Plan:
    """The plan of a command line: overrides checked, the user's config dirs added, the grid expanded (use_grid) and
    every trial validated. SweepInputError for a problem of the config as a whole; a problem of single trials is
    in Plan.problems."""
    from jbench.config import ConfigError, check_overrides, user_config_dirs
    from jbench.sweeps.plan import plan

    try:
        check_overrides(list(overrides))
        return plan(list(overrides), user_config_dirs(list(config_dirs)), use_grid=use_grid)
    except ConfigError as exc:
        raise SweepInputError(str(exc)) from None


@dataclass
class Store:
    """Where a sweep's runs go, checked before any device is touched."""

    uri: str
    shown: str  # the URI without its password
    spool: bool  # the server does not answer: measure into the local spool from the start
    notice: str = ""  # why the spool is used


# URI schemes an MLflow store can have (a plain path is a file store).
_STORE_SCHEMES = ("", "file", "sqlite", "http", "https", "databricks", "databricks-uc")


def check_store_uri(tracking: Any) -> str:
    """The tracking URI, refused with SweepInputError when MLflow cannot open it or it names a database (a dry run
    checks this much: it reads the store for its estimates)."""
    uri = resolve_uri(tracking.uri, tracking.results_dir)
    source = "tracking.uri" if tracking.uri else "$MLFLOW_TRACKING_URI"
    problem = database_problem(uri, source)
    if problem:
        raise SweepInputError(problem)
    if urlparse(uri).scheme.split("+")[0] not in _STORE_SCHEMES:
        raise SweepInputError(f"{source} '{redact(uri)}' is not a tracking store MLflow can open: give "
                              "http(s)://HOST:PORT for an MLflow server, sqlite:///PATH, or unset it to use the "
                              "results directory")
    return uri


def check_store(tracking: Any, experiment: str, trials: int = 1) -> Store:
    """The URI is one MLflow can open (check_store_uri), the results directory and store can be written and have
    room for `trials` trials, a tracking server answers (else tracking.unreachable decides: stop with
    SweepInputError, or spool), and the experiment was not written by a newer jbench. `tracking`: the plan's
    TrackingConfig; `experiment`: the MLflow experiment."""
    uri = check_store_uri(tracking)
    shown = redact(uri)
    problem = store_problem(uri, tracking.results_dir, trials)
    if problem:
        raise SweepInputError(f"cannot write results: {problem}. Free some space there, or set tracking.results_dir "
                              "(or $JBENCH_RESULTS_DIR) to a writable directory with room")
    if tracking.unreachable not in ("stop", "spool"):
        raise SweepInputError(f"tracking.unreachable={tracking.unreachable}: use stop or spool")
    down = server_problem(uri, wait_s=tracking.server_wait_s)
    if down is None:
        from jbench.tracking.format import StoreFormatError, check

        try:
            check(uri, tracking.experiment_name or experiment)
        except StoreFormatError as exc:
            raise SweepInputError(str(exc)) from None
        return Store(uri, shown, False)
    if tracking.unreachable == "stop":
        raise SweepInputError(f"tracking server {shown}: {down}. Start it, fix tracking.uri / $MLFLOW_TRACKING_URI, "
                              "or add tracking.unreachable=spool to measure into a local spool and upload it later "
                              "with `jbench sync`")
    return Store(uri, shown, True, f"tracking server {shown}: {down}; measuring into the spool "
                                   f"{spool_dir(tracking.results_dir)} (`jbench sync` uploads it once the server is back)")


def tracker_factory(tracking: Any, store: Store, notify: Callable[[str], None] = lambda m: None
                    ) -> Callable[[], Tracker]:
    """The store's writer, made when the recorder first writes (importing MLflow then, off the trial path)."""

    def make() -> Tracker:
        from jbench.tracking.writer import Tracker as MlflowTracker

        return MlflowTracker(tracking.uri, tracking.results_dir, spool=store.spool, notify=notify)

    return make


def _finished_runs(uri: str, exp_name: str, *, by_identity: bool) -> tuple[dict[str, dict], dict[str, dict]]:
    """({resume key by configuration: FINISHED run}, {by identity: ...} when asked) of an existing store: sqlite3
    when it can answer, else MLflow's reader; a store that does not answer gives none (an estimate, a dry run,
    is never worth an error)."""
    fast = finished_trials_sqlite(uri, exp_name, key="config_hash")
    if fast is not None:
        return fast, (finished_trials_sqlite(uri, exp_name, key="identity") or {}) if by_identity else {}
    from jbench.tracking.reader import finished_trials  # imports mlflow: only when sqlite3 cannot answer

    try:
        return (finished_trials(uri, exp_name),
                finished_trials(uri, exp_name, key="identity") if by_identity else {})
    except Exception as exc:  # an unreachable tracking server must not stop a sweep or a dry run
        log.warning("no duration estimate: %s", exc)
        return {}, {}


def _earlier(by_config: dict[str, dict], trial: Trial) -> dict:
    """The FINISHED run of trial's configuration (this round, else round 1), or {}."""
    return by_config.get(trial.resume_key) or by_config.get(resume_key(trial.config_hash, 1)) or {}


def durations(plan: Plan) -> dict[int, Optional[float]]:
    """Each planned trial's expected seconds: the wall time of an earlier FINISHED run of its configuration in the
    experiment (None: no such run). Read-only; a store that does not exist or does not answer gives no history."""
    uri = resolve_uri(plan.tracking.uri, plan.tracking.results_dir)
    by_config: dict[str, dict] = {}
    if store_exists(uri):
        by_config, _ = _finished_runs(uri, plan.tracking.experiment_name or plan.experiment, by_identity=False)
    return {t.index: _earlier(by_config, t).get("wall_s") or None for t in plan.trials}


@dataclass
class Estimate:
    trial: Trial
    seconds: Optional[float]  # from an earlier FINISHED run of the same configuration, else None
    finished: bool  # resume will skip it: a FINISHED run with its identity exists (unless sweep.rerun=true)
    unsure: bool = False  # finished by configuration only: its build and model file on a remote device not read


def _local_identities(plan: Plan) -> dict[int, TrialIdentity]:
    """The identity of each trial on this machine (read-only: the backend build and the model files are looked at,
    nothing is leased or changed). Trials on other devices are left out."""
    local = [t for t in plan.trials if t.cfg.device.kind == "local"]
    if not local or plan.pool is not None:
        return {}
    first = local[0].cfg
    with DeviceSession(first.device, first.profile, owner="dry-run") as session:
        if session.connect():
            return {}
        return preflight(session, local).identities


def estimates(plan: Plan) -> list[Estimate]:
    """Each planned trial's expected duration from the store's history and whether resume will skip it, without
    creating a store (`--dry-run`). Resume matches a trial's identity (configuration, backend build, model file):
    on this machine the identity is computed as the sweep would; a trial on a remote device is matched by its
    configuration and marked unsure. A tracking server that does not answer gives no estimates, not an error."""

    uri = check_store_uri(plan.tracking)
    by_config: dict[str, dict] = {}
    by_identity: dict[str, dict] = {}
    identities: dict[int, TrialIdentity] = {}
    if store_exists(uri):
        by_config, by_identity = _finished_runs(uri, plan.tracking.experiment_name or plan.experiment,
                                                by_identity=True)
        if by_config and not plan.sweep.rerun:
            identities = _local_identities(plan)
    out = []
    for t in plan.trials:
        entry = _earlier(by_config, t)
        if plan.sweep.rerun:
            finished, unsure = False, False
        elif t.index in identities:
            finished, unsure = resume_key(identities[t.index].hash, t.round) in by_identity, False
        else:
            finished, unsure = t.resume_key in by_config, t.resume_key in by_config
        out.append(Estimate(t, entry.get("wall_s") or None, finished, unsure))
    return out
