"""The record never lies, and reads the way MLflow users expect: run names, params, tags, notes, the
experiment's description and kind, the per-sweep summary table and report, resumed sweeps, model overrides.
Everything through the real `jbench` CLI on the real bundled model, read back with MlflowClient."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from .conftest import jbench_cli, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Other sweeps on this machine may hold the local device's lease for a moment: wait for it. One llama.cpp thread:
# llama-bench's spinning threads stall each other on cores that other tests share (these tests are about the record).
TINY = ["backend.n_prompt=16", "backend.n_gen=4", "backend.repetitions=1", "backend.threads=1",
        "device.lease_wait_s=600"]


def _client(results: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{results}/mlflow.db")


def _runs(client: MlflowClient, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"experiment {experiment} missing"
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("jbench.kind") == "sweep"]
    children = sorted((r for r in runs if r.data.tags.get("jbench.kind") == "trial"),
                      key=lambda r: (r.info.start_time, int(r.data.tags["jbench.trial_index"])))
    return exp, parents, children


def test_a_quant_ladder_reads_as_mlflow_users_expect(tmp_path, llama_build, bundled_model):
    env = {"JBENCH_RESULTS_DIR": str(tmp_path)}
    res = jbench_cli(["sweep", "+experiment=quant_ladder", "model.quant=Q4_0,Q8_0", *TINY], env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    client = _client(tmp_path)
    exp, parents, children = _runs(client, "quant_ladder")
    assert len(parents) == 1 and len(children) == 2
    parent = parents[0]
    sweep_id = parent.data.tags["jbench.sweep_id"]

    # The experiment opens on its runs (not MLflow 3's GenAI overview) and carries its description.
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert exp.tags["mlflow.note.content"] == "prefill and decode tok/s, memory and output quality across quantization levels"

    # Names: the parent names the experiment and the date; children only their varying dimension.
    assert parent.info.run_name.startswith("quant_ladder 20") and len(parent.info.run_name.split()) == 3
    assert [c.info.run_name for c in children] == ["Q4_0", "Q8_0"]
    assert "quant_ladder" in parent.data.tags["mlflow.note.content"] and sweep_id in parent.data.tags["mlflow.note.content"]

    for child, quant in zip(children, ["Q4_0", "Q8_0"]):
        params, tags = child.data.params, child.data.tags
        # Params are the trial's inputs: no nulls, nothing of another scenario, no connection details.
        assert params["model.quant"] == quant and params["backend.n_gen"] == "4"
        assert "null" not in params.values(), {k: v for k, v in params.items() if v == "null"}
        assert not [k for k in params if "latency" in k]
        assert not [k for k in params if k.startswith(("device.", "tracking.", "telemetry.")) and k != "device.name"]
        assert "backend.binary_dir" not in params and len(params) < 30, sorted(params)
        # model.sha256 is the file benchmarked, and only a tag; the package's hash has its own name.
        assert "model.sha256" not in params
        assert tags["model.sha256"] == bundled_model[quant]["sha256"] == tags["jbench.model_digest"]
        assert params["model.source_sha256"] != tags["model.sha256"]
        assert Path(tags["model.file"]).name.startswith(quant)
        # Standard MLflow fields.
        assert tags["mlflow.user"] and tags["mlflow.source.type"] == "LOCAL"
        assert tags["mlflow.source.name"].startswith("jbench sweep")
        assert quant in tags["mlflow.note.content"] and "Gemma 3 270M" in tags["mlflow.note.content"]
        assert not set(params) & {k for k in tags if k.startswith("model.sha")}
        # The full resolved config stays an artifact.
        assert "config.yaml" in {a.path for a in client.list_artifacts(child.info.run_id)}

    # The per-sweep summary table: an MLflow table artifact, one row per trial.
    assert json.loads(parent.data.tags["mlflow.loggedArtifacts"]) == [{"path": "summary.json", "type": "table"}]
    table = json.loads(Path(client.download_artifacts(parent.info.run_id, "summary.json", str(tmp_path / "dl"))).read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [(r["run"], r["model_quant"], r["status"]) for r in rows] == [("Q4_0", "Q4_0", "FINISHED"),
                                                                         ("Q8_0", "Q8_0", "FINISHED")]
    assert all(r["decode_tps"] > 0 and r["prefill_tps"] > 0 for r in rows)
    assert {r["run_id"] for r in rows} == {c.info.run_id for c in children}

    # A re-run with nothing to do records nothing: no empty parent.
    again = jbench_cli(["sweep", "+experiment=quant_ladder", "model.quant=Q4_0,Q8_0", *TINY], env_extra=env)
    assert again.returncode == 0, again.stdout + again.stderr
    _, parents_after, children_after = _runs(client, "quant_ladder")
    assert len(parents_after) == 1 and len(children_after) == 2

    # A whole-experiment report is attached to no parent; a sweep's report to its own, with its images.
    whole = jbench_cli(["report", "--out", str(tmp_path / "whole")], env_extra=env)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert "report" not in {a.path for a in client.list_artifacts(parent.info.run_id)}
    rep = jbench_cli(["report", "--sweep", sweep_id, "--out", str(tmp_path / "rep")], env_extra=env)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    attached = {Path(a.path).name for a in client.list_artifacts(parent.info.run_id, "report")}
    md = (tmp_path / "rep" / "report.md").read_text()
    images = [line.split("](")[1].rstrip(")") for line in md.splitlines() if line.startswith("![")]
    assert images and {"report.md", "report.html", *images} <= attached, (images, attached)
    assert all("/" not in i for i in images)  # relative links resolve beside report.md in MLflow's preview


def test_a_sweep_resumed_after_ctrl_c_is_one_sweep(tmp_path, llama_build, bundled_model):
    env = dict(os.environ, JBENCH_RESULTS_DIR=str(tmp_path), COLUMNS="200")
    argv = ["sweep", "+experiment=quant_ladder", "model.quant=Q4_0,Q4_K_M,Q8_0",
            "backend.n_prompt=16", "backend.n_gen=32", "backend.repetitions=3", "backend.threads=1",
            "device.lease_wait_s=600", "quality.enabled=false"]
    exe = str(Path(sys.executable).with_name("jbench"))
    proc = subprocess.Popen([exe, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    db = tmp_path / "mlflow.db"

    def one_finished() -> bool:
        # Read-only SQL: an MlflowClient here would race jbench's own creation of the store's tables.
        if not db.exists():
            return False
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            try:
                return bool(con.execute(
                    "SELECT 1 FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid WHERE r.status = 'FINISHED' "
                    "AND t.key = 'jbench.kind' AND t.value = 'trial'").fetchone())
            finally:
                con.close()
        except sqlite3.Error:
            return False

    try:
        assert wait_until(one_finished, 300), "no trial finished"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    client = _client(tmp_path)
    _, parents, first = _runs(client, "quant_ladder")
    assert len(parents) == 1 and parents[0].info.status == "KILLED"
    sweep_id = parents[0].data.tags["jbench.sweep_id"]
    assert 1 <= sum(c.info.status == "FINISHED" for c in first) < 3

    res = jbench_cli(argv, env_extra={"JBENCH_RESULTS_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stdout + res.stderr
    _, parents, children = _runs(client, "quant_ladder")
    # One sweep: the KILLED parent goes on and finishes, every trial under it with its sweep id.
    assert len(parents) == 1, [p.info.run_name for p in parents]
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["jbench.resumes"] == "1"
    assert parent.data.tags["jbench.finished_trials"] == "3" and parent.data.tags["jbench.skipped_trials"] == "0"
    assert parent.data.tags["jbench.resumed_after"] and "jbench.failure_reason" not in parent.data.tags
    assert {c.data.tags["jbench.sweep_id"] for c in children} == {sweep_id}
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    finished = sorted(c.info.run_name for c in children if c.info.status == "FINISHED")
    assert finished == ["Q4_0", "Q4_K_M", "Q8_0"]
    table = json.loads(Path(client.download_artifacts(parent.info.run_id, "summary.json", str(tmp_path / "dl"))).read_text())
    assert sorted(row[0] for row in table["data"]) == ["Q4_0", "Q4_K_M", "Q8_0"]
    # `report --sweep` sees all three trials.
    rep = jbench_cli(["report", "--sweep", sweep_id, "--out", str(tmp_path / "rep")],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path)})
    assert rep.returncode == 0, rep.stdout + rep.stderr
    md = (tmp_path / "rep" / "report.md").read_text()
    assert all(q in md for q in ("Q4_0", "Q4_K_M", "Q8_0")), md


@pytest.mark.parametrize("args, message", [
    (["+model.files.Q4_0=/tmp/elsewhere.gguf"], "model.files does not apply to the bundled model 'gemma3_270m'"),
    (["model.path_template='/models/m-{quant}.gguf'"], "model.path_template does not apply to the bundled model"),
    (["model.source=files", "model.name=mine", "+model.files.Q4_K_M=/nonexistent/mine.gguf"],
     "model file /nonexistent/mine.gguf not found (model 'mine' Q4_K_M)"),
    (["model.source=files", "model.name=mine", "model.path_template='/nonexistent/mine-{quant}.gguf'",
      "model.quant=Q4_0,Q8_0"], "model file /nonexistent/mine-Q4_0.gguf not found"),
])
def test_a_model_override_takes_effect_or_is_refused_before_anything_runs(tmp_path, args, message):
    res = jbench_cli(["sweep", *args], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in " ".join(res.stderr.split()) and "Traceback" not in res.stderr
    assert "nothing was run" in " ".join(res.stderr.split())
    assert not (tmp_path / "r").exists()  # no store, no FAILED runs


def test_a_users_model_file_is_the_file_benchmarked_and_recorded(tmp_path, llama_build, bundled_model):
    own = tmp_path / "my-Q4_0.gguf"
    own.write_bytes(Path(bundled_model["Q4_0"]["path"]).read_bytes())
    env = {"JBENCH_RESULTS_DIR": str(tmp_path / "r")}
    res = jbench_cli(["run", "model.source=files", "model.name=mine", "model.quant=Q4_0",
                      f"model.path_template='{tmp_path}/my-{{quant}}.gguf'", *TINY], env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    _, _, (child,) = _runs(_client(tmp_path / "r"), "adhoc")
    assert child.data.tags["model.file"] == str(own)
    assert child.data.tags["model.sha256"] == bundled_model["Q4_0"]["sha256"]  # the bytes benchmarked
    assert child.info.run_name == "mine Q4_0"  # no varying dimension: the model and its quant


@pytest.mark.ssh
def test_a_model_file_missing_on_a_remote_device_stops_the_sweep_before_anything_runs(orin_nano, tmp_path,
                                                                                       llama_build):
    from .test_ssh_devices import write_conf

    conf = write_conf(tmp_path, orin_nano)
    res = jbench_cli(["sweep", "--config-dir", str(conf), "device=emu", f"backend.binary_dir={llama_build['bin_dir']}",
                      "model.source=files", "model.name=mine", "model.path_template='/nonexistent/mine-{quant}.gguf'",
                      "model.quant=Q4_0,Q8_0", "telemetry.source=none"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 2, res.stdout + res.stderr
    text = " ".join(res.stderr.split())
    assert "model file /nonexistent/mine-Q4_0.gguf not found on device 'emu'" in text and "nothing was run" in text
    assert "mine-Q8_0.gguf" in text and "Traceback" not in res.stderr
    assert not (tmp_path / "r").exists()
