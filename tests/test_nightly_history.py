"""`jbench nightly` over many nights judges each unit's history: two emulated Orin Nano Supers (real sshd on
loopback) run the sleep engine whose printed phase times follow its duration, scaled per unit by a file in the
unit's home. Until a configuration has enough nights the nightly compares with the previous night; from then on it
looks for change points over the history; a slowdown of one unit from night N on is found on that unit, starting
on night N, in the JUnit, the markdown and the history report attached to the sweep's parent run."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from jbench.analysis.history import DEFAULT_SETTINGS
from jbench.sweeps.nightly import run_nightly
from jbench.core.exitcodes import ExitCode

from .conftest import jbench_cli
from .test_ssh_devices import device_cfg

UNIT_ENGINE = Path(__file__).parent / "fixtures" / "engine" / "unit_sleep_engine.sh"
CLASS = "orin_nano_super"
UNITS = ("u1", "u2")
EXPERIMENT = "nightly_history"
COMMON = ["backend=sleepy", "telemetry.source=none", "thermal.start_below_c=null", "power.mode=15W",
          "power.jetson_clocks=true", "device.lease_wait_s=600"]


def _conf(tmp_path: Path, emus: dict) -> Path:
    conf = tmp_path / "conf"
    for group in ("device", "backend", "experiment"):
        (conf / group).mkdir(parents=True, exist_ok=True)
    for name, emu in emus.items():
        body = {"defaults": ["device_schema", "_self_"], **device_cfg(emu, name=name, device_class=CLASS)}
        (conf / "device" / f"{name}.yaml").write_text(yaml.safe_dump(body))
    (conf / "backend" / "sleepy.yaml").write_text(yaml.safe_dump({
        "defaults": ["engine_schema", "_self_"], "name": "engine", "output": "log", "n_prompt": 16, "n_gen": 8,
        "repetitions": 5, "command": [str(UNIT_ENGINE), "0.08", "{prompt_tokens}", "{gen_tokens}"]}))
    (conf / "experiment" / f"{EXPERIMENT}.yaml").write_text("# @package _global_\n" + yaml.safe_dump({
        "experiment": {"name": EXPERIMENT, "description": "one configuration"}}))
    return conf


@pytest.mark.ssh
@pytest.mark.e2e
def test_nightly_finds_a_step_over_history_on_its_night_and_unit(emulated_jetson_factory, tmp_path):
    units = {name: emulated_jetson_factory(CLASS) for name in UNITS}
    conf = _conf(tmp_path, units)
    results = tmp_path / "r"
    enough = DEFAULT_SETTINGS.min_nights
    step_night = enough + 1  # u2 is 25 % slower from this night on
    last_night = enough + DEFAULT_SETTINGS.min_size  # the new level has lasted long enough to be a segment
    sweeps = []
    for night in range(1, last_night):
        if night == step_night:
            (units["u2"].home / "engine_slowdown").write_text("1.25\n")
        res = run_nightly(CLASS, experiment=EXPERIMENT, config_dirs=[conf], results_dir=results, overrides=COMMON)
        sweeps.append(res.sweep_id)
        if night == 1:
            assert res.exit_code == ExitCode.NO_VERDICT and res.mode == "pairwise", res.markdown
        elif night < enough:
            assert res.exit_code == ExitCode.OK and res.mode == "pairwise", res.markdown
        elif night == enough:  # as many nights as the history needs: judged over it, clean
            assert res.exit_code == ExitCode.OK and res.mode == "history", res.markdown
            assert "# jbench nightly orin_nano_super: OK" in res.markdown and "| no change | u1 |" in res.markdown

    if step_night == last_night:
        (units["u2"].home / "engine_slowdown").write_text("1.25\n")
    junit, md = tmp_path / "n.xml", tmp_path / "n.md"
    res = jbench_cli(["nightly", CLASS, "--experiment", EXPERIMENT, "--config-dir", str(conf), "--junit", str(junit),
                      "--markdown", str(md), *COMMON], env_extra={"JBENCH_RESULTS_DIR": str(results)})
    assert res.returncode == ExitCode.FAILED, res.stdout + res.stderr
    text = md.read_text()
    assert text.splitlines()[0] == f"# jbench nightly {CLASS}: FAIL: performance regression on u2"
    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    exp = client.get_experiment_by_name(EXPERIMENT)
    parents = sorted((r for r in client.search_runs([exp.experiment_id], max_results=1000)
                      if r.data.tags.get("jbench.kind") == "sweep"), key=lambda r: r.info.start_time)
    assert len(parents) == last_night
    sweeps.append(parents[-1].data.tags["jbench.sweep_id"])
    first_bad = sweeps[step_night - 1]
    rows = [line for line in text.splitlines() if line.startswith("| regression |")]
    # decode and prefill of u2's one configuration; the change starts on the step's night.
    assert len(rows) == 2 and all("| u2 |" in r and first_bad in r for r in rows), text
    assert all("-20.0" in r for r in rows), text  # 1/1.25 - 1 = -20 %
    cases = ET.fromstring(junit.read_text()).findall("testcase")
    failed = [c for c in cases if c.find("failure") is not None]
    assert len(cases) == 4 and {c.get("classname") for c in failed} == {f"jbench.nightly.{CLASS}.u2"}
    assert {c.get("name").rsplit(" ", 1)[1] for c in failed} == {"decode_tps", "prefill_tps"}
    tags = parents[-1].data.tags
    assert tags["jbench.nightly.mode"] == "history" and tags["jbench.nightly.regressed_units"] == "u2"
    attached = [f.path for f in client.list_artifacts(parents[-1].info.run_id, "report/history")]
    assert "report/history/history.html" in attached and any(p.endswith(".png") for p in attached)
    # The same verdict from `jbench regress` over the store (history is its default with enough nights).
    res = jbench_cli(["regress", "--experiment", EXPERIMENT, "--report-dir", str(tmp_path / "hist")],
                     env_extra={"JBENCH_RESULTS_DIR": str(results)})
    assert res.returncode == ExitCode.FAILED and "mode: history" in res.stderr, res.stdout + res.stderr
    assert (tmp_path / "hist" / "history.html").is_file()
    # ... and the two-sweep comparison is still there.
    res = jbench_cli(["regress", "--experiment", EXPERIMENT, "--baseline", "last"],
                     env_extra={"JBENCH_RESULTS_DIR": str(results)})
    assert res.stdout.startswith("# jbench regress: "), res.stdout + res.stderr
