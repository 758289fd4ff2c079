"""Run a validated plan: one MLflow parent run per sweep, one child run per trial.

A trial that fails (backend crash, unparseable output, timeout, missing file) becomes a FAILED
child run with its reason, category and logs, and the sweep goes on. Ctrl-C marks the current
trial and the sweep KILLED before re-raising.
"""

from __future__ import annotations

import io
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import yaml

from jbench import __version__, git_sha
from jbench.analysis.stats import describe
from jbench.backends.base import Backend, BackendError, backend_class
from jbench.device.connection import Connection, DeviceError
from jbench.device.connect import connect
from jbench.device.connection import ConnectionLost
from jbench.device.fingerprint import host_fingerprint
from jbench.device.jetson import jetson_fingerprint
from jbench.device.thermal import thermal_gate
from jbench.device.power import PowerStateError, PowerStrategy
from jbench.models.store import resolve_model_file
from jbench.trial import Trial, flatten
from jbench.results import BackendResult
from jbench.reporting.roofline import trial_roofline
from jbench.tracking.reader import finished_trials
from jbench.sweeps.measure import measure
from jbench.sweeps.plan import Plan

log = logging.getLogger("jbench")


class PreflightError(Exception):
    """Problems found on the device before any trial ran; nothing was recorded."""


@dataclass
class TrialOutcome:
    trial: Trial
    status: str  # FINISHED | FAILED | KILLED
    run_id: Optional[str] = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: Optional[str] = None
    category: Optional[str] = None
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)  # e.g. why energy was not measured
    findings: list[str] = field(default_factory=list)
    noisy: bool = False


@dataclass
class SweepOutcome:
    sweep_id: str
    experiment: str
    parent_run_id: Optional[str]
    tracking_uri: str
    outcomes: list[TrialOutcome]

    @property
    def failed(self) -> list[TrialOutcome]:
        return [o for o in self.outcomes if o.status in ("FAILED", "KILLED")]


def phase_metrics(result: BackendResult) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Summary metrics and per-repetition series, named as in docs/metrics.md."""
    metrics: dict[str, float] = {}
    stepped: dict[str, list[float]] = {}
    for phase, pr in result.phases.items():
        tps = pr.samples_tps
        st = describe(tps)
        metrics[f"{phase}_tps"] = st.mean
        metrics[f"{phase}_tps_std"] = st.std
        metrics[f"{phase}_tps_median"] = st.median
        metrics[f"{phase}_tps_ci95_low"], metrics[f"{phase}_tps_ci95_high"] = st.ci95
        metrics[f"{phase}_tps_cv"] = st.cv
        metrics[f"{phase}_tokens"] = pr.n_tokens
        metrics[f"{phase}_repetitions"] = st.n
        metrics[f"{phase}_ms_mean"] = describe([ns / 1e6 for ns in pr.samples_ns]).mean
        stepped[f"{phase}_tps_rep"] = tps
    return metrics, stepped


class _TrialLog:
    """Collects one trial's log lines for its artifact while also passing them to jbench's log."""

    def __init__(self, trial: Trial):
        self.buffer = io.StringIO()
        self.logger = logging.getLogger(f"jbench.trial.{trial.index}")
        self.logger.setLevel(logging.DEBUG)
        # Shown live only with -v (through the "jbench" logger's level); always kept in the artifact.
        self.logger.propagate = logging.getLogger("jbench").isEnabledFor(logging.DEBUG)
        self.handler = logging.StreamHandler(self.buffer)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self.logger.addHandler(self.handler)

    def text(self) -> str:
        return self.buffer.getvalue()

    def close(self) -> None:
        self.logger.removeHandler(self.handler)


def _backend_for(trial: Trial, cache: dict[str, Backend]) -> Backend:
    # One backend instance per distinct backend config within a sweep.
    key = repr(sorted(trial.config["backend"].items()))
    if key not in cache:
        cache[key] = backend_class(trial.config["backend"]["name"])(trial.config["backend"])
    return cache[key]


def _wants_power(trial: Trial) -> bool:
    power = trial.config.get("power") or {}
    return power.get("mode") is not None or power.get("jetson_clocks") is not None or power.get("fan") is not None


def run_plan(
    plan: Plan,
    *,
    tracker_factory: Callable[[], Any],
    on_trial_start: Callable[[Trial], None] = lambda t: None,
    on_trial_end: Callable[[TrialOutcome], None] = lambda o: None,
) -> SweepOutcome:
    """Preflight every device and backend, then run each trial in order.

    Devices whose trials ask for a power state get their original state saved first and restored
    at the end, whatever happens (an exception, Ctrl-C or SIGTERM turned into KeyboardInterrupt).
    """
    backends: dict[str, Backend] = {}
    connections: dict[str, Connection] = {}
    fingerprints: dict[str, dict[str, str]] = {}
    strategies: dict[str, PowerStrategy] = {}
    saved: list[PowerStrategy] = []
    preflighted: dict[tuple, list[str]] = {}  # one preflight per device and backend config
    unavailable: set[int] = set()
    try:
        # Preflight: reach every device and check every backend before the first trial.
        problems: list[str] = []
        for trial in plan.trials:
            dev = trial.config["device"]
            name = dev["name"]
            if name not in connections:
                try:
                    connections[name] = connect(dev)
                    fingerprints[name] = host_fingerprint(connections[name])
                    if dev.get("profile"):
                        fingerprints[name].update(jetson_fingerprint(connections[name], dev["paths"]))
                        strategies[name] = PowerStrategy(connections[name], dev, log)
                except DeviceError as exc:
                    problems.append(str(exc))
                    connections.pop(name, None)
                    continue
            backend = _backend_for(trial, backends)
            key = (name, repr(sorted(trial.config["backend"].items())))
            if key not in preflighted:
                preflighted[key] = backend.preflight(connections[name])
            msgs = preflighted[key]
            if msgs and (plan.sweep or {}).get("skip_unavailable_backends"):
                unavailable.add(trial.index)
                note = f"dropped {trial.label}: backend {trial.config['backend']['name']} not available on '{name}': {msgs[0]}"
                if note not in plan.notes:
                    plan.notes.append(note)
                continue
            for msg in msgs:
                if msg not in problems:
                    problems.append(msg)
            if _wants_power(trial):
                strategy = strategies.get(name)
                if strategy is None:
                    problems.append(f"trial {trial.label} sets power.* but device '{name}' has no Jetson profile "
                                    "(set device.profile)")
                    continue
                try:
                    if trial.config["power"].get("mode") is not None:
                        strategy.mode_id(trial.config["power"]["mode"])
                except DeviceError as exc:
                    if str(exc) not in problems:
                        problems.append(str(exc))
        for name in {t.config["device"]["name"] for t in plan.trials if _wants_power(t)}:
            if name in strategies and not problems:
                try:
                    strategies[name].check_sudo()
                except DeviceError as exc:
                    problems.append(str(exc))
        if unavailable:
            # skip_unavailable_backends: the backend_shootout runs what the device has.
            plan.trials = [t for t in plan.trials if t.index not in unavailable]
            if not plan.trials:
                problems.append("no backend of the sweep is available on the device: " + "; ".join(plan.notes))
        if problems:
            raise PreflightError("\n".join(problems))
        # A controller that died earlier may have left a device in a changed state: put it back first.
        for strategy in strategies.values():
            strategy.recover_leftover()
        for name in dict.fromkeys(t.config["device"]["name"] for t in plan.trials if _wants_power(t)):
            strategies[name].save_original()
            saved.append(strategies[name])
        return _run_trials(plan, backends, connections, fingerprints, strategies, tracker_factory(),
                           on_trial_start, on_trial_end)
    finally:
        for strategy in saved:
            try:
                strategy.log = log
                if not strategy.restore(allow_reboot=True):
                    log.error("the power state of %s was not fully restored; jbench will retry at its next start",
                              strategy.conn.name)
            except Exception as exc:  # keep restoring the other devices
                log.error("restoring the power state of %s failed: %s", strategy.conn.name, exc)
        for conn in connections.values():
            conn.close()


def _run_trials(plan, backends, connections, fingerprints, strategies, tracker, on_trial_start, on_trial_end) -> SweepOutcome:
    sweep_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    exp_name = plan.tracking.get("experiment_name") or plan.experiment
    exp_id = tracker.experiment_id(exp_name)
    common_tags = {"jbench.sweep_id": sweep_id, "jbench.version": __version__, "jbench.git_sha": git_sha()}
    parent = tracker.start_run(
        exp_id,
        f"sweep {sweep_id}",
        params={"sweep.overrides": " ".join(plan.overrides), "sweep.n_trials": len(plan.trials),
                **{f"sweep.dim.{k}": v for k, v in plan.dims.items()}},
        tags={**common_tags, "jbench.kind": "sweep", "jbench.experiment": plan.experiment},
    )
    outcomes: list[TrialOutcome] = []
    current: Optional[TrialOutcome] = None
    sweep = plan.sweep or {}
    done = {} if sweep.get("rerun") else finished_trials(tracker, exp_name)
    oom: list[tuple[tuple, int, str]] = []  # (model/KV/device key, context that failed, run id)
    try:
        for trial in plan.trials:
            on_trial_start(trial)
            dev_name = trial.config["device"]["name"]
            round_no = (trial.config.get("round") or {}).get("index", 1)
            key = f"{trial.config_hash}:{round_no}"
            if key in done:
                outcome = TrialOutcome(trial, "SKIPPED", run_id=done[key]["run_id"],
                                       error="already FINISHED in this experiment (sweep.rerun=true runs it again)",
                                       category="resumed")
                outcomes.append(outcome)
                on_trial_end(outcome)
                continue
            skip = _oom_skip(trial, oom)
            if skip:
                outcome = TrialOutcome(trial, "SKIPPED", error=skip, category="oom_skip")
                outcomes.append(outcome)
                on_trial_end(outcome)
                continue
            current = TrialOutcome(trial, "RUNNING")
            conn = connections[dev_name]
            outcome = _run_with_retries(trial, _backend_for(trial, backends), conn, fingerprints[dev_name],
                                        strategies.get(dev_name), tracker, exp_id, parent, common_tags, current,
                                        int(sweep.get("connection_retries", 3)))
            if outcome.status == "FINISHED" and sweep.get("rerun_noisy") and outcome.noisy:
                log.info("trial %d is noisy (CV over sweep.max_cv): running it once more", trial.index)
                outcomes.append(outcome)
                current = TrialOutcome(trial, "RUNNING")
                outcome = _run_with_retries(trial, _backend_for(trial, backends), conn, fingerprints[dev_name],
                                            strategies.get(dev_name), tracker, exp_id, parent, common_tags, current,
                                            int(sweep.get("connection_retries", 3)))
            outcomes.append(outcome)
            current = None
            if outcome.category == "out_of_memory":
                oom.append((_oom_key(trial), _context(trial), outcome.run_id or ""))
            on_trial_end(outcome)
    except KeyboardInterrupt:
        if current is not None and current.run_id:
            tracker.log(current.run_id, tags={"jbench.status": "KILLED", "jbench.failure_reason": "interrupted (Ctrl-C)"})
            tracker.end_run(current.run_id, "KILLED")
            current.status = "KILLED"
            outcomes.append(current)
        tracker.log(parent, tags={"jbench.status": "KILLED"})
        tracker.end_run(parent, "KILLED")
        raise
    n_failed = sum(o.status == "FAILED" for o in outcomes)
    n_skipped = sum(o.status == "SKIPPED" for o in outcomes)
    tracker.log(parent, tags={"jbench.failed_trials": n_failed, "jbench.skipped_trials": n_skipped,
                              "jbench.finished_trials": len(outcomes) - n_failed - n_skipped,
                              **({"jbench.dropped": "; ".join(plan.notes)[:5000]} if plan.notes else {})})
    tracker.end_run(parent, "FAILED" if n_failed else "FINISHED")
    return SweepOutcome(sweep_id, exp_name, parent, tracker.uri, outcomes)


def _context(trial: Trial) -> int:
    b = trial.config["backend"]
    return b.get("depth", 0) + b.get("n_prompt", 0) + b.get("n_gen", 0)


def _oom_key(trial: Trial) -> tuple:
    b, m = trial.config["backend"], trial.config["model"]
    return (trial.config["device"]["name"], m["name"], m["quant"], b.get("cache_type_k"), b.get("cache_type_v"))


def _oom_skip(trial: Trial, oom: list[tuple[tuple, int, str]]) -> Optional[str]:
    """After an out-of-memory failure, larger contexts of the same model and KV type are skipped."""
    for key, context, run_id in oom:
        if key == _oom_key(trial) and _context(trial) >= context:
            return (f"skipped: the same model and KV type ran out of memory at context {context} "
                    f"(run {run_id[:12]}); this trial needs {_context(trial)}")
    return None


def _run_with_retries(trial, backend, conn, fingerprint, strategy, tracker, exp_id, parent, common_tags,
                      outcome, retries: int) -> TrialOutcome:
    """A lost connection is retried with backoff (1, 2, 4 ... s) before the trial counts as failed."""
    attempt = 0
    while True:
        outcome = _run_one(trial, backend, conn, fingerprint, strategy, tracker, exp_id, parent, common_tags, outcome)
        if outcome.category != "connection_lost" or attempt >= retries:
            return outcome
        attempt += 1
        delay = 2 ** (attempt - 1)
        log.warning("trial %d: connection lost; reconnecting in %d s (retry %d of %d)", trial.index, delay, attempt, retries)
        time.sleep(delay)
        try:
            reconnect = getattr(conn, "reconnect", None)
            if reconnect is not None:
                reconnect(60)
        except DeviceError as exc:
            log.warning("reconnect failed: %s", exc)
        outcome = TrialOutcome(trial, "RUNNING", notes=[f"retry {attempt} after a lost connection"])


def _run_one(trial, backend, conn, fingerprint, strategy, tracker, exp_id, parent, common_tags, outcome) -> TrialOutcome:
    cfg = trial.config
    params = flatten(cfg)
    params.update({f"choice.{k}": v for k, v in trial.choices.items()})
    tags = {
        **common_tags,
        **fingerprint,
        "jbench.kind": "trial",
        "jbench.config_hash": trial.config_hash,
        "jbench.trial_index": trial.index,
        "jbench.trial_label": trial.label,
        "device.name": cfg["device"]["name"],
        "backend.name": cfg["backend"]["name"],
        "model.name": cfg["model"]["name"],
        "model.quant": cfg["model"]["quant"],
    }
    try:
        _, model_facts = resolve_model_file(cfg["model"])
        tags.update(model_facts)
    except Exception:  # the backend reports a missing model as the trial's failure
        pass
    name = f"{trial.index:03d} {trial.label}"
    outcome.run_id = tracker.start_run(exp_id, name, parent_run_id=parent, params=params, tags=tags)
    tlog = _TrialLog(trial)
    started = time.monotonic()
    files = {"config.yaml": yaml.safe_dump(cfg, sort_keys=False)}
    tlog.logger.info("trial %d: %s (config %s)", trial.index, trial.label, trial.config_hash)
    try:
        actual_mode = None
        if _wants_power(trial):
            power = trial.config["power"]
            strategy.log = tlog.logger
            changes = strategy.apply(power["mode"], power["jetson_clocks"], allow_reboot=power["allow_reboot"],
                                     reboot_timeout_s=power["reboot_timeout_s"], fan=power["fan"])
            snap = strategy.last
            actual_mode = snap.mode
            tracker.log(outcome.run_id, tags={"power.mode_actual": snap.mode, "power.mode_id": snap.mode_id,
                                              "power.jetson_clocks_actual": snap.clocks_locked,
                                              "power.changes": "; ".join(changes) or "none"})
        gate_tags = thermal_gate(conn, trial.config.get("thermal") or {}, tlog.logger)
        tracker.log(outcome.run_id, tags=gate_tags)
        measured = measure(trial, backend, conn, tlog.logger, actual_mode)
        result = measured.result
    except PowerStateError as exc:
        outcome.status, outcome.error, outcome.category = "FAILED", str(exc), "power_state"
        tlog.logger.error("FAILED (power_state): %s", exc)
    except BackendError as exc:
        outcome.status, outcome.error, outcome.category = "FAILED", str(exc), exc.category
        tlog.logger.error("FAILED (%s): %s", exc.category, exc)
        files["raw/stdout.txt"] = exc.raw_output
        files["raw/stderr.txt"] = exc.raw_stderr
    except ConnectionLost as exc:
        outcome.status, outcome.error, outcome.category = "FAILED", str(exc), "connection_lost"
        tlog.logger.error("FAILED (connection_lost): %s", exc)
    except DeviceError as exc:
        outcome.status, outcome.error, outcome.category = "FAILED", str(exc), "device"
        tlog.logger.error("FAILED (device): %s", exc)
    else:
        metrics, stepped = phase_metrics(result)
        metrics.update(measured.metrics)
        metrics.update(result.extra_metrics)
        metrics.update(result.metrics)
        for f in result.findings:  # backend-side diagnoses (e.g. the engine's GEMV trace)
            measured.tags[f"finding.{f['code']}"] = f["message"]
            outcome.findings.append(f["message"])
        if result.findings:
            files["backend_findings.json"] = json.dumps(result.findings, indent=2, default=str)
        roof_metrics, roof_tags = trial_roofline(cfg, metrics.get("decode_tps"))
        metrics.update(roof_metrics)
        measured.tags.update(roof_tags)
        max_cv = (cfg.get("quality") or {}).get("max_cv")
        cvs = {k: v for k, v in metrics.items() if k.endswith("_tps_cv") and v == v}
        if max_cv is not None and any(v > max_cv for v in cvs.values()):
            outcome.noisy = True
            tracker.log(outcome.run_id, tags={"jbench.noisy": "true", "jbench.noisy_reason": ", ".join(
                f"{k}={v:.3f} > sweep.max_cv={max_cv}" for k, v in cvs.items() if v > max_cv)})
        metrics["trial_wall_s"] = time.monotonic() - started
        outcome.metrics = metrics
        outcome.notes = [measured.sensor_problem] if measured.sensor_problem else []
        outcome.findings = [f.message for f in measured.findings]
        for f in measured.findings:
            tlog.logger.warning("finding %s: %s", f.code, f.message)
        files["raw/stdout.txt"] = result.raw_output
        files["raw/stderr.txt"] = result.raw_stderr
        files.update(measured.files)
        build_tags = {f"backend.{k}": v for k, v in result.build.items()}
        build_tags.update({f"backend.{k}": v for k, v in result.info.items()
                           if k in ("backends", "gpu_info", "cpu_info", "flash_attn")})
        build_tags.update(measured.tags)
        tracker.log(outcome.run_id, metrics=metrics, stepped=stepped, tags=build_tags)
        if measured.series:
            tracker.log_series(outcome.run_id, measured.series)
        outcome.status = "FINISHED"
        tlog.logger.info("FINISHED: %s", ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k.endswith("_tps")))
    outcome.wall_s = time.monotonic() - started
    files["trial.log"] = tlog.text()
    tlog.close()
    status_tags = {"jbench.status": outcome.status}
    if trial.config.get("round"):
        status_tags["jbench.round"] = trial.config["round"]["index"]
    if outcome.error:
        status_tags.update({"jbench.failure_reason": outcome.error[:5000], "jbench.failure_category": outcome.category})
    tracker.log(outcome.run_id, tags=status_tags)
    tracker.log_texts(outcome.run_id, {k: v for k, v in files.items() if v})
    tracker.end_run(outcome.run_id, outcome.status)
    return outcome
