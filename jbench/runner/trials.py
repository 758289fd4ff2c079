"""One trial on one held device: preflight of what it needs there, then its stages inside one recorded run.

`preflight` checks, on a connected DeviceSession and before anything changes there, what every trial of a workflow
needs (the backend and its build, the model file, the power mode by name, sudo rights) and computes each trial's
identity (configuration + backend build + model file). `TrialRunner.run` runs a trial's stages (power state, device
state, thermal gate, measure, analyses) inside one run of the recorder: a lost connection is retried in the same
run with backoff; any stage error becomes a FAILED run with its category, logs and raw output, never a crashed
workflow; with `rerun_noisy` a noisy trial is measured once more. Every workflow (sweep, nightly, confirm, bisect)
runs its trials through here, so each gets the same thermal gate, per-trial fingerprint and telemetry.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import yaml

from jbench.backends.base import BackendError
from jbench.core.identity import trial_identity
from jbench.core.results import Category, Finding, Result, Status
from jbench.core.trial import Trial, TrialConfig
from jbench.device.connection import CommandInterrupted, ConnectionLost, DeviceError
from jbench.device.power import PowerStateError
from jbench.models.store import ModelError, resolve_model_file
from jbench.runner.context import TrialContext, TrialLog
from jbench.runner.recorder import Recorder, RunHandle
from jbench.runner.scheduler import Stopped
from jbench.runner.session import DeviceSession
from jbench.runner.stages import Stage


class TrialIdentity(NamedTuple):
    """What resume matches a trial on: the identity hash and the two values beside the config in it."""

    hash: str
    build: Optional[str]
    model_digest: Optional[str]


class PreflightError(Exception):
    """Problems found on the devices before any trial ran; nothing was recorded."""


@dataclass
class Preflight:
    """What preflight found on one device: the trials that can run there, their identities, notes on dropped ones."""

    keep: list[Trial] = field(default_factory=list)
    identities: dict[int, TrialIdentity] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def preflight(session: DeviceSession, trials: list[Trial], *, skip_unavailable: bool = False,
              identity_config: Callable[[Trial], dict] = lambda t: t.config, check_backend: bool = True) -> Preflight:
    """Check every trial against the connected device (module doc). `identity_config(trial)`: the config a trial's
    identity is made of (a pool's trial: the class's config, whichever unit runs it). check_backend=False: the
    backend's own preflight and the identities are left out (a bisection checks each build as it measures it)."""
    out = Preflight()
    checked: dict[str, list[str]] = {}  # one backend preflight per backend config

    def problem(msg: str) -> None:
        if msg not in out.problems:
            out.problems.append(msg)

    for trial in trials:
        cfg = trial.cfg
        backend_cfg = cfg.backend
        key = repr(backend_cfg)
        if key not in checked:
            checked[key] = session.backend(backend_cfg).preflight(session.connection) if check_backend else []
        msgs = checked[key]
        if msgs and skip_unavailable:
            note = f"dropped {trial.label}: backend {backend_cfg.name} not available on '{session.name}': {msgs[0]}"
            if note not in out.notes:
                out.notes.append(note)
            continue
        for msg in msgs:
            problem(msg)
        if not msgs:
            if check_backend:
                build, digest = session.build_id(backend_cfg), session.model_digest(cfg.model)
                out.identities[trial.index] = TrialIdentity(
                    trial_identity(identity_config(trial), build=build, model_digest=digest), build, digest)
            if session.backend(backend_cfg).reads_model_file(trial) and \
                    (msg := session.model_missing(cfg.model)) is not None:
                problem(msg)
        if cfg.wants_power_control:
            if session.strategy is None:
                problem(f"trial {trial.label} sets power.* but device '{session.name}' has no Jetson profile "
                        "(set device.profile)")
                continue
            if cfg.power.mode is not None:
                try:
                    session.strategy.mode_id(cfg.power.mode)
                except DeviceError as exc:
                    problem(str(exc))
        out.keep.append(trial)
    if not out.problems and session.strategy is not None and any(t.cfg.wants_power_control for t in out.keep):
        try:
            session.strategy.check_sudo()
        except DeviceError as exc:
            problem(str(exc))
    if skip_unavailable and not out.keep and not out.problems:
        problem("no backend of the sweep is available on the device: " + "; ".join(out.notes))
    return out


@dataclass
class TrialOutcome:
    trial: Trial
    status: Status
    run: Optional[RunHandle] = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: Optional[str] = None
    category: Optional[Category] = None
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)  # e.g. why energy was not measured
    findings: list[Finding] = field(default_factory=list)
    noisy: bool = False
    retries: int = 0  # reconnections after a lost connection, inside this one run
    device: Optional[str] = None  # the unit that ran it, in a sweep over a device class (device=@CLASS)
    attempt: int = 1  # with sweep.rerun_noisy: 2 for the trial measured again after a noisy first attempt
    earlier_run_id: Optional[str] = None  # skipped as already FINISHED: that run
    record: Optional[Result] = None  # everything the stages recorded (a FINISHED trial)

    @property
    def run_id(self) -> Optional[str]:
        return self.run.run_id if self.run is not None else self.earlier_run_id


def failure(exc: Exception) -> tuple[Category, dict[str, str]]:
    """The category of a stage's exception and the raw output it carries."""
    if isinstance(exc, PowerStateError):
        return Category.POWER_STATE, {}
    if isinstance(exc, BackendError):
        return Category(exc.category), {"raw/stdout.txt": exc.raw_output, "raw/stderr.txt": exc.raw_stderr}
    if isinstance(exc, ConnectionLost):
        return Category.CONNECTION_LOST, {}
    return Category.DEVICE, {}


_STAGE_ERRORS = (PowerStateError, BackendError, DeviceError)  # ConnectionLost is a DeviceError


def trial_note(trial: Trial, experiment: str) -> str:
    """A child run's description: what ran, in words."""
    cfg = trial.cfg
    b, m = cfg.backend, cfg.model
    # Sizes as the backend's config has them (every llama-bench-like backend has these; others may not).
    sizes = {k: getattr(b, k, None) for k in ("n_prompt", "n_gen", "depth", "repetitions")}
    what = (f"{m.display_name or m.name} {m.quant} with {b.name} on device '{cfg.device.name}': "
            f"prompt {sizes['n_prompt']} tokens, {sizes['n_gen']} generated")
    if sizes["depth"]:
        what += f", at depth {sizes['depth']}"
    what += f", {sizes['repetitions']} repetition(s)"
    if trial.rounds > 1:
        what += f" (round {trial.round} of {trial.rounds})"
    return f"Trial {trial.index} of {experiment or 'the sweep'}: {trial.short_label}. {what}."


class TrialRunner:
    """Runs trials through the stages and records each in its own run (module doc). Shared by a pool's workers."""

    def __init__(self, recorder: Recorder, stages: list[Stage], *, experiment: str, retries: int = 3,
                 max_cv: Optional[float] = None, rerun_noisy: bool = False,
                 stop: Optional[threading.Event] = None):
        self.recorder, self.stages, self.experiment = recorder, stages, experiment
        self.retries, self.max_cv, self.rerun_noisy = retries, max_cv, rerun_noisy
        self.stop = stop or threading.Event()
        self._lock = threading.Lock()
        self.running: dict[Optional[str], TrialOutcome] = {}  # unit (None: no pool) -> its trial with an open run

    def open_runs(self) -> list[RunHandle]:
        with self._lock:
            return [o.run for o in self.running.values() if o.run is not None]

    def run(self, trial: Trial, session: DeviceSession, *, identity: Optional[TrialIdentity] = None,
            run_as: Optional[Trial] = None, unit: Optional[str] = None, tags: Optional[dict[str, Any]] = None,
            name: Optional[str] = None) -> list[TrialOutcome]:
        """The trial's attempts (one, or two when the first was noisy and rerun_noisy is on), each recorded as a run.
        `run_as`: the trial as it runs on a pool's unit (the run records `trial`, the class's, and the unit in tags);
        `tags`: more tags for the run (a bisection step's); `name`: the run's name instead of the trial's label."""
        attempts: list[TrialOutcome] = []
        for attempt in range(1, (2 if self.rerun_noisy else 1) + 1):
            outcome = TrialOutcome(trial, Status.RUNNING, device=unit, attempt=attempt)
            with self._lock:
                self.running[unit] = outcome
            try:
                self._run(trial, run_as or trial, session, outcome, identity, tags or {}, name)
            except Exception as exc:  # a fault on the controller's side: the run is recorded, then it propagates
                if outcome.run is not None and not isinstance(exc, Stopped):
                    self.recorder.finish(outcome.run, str(Status.FAILED), {
                        "jbench.failure_reason": f"internal error: {exc}"[:5000],
                        "jbench.failure_category": str(Category.DEVICE)}, {})
                    with self._lock:
                        self.running.pop(unit, None)
                raise
            # KeyboardInterrupt leaves the outcome in `running`: the workflow records it KILLED.
            with self._lock:
                self.running.pop(unit, None)
            attempts.append(outcome)
            if not (outcome.status == Status.FINISHED and outcome.noisy):
                break
            if self.rerun_noisy and attempt == 1:
                session.log.info("trial %d is noisy (CV over sweep.max_cv): running it once more", trial.index)
        return attempts

    def _start_tags(self, trial: Trial, run_as: Trial, session: DeviceSession,
                    identity: Optional[TrialIdentity]) -> dict[str, Any]:
        tags: dict[str, Any] = {**session.fingerprint, **session.extra_tags,
                                "mlflow.note.content": trial_note(trial, self.experiment)}
        if identity is not None:
            tags.update({k: v for k, v in (("jbench.identity", identity.hash), ("jbench.build", identity.build),
                                           ("jbench.model_digest", identity.model_digest)) if v})
        try:
            _, model_facts = resolve_model_file(run_as.cfg.model)
            tags.update(model_facts)
        except ModelError:  # the backend reports a missing model as the trial's failure
            pass
        if identity is not None and identity.model_digest:
            tags["model.sha256"] = identity.model_digest  # the file benchmarked, as its identity counts it
        return tags

    def _run(self, trial: Trial, run_as: Trial, session: DeviceSession, outcome: TrialOutcome,
             identity: Optional[TrialIdentity], tags: dict[str, Any], name: Optional[str]) -> None:
        if self.stop.is_set():
            raise Stopped()
        outcome.run = self.recorder.start_trial(trial, {**self._start_tags(trial, run_as, session, identity), **tags},
                                                name=name)
        tlog = TrialLog(trial, outcome.device)
        started = time.monotonic()
        tlog.logger.info("trial %d: %s (config %s)%s", trial.index, trial.label, trial.config_hash,
                         f" on {session.name}" if run_as is not trial else "")
        cfg = run_as.cfg
        artifacts = {"config.yaml": yaml.safe_dump(run_as.config, sort_keys=False)}
        quiet = self.recorder.quiet if session.connection.is_local else None
        try:
            self._stages(run_as, cfg, session, outcome, tlog, artifacts, quiet, started)
        except (KeyboardInterrupt, Stopped) as exc:
            # Interrupted: the workflow ends the run KILLED; what is known so far goes with it, as a FAILED run's does.
            why = exc.args[0] if exc.args else "Ctrl-C" if isinstance(exc, KeyboardInterrupt) else "the workflow stopped"
            tlog.logger.warning("interrupted (%s) after %.1f s", why, time.monotonic() - started)
            artifacts["trial.log"] = tlog.text()
            tlog.close()
            outcome.run.kept = artifacts
            raise
        outcome.wall_s = time.monotonic() - started
        artifacts["trial.log"] = tlog.text()
        tlog.close()
        end_tags: dict[str, Any] = {}
        if outcome.retries:
            end_tags["jbench.retries"] = outcome.retries
        if outcome.error:
            end_tags.update({"jbench.failure_reason": outcome.error[:5000],
                             "jbench.failure_category": str(outcome.category)})
        self.recorder.finish(outcome.run, str(outcome.status), end_tags, artifacts)

    def _stages(self, run_as: Trial, cfg: TrialConfig, session: DeviceSession, outcome: TrialOutcome, tlog: TrialLog,
                artifacts: dict[str, str], quiet: Optional[Callable], started: float) -> None:
        """The stages of one attempt, retried in the same run after a lost connection; fills `outcome` and
        `artifacts` (a stage's record is merged in as it finishes or fails)."""
        while True:
            ctx = TrialContext(run_as, cfg, session, session.backend(cfg.backend), tlog.logger, max_cv=self.max_cv)
            if quiet is not None:
                ctx.quiet = quiet
            try:
                for stage in self.stages:
                    if stage.applies(ctx):
                        stage.run(ctx)
            except KeyboardInterrupt as exc:
                artifacts.update(ctx.record.artifacts)  # what the stages kept before the interruption
                if isinstance(exc, CommandInterrupted):  # the command's output up to the interruption
                    artifacts.update({"raw/stdout.txt": exc.stdout, "raw/stderr.txt": exc.stderr})
                raise
            except _STAGE_ERRORS as exc:
                category, raw = failure(exc)
                if self.stop.is_set():  # Ctrl-C closed the unit's connection: no retry, nothing re-applied
                    artifacts.update({**ctx.record.artifacts, **raw})  # the output up to the interruption
                    raise Stopped() from exc
                if category == Category.CONNECTION_LOST and outcome.retries < self.retries:
                    outcome.retries += 1
                    delay = 2 ** (outcome.retries - 1)
                    tlog.logger.warning("connection lost (%s); reconnecting in %d s (retry %d of %d)", exc, delay,
                                        outcome.retries, self.retries)
                    time.sleep(delay)
                    try:
                        session.reconnect(60)
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
            outcome.record = record
            outcome.notes = ctx.notes
            for f in record.findings:
                tlog.logger.warning("finding %s: %s", f.code, f.message)
            tlog.logger.info("FINISHED: %s", ", ".join(f"{k}={v:.4g}" for k, v in record.metrics.items()
                                                        if k.endswith("_tps")))
            self.recorder.measured(outcome.run, record)
            artifacts.update(record.artifacts)
            break
