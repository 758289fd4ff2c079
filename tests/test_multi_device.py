"""Sweeps across a device class (`device=@CLASS`): three emulated Orin Nano Supers (real sshd on loopback), an
engine whose device-side work is a fixed sleep (tests/fixtures/engine/sleep_engine.sh), so the tests measure the
controller: every trial once, spread over the units, each unit's power state restored, a lost unit's trials run
by the others, pinning, resume whichever unit ran a trial, and the class's places leased from a real coordinator."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from jbench.farm import places as P
from jbench.farm.coordinator import Coordinator
from jbench.results import Status
from jbench.sweeps.plan import plan
from jbench.sweeps.sweep import Sweep

from .conftest import jbench_cli
from .labgrid_fixture import coordinator  # noqa: F401  (a fixture)
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
    assert again.stdout.count("skipped (resumed)") == 6, again.stdout
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

    p = plan([f"device=@{CLASS}", N_GEN, *COMMON, "sweep.connection_retries=1", "sweep.drop_device_after=3",
              f"tracking.results_dir={tmp_path / 'r'}"], [conf])
    assert not p.problems, p.problems
    try:
        result = Sweep(p, lambda: Tracker(None, tmp_path / "r"), on_trial_start=on_start).run()
    finally:
        lost.unblock()
    assert cut, "u3 never started a trial"
    by_index = Counter(o.trial.index for o in result.outcomes)
    assert sorted(by_index) == [1, 2, 3, 4, 5, 6] and set(by_index.values()) == {1}  # nothing ran twice
    failed = [o for o in result.outcomes if o.status == Status.FAILED]
    # The trial it was running is recorded FAILED (a lost connection, or the device gone at the retry).
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
