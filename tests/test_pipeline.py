"""The trial pipeline: plug-ins found through entry points, stages in order, failures as categories,
retries inside one run. Unit tests: no llama.cpp run, a local device, a tracker that records calls."""

from __future__ import annotations

import sys
import textwrap

import pytest

from jbench.core import registry
from jbench.backends.base import BackendError
from jbench.device.connection import ConnectionLost
from jbench.device.local import LocalConnection
from jbench.core.results import BackendResult, Category, Finding, PhaseResult, Result, Status
from jbench.runner import session as session_module
from jbench.runner import trials as trials_module
from jbench.runner.memory import Memory
from jbench.runner.quality import Quality
from jbench.runner.serving import Serving
from jbench.runner.analyses import Noise, PhaseSpeed, Roofline
from jbench.sweeps.plan import plan
from jbench.runner.stages import (DeviceState, Measure, PowerState, Stage, StageError, ThermalGate, default_stages,
                                  order_analyses)
from jbench.sweeps.sweep import run_sweep


@pytest.fixture
def plugin_package(tmp_path, monkeypatch):
    """A user's package that adds an analysis and a telemetry source the way a real one does: an
    installed distribution's entry_points.txt, found by importlib.metadata on sys.path."""
    (tmp_path / "my_checks.py").write_text(textwrap.dedent('''
        from jbench.core.results import Result
        from jbench.runner.stages import Stage
        from jbench.device.telemetry.samplers import NoSampler

        class TokensPerWatt(Stage):
            NAME = "tokens_per_watt"
            REQUIRES = ("decode_tps",)
            PROVIDES = ("decode_tokens_per_watt",)
            def run(self, ctx):
                # Runs after phase_speed, which provides what it requires: it sees decode_tps in the record.
                ctx.record.merge(Result(tags={"my_checks.seen": ctx.trial.label},
                                        metrics={"my_checks.decode_tps_seen": ctx.record.metrics.get("decode_tps", -1.0)}))

        def silent(conn, device, profile, interval_ms):
            return NoSampler("my_checks: a source that never samples")
    '''))
    dist = tmp_path / "my_checks-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-checks\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[jbench.analyses]\ntokens_per_watt = my_checks:TokensPerWatt\n\n"
        "[jbench.samplers]\nsilent = my_checks:silent\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.targets.cache_clear()
    yield
    registry.targets.cache_clear()
    sys.modules.pop("my_checks", None)


def test_default_stages_are_power_gate_measure_then_analyses_in_the_order_their_metrics_need():
    kinds = [type(s) for s in default_stages()]
    assert kinds[:4] == [PowerState, DeviceState, ThermalGate, Measure]
    # phase_speed provides decode_tps and the CVs; noise and roofline require them (ties by name); quality and serving
    # need none.
    assert kinds[4:10] == [Memory, PhaseSpeed, Quality, Serving, Noise, Roofline]


def test_analyses_are_ordered_by_what_they_require_not_by_registration():
    class Late(Stage):
        NAME = "a_late"
        REQUIRES = ("roofline_fraction",)

        def run(self, ctx):
            pass

    class Early(Stage):
        NAME = "z_early"
        PROVIDES = ("my_metric",)

        def run(self, ctx):
            pass

    order = order_analyses([Late, Roofline, Early, PhaseSpeed])
    assert order.index(PhaseSpeed) < order.index(Roofline) < order.index(Late)
    assert order.index(Early) < order.index(Roofline)  # no requirement: in the first batch, by name


def test_a_requirement_nothing_provides_or_a_cycle_is_refused_when_the_stages_are_built():
    class Orphan(Stage):
        NAME = "orphan"
        REQUIRES = ("no_such_metric",)

        def run(self, ctx):
            pass

    with pytest.raises(StageError, match="'orphan' requires metric 'no_such_metric'"):
        order_analyses([PhaseSpeed, Orphan])

    class A(Stage):
        NAME = "a"
        PROVIDES = ("x_a",)
        REQUIRES = ("x_b",)

        def run(self, ctx):
            pass

    class B(Stage):
        NAME = "b"
        PROVIDES = ("x_b",)
        REQUIRES = ("x_a",)

        def run(self, ctx):
            pass

    with pytest.raises(StageError, match="cycle"):
        order_analyses([A, B])


def test_a_users_package_adds_an_analysis_and_a_telemetry_source(plugin_package):
    names = [type(s).__name__ for s in default_stages()]
    assert "TokensPerWatt" in names and names.index("TokensPerWatt") > names.index("PhaseSpeed")
    from jbench.device.telemetry.sources import make_sampler

    sampler = make_sampler("silent", LocalConnection(), {"name": "local"}, None, 100)
    assert sampler.problem == "my_checks: a source that never samples"
    problems = plan(["telemetry.source=silent"], use_grid=False).problems
    assert not [m for m in problems if "telemetry.source" in m], problems


def test_an_unknown_telemetry_source_is_refused_at_planning_with_the_valid_names():
    problems = [m for m in plan(["telemetry.source=bogus"], use_grid=False).problems if "telemetry.source" in m]
    assert len(problems) == 1 and "unknown telemetry.source 'bogus'" in problems[0]
    assert "tegrastats" in problems[0] and "nvml" in problems[0]


class _Tracker:
    """Records what the sweep writes, as MLflow would keep it."""

    uri = "memory://"

    def __init__(self):
        self.runs: dict[str, dict] = {}

    def experiment_id(self, name):
        return "1"

    def start_run(self, exp_id, name, *, parent_run_id=None, params=None, tags=None):
        run_id = f"run{len(self.runs)}"
        self.runs[run_id] = {"name": name, "parent": parent_run_id, "params": dict(params or {}),
                             "tags": dict(tags or {}), "metrics": {}, "files": {}, "status": "RUNNING"}
        return run_id

    def log(self, run_id, *, params=None, tags=None, metrics=None, stepped=None):
        self.runs[run_id]["tags"].update(tags or {})
        self.runs[run_id]["metrics"].update(metrics or {})

    def log_series(self, run_id, series):
        pass

    def log_texts(self, run_id, files):
        self.runs[run_id]["files"].update(files)

    def end_run(self, run_id, status):
        self.runs[run_id]["status"] = status

    def running_runs(self, exp_id):
        return [(rid, dict(r["tags"]), dict(r["params"])) for rid, r in self.runs.items() if r["status"] == "RUNNING"]

    def describe_experiment(self, exp_id, description):
        self.description = description

    def log_table(self, run_id, rows, artifact_file):
        self.runs[run_id]["files"][artifact_file] = rows

    def run_record(self, run_id):
        r = self.runs[run_id]
        return {"status": r["status"], "params": r["params"], "tags": r["tags"], "metrics": r["metrics"]}

    def reopen_run(self, run_id):
        self.runs[run_id]["status"] = "RUNNING"


class _Scripted(Stage):
    """A measure stage that plays a script: exceptions to raise, then a result."""

    NAME = "scripted"

    def __init__(self, script):
        self.script = list(script)
        self.calls = 0

    def run(self, ctx):
        self.calls += 1
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        ctx.backend_result = BackendResult(phases={"decode": PhaseResult("decode", 16, [100_000_000] * 3)},
                                           raw_output="raw", findings=[Finding("slow", "it is slow")])
        ctx.record.merge(Result(artifacts={"raw/stdout.txt": "raw"}, findings=list(ctx.backend_result.findings)))


class _Run:
    """run_sweep over a fake store, the local device, the given stages; `.run()` returns its SweepOutcome."""

    def __init__(self, p, tracker, stages):
        self.p, self.tracker, self.stages = p, tracker, stages

    def run(self):
        return run_sweep(self.p, lambda: self.tracker, stages=self.stages)


def _sweep(stages, monkeypatch, **sweep_overrides):
    from jbench.backends.llamacpp.backend import LlamaCppBackend

    # The device part of preflight runs for real on the local device; the backend's binary checks do not (no
    # llama.cpp here), and backoff waits take no time.
    monkeypatch.setattr(LlamaCppBackend, "preflight", lambda self, conn: [])
    monkeypatch.setattr(LlamaCppBackend, "build_id", lambda self, conn: None)
    monkeypatch.setattr(trials_module.time, "sleep", lambda s: None)
    monkeypatch.setattr("jbench.tracking.resume_index.finished_trials_sqlite", lambda *a, **k: {})
    p = plan(["telemetry.source=none", "model.quant=Q4_0"] +
             [f"sweep.{k}={v}" for k, v in sweep_overrides.items()], use_grid=False)
    tracker = _Tracker()
    return _Run(p, tracker, stages), tracker


def test_a_users_analysis_runs_in_a_trial_and_its_output_is_recorded(plugin_package, monkeypatch):
    # The default stage list with the measurement played by a script (no device, no llama.cpp here): the
    # registered analyses run after it in the order their metrics need, and what the user's adds lands in the run.
    stages = [_Scripted(["ok"]) if isinstance(s, Measure) else s for s in default_stages()
              if not isinstance(s, (PowerState, DeviceState, ThermalGate))]
    assert [type(s).__name__ for s in stages] == ["_Scripted", "Memory", "PhaseSpeed", "Quality", "Serving", "Noise",
                                                  "Roofline", "TokensPerWatt"]
    s, tracker = _sweep(stages, monkeypatch)
    outcome = s.run().outcomes[0]
    assert outcome.status == Status.FINISHED, outcome
    run = next(r for r in tracker.runs.values() if r["parent"])
    assert run["status"] == "FINISHED"
    assert run["tags"]["my_checks.seen"] == outcome.trial.label
    assert run["metrics"]["my_checks.decode_tps_seen"] == pytest.approx(160.0) == run["metrics"]["decode_tps"]


def test_a_lost_connection_is_retried_inside_one_run(monkeypatch):
    measure = _Scripted([ConnectionLost("link down"), ConnectionLost("link down"), "ok"])
    s, tracker = _sweep([measure, PhaseSpeed()], monkeypatch)
    outcome = s.run().outcomes[0]
    assert measure.calls == 3
    assert outcome.status == Status.FINISHED and outcome.retries == 2
    trial_runs = [r for r in tracker.runs.values() if r["parent"]]
    assert len(trial_runs) == 1, "a retried trial is one run, not a FAILED run plus a FINISHED one"
    run = trial_runs[0]
    assert run["status"] == "FINISHED" and run["tags"]["jbench.retries"] == 2
    assert run["metrics"]["decode_tps"] == pytest.approx(160.0)
    assert run["tags"]["finding.slow"] == "it is slow" and "findings.json" in run["files"]


def test_connection_retries_run_out_into_one_failed_run(monkeypatch):
    measure = _Scripted([ConnectionLost("gone")] * 3)
    s, tracker = _sweep([measure], monkeypatch, connection_retries=2)
    outcome = s.run().outcomes[0]
    assert measure.calls == 3 and outcome.status == Status.FAILED
    assert outcome.category == Category.CONNECTION_LOST
    run = next(r for r in tracker.runs.values() if r["parent"])
    assert run["status"] == "FAILED" and run["tags"]["jbench.failure_category"] == "connection_lost"


@pytest.mark.parametrize("exc, category", [
    (BackendError("out_of_memory", "cudaMalloc failed", raw_output="o", raw_stderr="e"), Category.OUT_OF_MEMORY),
    (BackendError("unparseable_output", "no JSON record", raw_output="garbage"), Category.UNPARSEABLE_OUTPUT),
])
def test_a_stage_failure_is_a_failed_run_with_its_category_and_raw_output(monkeypatch, exc, category):
    later = _Scripted(["ok"])
    s, tracker = _sweep([_Scripted([exc]), later], monkeypatch)
    outcome = s.run().outcomes[0]
    assert outcome.status == Status.FAILED and outcome.category == category
    assert later.calls == 0, "stages after a failure do not run"
    run = next(r for r in tracker.runs.values() if r["parent"])
    assert run["files"]["raw/stdout.txt"] == exc.raw_output
    assert "trial.log" in run["files"] and "config.yaml" in run["files"]


def test_noise_stage_marks_a_trial_whose_cv_is_over_the_limit(monkeypatch):
    class Jittery(_Scripted):
        def run(self, ctx):
            ctx.backend_result = BackendResult(phases={"decode": PhaseResult("decode", 16, [80e6, 120e6, 100e6])})

    s, tracker = _sweep([Jittery(["ok"]), PhaseSpeed(), Noise()], monkeypatch, max_cv=0.05)
    outcome = s.run().outcomes[0]
    assert outcome.noisy
    run = next(r for r in tracker.runs.values() if r["parent"])
    assert run["tags"]["jbench.noisy"] == "true" and "decode_tps_cv" in run["tags"]["jbench.noisy_reason"]


@pytest.mark.slow  # three sweeps into a real MLflow store: ~5 s
def test_resume_matches_on_identity_so_another_build_runs_again(tmp_path, monkeypatch):
    """The same config with the same llama.cpp build is resumed; the same config with another build is
    not "already FINISHED" (the build is part of the trial's identity). Real MLflow store in tmp_path."""
    from jbench.backends.llamacpp.backend import LlamaCppBackend
    from jbench.tracking.writer import Tracker

    build = {"commit": "0c1e57098"}
    monkeypatch.setattr(LlamaCppBackend, "preflight", lambda self, conn: [])
    monkeypatch.setattr(LlamaCppBackend, "build_id", lambda self, conn: build["commit"])
    monkeypatch.setattr(session_module, "host_fingerprint", lambda conn: {})
    p = plan(["telemetry.source=none", "model.quant=Q4_0", f"tracking.results_dir={tmp_path}"], use_grid=False)

    def run_once():
        stage = _Scripted(["ok"])
        outcome = run_sweep(p, lambda: Tracker(None, tmp_path), stages=[stage, PhaseSpeed()]).outcomes[0]
        return outcome, stage.calls

    first, calls = run_once()
    assert first.status == Status.FINISHED and calls == 1
    again, calls = run_once()
    assert again.status == Status.SKIPPED and again.category == Category.RESUMED and calls == 0
    assert again.run_id == first.run_id
    build["commit"] = "b4d5e6f"
    rebuilt, calls = run_once()
    assert rebuilt.status == Status.FINISHED and calls == 1
    from jbench.tracking.reader import runs_frame

    df = runs_frame(f"sqlite:///{tmp_path}/mlflow.db", [p.experiment], kinds=("trial",))
    assert set(df["tags.jbench.build"]) == {"0c1e57098", "b4d5e6f"}
    assert set(df["tags.jbench.hash_version"]) == {"2"} and df["tags.jbench.identity"].nunique() == 2
    assert df["tags.jbench.config_hash"].nunique() == 1  # same configuration: compare/regress still match them


def test_two_units_running_the_same_trial_keep_their_own_trial_logs():
    """A nightly over a class runs trial 3 on every unit at once: each run's trial.log holds its unit's lines only
    (a logger named by the trial index alone was shared, and both logs got both units' lines)."""
    from jbench.core.trial import Trial
    from jbench.runner.context import TrialLog

    trial = Trial(3, {"device": {"name": "@orin"}}, {}, {}, "h")
    logs = {unit: TrialLog(trial, unit) for unit in ("u1", "u2")}
    for unit, tlog in logs.items():
        tlog.logger.info("measured on %s", unit)
    for unit, tlog in logs.items():
        other = "u2" if unit == "u1" else "u1"
        assert f"measured on {unit}" in tlog.text() and f"measured on {other}" not in tlog.text()
        tlog.close()
