"""The run layer on its own: a DeviceSession's guarded lifecycle and step events, the Recorder writing behind the
trials, the Scheduler's queues. This machine is the device (a local connection); the store is a recording fake."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from jbench.core.results import Result
from jbench.core.schema import PowerConfig
from jbench.core.trial import Trial
from jbench.device.lease import LeaseBusy
from jbench.runner.recorder import Recorder, WriterError
from jbench.runner.scheduler import Scheduler, Unit, group_runs
from jbench.runner.session import DeviceSession, SessionStateError, State


def _device(tmp_path, name="local"):
    return {"name": name, "kind": "local", "paths": {"state_dir": str(tmp_path)}}


def test_a_session_goes_through_its_states_and_reports_every_step(tmp_path):
    events = []
    with DeviceSession(_device(tmp_path), owner="s1", on_step=events.append) as s:
        assert s.state is State.NEW
        assert s.connect() == [] and s.state is State.CONNECTED
        assert s.fingerprint  # host facts read through the connection
        s.lease()
        assert s.state is State.LEASED and list(tmp_path.glob("lease-local.json"))
        s.save(control_power=False)
        assert s.state is State.SAVED
    assert s.state is State.CLOSED
    assert not list(tmp_path.glob("lease-local.json"))  # released
    assert [(e.step, e.state) for e in events] == [("connect", State.CONNECTED), ("lease", State.LEASED),
                                                   ("save", State.SAVED), ("close", State.CLOSED)]
    assert all(e.error is None and e.duration_s >= 0 for e in events)


def test_a_step_in_the_wrong_state_is_refused_as_a_bug(tmp_path):
    s = DeviceSession(_device(tmp_path), owner="s1")
    with pytest.raises(SessionStateError, match="lease in state new"):
        s.lease()
    assert s.connect() == []
    with pytest.raises(SessionStateError, match="apply in state connected"):
        s.apply(PowerConfig(mode="15W"))
    with pytest.raises(SessionStateError, match="connect in state connected"):
        s.connect()
    s.lease()
    s.save(control_power=True)
    with pytest.raises(SessionStateError, match="no saved power state"):  # not a Jetson: nothing to apply
        s.apply(PowerConfig(mode="15W"))
    s.close()
    s.close()  # closing twice does nothing


def test_a_failed_step_is_reported_with_its_error_and_keeps_the_state(tmp_path):
    events = []
    first = DeviceSession(_device(tmp_path), owner="s1")
    second = DeviceSession(_device(tmp_path), owner="s2", on_step=events.append)
    try:
        assert first.connect() == [] and second.connect() == []
        first.lease()
        with pytest.raises(LeaseBusy, match="in use by another jbench controller"):
            second.lease()
        assert second.state is State.CONNECTED
        assert events[-1].step == "lease" and "in use" in events[-1].error
    finally:
        first.close()
        second.close()
    with DeviceSession(_device(tmp_path), owner="s3") as third:  # free again once the holder closed
        assert third.connect() == []
        third.lease()


def test_an_unreachable_device_is_a_problem_not_an_exception(tmp_path):
    s = DeviceSession({"name": "far", "kind": "ssh", "host": "127.0.0.1", "port": 1, "user": "nobody",
                       "connect_timeout_s": 2, "paths": {"state_dir": str(tmp_path)}}, owner="s1")
    problems = s.connect()
    assert problems and s.state is State.NEW
    s.close()


class _Store:
    """A store that records calls in order; `slow` makes each call take that long; `fail_on` raises on that call."""

    uri = "memory://"

    def __init__(self, slow=0.0, fail_on=None):
        self.calls: list[tuple] = []
        self.slow, self.fail_on = slow, fail_on
        self.thread_names: set[str] = set()

    slow_gate = None  # a threading.Event every call waits for

    def _call(self, name, *args):
        self.thread_names.add(threading.current_thread().name)
        if self.slow_gate is not None:
            assert self.slow_gate.wait(60), "the test never opened the gate"
        time.sleep(self.slow)
        if name == self.fail_on:
            raise RuntimeError(f"{name} refused")
        self.calls.append((name, *args))

    def experiment_id(self, name):
        self._call("experiment_id", name)
        return "1"

    def describe_experiment(self, exp, description):
        self._call("describe_experiment")

    def running_runs(self, exp):
        return []

    def start_run(self, exp, name, *, parent_run_id=None, params=None, tags=None):
        self._call("start_run", name, parent_run_id)
        return f"run-{name}"

    def log(self, run_id, **kw):
        self._call("log", run_id, tuple(sorted(kw.get("metrics") or {})), tuple(sorted(kw.get("tags") or {})))

    def log_series(self, run_id, series):
        self._call("log_series", run_id)

    def log_texts(self, run_id, files):
        self._call("log_texts", run_id, tuple(sorted(files)))

    def log_table(self, run_id, rows, name):
        self._call("log_table", run_id, len(rows))

    def end_run(self, run_id, status):
        self._call("end_run", run_id, status)

    def run_record(self, run_id):
        return {"status": "FINISHED", "params": {}, "tags": {}, "metrics": {}}

    def reopen_run(self, run_id):
        self._call("reopen_run", run_id)


def _trial(index=1):
    return Trial(index, {"device": {"name": "local"}, "backend": {"name": "llamacpp"}, "model": {"name": "m"}},
                 {}, {"model.quant": f"Q{index}"}, "h")


def _recorder(store):
    rec = Recorder(lambda: store, experiment="e", sweep_id="sweep1", common_tags={"jbench.version": "x"})
    rec.open_sweep(run_name="sweep", params={}, tags={"jbench.kind": "sweep"}, description="", resume=lambda t: None,
                   leased=set())
    return rec


def test_the_recorder_writes_behind_the_trial_in_order_and_fills_in_run_ids():
    store = _Store()
    gate = threading.Event()
    store.slow_gate = gate
    rec = _recorder(store)
    gate.set()
    handle = rec.start_trial(_trial(), {"extra": "1"})  # waits for its run alone: a killed controller leaves it
    assert handle.run_id == "run-Q1"
    gate.clear()  # the store is stuck from here on (a slow server)
    rec.measured(handle, Result(metrics={"decode_tps": 1.0}))
    rec.finish(handle, "FINISHED", {}, {"trial.log": "lines"})
    # The trial path queued its metrics and artifacts and went on.
    assert [c[0] for c in store.calls] == ["experiment_id", "describe_experiment", "start_run", "start_run"]
    gate.set()
    rec.end_sweep("FINISHED", {}, lambda t: [{"run": "Q1"}])
    rec.flush()
    rec.close()
    assert rec.sweep.parent.run_id == "run-sweep"
    names = [c[0] for c in store.calls]
    assert names == ["experiment_id", "describe_experiment", "start_run", "start_run", "log", "log", "log_texts",
                     "end_run", "log", "log_table", "end_run"]
    assert store.thread_names == {"jbench-recorder"}  # one writer thread, never the trial's


def test_run_creations_go_ahead_of_queued_writes():
    """The next trial's run is created without waiting for the earlier trials' queued metrics and artifacts."""
    store = _Store()
    gate = threading.Event()
    store.slow_gate = gate
    gate.set()
    rec = _recorder(store)
    first = rec.start_trial(_trial(1), {})
    with rec.quiet():  # holds the first trial's writes back, as a measurement on this machine does
        rec.finish(first, "FINISHED", {}, {"trial.log": "x"})
        second = rec.start_trial(_trial(2), {})  # created now, ahead of them
        assert second.run_id == "run-Q2"
        assert [c[0] for c in store.calls][-2:] == ["start_run", "start_run"]
    rec.flush()
    rec.close()
    assert [c[0] for c in store.calls][-4:] == ["start_run", "log", "log_texts", "end_run"]


def test_no_write_starts_while_a_local_measurement_is_quiet():
    store = _Store(slow=0.05)
    rec = _recorder(store)
    handle = rec.start_trial(_trial(), {})
    with rec.quiet():  # waits for the running write, then holds the writer
        done_before = len(store.calls)
        rec.measured(handle, Result(metrics={"decode_tps": 1.0}))
        rec.finish(handle, "FINISHED", {}, {})
        time.sleep(0.3)
        assert len(store.calls) == done_before  # queued, not written, while the measurement runs
    rec.flush()
    assert [c[0] for c in store.calls[done_before:]] == ["log", "log", "log_texts", "end_run"]
    rec.close()


def test_a_write_the_store_refuses_surfaces_at_the_next_write_or_flush():
    store = _Store(fail_on="log_texts")
    rec = _recorder(store)
    handle = rec.start_trial(_trial(), {})
    rec.finish(handle, "FINISHED", {}, {"trial.log": "x"})
    with pytest.raises(WriterError, match="log_texts refused"):
        rec.flush()
    with pytest.raises(WriterError):
        rec.start_trial(_trial(2), {})
    rec.close()


def test_a_killed_run_gets_nothing_written_after_the_kill():
    store = _Store()
    rec = _recorder(store)
    handle = rec.start_trial(_trial(), {})
    rec.flush()
    rec.kill_sweep([handle], "interrupted (Ctrl-C)")
    rec.measured(handle, Result(metrics={"decode_tps": 1.0}))
    rec.finish(handle, "FINISHED", {}, {})
    rec.flush()
    rec.close()
    ends = [c for c in store.calls if c[0] == "end_run"]
    assert ends == [("end_run", "run-Q1", "KILLED"), ("end_run", "run-sweep", "KILLED")]
    assert not [c for c in store.calls if c[0] == "log" and c[2] == ("decode_tps",)]


def test_ctrl_c_while_a_trials_run_is_being_created_kills_that_run_too():
    """Ctrl-C lands while a worker's trial waits for its run to be created (a slow store): the trial path has no
    handle yet, so the sweep's list of open runs lacks it. The run must still end KILLED, never stay RUNNING (CI saw a
    class sweep leave one); and a run created just after the kill is ended KILLED at once."""
    store = _Store()
    gate = threading.Event()
    store.slow_gate = gate
    gate.set()
    rec = _recorder(store)
    rec.flush()
    gate.clear()  # the store stalls: the next creation waits
    got = {}
    worker = threading.Thread(target=lambda: got.setdefault("h", rec.start_trial(_trial(2), {})))
    worker.start()
    deadline = time.monotonic() + 10
    while not rec._open and time.monotonic() < deadline:
        time.sleep(0.01)
    rec.kill_sweep([], "interrupted (Ctrl-C)")  # the open runs the sweep knows of: none
    gate.set()
    worker.join(10)
    late = rec.start_trial(_trial(3), {})  # a worker that checked for the stop just before it was set
    rec.flush()
    rec.close()
    assert got["h"].killed and late.killed
    ends = [c for c in store.calls if c[0] == "end_run"]
    assert ("end_run", "run-Q2", "KILLED") in ends and ("end_run", "run-Q3", "KILLED") in ends
    assert ("end_run", "run-sweep", "KILLED") in ends and len(ends) == 3


def test_group_runs_keeps_neighbours_together_within_an_even_share():
    items = [("A", i) for i in range(5)] + [("B", i) for i in range(2)]
    groups = group_runs(items, key=lambda x: x[0], units=2)
    assert groups == [[("A", 0), ("A", 1), ("A", 2), ("A", 3)], [("A", 4)], [("B", 0), ("B", 1)]]


def test_the_shared_queue_runs_every_item_once_and_a_dropped_units_rest_goes_to_the_others():
    ran: list[tuple[str, int]] = []
    lock = threading.Lock()

    def run(unit, item):
        with lock:
            ran.append((unit.name, item))
        if unit.name == "bad":
            return "broken"  # the unit stops: the rest of its group goes back to the queue
        time.sleep(0.01)
        return None

    s: Scheduler = Scheduler()
    left = s.pool([Unit("good", None), Unit("bad", None)], [[1, 2, 3], [4, 5], [6]], run)
    assert left == []
    assert sorted(i for _, i in ran) == [1, 2, 3, 4, 5, 6]  # each once
    assert len([u for u, _ in ran if u == "bad"]) == 1


def test_every_unit_runs_every_item_and_reports_what_a_dropped_unit_left():
    ran: dict[str, list[int]] = {"u1": [], "u2": []}

    def run(unit, item):
        ran[unit.name].append(item)
        return "gone" if unit.name == "u2" and item == 2 else None

    left = Scheduler().pool([Unit("u1", None), Unit("u2", None)], [[1, 2], [3]], run, every_unit=True)
    assert ran == {"u1": [1, 2, 3], "u2": [1, 2]}
    assert [(x.unit, x.items) for x in left] == [("u2", [3])]


def test_a_link_lost_while_the_wall_meter_starts_stops_the_device_sampler(tmp_path, monkeypatch):
    """The device's telemetry sampler is started before the wall meter; a ConnectionLost while the meter started
    left the sampler running on the device."""
    from jbench.backends.llamacpp.backend import LlamaCppBackend
    from jbench.device.connection import ConnectionLost
    from jbench.runner import measure as measure_module
    from jbench.runner.context import TrialContext
    from jbench.sweeps.plan import plan

    class Started:
        source, problem = "fake", None
        stopped = 0

        def start(self):
            pass

        def wait_for_samples(self, n, timeout_s):
            return True

        def stop(self):
            self.stopped += 1
            return []

    sampler = Started()
    monkeypatch.setattr(measure_module, "make_sampler", lambda *a, **k: sampler)

    def link_drops(conn, rounds):
        raise ConnectionLost("link down while measuring the clock offset")

    monkeypatch.setattr(measure_module, "measure_clock_offset", link_drops)
    trial = plan(["wall_power.source=shelly", "wall_power.host=127.0.0.1", "wall_power.port=9"], use_grid=False).trials[0]
    with DeviceSession(_device(tmp_path), owner="s1") as session:
        assert session.connect() == []
        ctx = TrialContext(trial, trial.cfg, session, LlamaCppBackend(trial.cfg.backend), logging.getLogger("t"))
        with pytest.raises(ConnectionLost):
            measure_module.measure(ctx)
    assert sampler.stopped == 1
