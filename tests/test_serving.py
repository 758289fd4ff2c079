"""The serving scenario end to end: the REAL llama-server of `jbench setup` with the bundled Gemma 3 270M Q4_0 under
load levels (tiny prompts, few tokens, one server thread: the test machine has 2 cores), through the backend and
through `jbench sweep +experiment=serving` into MLflow; over SSH on the emulated Jetson. The levels' analysis is
tests/test_serving_analysis.py's, the record's tests/test_serving_stage.py's, the load generator's
tests/test_serving_loadgen.py's."""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from jbench.backends.llamacpp import client
from jbench.backends.llamacpp.backend import LlamaCppBackend
from jbench.core.identity import config_hash
from jbench.device.connect import connect
from jbench.device.local import LocalConnection
from jbench.sweeps.plan import plan

from .conftest import jbench_cli
from .test_latency import assert_server_gone, trial_logger

SMALL = ["+experiment=serving", "model.quant=Q4_0", "backend.threads=1", "serving.slots=2",
         "serving.requests_per_level=6", "serving.input.kind=fixed", "serving.input.mean=16", "serving.output.mean=8",
         "backend.timeout_s=300"]


def make_trial(*overrides: str):
    p = plan([*SMALL, *overrides])
    assert not p.problems, p.problems
    return p.trials[0]


def level_rows(raw: str) -> list[dict]:
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


@pytest.mark.e2e  # plans on the bundled model
def test_bad_serving_input_is_refused_whole_before_anything_runs(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "input_tokens": 8, "output_tokens": 4}\n{"arrival_s": 1, "output_tokens": 4}\n')
    p = plan([*SMALL, "serving.load=burst", "serving.search=slo", "serving.input.low=0",
              "serving.slo.ttft_ms=null", "serving.slo.tpot_ms=null",
              f"serving.trace={trace}"])
    text = "\n".join(p.problems)
    assert "serving.load 'burst' is not valid" in text
    assert "serving.search=slo needs a target" in text
    assert "serving.input.low" in text
    assert f"{trace}:2" in text  # the trace's bad line, by number
    assert any("not a whole number" in m for m in plan([*SMALL, "serving.levels=[1,2.5]"]).problems)


@pytest.mark.e2e  # plans on the bundled model
def test_serving_keys_are_identity_only_in_the_serving_scenario():
    bench = plan(["model.quant=Q4_0"]).trials[0]
    changed = dict(bench.config, serving=dict(bench.config["serving"], requests_per_level=99))
    assert config_hash(changed) == bench.config_hash
    t = make_trial()
    more = dict(t.config, serving=dict(t.config["serving"], requests_per_level=99))
    assert config_hash(more) != t.config_hash
    timeout = dict(t.config, serving=dict(t.config["serving"], level_timeout_s=5.0))
    assert config_hash(timeout) == t.config_hash


@pytest.mark.e2e
def test_a_ladder_against_real_llama_server_gives_levels_windows_and_every_request(llama_build, bundled_model):
    trial = make_trial("serving.levels=[1,2,4]")
    log, lines = trial_logger("serving-ladder")
    result = LlamaCppBackend(trial.config["backend"]).run(trial, LocalConnection(), log)
    assert_server_gone(lines.lines, result.command)
    argv = result.command
    assert argv[argv.index("--parallel") + 1] == "2" and argv[argv.index("-c") + 1] == "512"
    assert [lv.load for lv in result.serving_levels] == [1.0, 2.0, 4.0]
    assert [w.name for w in result.load_windows] == ["level1", "level2", "level3"]
    for lv, w in zip(result.serving_levels, result.load_windows):
        assert len(lv.outcomes) == 6 and all(o.ok for o in lv.outcomes)
        assert all(o.output_tokens == 8 and o.prompt_tokens == 16 for o in lv.outcomes)
        assert w.output_tokens == 48 and w.total_tokens == 6 * 24
        # The window is the level's stretch, on the device's clock (here the same machine: the same clock).
        assert w.end - w.start == pytest.approx(lv.wall_s, abs=0.05)
    w1, w2 = result.load_windows[:2]
    assert w1.end <= w2.start + 0.05
    rows = level_rows(result.raw_output)
    assert len(rows) == 18 and {r["level"] for r in rows} == {1, 2, 3}
    assert all(r["cached_tokens"] == 0 for r in rows)  # no request reused another's prompt cache
    # At 4 in flight against 2 slots, requests were sent before others ended (a real queue on the server).
    level3 = [r for r in rows if r["level"] == 3]
    first_end = min(r["sent_at"] + r["e2e_s"] for r in level3)
    assert sum(r["sent_at"] < first_end for r in level3) >= 3  # more in flight than the 2 slots
    assert result.phases == {}  # a served request's TTFT is no prefill rate
    assert math.isfinite(result.metrics["serving_clock_uncertainty_ms"])


@pytest.mark.e2e
def test_the_slo_search_brackets_and_bisects_on_a_real_server(llama_build, bundled_model):
    # A TTFT target a queue of two waiting requests breaks: the search climbs 1, 2, 4 ... and stops where it fails.
    trial = make_trial("serving.search=slo", "serving.levels=[1]", "serving.max_load=4", "serving.replicates=1",
                       "serving.slo.ttft_ms=60000", "serving.requests_per_level=4")
    log, lines = trial_logger("serving-search")
    result = LlamaCppBackend(trial.config["backend"]).run(trial, LocalConnection(), log)
    assert_server_gone(lines.lines, result.command)
    loads = [lv.load for lv in result.serving_levels]
    # A one-minute TTFT holds at every load: the search climbs to max_load and stops, not bracketed.
    assert loads == [1.0, 2.0, 4.0]


@pytest.mark.e2e
def test_an_open_loop_far_over_capacity_is_stopped_as_over_saturated(llama_build, bundled_model):
    # One slot on one thread serves about 1.5 requests/s of 32 tokens here (less on a loaded machine); 4/s for 20 s
    # grows its queue by the second, and the level stops sending once 8 answers show it, long before the last is due.
    trial = make_trial("serving.load=rate", "serving.levels=[4]", "serving.arrival=constant", "serving.slots=1",
                       "serving.requests_per_level=80", "serving.output.mean=32")
    log, lines = trial_logger("serving-saturated")
    result = LlamaCppBackend(trial.config["backend"]).run(trial, LocalConnection(), log)
    assert_server_gone(lines.lines, result.command)
    [level] = result.serving_levels
    assert level.stopped_early and "queue grows" in level.stopped_early
    assert sum(o.ok for o in level.outcomes) < 80  # it stopped sending


@pytest.mark.e2e
def test_server_is_stopped_when_the_run_is_interrupted_mid_level(llama_build, bundled_model, monkeypatch):
    real_complete = client.StreamingClient.complete
    calls = []

    def interrupting(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_complete(self, *args, **kwargs)

    monkeypatch.setattr(client.StreamingClient, "complete", interrupting)
    trial = make_trial("serving.levels=[2]")
    log, lines = trial_logger("serving-ctrl-c")
    with pytest.raises(KeyboardInterrupt):
        LlamaCppBackend(trial.config["backend"]).run(trial, LocalConnection(), log)
    assert_server_gone(lines.lines)
    assert any("llama-server stopped" in line for line in lines.lines)


@pytest.mark.e2e
def test_jbench_sweep_experiment_serving_records_every_level_in_mlflow(tmp_path, llama_build, bundled_model):
    env = {"JBENCH_RESULTS_DIR": str(tmp_path / "r")}
    res = jbench_cli(["sweep", *SMALL, "serving.levels=[1,2,4]", "serving.slo.ttft_ms=60000",
                      "telemetry.idle_s=0.5", "telemetry.cooldown_s=0"], env_extra=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "serving" in res.stdout and "SLO" in res.stdout
    c = MlflowClient(f"sqlite:///{tmp_path}/r/mlflow.db")
    exp = c.get_experiment_by_name("serving")
    [run] = [r for r in c.search_runs([exp.experiment_id]) if r.data.tags.get("jbench.kind") == "trial"]
    m, tags = run.data.metrics, run.data.tags
    assert run.info.status == "FINISHED"
    assert m["serving_levels_run"] == 3 and m["serving_max_output_tps"] > 0
    history = c.get_metric_history(run.info.run_id, "serving_output_tps")
    assert [h.step for h in history] == [0, 1, 2] and all(h.value > 0 for h in history)
    loads = c.get_metric_history(run.info.run_id, "serving_level_load")
    assert [h.value for h in loads] == [1.0, 2.0, 4.0]
    assert m["serving_slo_capacity"] == 4.0 and tags["serving.slo_capacity"].startswith("not bracketed")
    assert "serving.knee_load" in tags
    # No power sensor here: no energy figure, the reason instead.
    if tags.get("energy.status", "").startswith("not measured"):
        assert "serving_output_tokens_per_joule" not in m and tags["serving.energy"].startswith("not measured")
    table = Path(c.download_artifacts(run.info.run_id, "serving/levels.csv", str(tmp_path)))
    rows = list(csv.DictReader(io.StringIO(table.read_text())))
    assert [float(r["load"]) for r in rows] == [1.0, 2.0, 4.0] and all(float(r["requests"]) == 6 for r in rows)
    raw = Path(c.download_artifacts(run.info.run_id, "raw/stdout.txt", str(tmp_path))).read_text()
    assert len(level_rows(raw)) == 18


@pytest.mark.ssh
@pytest.mark.e2e
def test_serving_over_ssh_starts_and_stops_the_server_on_the_device(llama_build, bundled_model, orin_nano):
    trial = make_trial("serving.levels=[1,2]", "serving.requests_per_level=3")
    log, lines = trial_logger("serving-ssh")
    with connect(orin_nano.device_config(name="emu")) as conn:
        backend = LlamaCppBackend(trial.config["backend"])
        assert backend.preflight(conn) == []
        result = backend.run(trial, conn, log)
        assert_server_gone(lines.lines, result.command)  # same machine: the device's pid and port are ours
    assert [lv.load for lv in result.serving_levels] == [1.0, 2.0]
    assert all(o.ok and o.output_tokens == 8 for lv in result.serving_levels for o in lv.outcomes)
    # Windows on the device's clock, read through the connection: the offset's uncertainty is recorded.
    assert result.metrics["serving_clock_uncertainty_ms"] >= 0
    assert result.metrics["serving_server_peak_rss_mib"] > 100  # llama-server with the model mapped, on the device
    for lv, w in zip(result.serving_levels, result.load_windows):
        assert w.end - w.start == pytest.approx(lv.wall_s, abs=0.05)


@pytest.mark.ssh
@pytest.mark.e2e
def test_ctrl_c_mid_level_over_ssh_leaves_no_server_on_the_device(llama_build, bundled_model, orin_nano,
                                                                 monkeypatch):
    real_complete = client.StreamingClient.complete
    calls = []

    def interrupting(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_complete(self, *args, **kwargs)

    monkeypatch.setattr(client.StreamingClient, "complete", interrupting)
    trial = make_trial("serving.levels=[2]", "serving.requests_per_level=6")
    log, lines = trial_logger("serving-ssh-ctrl-c")
    with connect(orin_nano.device_config(name="emu")) as conn:
        with pytest.raises(KeyboardInterrupt):
            LlamaCppBackend(trial.config["backend"]).run(trial, conn, log)
        assert_server_gone(lines.lines)  # the emulated device is this machine: its pid is ours to look at
        assert any("llama-server stopped" in line for line in lines.lines)


# --- the same llama-server declared as any OpenAI-compatible server is (the openai backend, conf/backend/llama_server.yaml)

def generic_trial(llama_build, *overrides: str):
    """SMALL through the openai backend: llama-server of `jbench setup` started from the llama_server declaration, one
    thread through its environment (llama-server reads LLAMA_ARG_THREADS)."""
    p = plan([*[o for o in SMALL if not o.startswith("backend.threads")], "backend=llama_server",
              f"backend.vars.server={llama_build['bin_dir']}/llama-server", "+backend.env.LLAMA_ARG_THREADS=1",
              *overrides])
    assert not p.problems, p.problems
    return p.trials[0]


def tpot_p50_ms(level) -> float:
    import statistics

    return 1000 * statistics.median((o.e2e_s - o.ttft_s) / (o.output_tokens - 1) for o in level.outcomes if o.ok)


@pytest.mark.e2e
@pytest.mark.alone  # two backends' speeds compared
def test_the_generic_backend_and_the_llamacpp_backend_agree_on_the_same_server(llama_build, bundled_model):
    """The same trial (2 in flight on 2 slots, one thread) through the llama.cpp backend and through the openai backend
    started from conf/backend/llama_server.yaml, run in alternating pairs (A B A B): the two backends' mean per-request
    TPOT p50 differ by no more than the noise, 3x the larger same-backend difference, at least 15 %. (On the 2-core VM
    they were 41.7 vs 41.0 ms; bench/serving_generic.py measures both levels in 5 pairs.)"""
    from jbench.backends.openai.backend import OpenAIBackend

    llama = make_trial("serving.levels=[2]", "serving.requests_per_level=6", "serving.output.mean=16")
    generic = generic_trial(llama_build, "serving.levels=[2]", "serving.requests_per_level=6",
                            "serving.output.mean=16")
    log, _ = trial_logger("serving-agree")
    runs: dict[str, list] = {"llamacpp": [], "openai": []}
    with LocalConnection() as conn:
        for _ in range(2):
            runs["llamacpp"].append(LlamaCppBackend(llama.config["backend"]).run(llama, conn, log))
            runs["openai"].append(OpenAIBackend(generic.config["backend"]).run(generic, conn, log))
    for r in runs["openai"]:
        assert r.build["server_version"].startswith("version:") and r.info["served_model"]
        assert all(o.ok and o.output_tokens == 16 for lv in r.serving_levels for o in lv.outcomes)
        prompts = [o.prompt_tokens for lv in r.serving_levels for o in lv.outcomes]
        assert all(12 <= n <= 20 for n in prompts), prompts  # text of about 16 tokens, counted by the server
    for level in range(1):
        tp = {k: [tpot_p50_ms(r.serving_levels[level]) for r in v] for k, v in runs.items()}
        noise = max(abs(v[0] - v[1]) for v in tp.values())
        ref = sum(tp["llamacpp"]) / 2
        diff = abs(sum(tp["openai"]) / 2 - ref)
        assert diff <= max(3 * noise, 0.15 * ref), (level, tp)


@pytest.mark.e2e
def test_jbench_sweep_runs_the_generic_backend_into_mlflow(tmp_path, llama_build, bundled_model):
    env = {"JBENCH_RESULTS_DIR": str(tmp_path / "r")}
    args = [a for a in SMALL if not a.startswith("backend.threads")]
    res = jbench_cli(["sweep", *args, "backend=llama_server", f"backend.vars.server={llama_build['bin_dir']}/llama-server",
                      "+backend.env.LLAMA_ARG_THREADS=1", "serving.levels=[1,2]", "telemetry.idle_s=0.5",
                      "telemetry.cooldown_s=0"], env_extra=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "max out" in res.stdout and "SLO" in res.stdout  # the serving table, not the phase speeds
    c = MlflowClient(f"sqlite:///{tmp_path}/r/mlflow.db")
    exp = c.get_experiment_by_name("serving")
    [run] = [r for r in c.search_runs([exp.experiment_id]) if r.data.tags.get("jbench.kind") == "trial"]
    m, tags = run.data.metrics, run.data.tags
    assert run.info.status == "FINISHED" and m["serving_levels_run"] == 2 and m["serving_max_output_tps"] > 0
    assert tags["backend.server_version"].startswith("version:")
    assert "roofline_decode_tps" in m  # the server reads the trial's own model file ({model_path})


@pytest.mark.ssh
@pytest.mark.e2e
def test_the_generic_backend_over_ssh_starts_and_stops_the_server_and_ctrl_c_leaves_none(
        llama_build, bundled_model, orin_nano, monkeypatch):
    from jbench.backends.openai import client as openai_client
    from jbench.backends.openai.backend import OpenAIBackend

    trial = generic_trial(llama_build, "serving.levels=[1,2]", "serving.requests_per_level=3")
    log, lines = trial_logger("generic-ssh")
    with connect(orin_nano.device_config(name="emu")) as conn:
        backend = OpenAIBackend(trial.config["backend"])
        assert backend.preflight(conn) == []
        result = backend.run(trial, conn, log)
        assert_server_gone(lines.lines, result.command)
        assert [lv.load for lv in result.serving_levels] == [1.0, 2.0]
        assert all(o.ok and o.output_tokens == 8 for lv in result.serving_levels for o in lv.outcomes)

        real = openai_client.OpenAIClient.stream
        calls = []

        def interrupting(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return real(self, *args, **kwargs)

        monkeypatch.setattr(openai_client.OpenAIClient, "stream", interrupting)
        log, lines = trial_logger("generic-ssh-ctrl-c")
        with pytest.raises(KeyboardInterrupt):
            OpenAIBackend(trial.config["backend"]).run(trial, conn, log)
        assert_server_gone(lines.lines)
        assert any("llama-server stopped" in line for line in lines.lines)


def _tagged_server(tag: str) -> int | None:
    """The pid of a llama-server whose environment holds JBENCH_TEST_TAG=tag (this test's own, not a neighbour's)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"llama-server" in (entry / "cmdline").read_bytes() and \
                    f"JBENCH_TEST_TAG={tag}".encode() in (entry / "environ").read_bytes():
                return int(entry.name)
        except OSError:
            continue
    return None


@pytest.mark.e2e
def test_sigint_to_a_running_serving_sweep_stops_the_server_and_records_it_killed(tmp_path, llama_build,
                                                                                 bundled_model):
    """Ctrl-C as a user sends it (SIGINT to the `jbench sweep +experiment=serving` process) while a level runs: the
    sweep ends with exit 130 and KILLED runs, and the llama-server it started on the device is gone."""
    import signal
    import subprocess
    import sys
    import time
    import uuid

    from .test_latency import pid_gone

    tag = uuid.uuid4().hex
    argv = [str(Path(sys.executable).with_name("jbench")), "sweep", *SMALL, "serving.levels=[2]",
            "serving.requests_per_level=2000", "serving.output.mean=32", f"+backend.env.JBENCH_TEST_TAG={tag}",
            "telemetry.idle_s=0.5", "telemetry.cooldown_s=0"]
    env = {**os.environ, "JBENCH_RESULTS_DIR": str(tmp_path / "r"), "COLUMNS": "200"}
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
    try:
        deadline, pid = time.monotonic() + 180, None
        while pid is None and time.monotonic() < deadline and proc.poll() is None:
            pid = _tagged_server(tag)
            time.sleep(0.2)
        assert pid is not None, (tmp_path / "err").read_text()
        time.sleep(4)  # warm-up done, the level under way
        assert proc.poll() is None and not pid_gone(pid, wait_s=0)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (tmp_path / "out").read_text() + (tmp_path / "err").read_text()
    assert pid_gone(pid), f"llama-server {pid} outlived the interrupted sweep"
    c = MlflowClient(f"sqlite:///{tmp_path}/r/mlflow.db")
    runs = c.search_runs([c.get_experiment_by_name("serving").experiment_id])
    assert {r.info.status for r in runs} == {"KILLED"}, [(r.info.run_name, r.info.status) for r in runs]
