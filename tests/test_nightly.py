"""`jbench nightly CLASS`: two emulated Orin Nano Supers (real sshd on loopback), an engine whose device-side work
is a fixed sleep whose printed phase times follow its duration argument, scaled per unit by a file in the unit's own
home (tests/fixtures/engine/unit_sleep_engine.sh), and a real labgrid coordinator leasing the class. Night 1 has
no baseline (exit 3), night 2 measures the same (exit 0), night 3 has one slower unit (exit 1 naming it only);
failed trials are never green (exit 4); bad input runs nothing (exit 2); Ctrl-C releases the places."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient

from jbench.analysis.regress import regress
from jbench.farm import places as P
from jbench.farm.coordinator import Coordinator
from jbench.sweeps.nightly import (NightlyError, exit_code, run_nightly)
from jbench.core.exitcodes import ExitCode

from .conftest import jbench_cli
from .labgrid_fixture import coordinator, eventually  # noqa: F401  (a fixture)
from .test_ssh_devices import device_cfg

UNIT_ENGINE = Path(__file__).parent / "fixtures" / "engine" / "unit_sleep_engine.sh"
CLASS = "orin_nano_super"
UNITS = ("u1", "u2")
N_GEN = (4, 8)  # two configurations
REPS = 5  # 5 vs 5 repetitions: the smallest attainable Mann-Whitney p is 2/252 < alpha = 0.01
EXPERIMENT = "nightly_lab"  # the lab's own matrix (small: 2 configurations)
COMMON = ["--experiment", EXPERIMENT, "backend=sleepy", "telemetry.source=none", "thermal.start_below_c=null",
          "power.mode=15W", "power.jetson_clocks=true"]


def _conf(tmp_path: Path, emus: dict, *, device_class: str | None = CLASS) -> Path:
    conf = tmp_path / "conf"
    for group in ("device", "backend", "experiment"):
        (conf / group).mkdir(parents=True, exist_ok=True)
    for name, emu in emus.items():
        body = {"defaults": ["device_schema", "_self_"], **device_cfg(emu, name=name, device_class=device_class)}
        (conf / "device" / f"{name}.yaml").write_text(yaml.safe_dump(body))
    (conf / "backend" / "sleepy.yaml").write_text(yaml.safe_dump({
        "defaults": ["engine_schema", "_self_"], "name": "engine", "output": "log", "n_prompt": 16, "n_gen": 8,
        "repetitions": REPS, "command": [str(UNIT_ENGINE), "0.3", "{prompt_tokens}", "{gen_tokens}"]}))
    (conf / "experiment" / f"{EXPERIMENT}.yaml").write_text("# @package _global_\n" + yaml.safe_dump({
        "experiment": {"name": EXPERIMENT, "description": "test matrix"},
        "sweep": {"grid": {"backend.n_gen": list(N_GEN)}}}))
    return conf


@pytest.fixture
def two_units(emulated_jetson_factory):
    return {name: emulated_jetson_factory(CLASS) for name in UNITS}


def _client(results: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{results}/mlflow.db")


def _runs(results: Path, sweep_id: str | None = None, kind: str = "trial") -> list:
    client = _client(results)
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    return [r for r in runs if r.data.tags.get("jbench.kind") == kind
            and (sweep_id is None or r.data.tags["jbench.sweep_id"] == sweep_id)]


def _sweep_id(results: Path) -> str:
    parents = sorted(_runs(results, kind="sweep"), key=lambda r: r.info.start_time)
    return parents[-1].data.tags["jbench.sweep_id"]


def _cases(path: Path) -> list:
    return ET.fromstring(path.read_text()).findall("testcase")


def _restored(emu) -> bool:
    return emu.nvpmodel_mode_name == "25W" and not emu.clocks_locked


# --- pure: the exit code and regress per unit ----------------------------------------------------------------


def test_exit_code_precedence_regression_then_failed_trials_then_no_verdict():
    assert exit_code(ExitCode.OK, 0) == ExitCode.OK
    assert exit_code(ExitCode.NO_VERDICT, 0) == ExitCode.NO_VERDICT
    assert exit_code(ExitCode.OK, 2) == ExitCode.TRIALS_FAILED  # failed trials are never green
    assert exit_code(ExitCode.NO_VERDICT, 1) == ExitCode.TRIALS_FAILED
    assert exit_code(ExitCode.FAILED, 3) == ExitCode.FAILED


def _class_frame(rates: dict) -> tuple[pd.DataFrame, dict]:
    """Two sweeps of one configuration of a class sweep: {(sweep, unit): decode rate}; 5 samples per run."""
    rows, dec, pre = [], {}, {}
    t0 = pd.Timestamp("2026-11-01T02:00:00Z")
    for i, ((sweep, unit), rate) in enumerate(rates.items()):
        run_id = f"r{i}"
        dec[run_id] = [rate * (1 + 0.001 * k) for k in range(5)]
        pre[run_id] = [20 * v for v in dec[run_id]]
        rows.append({"run_id": run_id, "experiment": "nightly", "status": "FINISHED",
                     "start_time": t0 + pd.Timedelta(days=int(sweep[-1]), minutes=i), "tags.jbench.kind": "trial",
                     "tags.jbench.config_hash": "h1", "tags.jbench.sweep_id": sweep,
                     "tags.jbench.trial_label": "n_gen=4",
                     "tags.device.name": f"@{CLASS}", "tags.device.unit": unit,
                     "metrics.decode_tps": sum(dec[run_id]) / 5, "metrics.prefill_tps": sum(pre[run_id]) / 5})
    return pd.DataFrame(rows), {"decode_tps_rep": dec, "prefill_tps_rep": pre}


def test_regress_compares_a_class_sweep_per_unit():
    # Both units' runs carry device.name=@CLASS: keyed on it, u2's slow night would be pooled with u1's.
    df, samples = _class_frame({("s1", "u1"): 40.0, ("s1", "u2"): 30.0, ("s2", "u1"): 40.0, ("s2", "u2"): 24.0})
    rep = regress(df, samples, baseline="last", current="s2")
    status = {(r.device, r.config_hash): r.status for r in rep.results}
    assert status == {("u1", "h1"): "pass", ("u2", "h1"): "regression"}
    assert rep.exit_code == ExitCode.FAILED
    # Without the unit tag (a pinned device=NAME sweep) the device entry is the key, as before.
    plain = df.drop(columns=["tags.device.unit"]).assign(**{"tags.device.name": "nano1"})
    assert [r.device for r in regress(plain[plain.index % 2 == 0], samples, current="s2").results] == ["nano1"]
    # JUnit per rate: one case per unit x configuration x rate, failures on the regressed unit's rates only.
    cases = ET.fromstring(rep.to_junit_xml("jbench.nightly", per_metric=True)).findall("testcase")
    assert len(cases) == 2 * 1 * 2
    failed = [c for c in cases if c.find("failure") is not None]
    assert sorted((c.get("classname"), c.get("name").rsplit(" ", 1)[1]) for c in failed) \
        == [("jbench.nightly.u2", "decode_tps"), ("jbench.nightly.u2", "prefill_tps")]


# --- the command, on emulated units ------------------------------------------------------------------------------


@pytest.mark.ssh
@pytest.mark.e2e
@pytest.mark.coordinator
def test_three_nights_no_baseline_then_clean_then_one_slower_unit(coordinator, two_units, tmp_path):  # noqa: F811
    conf = _conf(tmp_path, two_units, device_class=None)  # the places' class tag selects the units
    with Coordinator(coordinator) as c:
        for name in UNITS:
            c.add_place(f"jetson-{name}")
            c.set_tags(f"jetson-{name}", {"class": CLASS, P.DEVICE: name, P.HEALTH: P.HEALTHY})
    results = tmp_path / "r"

    def night(n: int):
        junit, md = tmp_path / f"night{n}.xml", tmp_path / f"night{n}.md"
        res = jbench_cli(["nightly", CLASS, "--config-dir", str(conf), "--junit", str(junit), "--markdown", str(md),
                          *COMMON, f"farm.coordinator={coordinator}", "farm.heartbeat_s=1"],
                         env_extra={"JBENCH_RESULTS_DIR": str(results)})
        with Coordinator(coordinator) as c:  # released whatever the verdict
            assert all(c.place(f"jetson-{u}").acquired is None for u in UNITS), res.stdout + res.stderr
        return res, junit, md, _sweep_id(results)

    # Night 1: every unit ran every configuration; nothing to compare with: no verdict, never green.
    res, junit, md, sweep1 = night(1)
    assert res.returncode == ExitCode.NO_VERDICT, res.stdout + res.stderr
    assert "NO VERDICT" in res.stderr and "no baseline runs" in md.read_text()
    runs = _runs(results, sweep1)
    assert Counter((r.data.tags["device.unit"], r.data.params["backend.n_gen"]) for r in runs) \
        == Counter((u, str(g)) for u in UNITS for g in N_GEN)
    assert all(r.data.tags["farm.place"] == f"jetson-{r.data.tags['device.unit']}" for r in runs)
    cases = _cases(junit)
    assert len(cases) == len(UNITS) * len(N_GEN) * 2  # unit x configuration x rate
    assert all(c.find("skipped") is not None for c in cases)
    assert {c.get("classname") for c in cases} == {f"jbench.nightly.{CLASS}.{u}" for u in UNITS}
    parent = _runs(results, sweep1, kind="sweep")[0]
    assert parent.data.tags["jbench.nightly.verdict"] == "no verdict"
    assert parent.data.tags["jbench.nightly.exit_code"] == "3"
    assert (results / "reports" / f"nightly-{CLASS}-{sweep1}" / "report.html").is_file()
    for name, emu in two_units.items():
        assert _restored(emu), name

    # Night 2: the same speed on both units: clean.
    res, junit, md, sweep2 = night(2)
    assert res.returncode == ExitCode.OK, res.stdout + res.stderr
    assert md.read_text().startswith(f"# jbench nightly {CLASS}: OK")
    cases = _cases(junit)
    assert len(cases) == 8 and not any(c.find("failure") is not None or c.find("skipped") is not None for c in cases)
    assert _runs(results, sweep2, kind="sweep")[0].data.tags["jbench.nightly.verdict"] == "clean"

    # Night 3: u2 takes 1.5x as long (its printed phase times follow): a regression on u2 only.
    (two_units["u2"].home / "engine_slowdown").write_text("1.5\n")
    res, junit, md, sweep3 = night(3)
    assert res.returncode == ExitCode.FAILED, res.stdout + res.stderr
    text = md.read_text()
    assert text.splitlines()[0] == f"# jbench nightly {CLASS}: FAIL: performance regression on u2"
    rows = [line for line in text.splitlines() if line.startswith("| regression")]
    assert len(rows) == len(N_GEN) and all("| u2 |" in line for line in rows), text
    failed = [c for c in _cases(junit) if c.find("failure") is not None]
    assert len(failed) == len(N_GEN) * 2 and {c.get("classname") for c in failed} == {f"jbench.nightly.{CLASS}.u2"}
    tags = _runs(results, sweep3, kind="sweep")[0].data.tags
    assert tags["jbench.nightly.verdict"] == "regression" and tags["jbench.nightly.regressed_units"] == "u2"


@pytest.mark.ssh
@pytest.mark.e2e
def test_failed_trials_are_never_green_and_are_reported(two_units, tmp_path):
    conf = _conf(tmp_path, two_units)
    (two_units["u1"].home / "engine_slowdown").write_text("fail\n")
    junit = tmp_path / "n.xml"
    res = jbench_cli(["nightly", CLASS, "--config-dir", str(conf), "--junit", str(junit), *COMMON],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    # No baseline yet (3) and failed trials (4): failed trials win.
    assert res.returncode == ExitCode.TRIALS_FAILED, res.stdout + res.stderr
    assert f"# jbench nightly {CLASS}: FAIL: {len(N_GEN)} trial(s) failed" in res.stdout
    suite = ET.fromstring(junit.read_text())
    errors = [c for c in suite.findall("testcase") if c.find("error") is not None]
    assert suite.get("errors") == str(len(N_GEN)) and len(errors) == len(N_GEN)
    assert {c.get("classname") for c in errors} == {f"jbench.nightly.{CLASS}.u1"}
    # u2's trials ran and were regressed (no baseline: skipped), one case per configuration and rate.
    u2 = [c for c in suite.findall("testcase") if c.get("classname").endswith(".u2")]
    assert len(u2) == len(N_GEN) * 2 and all(c.find("skipped") is not None for c in u2)
    runs = _runs(tmp_path / "r")
    assert Counter((r.data.tags["device.unit"], r.info.status) for r in runs) == \
        Counter({("u1", "FAILED"): len(N_GEN), ("u2", "FINISHED"): len(N_GEN)})
    for name, emu in two_units.items():
        assert _restored(emu), name


@pytest.mark.ssh
def test_an_unknown_class_or_bad_input_runs_nothing(two_units, tmp_path):
    conf = _conf(tmp_path, two_units)
    res = jbench_cli(["nightly", "agx_thor", "--config-dir", str(conf), *COMMON],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == ExitCode.BAD_INPUT, res.stdout + res.stderr
    assert "no device entry has device_class 'agx_thor'" in res.stderr and f"{CLASS}: u1, u2" in res.stderr
    for bad, says in ((["device=u1"], "give the class as the argument"),
                      (["backend.n_gn=3"], "Did you mean backend.n_gen"),
                      (["--baseline", "golden"], "--baseline 'golden'"),
                      (["--junit", "/proc/nightly.xml"], "cannot write /proc/nightly.xml"),
                      (["--confirm-pairs", "2"], "at least 3 are needed")):
        res = jbench_cli(["nightly", CLASS, "--config-dir", str(conf), *COMMON, *bad],
                         env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
        assert res.returncode == ExitCode.BAD_INPUT and says in res.stderr, (bad, res.stdout + res.stderr)
        assert res.stderr.count("error:") == 1 and "Traceback" not in res.stderr
    with pytest.raises(NightlyError, match="agx_thor"):  # the same through Python
        run_nightly("agx_thor", experiment=EXPERIMENT, config_dirs=[conf], overrides=COMMON[2:],
                    results_dir=tmp_path / "r")
    assert not (tmp_path / "r" / "mlflow.db").exists()
    for emu in two_units.values():  # no device was touched
        assert not [c for c in emu.command_log() if c["tool"] in ("nvpmodel", "jetson_clocks")]


@pytest.mark.ssh
@pytest.mark.e2e
@pytest.mark.coordinator
def test_ctrl_c_releases_the_places_and_restores_the_units(coordinator, two_units, tmp_path):  # noqa: F811
    conf = _conf(tmp_path, two_units, device_class=None)
    with Coordinator(coordinator) as c:
        for name in UNITS:
            c.add_place(f"jetson-{name}")
            c.set_tags(f"jetson-{name}", {"class": CLASS, P.DEVICE: name, P.HEALTH: P.HEALTHY})
    (two_units["u1"].home / "engine_slowdown").write_text("20\n")  # 6 s per repetition: still running at Ctrl-C
    env = {**os.environ, "JBENCH_RESULTS_DIR": str(tmp_path / "r"), "COLUMNS": "200"}
    exe = Path(sys.executable).with_name("jbench")
    proc = subprocess.Popen([str(exe), "nightly", CLASS, "--config-dir", str(conf), *COMMON,
                             f"farm.coordinator={coordinator}", "farm.heartbeat_s=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        # Ctrl-C once u1 measures (its engine sleeps 0.3 x 20 s), past the power stage: the sweep stops its
        # workers without joining them, so a unit still applying its power state would race the restore.
        eventually(lambda: subprocess.run(["pgrep", "-f", "sleep 6.000"], capture_output=True).returncode == 0,
                   "u1's engine runs", timeout=120)
        with Coordinator(coordinator) as c:
            assert all(c.place(f"jetson-{u}").acquired for u in UNITS)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    with Coordinator(coordinator) as c:
        assert all(c.place(f"jetson-{u}").acquired is None for u in UNITS)
    killed = [r for r in _runs(tmp_path / "r") if r.info.status == "KILLED"]
    assert killed and all(r.data.tags["jbench.failure_reason"] == "interrupted (Ctrl-C)" for r in killed)
    for name, emu in two_units.items():
        assert _restored(emu), (name, emu.clock_state(), err[:3000])


@pytest.mark.ssh
def test_a_unit_lost_mid_night_keeps_its_trials_and_fails_the_night(two_units, tmp_path):
    # Every unit runs the whole matrix, so a lost unit's trials are not handed to another unit (that unit's
    # results would then hold two runs of one configuration): they are recorded as not run, and the night fails.
    # connection_retries=0: the lost trial fails at once (a retry would wait for the blocked unit to come back).
    conf = _conf(tmp_path, two_units)
    lost = two_units["u2"]
    (lost.home / "engine_slowdown").write_text("5\n")  # 1.5 s a repetition: still running when its session dies
    cut: list[int] = []

    def on_start(trial) -> None:
        if trial.config["device"]["name"] == "u2" and not cut:
            cut.append(trial.index)
            lost.die_after(0.3, match=[UNIT_ENGINE.name, "sleep_engine.sh"])  # the first execs the second
            lost.block()

    junit = tmp_path / "n.xml"
    try:
        result = run_nightly(CLASS, experiment=EXPERIMENT, config_dirs=[conf], results_dir=tmp_path / "r",
                             overrides=[*COMMON[2:], "sweep.connection_retries=0"], junit=junit,
                             on_trial_start=on_start)
    finally:
        lost.unblock()
    assert cut, "u2 never started a trial"
    assert result.exit_code == ExitCode.TRIALS_FAILED, result.markdown
    assert Counter((o.device, o.trial.index, str(o.status)) for o in result.outcomes if o.device == "u1") \
        == Counter(("u1", i, "FINISHED") for i in (1, 2))  # u1 ran its own matrix once, nothing of u2's
    failed = sorted((o.device, o.trial.index) for o in result.failed)
    assert failed == [("u2", 1), ("u2", 2)], result.markdown
    assert any(o.error.startswith("not run: 'u2' was dropped") for o in result.failed)
    assert any("device 'u2' dropped" in n and "its other trials were not run" in n for n in result.notes)
    errors = [c for c in _cases(junit) if c.find("error") is not None]
    assert {c.get("classname") for c in errors} == {f"jbench.nightly.{CLASS}.u2"} and len(errors) == 2
    assert _restored(two_units["u1"])
