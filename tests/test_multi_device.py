"""Sweeps across a device class (`device=@CLASS`): three emulated Orin Nano Supers (real sshd on loopback), an
engine whose device-side work is a fixed sleep (tests/fixtures/engine/sleep_engine.sh), so the tests measure the
controller: every trial once, spread over the units, each unit's power state restored, a lost unit's trials run
by the others, pinning, resume whichever unit ran a trial, and the class's places leased from a real coordinator;
each unit's serial in its runs, a controller SIGKILLed mid-sweep cleaned up and completed by a re-run, Ctrl-C."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from jbench.farm import places as P
from jbench.farm.coordinator import Coordinator
from jbench.core.results import Status
from jbench.sweeps.plan import plan
from jbench.sweeps.sweep import run_sweep

from .conftest import jbench_cli
from .labgrid_fixture import coordinator  # noqa: F401  (a fixture)
from .labgrid_fixture import eventually
from .test_ssh_devices import device_cfg

SLEEP_ENGINE = Path(__file__).parent / "fixtures" / "engine" / "sleep_engine.sh"
CLASS = "orin_nano_super"
UNITS = ("u1", "u2", "u3")
N_GEN = "backend.n_gen=4,8,16,32,64,128"  # six trials of one model and power state
COMMON = ["backend=sleepy", "telemetry.source=none", "thermal.start_below_c=null", "power.mode=15W",
          "power.jetson_clocks=true"]


def _conf(tmp_path: Path, emus: dict, *, device_class: str = CLASS) -> Path:
    conf = tmp_path / "conf"
    (conf / "device").mkdir(parents=True, exist_ok=True)
    (conf / "backend").mkdir(exist_ok=True)
    for name, emu in emus.items():
        body = {"defaults": ["device_schema", "_self_"], **device_cfg(emu, name=name, device_class=device_class)}
        (conf / "device" / f"{name}.yaml").write_text(yaml.safe_dump(body))
    (conf / "backend" / "sleepy.yaml").write_text(yaml.safe_dump({
        "defaults": ["engine_schema", "_self_"], "name": "engine", "output": "log", "n_prompt": 16, "n_gen": 8,
        "repetitions": 1, "command": [str(SLEEP_ENGINE), "1.5", "{prompt_tokens}", "{gen_tokens}"]}))
    return conf


@pytest.fixture
def three_units(emulated_jetson_factory):
    return {name: emulated_jetson_factory(CLASS) for name in UNITS}


def _trial_runs(results: Path, experiment: str = "adhoc") -> list:
    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    exp = client.get_experiment_by_name(experiment)
    return [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("jbench.kind") == "trial"]


def _restored(emu) -> bool:
    return emu.nvpmodel_mode_name == "25W" and not emu.clocks_locked


def _mode_set_on(emu) -> bool:
    return any(c["tool"] == "nvpmodel" and "-m" in c["argv"] for c in emu.command_log())


@pytest.mark.ssh
@pytest.mark.e2e
def test_a_class_sweep_runs_each_trial_once_over_every_unit_and_resumes_whichever_ran_it(three_units, tmp_path):
    conf = _conf(tmp_path, three_units)
    argv = ["sweep", "--config-dir", str(conf), f"device=@{CLASS}", N_GEN, *COMMON]
    env = {"JBENCH_RESULTS_DIR": str(tmp_path / "r")}
    res = jbench_cli(argv, env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = _trial_runs(tmp_path / "r")
    # Every trial exactly once, FINISHED, identified by the class; the unit that ran it in tags.
    assert sorted(int(r.data.tags["jbench.trial_index"]) for r in runs) == [1, 2, 3, 4, 5, 6]
    assert all(r.info.status == "FINISHED" for r in runs)
    assert {r.data.params["device.name"] for r in runs} == {f"@{CLASS}"}
    units = Counter(r.data.tags["device.unit"] for r in runs)
    assert set(units) == set(UNITS), units  # spread: each unit ran at least one
    for r in runs:
        unit = r.data.tags["device.unit"]
        emu = three_units[unit]
        assert r.data.tags["device.class"] == CLASS and r.data.tags["device.host"] == f"{emu.host}:{emu.port}"
        assert r.data.tags["power.mode_actual"] == "15W"
    # Each unit's power state was changed for its trials and restored after the sweep.
    for name, emu in three_units.items():
        assert _mode_set_on(emu), name
        assert _restored(emu), (name, emu.clock_state())
    # Plain progress lines in a pipe name the unit.
    assert all(any(line.startswith(f"{u}: trial ") for line in res.stdout.splitlines()) for u in UNITS), res.stdout

    # Resume: the same command again runs nothing; the trials count as done whichever unit ran them.
    again = jbench_cli(argv, env_extra=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("FINISHED earlier (run ") == 6, again.stdout
    assert len(_trial_runs(tmp_path / "r")) == 6


@pytest.mark.ssh
@pytest.mark.e2e
def test_pinning_a_unit_runs_there_only(three_units, tmp_path):
    conf = _conf(tmp_path, three_units)
    res = jbench_cli(["sweep", "--config-dir", str(conf), "device=u2", "backend.n_gen=4,8", *COMMON],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 0, res.stdout + res.stderr
    runs = _trial_runs(tmp_path / "r")
    assert len(runs) == 2 and {r.data.params["device.name"] for r in runs} == {"u2"}
    assert not any("device.unit" in r.data.tags for r in runs)
    assert _mode_set_on(three_units["u2"]) and _restored(three_units["u2"])
    assert not _mode_set_on(three_units["u1"]) and not _mode_set_on(three_units["u3"])


@pytest.mark.ssh
@pytest.mark.e2e
def test_an_unknown_class_is_one_message_and_exit_2(three_units, tmp_path):
    conf = _conf(tmp_path, three_units)
    res = jbench_cli(["sweep", "--config-dir", str(conf), "device=@agx_thor", *COMMON],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no device entry has device_class 'agx_thor'" in res.stderr and f"{CLASS}: u1, u2, u3" in res.stderr
    assert not (tmp_path / "r" / "mlflow.db").exists()


@pytest.mark.ssh
def test_a_unit_lost_mid_sweep_hands_its_trials_to_the_others(three_units, tmp_path):
    from jbench.tracking.writer import Tracker

    conf = _conf(tmp_path, three_units)
    lost = three_units["u3"]
    cut = []

    def on_start(trial) -> None:
        # u3's first trial: its SSH session dies under the engine and new connections are refused.
        if trial.config["device"]["name"] == "u3" and not cut:
            cut.append(trial.index)
            lost.die_after(0.3, match=[SLEEP_ENGINE.name])
            lost.block()

    # No retry in the trial: a retry's reconnect waits 60 s for a device that may be rebooting (runner/trials.py),
    # and the retry itself is tests/test_ssh_devices.py's. Here the unit is found unreachable after its trial
    # (device.connect_timeout_s) and dropped; drop_device_after=3 shows that it is the unreachability that drops it.
    p = plan([f"device=@{CLASS}", N_GEN, *COMMON, "sweep.connection_retries=0", "sweep.drop_device_after=3",
              f"tracking.results_dir={tmp_path / 'r'}"], [conf])
    assert not p.problems, p.problems
    try:
        result = run_sweep(p, lambda: Tracker(None, tmp_path / "r"), on_trial_start=on_start)
    finally:
        lost.unblock()
    assert cut, "u3 never started a trial"
    by_index = Counter(o.trial.index for o in result.outcomes)
    assert sorted(by_index) == [1, 2, 3, 4, 5, 6] and set(by_index.values()) == {1}  # nothing ran twice
    failed = [o for o in result.outcomes if o.status == Status.FAILED]
    # The trial it was running is recorded FAILED (a lost connection).
    assert [(o.trial.index, o.device) for o in failed] == [(cut[0], "u3")]
    assert str(failed[0].category) in ("connection_lost", "device")
    assert all(o.device in ("u1", "u2") for o in result.outcomes if o.status == Status.FINISHED)
    assert any("device 'u3' dropped" in n and "unreachable" in n for n in result.notes), result.notes
    runs = _trial_runs(tmp_path / "r")
    assert Counter(int(r.data.tags["jbench.trial_index"]) for r in runs) == Counter(range(1, 7))
    assert [r.data.tags["device.unit"] for r in runs if r.info.status == "FAILED"] == ["u3"]
    for name in ("u1", "u2"):
        assert _restored(three_units[name]), name


@pytest.mark.ssh
@pytest.mark.e2e
@pytest.mark.coordinator
def test_a_class_sweep_leases_the_class_places_from_the_coordinator(coordinator, three_units, tmp_path):  # noqa: F811
    # The entries carry no device_class: with a coordinator the places' class tag selects the pool.
    conf = _conf(tmp_path, three_units, device_class=None)
    with Coordinator(coordinator) as c:
        for name in UNITS:
            c.add_place(f"jetson-{name}")
            c.set_tags(f"jetson-{name}", {"class": CLASS, P.DEVICE: name, P.HEALTH: P.HEALTHY})
        c.add_place("jetson-other")
        c.set_tags("jetson-other", {"class": "agx_orin", P.DEVICE: "u1", P.HEALTH: P.HEALTHY})
    res = jbench_cli(["sweep", "--config-dir", str(conf), f"device=@{CLASS}", N_GEN, *COMMON,
                      f"farm.coordinator={coordinator}", "farm.heartbeat_s=1"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 0, res.stdout + res.stderr
    runs = _trial_runs(tmp_path / "r")
    assert sorted(int(r.data.tags["jbench.trial_index"]) for r in runs) == [1, 2, 3, 4, 5, 6]
    assert {r.data.tags["farm.place"] for r in runs} <= {f"jetson-{u}" for u in UNITS}
    assert all(r.data.tags["farm.place"] == f"jetson-{r.data.tags['device.unit']}" for r in runs)
    with Coordinator(coordinator) as c:  # released at the end; the other class never touched
        assert all(c.place(f"jetson-{u}").acquired is None for u in UNITS)
        assert c.place("jetson-other").acquired is None
    for name, emu in three_units.items():
        assert _restored(emu), name


# -- the unit's identity, a dead controller, Ctrl-C (issue 14: robustness of class sweeps) ------------------------


def _sleepy(conf: Path, seconds: float) -> Path:
    """The sleep engine's duration changed: long enough that a signal lands while trials run."""
    path = conf / "backend" / "sleepy.yaml"
    body = yaml.safe_load(path.read_text())
    body["command"][1] = str(seconds)
    path.write_text(yaml.safe_dump(body))
    return conf


def _popen_jbench(argv: list[str], tmp_path: Path, env_extra: dict) -> subprocess.Popen:
    """`jbench` as a user starts it, in the background (output to files: a full pipe must not stall it)."""
    env = {**os.environ, "COLUMNS": "200", **env_extra}
    # The child keeps its own copies of the files.
    with open(tmp_path / "sweep.out", "w") as out, open(tmp_path / "sweep.err", "w") as err:
        return subprocess.Popen([str(Path(sys.executable).with_name("jbench")), *argv], stdout=out, stderr=err,
                                env=env, start_new_session=True)


def _trial_states(results: Path) -> list[tuple[str, str, str]]:
    """(run id, status, unit) of every trial run, read from the store's SQLite file while a sweep writes it."""
    db = results / "mlflow.db"
    if not db.exists():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as con:
            return con.execute(
                "SELECT r.run_uuid, r.status, COALESCE(u.value, '') FROM runs r "
                "JOIN tags k ON k.run_uuid = r.run_uuid AND k.key = 'jbench.kind' AND k.value = 'trial' "
                "LEFT JOIN tags u ON u.run_uuid = r.run_uuid AND u.key = 'device.unit'").fetchall()
    except sqlite3.OperationalError:  # the store is being created
        return []


def _mid_sweep(results: Path, units: dict):
    """Trials are running on every unit and at least one has finished: the moment to kill or interrupt."""
    def check():
        states = _trial_states(results)
        return (any(s == "FINISHED" for _, s, _ in states) and any(s == "RUNNING" for _, s, _ in states)
                and all(_mode_set_on(e) for e in units.values()) and states)
    return check


def _lease_file(emu, name: str) -> Path:
    return emu.home / ".cache" / "jbench" / f"lease-{name}.json"  # the on-device lease (state_dir ~/.cache/jbench)


def _farm_places(address: str) -> None:
    with Coordinator(address) as c:
        for name in UNITS:
            c.add_place(f"jetson-{name}")
            c.set_tags(f"jetson-{name}", {"class": CLASS, P.DEVICE: name, P.HEALTH: P.HEALTHY})


@pytest.mark.ssh
@pytest.mark.e2e
def test_a_class_sweep_records_each_units_serial(three_units, tmp_path):
    conf = _conf(tmp_path, three_units)
    res = jbench_cli(["sweep", "--config-dir", str(conf), f"device=@{CLASS}", N_GEN, *COMMON],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 0, res.stdout + res.stderr
    runs = _trial_runs(tmp_path / "r")
    assert {r.data.tags["device.unit"] for r in runs} == set(UNITS)
    for r in runs:  # the serial read on the unit that ran the trial, in both spellings
        emu = three_units[r.data.tags["device.unit"]]
        assert r.data.tags["device.serial"] == emu.serial == r.data.tags["jetson.serial"], r.data.tags
    assert len({e.serial for e in three_units.values()}) == 3  # units of one class told apart


@pytest.mark.ssh
def test_the_serial_is_read_at_the_device_trees_real_path(emulated_jetson_factory):
    from jbench.device.connect import connect
    from jbench.device.jetson import jetson_fingerprint

    emu = emulated_jetson_factory(CLASS, real_paths=True)
    device = device_cfg(emu, name="real")
    del device["paths"]["serial_number"]  # the product's default path: /sys/firmware/devicetree/base/serial-number
    with connect(device) as conn:
        assert conn.run(["cat", "/sys/firmware/devicetree/base/serial-number"]).stdout == emu.serial + "\0"
        paths = {"device_tree_model": device["paths"]["device_tree_model"],
                 "tegra_release": device["paths"]["tegra_release"]}
        assert jetson_fingerprint(conn, paths)["jetson.serial"] == emu.serial


@pytest.mark.ssh
@pytest.mark.e2e
def test_runs_of_a_controller_that_lost_a_unit_are_marked_killed_by_the_units_next_holder(three_units, tmp_path):
    from jbench.tracking.writer import Tracker

    # Runs another host's controller left RUNNING (its pid cannot be checked from here): a class sweep's runs name
    # the class as device.name and the unit in device.unit.
    results = tmp_path / "r"
    tracker = Tracker(None, results)
    exp = tracker.experiment_id("adhoc")
    orphans = {}
    for unit in ("u1", "u3", "u9"):  # u9 is not a unit of this pool: its run is not ours to judge
        orphans[unit] = tracker.start_run(
            exp, f"orphan on {unit}", params={"device.name": f"@{CLASS}"},
            tags={"jbench.kind": "trial", "jbench.sweep_id": "20000101-000000-dead00", "device.unit": unit,
                  "jbench.controller": "another-host:4242:1"})
    conf = _conf(tmp_path, three_units)
    res = jbench_cli(["sweep", "--config-dir", str(conf), f"device=@{CLASS}", "backend.n_gen=4,8,16", *COMMON],
                     env_extra={"JBENCH_RESULTS_DIR": str(results)})
    assert res.returncode == 0, res.stdout + res.stderr
    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    for unit in ("u1", "u3"):
        run = client.get_run(orphans[unit])
        assert run.info.status == "KILLED" and run.data.tags["jbench.status"] == "KILLED"
        assert f"device '{unit}' was leased by sweep" in run.data.tags["jbench.failure_reason"], run.data.tags
    assert client.get_run(orphans["u9"]).info.status == "RUNNING"


@pytest.mark.ssh
@pytest.mark.e2e
@pytest.mark.parametrize("with_farm", [False, True], ids=["on-device-leases", "coordinator"])
def test_a_class_sweep_killed_mid_run_is_cleaned_up_and_completed_by_a_rerun(request, with_farm, three_units,
                                                                            tmp_path):
    conf = _sleepy(_conf(tmp_path, three_units, device_class=None if with_farm else CLASS), 3.0)
    argv = ["sweep", "--config-dir", str(conf), f"device=@{CLASS}", N_GEN, *COMMON, "device.lease_wait_s=600"]
    if with_farm:
        coord = request.getfixturevalue("coordinator")
        _farm_places(coord)
        argv += [f"farm.coordinator={coord}", "farm.heartbeat_s=1", "farm.stale_after_s=3"]
    results = tmp_path / "r"
    env = {"JBENCH_RESULTS_DIR": str(results)}
    proc = _popen_jbench(argv, tmp_path, env)
    try:
        eventually(_mid_sweep(results, three_units), "trials running on every unit, one finished", timeout=300)
    finally:
        proc.send_signal(signal.SIGKILL)  # a CI runner killed: no handler, no cleanup
        proc.wait()
    states = _trial_states(results)
    orphaned = {run_id for run_id, s, _ in states if s == "RUNNING"}
    finished = sum(s == "FINISHED" for _, s, _ in states)
    assert orphaned and finished < 6, states
    for name, emu in three_units.items():  # the dead controller left every unit in the sweep's state
        assert not _restored(emu), (name, emu.clock_state())
    if with_farm:
        with Coordinator(coord) as c:
            assert all(c.place(f"jetson-{u}").acquired for u in UNITS)  # labgrid itself never frees them

    again = jbench_cli(argv, env_extra=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("FINISHED earlier (run ") == finished, again.stdout
    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    for run_id in orphaned:
        run = client.get_run(run_id)
        assert run.info.status == "KILLED", run.info
        assert run.data.tags["jbench.failure_reason"].startswith("controller died: "), run.data.tags
    runs = _trial_runs(results)
    done = Counter(int(r.data.tags["jbench.trial_index"]) for r in runs if r.info.status == "FINISHED")
    assert done == Counter(range(1, 7)), done  # every trial FINISHED exactly once
    assert not [r for r in runs if r.info.status == "RUNNING"]
    for name, emu in three_units.items():  # the next holder put back the original state (25W, nothing locked)
        assert _restored(emu), (name, emu.clock_state())
        assert not _lease_file(emu, name).exists()
    if with_farm:
        assert "sent no heartbeat" in again.stderr, again.stderr  # freed by the stale policy, not by hand
        with Coordinator(coord) as c:
            assert all(c.place(f"jetson-{u}").acquired is None for u in UNITS)


@pytest.mark.ssh
@pytest.mark.e2e
@pytest.mark.parametrize("with_farm", [False, True], ids=["on-device-leases", "coordinator"])
def test_ctrl_c_of_a_class_sweep_restores_every_unit_and_records_killed(request, with_farm, three_units, tmp_path):
    conf = _sleepy(_conf(tmp_path, three_units, device_class=None if with_farm else CLASS), 3.0)
    argv = ["sweep", "--config-dir", str(conf), f"device=@{CLASS}", N_GEN, *COMMON]
    if with_farm:
        coord = request.getfixturevalue("coordinator")
        _farm_places(coord)
        argv += [f"farm.coordinator={coord}", "farm.heartbeat_s=1"]
    results = tmp_path / "r"
    proc = _popen_jbench(argv, tmp_path, {"JBENCH_RESULTS_DIR": str(results)})
    try:
        eventually(_mid_sweep(results, three_units), "trials running on every unit, one finished", timeout=300)
        running = {run_id for run_id, s, _ in _trial_states(results) if s == "RUNNING"}
        proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = (tmp_path / "sweep.err").read_text()
    assert rc == 130, err  # cli/run.py: an interrupted sweep exits 130
    assert "interrupted" in err
    for name, emu in three_units.items():
        assert _restored(emu), (name, emu.clock_state())
        assert not _lease_file(emu, name).exists(), name  # on-device lease released
        eventually(lambda: not emu.device_processes(names=[SLEEP_ENGINE.name]), f"nothing left running on {name}")
    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    # The trials running when the signal landed are KILLED (one that ended in the same instant is FINISHED).
    ended = {run_id: client.get_run(run_id) for run_id in running}
    killed = [r for r in ended.values() if r.info.status == "KILLED"]
    assert killed and all(r.info.status in ("KILLED", "FINISHED") for r in ended.values()), ended
    assert all(r.data.tags["jbench.failure_reason"] == "interrupted (Ctrl-C)" for r in killed)
    exp = client.get_experiment_by_name("adhoc")
    all_runs = client.search_runs([exp.experiment_id])
    assert not [r for r in all_runs if r.info.status == "RUNNING"]
    sweeps = [r for r in all_runs if r.data.tags.get("jbench.kind") == "sweep"]
    assert [r.info.status for r in sweeps] == ["KILLED"]
    if with_farm:
        with Coordinator(coord) as c:
            assert all(c.place(f"jetson-{u}").acquired is None for u in UNITS)


@pytest.mark.ssh
@pytest.mark.e2e
def test_ctrl_c_while_units_apply_their_power_state_waits_for_them_before_restoring(three_units, tmp_path):
    """Ctrl-C lands while the units' `nvpmodel -m` is still running (slowed under sudo): the controller ends those
    commands and waits for its workers before restoring, so no late mode change lands after the restore."""
    conf = _sleepy(_conf(tmp_path, three_units), 1.0)
    for emu in three_units.values():
        emu.slow_tool("nvpmodel", "-m", 5.0)
    results = tmp_path / "r"
    argv = ["sweep", "--config-dir", str(conf), f"device=@{CLASS}", N_GEN, *COMMON]
    proc = _popen_jbench(argv, tmp_path, {"JBENCH_RESULTS_DIR": str(results)})

    def applying() -> bool:
        return any(c["tool"] == "nvpmodel" and c["argv"][:1] == ["-m"] and c["root"]
                   for emu in three_units.values() for c in emu.command_log())

    try:
        eventually(applying, "a unit applying its power mode", timeout=300)
        for emu in three_units.values():
            # The restore reads the mode (still the original: the change has not landed) and restores the clocks;
            # slowed, so that an unfinished mode change would land before the restore's check.
            emu.slow_tool("jetson_clocks", "--restore", 8.0)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = (tmp_path / "sweep.err").read_text()
    assert rc == 130, err
    # Longer than the slowed step: a mode change still under way at the restore would have landed by now.
    time.sleep(6)
    for name, emu in three_units.items():
        assert _restored(emu), (name, emu.nvpmodel_mode_name, emu.clock_state(), err[-3000:])
        assert not emu.device_processes(names=["nvpmodel"]), name
