"""What a farm nightly must survive (issue 26, part 4), without a coordinator.

- A dead unit does not stop the night: two emulated Orin Nano Supers (real sshd on loopback) of one class, one
  unit's sshd stopped: the other unit is measured, the dead one is a JUnit error, a markdown line and exit 4;
  after `farm.quarantine_after_failures` nights in a row without a measurement it is quarantined (skipped, still
  reported) until `--unquarantine`; the record of it is read back from the store. No unit reachable: exit 2.
- A change found only after it left the newest nights, never reported, is reported with its first night
  (decided from what earlier nights recorded, jbench.analysis.history.Reported).
- `jbench sweep --info` and `--cfg job` accept `device=@CLASS`.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from jbench.analysis.history import (NO_CHANGE, REGRESSION, Reported, history, judge, reported_changes)
from jbench.core.exitcodes import ExitCode
from jbench.sweeps.nightly import (TAG_REPORTED, decode_changes, encode_changes, exit_code, next_streaks,
                                   reported_in_store, unit_streaks)

from .conftest import jbench_cli

CLASS = "orin_nano_super"

# A clean measured-like history (8 % night-to-night noise) with a -20 % step from night 9: at this noise the step
# stands only from night 14, when its first night is no longer among the newest three (nights 9-16 judged alone
# are all "no change"). Found with judge() over seeded histories; kept as numbers so the test never drifts.
LATE = [101.5, 95.8, 96.7, 80.5, 114.4, 109.2, 97.4, 106.2, 81.8, 76.5, 86.3, 78.0, 77.9, 74.9, 82.9, 79.4]
STEP_NIGHT = 9  # 1-based
FOUND_NIGHT = 14


def _frame(values: list[float], unit: str = "u1") -> pd.DataFrame:
    """One trial run per night of one configuration on one unit: what runs_frame gives for a nightly's history."""
    t0 = pd.Timestamp("2026-11-01T02:00:00Z")
    return pd.DataFrame([{"run_id": f"r{i}", "experiment": "nightly", "status": "FINISHED",
                          "start_time": t0 + pd.Timedelta(days=i), "tags.jbench.kind": "trial",
                          "tags.jbench.config_hash": "h1", "tags.jbench.sweep_id": f"s{i + 1:02d}",
                          "tags.jbench.trial_label": "n_gen=4", "tags.device.name": f"@{CLASS}",
                          "tags.device.unit": unit, "metrics.decode_tps": v} for i, v in enumerate(values)])


def _nights(values: list[float], reported: Reported | None) -> list:
    """Judge night after night as the nightly does: each night's report sees what the earlier ones recorded."""
    keys, judged, out = set(), set(), []
    df = _frame(values)
    for n in range(1, len(values) + 1):
        sweep = f"s{n:02d}"
        known = None if reported is None else Reported(frozenset(keys), frozenset(judged) | reported.judged)
        rep = history(df.iloc[:n], metrics=["decode_tps"], current=[sweep], reported=known)
        out.append(rep)
        keys.update(reported_changes(rep))
        judged.add(sweep)
    return out


# --- a late change (pure) ---------------------------------------------------------------------------------------


def test_the_history_finds_the_step_only_after_it_left_the_newest_nights():
    # The premise: without a record of earlier reports the step is "no change" on every night.
    verdicts = [judge(LATE[:n])[0] for n in range(STEP_NIGHT, len(LATE) + 1)]
    assert verdicts == [NO_CHANGE] * len(verdicts)
    _, changes, _ = judge(LATE[:FOUND_NIGHT])
    assert [c.index + 1 for c in changes] == [STEP_NIGHT] and changes[0].p_value < 0.001
    assert [r.results[0].verdict for r in _nights(LATE, None)][STEP_NIGHT - 1:] == [NO_CHANGE] * len(verdicts)


def test_an_unreported_change_is_reported_once_with_its_first_night():
    reports = _nights(LATE, Reported())
    verdicts = [r.results[0].verdict for r in reports]
    assert verdicts[:FOUND_NIGHT - 1] == [NO_CHANGE if n >= 8 else "no verdict" for n in range(1, FOUND_NIGHT)]
    found = reports[FOUND_NIGHT - 1]
    r = found.results[0]
    assert r.verdict == REGRESSION and found.exit_code == ExitCode.FAILED and found.alarms() == [r]
    assert r.deciding is r.late and r.deciding.sweep_id == f"s{STEP_NIGHT:02d}"  # its first night, 6 nights back
    assert "reported late" in r.message and "reported late" in found.to_markdown()
    assert found.to_dict()["series"][0]["reported_late"] is True
    failures = [c for c in ET.fromstring(found.to_junit_xml("n")).findall("testcase") if c.find("failure") is not None]
    assert len(failures) == 1
    # Reported once: the next nights know it (what night 14 recorded) and say no change again.
    assert verdicts[FOUND_NIGHT:] == [NO_CHANGE] * (len(LATE) - FOUND_NIGHT)


def test_a_change_an_earlier_night_reported_is_not_reported_again():
    # A night reported this change (by the pairwise gate on its own night, or the history a night off): no alarm.
    judged = frozenset(f"s{n:02d}" for n in range(1, FOUND_NIGHT))
    df = _frame(LATE[:FOUND_NIGHT])
    for first in (f"s{STEP_NIGHT:02d}", f"s{STEP_NIGHT + 1:02d}"):
        known = Reported(frozenset({("u1", "h1", "decode_tps", first)}), judged)
        assert history(df, metrics=["decode_tps"], reported=known).results[0].verdict == NO_CHANGE
    # Another unit's or metric's report is not this change's.
    other = Reported(frozenset({("u2", "h1", "decode_tps", f"s{STEP_NIGHT:02d}"),
                                ("u1", "h1", "prefill_tps", f"s{STEP_NIGHT:02d}")}), judged)
    assert history(df, metrics=["decode_tps"], reported=other).results[0].verdict == REGRESSION


def test_a_store_without_the_record_reports_nothing_late():
    # Nights judged before the record existed (no jbench.nightly.reported tag): whether they reported the change
    # is unknown, so it is not reported again (an upgrade does not flood a lab with its old changes).
    judged = frozenset(f"s{n:02d}" for n in range(STEP_NIGHT + 1, FOUND_NIGHT))  # the record starts after night 9
    rep = history(_frame(LATE[:FOUND_NIGHT]), metrics=["decode_tps"], reported=Reported(frozenset(), judged))
    assert rep.results[0].verdict == NO_CHANGE and rep.results[0].late is None


def test_a_late_improvement_is_reported_but_does_not_fail():
    up = [2 * LATE[0] - v for v in LATE]  # the mirror image: +20 % from night 9
    assert judge(up[:FOUND_NIGHT])[1]
    rep = _nights(up, Reported())[FOUND_NIGHT - 1]
    assert rep.results[0].verdict == "improvement" and rep.exit_code == ExitCode.OK


# --- the record in the store's tags (pure) -----------------------------------------------------------------------


def test_reported_changes_round_trip_through_the_tags_also_when_long():
    keys = [("u1", f"{i:012x}", "decode_tps", f"20261125-021500-{i:06x}") for i in range(200)]
    tags = encode_changes(keys)
    assert len(tags) > 1 and all(len(v) <= 5000 for v in tags.values())  # MLflow's tag value limit
    assert decode_changes(tags) == keys
    assert decode_changes(encode_changes([])) == [] and decode_changes({}) is None
    parents = pd.DataFrame([{"run_id": "p1", "start_time": 1, "tags.jbench.sweep_id": "s1", **{
        f"tags.{k}": v for k, v in encode_changes(keys[:2]).items()}},
                            {"run_id": "p2", "start_time": 2, "tags.jbench.sweep_id": "s2",
                             f"tags.{TAG_REPORTED}": "none"},
                            {"run_id": "p3", "start_time": 3, "tags.jbench.sweep_id": "s3"}])  # before the record
    known = reported_in_store(parents)
    assert known.judged == {"s1", "s2"} and known.changes == set(keys[:2])


def test_unit_streaks_come_from_the_newest_nightly_of_the_class():
    parents = pd.DataFrame([
        {"run_id": "a", "start_time": 1, "tags.jbench.nightly.class": CLASS, "tags.jbench.nightly.verdict": "clean",
         "tags.jbench.nightly.unit_failures": "u2=1"},
        {"run_id": "b", "start_time": 2, "tags.jbench.nightly.class": CLASS, "tags.jbench.nightly.verdict": "x",
         "tags.jbench.nightly.unit_failures": "u2=2,u3=1"},
        {"run_id": "c", "start_time": 3, "tags.jbench.nightly.class": "agx_orin", "tags.jbench.nightly.verdict": "x",
         "tags.jbench.nightly.unit_failures": "u2=9"},
        {"run_id": "d", "start_time": 4, "tags.jbench.nightly.class": CLASS}])  # a night that died before its verdict
    assert unit_streaks(parents, CLASS) == {"u2": 2, "u3": 1}
    assert unit_streaks(None, CLASS) == {} and unit_streaks(parents, "thor") == {}
    assert next_streaks(["u1", "u2", "u3"], {"u2": 2, "u3": 1}, {"u2"}) == {"u1": 0, "u2": 3, "u3": 0}


def test_missing_units_fail_the_night_below_a_regression():
    assert exit_code(ExitCode.OK, 0, 1) == ExitCode.TRIALS_FAILED
    assert exit_code(ExitCode.NO_VERDICT, 0, 1) == ExitCode.TRIALS_FAILED
    assert exit_code(ExitCode.FAILED, 0, 1) == ExitCode.FAILED
    assert exit_code(ExitCode.OK, 0, 0) == ExitCode.OK


# --- --info and --cfg job with device=@CLASS ---------------------------------------------------------------------


def _class_conf(tmp_path: Path) -> Path:
    conf = tmp_path / "conf"
    (conf / "device").mkdir(parents=True)
    for name, port in (("u1", 2201), ("u2", 2202)):
        (conf / "device" / f"{name}.yaml").write_text(yaml.safe_dump({
            "defaults": ["device_schema", "_self_"], "name": name, "kind": "ssh", "host": "127.0.0.1", "port": port,
            "user": "nobody", "device_class": CLASS, "profile": CLASS}))
    (conf / "experiment").mkdir()
    (conf / "experiment" / "nightly.yaml").write_text("# @package _global_\n" + yaml.safe_dump({
        "experiment": {"name": "lab_nightly", "description": "the lab's own"}}))
    return conf


@pytest.mark.e2e
def test_info_and_cfg_job_accept_a_device_class(tmp_path):
    conf = _class_conf(tmp_path)
    env = {"JBENCH_RESULTS_DIR": str(tmp_path / "r")}
    res = jbench_cli(["sweep", "+experiment=nightly", f"device=@{CLASS}", "--config-dir", str(conf), "--info"],
                     env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"device: @{CLASS} (units: u1, u2" in res.stdout and "experiment: nightly" in res.stdout
    assert res.stdout.index(f"file://{conf}") < res.stdout.index("pkg://")  # the lab's nightly.yaml wins
    res = jbench_cli(["sweep", "+experiment=nightly", f"device=@{CLASS}", "--config-dir", str(conf), "--cfg", "job"],
                     env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    job = yaml.safe_load(res.stdout)
    assert job["device"]["name"] == f"@{CLASS}" and job["device"]["device_class"] == CLASS
    assert job["experiment"]["name"] == "lab_nightly"  # the config dir's nightly.yaml, not jbench's
    assert "units: u1, u2" in res.stderr
    res = jbench_cli(["sweep", "device=@agx_thor", "--config-dir", str(conf), "--cfg", "job"], env_extra=env)
    assert res.returncode == ExitCode.BAD_INPUT and "no device entry has device_class 'agx_thor'" in res.stderr
    assert not (tmp_path / "r").exists()  # nothing ran, no store


# --- a dead unit, on two emulated units of one class --------------------------------------------------------------

UNIT_ENGINE = Path(__file__).parent / "fixtures" / "engine" / "unit_sleep_engine.sh"
EXPERIMENT = "nightly_survival"
COMMON = ["backend=sleepy", "telemetry.source=none", "thermal.start_below_c=null", "power.mode=15W",
          "power.jetson_clocks=true", "farm.quarantine_after_failures=2"]


def _units_conf(tmp_path: Path, emus: dict) -> Path:
    from .test_ssh_devices import device_cfg

    conf = tmp_path / "conf"
    for group in ("device", "backend", "experiment"):
        (conf / group).mkdir(parents=True, exist_ok=True)
    for name, emu in emus.items():
        body = {"defaults": ["device_schema", "_self_"], **device_cfg(emu, name=name, device_class=CLASS)}
        (conf / "device" / f"{name}.yaml").write_text(yaml.safe_dump(body))
    (conf / "backend" / "sleepy.yaml").write_text(yaml.safe_dump({
        "defaults": ["engine_schema", "_self_"], "name": "engine", "output": "log", "n_prompt": 16, "n_gen": 8,
        "repetitions": 3, "command": [str(UNIT_ENGINE), "0.05", "{prompt_tokens}", "{gen_tokens}"]}))
    (conf / "experiment" / f"{EXPERIMENT}.yaml").write_text("# @package _global_\n" + yaml.safe_dump({
        "experiment": {"name": EXPERIMENT, "description": "one configuration"}}))
    return conf


def _parent_tags(results: Path, sweep_id: str) -> dict:
    from jbench.tracking.reader import runs_frame

    df = runs_frame(f"sqlite:///{results}/mlflow.db", [EXPERIMENT], kinds=("sweep",))
    row = df[df["tags.jbench.sweep_id"] == sweep_id].iloc[0]
    return {k[len("tags."):]: v for k, v in row.items() if k.startswith("tags.") and isinstance(v, str)}


@pytest.mark.ssh
@pytest.mark.e2e
def test_a_dead_unit_is_reported_and_quarantined_while_the_other_is_measured(emulated_jetson_factory, tmp_path):
    from jbench.sweeps.nightly import run_nightly

    units = {name: emulated_jetson_factory(CLASS) for name in ("u1", "u2")}
    conf, results = _units_conf(tmp_path, units), tmp_path / "r"
    units["u2"].block()  # its sshd is down: connections refused

    def night(n: int, **options):
        junit, md = tmp_path / f"n{n}.xml", tmp_path / f"n{n}.md"
        res = run_nightly(CLASS, experiment=EXPERIMENT, config_dirs=[conf], results_dir=results, overrides=COMMON,
                          junit=junit, markdown=md, **options)
        assert md.read_text() == res.markdown
        return res, ET.fromstring(junit.read_text())

    # Night 1: u1 measured, u2 missing: exit 4 (over "no baseline"), a JUnit error and a markdown line for u2.
    res, suite = night(1)
    assert res.exit_code == ExitCode.TRIALS_FAILED, res.markdown
    assert {(o.device, str(o.status)) for o in res.outcomes} == {("u1", "FINISHED")}
    assert list(res.missing) == ["u2"] and res.missing["u2"].startswith("unreachable")
    assert res.markdown.splitlines()[0] == f"# jbench nightly {CLASS}: FAIL: unit(s) not measured: u2"
    assert any(line.startswith("- u2: unreachable") for line in res.markdown.splitlines())
    errors = [c for c in suite.findall("testcase") if c.find("error") is not None]
    assert [(c.get("classname"), c.find("error").get("type")) for c in errors] == [
        (f"jbench.nightly.{CLASS}.u2", "unreachable")] and suite.get("errors") == "1"
    assert any(c.get("classname").endswith(".u1") for c in suite.findall("testcase"))  # u1 was regressed
    tags = _parent_tags(results, res.sweep_id)
    assert tags["jbench.nightly.missing_units"] == "u2" and tags["jbench.nightly.unit_failures"] == "u2=1"
    assert tags[TAG_REPORTED] == "none" and not res.quarantined

    # Night 2: the second night in a row without u2: quarantined (farm.quarantine_after_failures=2).
    res, _ = night(2)
    assert res.exit_code == ExitCode.TRIALS_FAILED and res.quarantined == ["u2"], res.markdown
    assert any("unit u2 quarantined" in n for n in res.notes)
    assert _parent_tags(results, res.sweep_id)["jbench.nightly.quarantined"] == "u2"

    # Night 3: u2 answers again but stays quarantined (the record is the store's): skipped, not even connected.
    units["u2"].unblock()
    seen = len(units["u2"].command_log())
    res, suite = night(3)
    assert res.exit_code == ExitCode.TRIALS_FAILED and res.missing["u2"].startswith("quarantined"), res.markdown
    assert len(units["u2"].command_log()) == seen
    assert [c.find("error").get("type") for c in suite.findall("testcase") if c.find("error") is not None] \
        == ["quarantined"]
    assert "--unquarantine u2" in res.markdown

    # Night 4: --unquarantine u2: measured again, its run of failed nights ends.
    res, _ = night(4, unquarantine=["u2"])
    assert not res.missing and res.units == ["u1", "u2"] and not res.quarantined, res.markdown
    assert res.exit_code == ExitCode.NO_VERDICT  # u2 has no earlier night to compare with
    assert "jbench.nightly.unit_failures" not in _parent_tags(results, res.sweep_id)
    # What the four nights recorded is what the next one reads back.
    from jbench.tracking.reader import runs_frame

    known = reported_in_store(runs_frame(f"sqlite:///{results}/mlflow.db", [EXPERIMENT], kinds=("sweep",)))
    assert len(known.judged) == 4 and not known.changes
    for emu in units.values():
        assert emu.nvpmodel_mode_name == "25W" and not emu.clocks_locked  # restored


@pytest.mark.ssh
@pytest.mark.e2e
def test_a_class_with_no_reachable_unit_runs_nothing(emulated_jetson_factory, tmp_path):
    units = {name: emulated_jetson_factory(CLASS) for name in ("u1", "u2")}
    conf = _units_conf(tmp_path, units)
    for emu in units.values():
        emu.block()
    res = jbench_cli(["nightly", CLASS, "--experiment", EXPERIMENT, "--config-dir", str(conf), *COMMON],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == ExitCode.BAD_INPUT, res.stdout + res.stderr
    assert res.stderr.count("error:") == 1 and "Traceback" not in res.stderr
    assert f"no unit of {CLASS} can be reached; nothing was run" in res.stderr
    assert "- u1: unreachable" in res.stderr and "- u2: unreachable" in res.stderr
    assert not (tmp_path / "r" / "mlflow.db").exists()
    res = jbench_cli(["nightly", CLASS, "--experiment", EXPERIMENT, "--config-dir", str(conf), *COMMON,
                      "--unquarantine", "u9"], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == ExitCode.BAD_INPUT and "--unquarantine u9: not a unit of" in res.stderr
