"""The team store (docs/team-store.md): a real `mlflow server` on a real PostgreSQL cluster with proxied artifacts,
several controllers (real `jbench sweep` processes) writing into one experiment at once; per-controller spool and
`jbench sync` when the server dies; no credential in jbench's output or records; read-only commands on it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from .conftest import jbench_cli
from .test_interrupts import _descendant_named
from .team_store import team_store  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# One llama.cpp thread: llama-bench's spinning threads stall each other on cores that other tests share, and these
# tests are about the records, not the speed.
SMALL = ["backend.n_prompt=16", "backend.n_gen=4", "backend.repetitions=1", "backend.threads=1",
         "device.lease_wait_s=600"]
EXPERIMENT = "team"


def _sweep(args: list[str], results: Path, uri: str) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "JBENCH_RESULTS_DIR": str(results), "COLUMNS": "200"}
    exe = Path(sys.executable).with_name("jbench")
    return subprocess.Popen([str(exe), "sweep", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _runs(uri: str, experiment: str) -> list:
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id], max_results=1000)


def _listing(client: MlflowClient, run_id: str, path=None) -> list[str]:
    out = []
    for a in client.list_artifacts(run_id, path):
        out += _listing(client, run_id, a.path) if a.is_dir else [a.path]
    return out


@pytest.fixture(scope="module")
def three_controllers(team_store, llama_build, bundled_model, tmp_path_factory):  # noqa: F811
    """Three controllers, each with its own results directory, sweeping into one experiment at once. They take turns
    on this machine (the local device's lease); sweep.rerun=true because a controller that waited would otherwise
    resume what the one before it finished (the same trials on the same device) and record nothing."""
    base = tmp_path_factory.mktemp("controllers")
    procs = [_sweep(["model.quant=Q4_0,Q8_0", f"tracking.experiment_name={EXPERIMENT}", "sweep.rerun=true", *SMALL],
                    base / f"c{i}", team_store.uri) for i in range(3)]
    outs = [p.communicate(timeout=900) for p in procs]
    return base, procs, outs


def test_three_controllers_write_one_experiment_at_once(team_store, three_controllers):  # noqa: F811
    base, procs, outs = three_controllers
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
        assert "Traceback" not in out + err and "spool" not in out + err, out + err
    for i in range(3):
        assert not (base / f"c{i}" / "spool").exists()  # nothing went to a spool: the server had it all
    client = MlflowClient(team_store.uri)
    runs = _runs(team_store.uri, EXPERIMENT)
    parents = [r for r in runs if r.data.tags.get("jbench.kind") == "sweep"]
    trials = [r for r in runs if r.data.tags.get("jbench.kind") == "trial"]
    assert len(parents) == 3 and len(trials) == 6, [(r.info.run_name, r.data.tags.get("jbench.kind")) for r in runs]
    assert len({r.data.tags["jbench.sweep_id"] for r in parents}) == 3
    assert len({r.data.tags["jbench.run_uid"] for r in runs}) == 9  # no run twice
    assert all(r.info.status == "FINISHED" and r.info.end_time for r in runs)
    by_parent = {p.info.run_id: [] for p in parents}
    for t in trials:
        by_parent[t.data.tags["mlflow.parentRunId"]].append(t.data.params["model.quant"])
    assert all(sorted(q) == ["Q4_0", "Q8_0"] for q in by_parent.values()), by_parent
    for t in trials:
        assert t.data.metrics["decode_tps"] > 0
        # Proxied artifacts: the run's location names the server, and the files come back through it.
        assert t.info.artifact_uri.startswith("mlflow-artifacts:"), t.info.artifact_uri
        assert {"config.yaml", "trial.log", "raw/stdout.txt"} <= set(_listing(client, t.info.run_id))
        local = client.download_artifacts(t.info.run_id, "config.yaml", str(base / "dl" / t.info.run_id))
        assert "quant: " + t.data.params["model.quant"] in Path(local).read_text()
    for p in parents:
        assert "summary.json" in _listing(client, p.info.run_id)
    # ...and they live in the server's --artifacts-destination, not on the controllers.
    assert len(list(team_store.artifacts.rglob("config.yaml"))) == 6
    assert not any((base / f"c{i}" / "artifacts").exists() for i in range(3))


def test_read_only_commands_read_the_team_store(team_store, three_controllers, tmp_path):  # noqa: F811
    env = {"MLFLOW_TRACKING_URI": team_store.uri, "JBENCH_RESULTS_DIR": str(tmp_path / "none")}
    sweeps = sorted(r.data.tags["jbench.sweep_id"] for r in _runs(team_store.uri, EXPERIMENT)
                    if r.data.tags.get("jbench.kind") == "sweep")
    res = jbench_cli(["compare", sweeps[0], sweeps[1], "--json"], env_extra=env)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert '"Q4_0"' in res.stdout or "Q4_0" in res.stdout
    res = jbench_cli(["regress", "--experiment", EXPERIMENT], env_extra=env)
    # Three sweeps (fewer nights than history needs): pairwise, newest against the one before. One repetition a
    # side is fewer than the 3 samples a test needs: no verdict (exit 3), never green, and it says why.
    assert res.returncode == 3 and res.stdout.startswith("# jbench regress:"), res.stdout + res.stderr
    assert "mode: pairwise" in res.stderr and "NO VERDICT: insufficient data" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    res = jbench_cli(["report", "--sweep", sweeps[2], "--out", str(tmp_path / "rep")], env_extra=env)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert "data:image/png;base64," in (tmp_path / "rep" / "report.html").read_text()
    res = jbench_cli(["export", "--experiment", EXPERIMENT, "--out", str(tmp_path / "runs.csv")], env_extra=env)
    assert res.returncode == 0 and len((tmp_path / "runs.csv").read_text().strip().splitlines()) == 7
    assert not (tmp_path / "none").exists()  # reading a server creates no local store


def test_server_killed_each_controller_spools_and_syncs_once(team_store, llama_build, bundled_model,  # noqa: F811
                                                            tmp_path):
    """Two controllers with credentials in their tracking URI; the server dies after the first trial is on it.
    Each spools into its own results directory; after the restart each `jbench sync` uploads exactly once.
    No password appears in jbench's output, in the spool's tags or on the server."""
    password = "s3cret-Pa55"
    uri = f"http://alice:{password}@127.0.0.1:{team_store.port}"
    experiment = "team-outage"
    # Trials of a few seconds: the server dies while the first controller's second trial measures.
    args = ["model.quant=Q4_0,Q8_0,Q4_K_M", f"tracking.experiment_name={experiment}", "backend.n_prompt=16",
            "backend.n_gen=16", "backend.repetitions=3", "backend.threads=1", "device.lease_wait_s=600"]
    results = [tmp_path / "a", tmp_path / "b"]
    procs = [_sweep(args, r, uri) for r in results]
    try:
        deadline = time.monotonic() + 600
        while not any(r.info.status == "FINISHED" for r in _runs(team_store.uri, experiment)
                      if r.data.tags.get("jbench.kind") == "trial"):
            assert all(p.poll() is None for p in procs), "a sweep ended before the first trial was recorded"
            assert time.monotonic() < deadline
            time.sleep(0.2)
        # Killed while a trial measures (no write starts then: the Recorder is quiet, and the other controller
        # waits for the device), not in the middle of the request that recorded the first trial.
        while not any(_descendant_named(p.pid, "llama-bench") for p in procs):
            assert all(p.poll() is None for p in procs), "a sweep ended before its second trial measured"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        team_store.kill_server()
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if team_store.server is None:
            team_store.start_server()
    for p, (out, err), res_dir in zip(procs, outs, results):
        assert p.returncode == 0, out + err
        assert "Traceback" not in out + err and password not in out + err, out + err
        lines = [ln for ln in (out + err).splitlines() if "measuring on into the spool" in ln]
        assert len(lines) == 1 and str(res_dir / "spool") in lines[0] and "alice:***@" in lines[0], out + err
        spool = MlflowClient(f"sqlite:///{res_dir}/spool/mlflow.db")
        spooled = spool.search_runs([spool.get_experiment_by_name(experiment).experiment_id])
        assert spooled and all(r.data.tags["jbench.spooled_for"] == f"http://alice:***@127.0.0.1:{team_store.port}"
                               for r in spooled)
    # Server back (restarted above): sync names no password; the spool's redacted URI is not guessed at.
    env = {"JBENCH_RESULTS_DIR": str(results[0])}
    res = jbench_cli(["sync"], env_extra={**env, "MLFLOW_TRACKING_URI": ""})
    assert res.returncode == 2 and "alice:***@" in res.stderr and "--uri" in res.stderr, res.stdout + res.stderr
    for res_dir in results:
        res = jbench_cli(["sync"], env_extra={"JBENCH_RESULTS_DIR": str(res_dir), "MLFLOW_TRACKING_URI": uri})
        assert res.returncode == 0 and password not in res.stdout + res.stderr, res.stdout + res.stderr
        assert "alice:***@" in res.stdout
    runs = _runs(team_store.uri, experiment)
    parents = [r for r in runs if r.data.tags.get("jbench.kind") == "sweep"]
    trials = [r for r in runs if r.data.tags.get("jbench.kind") == "trial"]
    assert len(parents) == 2 and len(trials) == 6, [(r.info.run_name, r.info.status) for r in runs]
    assert len({r.data.tags["jbench.run_uid"] for r in runs}) == 8
    assert all(r.info.status == "FINISHED" and r.info.end_time for r in runs)
    for p in parents:
        kids = [t for t in trials if t.data.tags["mlflow.parentRunId"] == p.info.run_id]
        assert sorted(t.data.params["model.quant"] for t in kids) == ["Q4_0", "Q4_K_M", "Q8_0"]
    client = MlflowClient(team_store.uri)
    for t in trials:
        reps = client.get_metric_history(t.info.run_id, "decode_tps_rep")
        # each settled repetition once, none twice (3 repetitions + 1 settle repetition, the cold ones set aside)
        assert len(reps) == t.data.metrics["decode_repetitions"] and 3 <= len(reps) <= 4, reps
        assert "config.yaml" in _listing(client, t.info.run_id)
    for r in runs:  # no credential recorded anywhere on the server
        assert not any(password in v or team_store.pg.password in v
                       for v in [*r.data.tags.values(), *r.data.params.values()])
    before = sorted((r.info.run_id, r.info.end_time) for r in runs)
    for res_dir in results:
        res = jbench_cli(["sync"], env_extra={"JBENCH_RESULTS_DIR": str(res_dir), "MLFLOW_TRACKING_URI": uri})
        assert res.returncode == 0 and "synced 0 run(s)" in res.stdout, res.stdout + res.stderr
    assert sorted((r.info.run_id, r.info.end_time) for r in _runs(team_store.uri, experiment)) == before


def test_database_uri_is_refused_with_the_fix_and_no_password(team_store, bundled_model, tmp_path):  # noqa: F811
    """A postgresql:// URI given to jbench itself: one message naming `mlflow server`, exit 2, password hidden."""
    pg = team_store.pg
    db_uri = f"postgresql://{pg.role}:{pg.password}@127.0.0.1:{pg.port}/{pg.database}"
    env = {"JBENCH_RESULTS_DIR": str(tmp_path / "r")}
    for args, extra in ((["sweep", *SMALL, f"tracking.uri={db_uri}"], {}),
                        (["sweep", *SMALL, "--dry-run"], {"MLFLOW_TRACKING_URI": db_uri}),
                        (["report"], {"MLFLOW_TRACKING_URI": db_uri}),
                        (["sync", "--uri", db_uri], {})):
        res = jbench_cli(args, env_extra={**env, **extra})
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert pg.password not in res.stdout + res.stderr and "Traceback" not in res.stderr
        assert "mlflow server" in res.stderr and f"{pg.role}:***@" in res.stderr, res.stderr
    assert not (tmp_path / "r").exists()


SLEEP_ENGINE = Path(__file__).parent / "fixtures" / "engine" / "sleep_engine.sh"


def _sleepy_conf(tmp_path: Path, seconds: float) -> Path:
    """A backend whose device-side work is a fixed sleep on this machine: the test is about the records."""
    conf = tmp_path / "conf"
    (conf / "backend").mkdir(parents=True)
    (conf / "backend" / "sleepy.yaml").write_text(
        "defaults: [engine_schema, _self_]\nname: engine\noutput: log\nn_prompt: 16\nn_gen: 8\nrepetitions: 1\n"
        f'command: ["{SLEEP_ENGINE}", "{seconds}", "{{prompt_tokens}}", "{{gen_tokens}}"]\n')
    return conf


def _store_answer(uri: str) -> tuple[int, str]:
    """What the server answers to a store request (an experiment search), as a client sees it on the wire."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri}/api/2.0/mlflow/experiments/search?max_results=1", timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_database_stopped_mid_sweep_spools_and_syncs_once(team_store, tmp_path):  # noqa: F811
    """PostgreSQL stopped (pg_ctl stop -m fast) under a running sweep with tracking.unreachable=spool: the server
    answers 503, the sweep measures on into its spool, `jbench sync` waits for the database, stops cleanly when the
    database goes down again under it, and uploads every run exactly once."""
    from mlflow.exceptions import MlflowException

    from jbench.tracking.sync import SyncError, sync as run_sync
    from jbench.tracking.writer import unreachable

    experiment = "team-db-outage"
    args = ["--config-dir", str(_sleepy_conf(tmp_path, 2.0)), "backend=sleepy", "backend.n_gen=4,8,16,32,64,128",
            "telemetry.source=none", "thermal.start_below_c=null", f"tracking.experiment_name={experiment}",
            "device.lease_wait_s=600"]
    results = tmp_path / "c"
    env = {"JBENCH_RESULTS_DIR": str(results), "MLFLOW_TRACKING_URI": team_store.uri}
    proc = _sweep([*args, "tracking.unreachable=spool"], results, team_store.uri)
    try:
        deadline = time.monotonic() + 600
        while not any(r.info.status == "FINISHED" for r in _runs(team_store.uri, experiment)
                      if r.data.tags.get("jbench.kind") == "trial"):
            assert proc.poll() is None, "the sweep ended before its first trial was recorded"
            assert time.monotonic() < deadline
            time.sleep(0.2)
        team_store.pg.stop("fast")
        # Measured: /health still says OK, every store request is a 503 naming the database's failure.
        status, body = _store_answer(team_store.uri)
        assert status == 503 and '"TEMPORARILY_UNAVAILABLE"' in body and "OperationalError" in body, (status, body)
        with pytest.raises(MlflowException) as answer:  # MLflow's client, with jbench's retry settings
            MlflowClient(team_store.uri).search_experiments(max_results=1)
        assert "503" in str(answer.value) and unreachable(answer.value), repr(answer.value)  # not a refusal
        out, err = proc.communicate(timeout=600)
        # While the database is down: a new sweep that may not spool stops before measuring, sync waits.
        res = jbench_cli(["sweep", *args, "tracking.unreachable=stop"], env_extra=env)
        assert res.returncode == 2 and "its store does not" in res.stderr, res.stdout + res.stderr
        res = jbench_cli(["sync"], env_extra=env)
        assert res.returncode == 2 and "its store does not" in res.stderr and "untouched" in res.stderr, \
            res.stdout + res.stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if not (team_store.pg.data / "postmaster.pid").exists():
            team_store.pg.start()
    assert proc.returncode == 0, out + err
    assert "Traceback" not in out + err, out + err
    assert len([ln for ln in (out + err).splitlines() if "measuring on into the spool" in ln]) == 1, out + err
    spool = MlflowClient(f"sqlite:///{results}/spool/mlflow.db")
    spooled = {r.data.tags["jbench.run_uid"]: r for r in
               spool.search_runs([spool.get_experiment_by_name(experiment).experiment_id])}
    assert spooled and all(r.info.status == "FINISHED" for r in spooled.values())

    # The database is back (the server answers again by itself), then goes down under the sync after one run.
    def database_dies_after_the_first_run(step: str) -> None:
        if step.startswith("synced ") and (team_store.pg.data / "postmaster.pid").exists():
            team_store.pg.stop("fast")

    try:
        with pytest.raises(SyncError, match=r"stopped answering after 1 run\(s\)"):
            run_sync(results, team_store.uri, progress=database_dies_after_the_first_run)
    finally:
        if not (team_store.pg.data / "postmaster.pid").exists():
            team_store.pg.start()
    res = jbench_cli(["sync"], env_extra=env)
    assert res.returncode == 0 and f"synced {len(spooled) - 1} run(s)" in res.stdout and "1 synced before" in \
        res.stdout, res.stdout + res.stderr
    runs = _runs(team_store.uri, experiment)
    trials = [r for r in runs if r.data.tags.get("jbench.kind") == "trial"]
    assert [r.data.tags.get("jbench.kind") for r in runs].count("sweep") == 1
    assert sorted(int(r.data.tags["jbench.trial_index"]) for r in trials) == [1, 2, 3, 4, 5, 6]  # each once
    assert len({r.data.tags["jbench.run_uid"] for r in runs}) == len(runs) == 7
    assert all(r.info.status == "FINISHED" and r.info.end_time for r in runs)
    client = MlflowClient(team_store.uri)
    for t in trials:  # nothing measured lost: the spooled figures are the server's
        assert t.data.metrics["decode_tps"] > 0
        if t.data.tags["jbench.run_uid"] in spooled:
            assert spooled[t.data.tags["jbench.run_uid"]].data.metrics == t.data.metrics
        assert "trial.log" in _listing(client, t.info.run_id)
    before = sorted((r.info.run_id, r.info.end_time) for r in runs)
    res = jbench_cli(["sync"], env_extra=env)
    assert res.returncode == 0 and "synced 0 run(s)" in res.stdout, res.stdout + res.stderr
    assert sorted((r.info.run_id, r.info.end_time) for r in _runs(team_store.uri, experiment)) == before
