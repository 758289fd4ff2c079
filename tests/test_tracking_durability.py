"""Nothing measured is lost: a real `mlflow server` killed mid-sweep, the spool, `jbench sync` (idempotent,
interruptible), an unreachable server at start, unwritable results, a moved store, read-only commands that
never create a store, and `jbench ui` as a real process."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from .conftest import jbench_cli
from .test_interrupts import _descendant_named

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Other test sessions share the local device: wait for its lease instead of failing. One llama.cpp thread: on a
# machine whose cores other tests share, llama-bench's spinning threads would stall each other (the tests here are
# about the store, not the speed).
SMALL = ["backend.n_prompt=16", "backend.n_gen=4", "backend.repetitions=2", "backend.threads=1",
         "device.lease_wait_s=600"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            assert proc.poll() is None, f"{proc.args} exited"
            assert time.monotonic() < deadline, f"{url} did not answer"
            time.sleep(0.3)


def _server(tmp_path: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path}/server.db", "--artifacts-destination",
         str(tmp_path / "server-artifacts"), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path, start_new_session=True)
    _wait_http(f"http://127.0.0.1:{port}/health", proc)
    return proc


def _kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _finished_trials_on_server(db: Path) -> int:
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            return con.execute("SELECT COUNT(*) FROM runs JOIN tags ON tags.run_uuid = runs.run_uuid "
                               "WHERE tags.key = 'jbench.kind' AND tags.value = 'trial' "
                               "AND runs.status = 'FINISHED'").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def _digest(directory: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(directory)).encode() + path.read_bytes())
    return h.hexdigest()


def _server_state(uri: str) -> dict:
    """Every run of the server: status, params, tags, metric histories, artifact paths (by run uid)."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("adhoc")
    state = {}
    for run in client.search_runs([exp.experiment_id], max_results=1000):
        uid = run.data.tags["jbench.run_uid"]
        assert uid not in state, f"two server runs with jbench.run_uid {uid}"
        histories = {k: sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(run.info.run_id, k))
                     for k in run.data.metrics}

        def listing(path=None):
            out = []
            for a in client.list_artifacts(run.info.run_id, path):
                out += listing(a.path) if a.is_dir else [a.path]
            return out

        state[uid] = {"id": run.info.run_id, "status": run.info.status, "end": run.info.end_time,
                      "params": dict(run.data.params), "tags": dict(run.data.tags), "metrics": histories,
                      "artifacts": sorted(listing())}
    return state


def test_server_killed_mid_sweep_is_spooled_and_synced_once(tmp_path, llama_build, bundled_model):
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    results = tmp_path / "results"
    server = _server(tmp_path, port)
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "JBENCH_RESULTS_DIR": str(results), "COLUMNS": "200"}
    exe = Path(sys.executable).with_name("jbench")
    # Trials of a few seconds each (the server dies while the second one measures); four repetitions, each of which
    # must reach the server once.
    sweep = subprocess.Popen([str(exe), "sweep", "model.quant=Q4_0,Q8_0,Q4_K_M", "backend.n_prompt=16",
                              "backend.n_gen=16", "backend.repetitions=4", "backend.threads=1",
                              "device.lease_wait_s=600"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while _finished_trials_on_server(tmp_path / "server.db") < 1:
            assert sweep.poll() is None, "the sweep ended before its first trial was recorded"
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # Killed while the next trial measures (no write starts then: the Recorder is quiet), not in the middle of
        # the request that recorded the first one.
        while not _descendant_named(sweep.pid, "llama-bench"):
            assert sweep.poll() is None, "the sweep ended before its second trial measured"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _kill(server)
        out, err = sweep.communicate(timeout=300)
    finally:
        if sweep.poll() is None:
            sweep.kill()
        _kill(server)
    assert sweep.returncode == 0, out + err
    assert "Traceback" not in out + err
    spool_lines = [ln for ln in (out + err).splitlines() if "measuring on into the spool" in ln]
    assert len(spool_lines) == 1 and "jbench sync" in spool_lines[0] and str(results / "spool") in spool_lines[0]
    # ...and the last line says where the results are: the spool, not the server that died.
    final = [ln for ln in out.splitlines() if ln.startswith("results: ")]
    assert len(final) == 1 and final[0].startswith("results: spooled in") and "jbench sync" in final[0], out
    assert "trial 3/3" in out or out.count("FINISHED") >= 3, out

    # The server still down: sync says so in one line, exit 2, and leaves the spool as it was.
    before = _digest(results / "spool")
    res = jbench_cli(["sync"], env_extra={"MLFLOW_TRACKING_URI": uri, "JBENCH_RESULTS_DIR": str(results)})
    assert res.returncode == 2 and uri in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) <= 2  # one message (rich may wrap it)
    assert _digest(results / "spool") == before

    server = _server(tmp_path, port)
    try:
        # An interrupted sync (Ctrl-C after the metrics of the second run it uploads) ...
        from jbench.tracking.sync import sync

        steps: list[str] = []

        def interrupt(step: str) -> None:
            steps.append(step)
            if step.startswith("metrics of") and sum(s.startswith("metrics of") for s in steps) == 2:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            sync(results, uri, progress=interrupt)
        # ... is finished by running it again, then nothing changes.
        res = jbench_cli(["sync"], env_extra={"MLFLOW_TRACKING_URI": uri, "JBENCH_RESULTS_DIR": str(results)})
        assert res.returncode == 0 and "Traceback" not in res.stdout + res.stderr, res.stdout + res.stderr
        state = _server_state(uri)
        parents = [r for r in state.values() if r["tags"].get("jbench.kind") == "sweep"]
        trials = [r for r in state.values() if r["tags"].get("jbench.kind") == "trial"]
        assert len(parents) == 1 and len(trials) == 3, state
        assert all(r["status"] == "FINISHED" and r["end"] for r in state.values())
        assert sorted(r["params"]["model.quant"] for r in trials) == ["Q4_0", "Q4_K_M", "Q8_0"]
        for r in trials:
            assert r["tags"]["mlflow.parentRunId"] == parents[0]["id"]
            assert r["metrics"]["decode_tps"] and r["metrics"]["decode_tps"][0][2] > 0
            reps = r["metrics"]["decode_tps_rep"]
            # each settled repetition once, none twice (4 repetitions + 1 settle repetition, the cold ones set aside)
            n = r["metrics"]["decode_repetitions"][0][2]
            assert len(reps) == n and 4 <= n <= 5 and len(set(reps)) == n, reps
            assert {"config.yaml", "trial.log", "raw/stdout.txt"} <= set(r["artifacts"]), r["artifacts"]
            assert "jbench.spooled_for" not in r["tags"]
        # The spool's runs are marked synced, and a second sync changes nothing on the server.
        spool = MlflowClient(f"sqlite:///{results}/spool/mlflow.db")
        exp = spool.get_experiment_by_name("adhoc")
        spooled = spool.search_runs([exp.experiment_id])
        assert {r.data.tags["jbench.kind"] for r in spooled} == {"sweep", "trial"}  # the open parent was re-created
        assert spooled and all(r.data.tags.get("jbench.synced_to") in {s["id"] for s in state.values()} for r in spooled)
        res = jbench_cli(["sync"], env_extra={"MLFLOW_TRACKING_URI": uri, "JBENCH_RESULTS_DIR": str(results)})
        assert res.returncode == 0 and "synced 0 run(s)" in res.stdout, res.stdout + res.stderr
        assert _server_state(uri) == state
    finally:
        _kill(server, signal.SIGTERM)


def test_unreachable_server_at_start_stops_or_spools(tmp_path, bundled_model):
    uri = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    results = tmp_path / "results"
    env = {"MLFLOW_TRACKING_URI": uri, "JBENCH_RESULTS_DIR": str(results)}
    res = jbench_cli(["run", *SMALL], env_extra=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert uri in res.stderr and "tracking.unreachable=spool" in res.stderr and "Traceback" not in res.stderr
    assert not results.exists()  # nothing created, nothing measured
    res = jbench_cli(["run", *SMALL, "tracking.unreachable=spool"], env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "spool" in res.stdout and "Traceback" not in res.stdout + res.stderr
    spool = MlflowClient(f"sqlite:///{results}/spool/mlflow.db")
    runs = spool.search_runs([spool.get_experiment_by_name("adhoc").experiment_id])
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)
    assert all(r.data.tags["jbench.spooled_for"] == uri for r in runs)
    res = jbench_cli(["run", *SMALL, "tracking.unreachable=maybe"], env_extra=env)
    assert res.returncode == 2 and "stop or spool" in res.stderr


def test_unwritable_results_and_out_paths_stop_before_anything_runs(tmp_path, bundled_model):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for results in (blocker / "results", Path("/proc/jbench-results")):
        res = jbench_cli(["run", *SMALL], env_extra={"JBENCH_RESULTS_DIR": str(results)}, timeout=60)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "cannot write results" in res.stderr and "Traceback" not in res.stderr
        assert "trial 1" not in res.stdout
    # A store whose experiment keeps its artifacts in a place that cannot be written (an old absolute location).
    results = tmp_path / "results"
    res = jbench_cli(["run", *SMALL], env_extra={"JBENCH_RESULTS_DIR": str(results)})
    assert res.returncode == 0, res.stdout + res.stderr
    con = sqlite3.connect(results / "mlflow.db")
    con.execute("UPDATE experiments SET artifact_location = ? WHERE name = 'adhoc'", ((blocker / "art").as_uri(),))
    con.commit()
    con.close()
    res = jbench_cli(["run", *SMALL], env_extra={"JBENCH_RESULTS_DIR": str(results)})
    assert res.returncode == 2 and "cannot write results" in res.stderr and "Traceback" not in res.stderr
    for args in (["report", "--no-log", "--out", str(blocker / "report")],
                 ["export", "--out", str(blocker / "x.csv")]):
        res = jbench_cli(args, env_extra={"JBENCH_RESULTS_DIR": str(results)})
        assert res.returncode == 2 and "cannot write" in res.stderr and "Traceback" not in res.stderr, args


def test_read_only_commands_never_create_a_store(tmp_path):
    results = tmp_path / "nothing-here"
    env = {"JBENCH_RESULTS_DIR": str(results)}
    for args in (["regress"], ["report"], ["compare", "a", "b"], ["export", "--out", str(tmp_path / "x.csv")],
                 ["ui", "--port", str(_free_port())]):
        res = jbench_cli(args, env_extra=env, timeout=60)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert str(results) in res.stderr and "run a sweep first" in res.stderr and "Traceback" not in res.stderr
        assert not results.exists(), args


def test_moved_store_keeps_working_and_ui_serves_old_and_new_artifacts(tmp_path, bundled_model):
    first = tmp_path / "first"
    res = jbench_cli(["run", *SMALL], env_extra={"JBENCH_RESULTS_DIR": str(first)})
    assert res.returncode == 0, res.stdout + res.stderr
    for noise in ("View run", "Uploading artifacts", "alembic", "INFO ", "Downloading artifacts", "%|"):
        assert noise not in res.stdout + res.stderr, noise
    moved = tmp_path / "moved"
    first.rename(moved)
    env = {"JBENCH_RESULTS_DIR": str(moved)}
    res = jbench_cli(["run", *SMALL, "model.quant=Q8_0"], env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    client = MlflowClient(f"sqlite:///{moved}/mlflow.db")
    exp = client.get_experiment_by_name("adhoc")
    newest = client.search_runs([exp.experiment_id], filter_string="tags.`jbench.kind` = 'sweep'",
                                order_by=["attributes.start_time DESC"], max_results=1)[0]
    # A sweep's report is attached to its own parent (a whole-experiment report is attached nowhere).
    res = jbench_cli(["report", "--sweep", newest.data.tags["jbench.sweep_id"]], env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not first.exists()
    assert exp.artifact_location == "mlflow-artifacts:/adhoc"
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`jbench.kind` = 'trial'",
                              order_by=["attributes.start_time ASC"])
    old, new = runs[0].info.run_id, runs[1].info.run_id
    assert (moved / "artifacts" / "adhoc" / new / "artifacts" / "config.yaml").exists()
    assert any((moved / "artifacts" / "adhoc").glob("*/artifacts/report/*.html"))

    port = _free_port()
    exe = Path(sys.executable).with_name("jbench")
    ui = subprocess.Popen([str(exe), "ui", "--port", str(port), "--results-dir", str(moved)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", ui)
        for run_id in (old, new):
            url = f"http://127.0.0.1:{port}/get-artifact?path=config.yaml&run_uuid={run_id}"
            body = urllib.request.urlopen(url, timeout=10).read().decode()
            assert "model:" in body, body[:200]
        busy = jbench_cli(["ui", "--port", str(port), "--results-dir", str(moved)], timeout=60)
        assert busy.returncode != 0 and "in use" in busy.stderr and "Traceback" not in busy.stderr
    finally:
        ui.send_signal(signal.SIGTERM)
        out, err = ui.communicate(timeout=30)
    assert f"http://127.0.0.1:{port}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning" in out, out
    assert "Traceback" not in out + err, err
    with pytest.raises(OSError):  # the server and its workers are gone
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
    # Ctrl-C (SIGINT) stops it the same way.
    ui = subprocess.Popen([str(exe), "ui", "--port", str(port), "--results-dir", str(moved)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", ui)
    finally:
        ui.send_signal(signal.SIGINT)
        out, err = ui.communicate(timeout=30)
    assert "Traceback" not in out + err and "stopped" in out, out + err
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
