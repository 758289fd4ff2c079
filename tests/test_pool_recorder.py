"""A sweep over a device class writes its finished trials' runs behind its workers (bench/farm_scale.py found 64
units ending together waiting ~9 s each in line for the tracker before their devices got more work): the worker
hands the run over and goes on, the run is written by the recorder's own thread, and nothing is lost when the
sweep ends. Real MLflow store (SQLite); the tracker is wrapped only to hold one write until the test looks."""

from __future__ import annotations

import threading

from mlflow.tracking import MlflowClient

from jbench.results import Status
from jbench.sweeps.plan import plan
from jbench.sweeps.sweep import TrialOutcome, _Recorder
from jbench.tracking.writer import Tracker


class HeldEndRun:
    """The real tracker, except that end_run waits until the test lets it go."""

    def __init__(self, tracker: Tracker):
        self._tracker = tracker
        self.entered = threading.Event()
        self.go = threading.Event()

    def end_run(self, run_id: str, status: str) -> None:
        self.entered.set()
        assert self.go.wait(60), "the test never let end_run go"
        self._tracker.end_run(run_id, status)

    def __getattr__(self, name: str):
        return getattr(self._tracker, name)


def _setup(tmp_path):
    trials = plan(["backend.n_gen=4,8"], []).trials
    real = Tracker(None, tmp_path / "r")
    exp_id = real.experiment_id("adhoc")
    parent = real.start_run(exp_id, "sweep", tags={"jbench.kind": "sweep"})
    held = HeldEndRun(real)
    return trials, real, held, _Recorder(held, exp_id, parent, {}, "adhoc"), MlflowClient(real.uri)


def test_a_finished_trial_is_written_behind_its_worker_and_drain_waits_for_it(tmp_path):
    trials, real, held, recorder, client = _setup(tmp_path)
    recorder.write_behind()
    run_id = recorder.start(trials[0], {}, None)
    outcome = TrialOutcome(trials[0], Status.FINISHED, run_id=run_id)
    recorder.finish_soon(outcome, {"trial.log": "the trial's log\n"})  # returns while the write is held
    assert held.entered.wait(60)
    # The worker is free while its run is still being written: it can start its next trial's run meanwhile.
    assert client.get_run(run_id).info.status == "RUNNING"
    drained = threading.Thread(target=recorder.drain)
    drained.start()
    drained.join(0.5)
    assert drained.is_alive()  # drain waits for the queued write
    held.go.set()
    drained.join(60)
    assert not drained.is_alive()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["jbench.status"] == "FINISHED"
    assert [a.path for a in client.list_artifacts(run_id)] == ["trial.log"]


def test_after_drain_and_without_write_behind_a_run_is_written_at_once(tmp_path):
    trials, real, held, recorder, client = _setup(tmp_path)
    held.go.set()
    first = recorder.start(trials[0], {}, None)
    recorder.finish_soon(TrialOutcome(trials[0], Status.FINISHED, run_id=first), {})  # no writer: now
    assert client.get_run(first).info.status == "FINISHED"
    recorder.write_behind()
    recorder.drain()
    second = recorder.start(trials[1], {}, None)
    recorder.finish_soon(TrialOutcome(trials[1], Status.FAILED, run_id=second, error="boom"), {})
    run = client.get_run(second)
    assert run.info.status == "FAILED" and run.data.tags["jbench.failure_reason"] == "boom"
