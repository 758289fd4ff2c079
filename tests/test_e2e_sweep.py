"""End to end: the `jbench` CLI on the real bundled model with the real llama.cpp build,
results checked through MlflowClient the way a user sees them in the MLflow UI."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from jbench.backends.llamacpp.bench import parse_output

from .conftest import jbench_cli
from .gguf_files import unloadable_gguf

pytestmark = pytest.mark.e2e

# quality is tested in tests/test_quality.py; here it would only add llama-perplexity passes
SMALL = ["backend.n_prompt=16", "backend.n_gen=4", "backend.repetitions=2", "quality.enabled=false"]


def _runs(uri: str, experiment: str):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"experiment {experiment} missing"
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("jbench.kind") == "sweep"]
    children = sorted((r for r in runs if r.data.tags.get("jbench.kind") == "trial"),
                      key=lambda r: int(r.data.tags["jbench.trial_index"]))
    return client, parents, children


def test_quant_ladder_sweep_lands_in_mlflow(tmp_path, llama_build, bundled_model):
    res = jbench_cli(["sweep", "+experiment=quant_ladder", "model.quant=Q4_0,Q8_0", *SMALL],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "trial 2/2" in res.stdout and "FINISHED" in res.stdout
    client, parents, children = _runs(f"sqlite:///{tmp_path}/mlflow.db", "quant_ladder")
    assert len(parents) == 1 and len(children) == 2
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    sweep_id = parent.data.tags["jbench.sweep_id"]
    for child, quant in zip(children, ["Q4_0", "Q8_0"]):
        tags, params, metrics = child.data.tags, child.data.params, child.data.metrics
        assert child.info.status == "FINISHED"
        assert tags["mlflow.parentRunId"] == parent.info.run_id and tags["jbench.sweep_id"] == sweep_id
        assert params["model.quant"] == quant and params["backend.n_gen"] == "4" and params["backend.repetitions"] == "2"
        assert tags["jbench.choice.model"] == "gemma3_270m" and tags["jbench.choice.device"] == "local"
        # Identity keys are params only, never repeated as tags.
        assert not {"model.quant", "model.name", "backend.name", "device.name"} & set(tags)
        assert tags["model.sha256"] == bundled_model[quant]["sha256"]
        assert tags["model.requantized_from"] == "Q4_K_M"
        assert params["backend.name"] == "llamacpp" and tags["backend.build_commit"] == llama_build["build_commit"]
        assert params["device.name"] == "local" and tags["host.kernel"].startswith("Linux") and tags["host.cpu"]
        assert len(tags["jbench.config_hash"]) == 16 and tags["jbench.version"] and tags["jbench.git_sha"]
        assert not set(params) & set(tags), "a param repeated as a tag"
        for key in ("prefill_tps", "decode_tps", "prefill_tps_std", "decode_tps_std"):
            assert metrics[key] > 0, key
        history = client.get_metric_history(child.info.run_id, "decode_tps_rep")
        # Two repetitions and one settle repetition ran; the leading cold ones (if any) are set aside, said.
        cold = int(metrics["decode_cold_repetitions"])
        assert 0 <= cold <= 1 and tags["decode.settle"]
        assert sorted(m.step for m in history) == list(range(3 - cold))
        # Honest numbers: the logged mean is recomputed from the raw llama-bench output artifact.
        artifacts = {a.path for a in client.list_artifacts(child.info.run_id)}
        assert {"config.yaml", "trial.log", "raw"} <= artifacts
        raw = Path(client.download_artifacts(child.info.run_id, "raw/stdout.txt", str(tmp_path / child.info.run_id)))
        phases, _, _ = parse_output(raw.read_text())
        assert len(phases["decode"].samples_tps) == 3
        decode = phases["decode"].samples_tps[cold:]  # the cold ones ran first
        assert metrics["decode_tps"] == pytest.approx(sum(decode) / len(decode), rel=1e-9)
        assert sorted(m.value for m in history) == pytest.approx(sorted(decode))
        log = Path(client.download_artifacts(child.info.run_id, "trial.log", str(tmp_path / child.info.run_id))).read_text()
        assert "llama-bench -m" in log and "FINISHED" in log


def test_failed_trials_are_recorded_and_the_sweep_goes_on(tmp_path, llama_build, bundled_model):
    corrupt = unloadable_gguf(tmp_path / "corrupt.gguf")  # a whole GGUF file (planning refuses a broken one)
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "mixed.yaml").write_text(json.dumps({
        "defaults": ["model_schema", "_self_"], "name": "mixed", "quant": "Q4_0",
        "files": {"Q4_0": bundled_model["Q4_0"]["path"], "Q8_0": str(corrupt)},
    }))
    res = jbench_cli(["sweep", "--config-dir", str(conf), "model=mixed", "model.quant=Q8_0,Q4_0", *SMALL],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "results")})
    assert res.returncode == 4, res.stdout + res.stderr
    assert "1 of 2 trial(s) failed" in res.stderr
    client, parents, children = _runs(f"sqlite:///{tmp_path}/results/mlflow.db", "adhoc")
    failed, ok = children
    assert failed.info.status == "FAILED" and ok.info.status == "FINISHED"
    assert failed.data.tags["jbench.failure_category"] == "backend_crash"
    assert "llama-bench exited with code" in failed.data.tags["jbench.failure_reason"]
    stderr = Path(client.download_artifacts(failed.info.run_id, "raw/stderr.txt", str(tmp_path / "dl"))).read_text()
    assert "corrupt.gguf" in stderr or "failed" in stderr.lower()
    assert ok.data.metrics["decode_tps"] > 0
    assert parents[0].info.status == "FAILED" and parents[0].data.tags["jbench.failed_trials"] == "1"


def test_unparseable_backend_output_is_a_failed_trial_not_a_zero(tmp_path, bundled_model):
    fake = Path(__file__).parent / "fixtures" / "unparseable_llamacpp"
    res = jbench_cli(["run", f"backend.binary_dir={fake}", *SMALL], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path)})
    assert res.returncode == 4
    client, _, children = _runs(f"sqlite:///{tmp_path}/mlflow.db", "adhoc")
    run = children[0]
    assert run.info.status == "FAILED" and run.data.tags["jbench.failure_category"] == "unparseable_output"
    assert "decode_tps" not in run.data.metrics and "prefill_tps" not in run.data.metrics
    raw = Path(client.download_artifacts(run.info.run_id, "raw/stdout.txt", str(tmp_path / "dl"))).read_text()
    assert "unexpected output format" in raw


def test_missing_build_says_run_setup(tmp_path):
    res = jbench_cli(["sweep", "+experiment=quant_ladder"],
                     env_extra={"JBENCH_CACHE_DIR": str(tmp_path / "empty-cache"), "JBENCH_RESULTS_DIR": str(tmp_path)})
    assert res.returncode == 2
    assert "run `jbench setup`" in res.stderr and "Traceback" not in res.stderr
    res = jbench_cli(["run", "backend.binary_dir=/nonexistent/bin"], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path)})
    assert res.returncode == 2 and "/nonexistent/bin/llama-bench not found" in res.stderr
    assert not (tmp_path / "mlflow.db").exists()  # nothing recorded before the device is ready


def test_bad_input_lists_valid_names_without_traceback(tmp_path):
    res = jbench_cli(["sweep", "+experiment=quant_ladder", "model.quant=Q4_0,Q3_Z"], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path)})
    assert res.returncode == 2
    assert "unknown quant 'Q3_Z'" in res.stderr and "Q4_K_M" in res.stderr and "Traceback" not in res.stderr
    res = jbench_cli(["sweep", "+experiment=quant_ladr"])
    assert res.returncode == 2 and "Valid experiment names: backend_shootout, context_sweep" in res.stderr


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    res = jbench_cli(["sweep", "+experiment=quant_ladder", "backend.n_gen=64,128", "--dry-run"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    assert "12 trial(s)" in res.stdout and "model.quant=F16 backend.n_gen=128" in res.stdout
    assert not (tmp_path / "mlflow.db").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_remote_tracking_through_mlflow_server(tmp_path, bundled_model):
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path}/server.db", "--artifacts-destination", str(tmp_path / "artifacts"),
         "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, "mlflow server exited"
                assert time.monotonic() < deadline, "mlflow server did not become ready"
                time.sleep(0.5)
        res = jbench_cli(["run", *SMALL], env_extra={"MLFLOW_TRACKING_URI": uri, "JBENCH_RESULTS_DIR": str(tmp_path / "local")})
        assert res.returncode == 0, res.stdout + res.stderr
        client, parents, children = _runs(uri, "adhoc")
        assert len(children) == 1 and children[0].data.metrics["decode_tps"] > 0
        assert {a.path for a in client.list_artifacts(children[0].info.run_id)} >= {"config.yaml", "trial.log", "raw"}
        assert not (tmp_path / "local" / "mlflow.db").exists()
    finally:
        server.terminate()
        server.wait(timeout=30)
