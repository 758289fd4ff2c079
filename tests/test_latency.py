"""llama.cpp latency scenario: llama-server on the device, streaming completions, TTFT/ITL/e2e.

The end-to-end tests run the REAL llama-server of `jbench setup` with the bundled Gemma 3 270M Q4_0 (tiny
prompts, few tokens: the test machine has 2 cores). Failure paths use a stand-in server
(tests/fixtures/fake_llama_server) that answers 503 forever or exits before listening.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
import re
import socket
import time
from pathlib import Path

import pytest

from jbench.analysis.stats import percentile
from jbench.backends.llamacpp import client, server
from jbench.backends.base import BackendError
from jbench.backends.llamacpp.backend import LlamaCppBackend
from jbench.device.local import LocalConnection
from jbench.device.connect import connect
from jbench.sweeps.plan import plan
from jbench.runner.analyses import phase_metrics
from jbench.core.identity import config_hash
from jbench.core.results import BackendResult

FAKE_SERVER_DIR = Path(__file__).parent / "fixtures" / "fake_llama_server"

# threads=1: two server threads spin-wait against the test process and each other on a 2-core machine.
BASE = ["model.quant=Q4_0", "backend.scenario=latency", "backend.threads=1", "backend.n_prompt=8",
        "backend.n_gen=4", "backend.latency_warmup_requests=1", "backend.timeout_s=300"]


def make_trial(*overrides: str, **backend):
    p = plan([*BASE, *overrides])
    assert not p.problems, p.problems
    t = p.trials[0]
    if backend:
        cfg = dict(t.config)
        cfg["backend"] = dict(cfg["backend"], **backend)
        t = dataclasses.replace(t, config=cfg)
    return t


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def trial_logger(name: str) -> tuple[logging.Logger, _Lines]:
    logger = logging.getLogger(f"jbench.test.latency.{name}")
    logger.setLevel(logging.DEBUG)
    handler = _Lines()
    logger.addHandler(handler)
    return logger, handler


def server_pids(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for line in lines if (m := re.search(r"llama-server pid (\d+)", line))]


def pid_gone(pid: int, wait_s: float = 5.0) -> bool:
    end = time.monotonic() + wait_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.05)


def port_closed(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) != 0


def argv_port(argv: list[str]) -> int:
    return int(argv[argv.index("--port") + 1])


def assert_server_gone(lines: list[str], argv: list[str] | None = None) -> None:
    pids = server_pids(lines)
    assert pids, f"no server pid in the log: {lines}"
    for pid in pids:
        assert pid_gone(pid), f"llama-server pid {pid} still alive"
    if argv is not None:
        assert port_closed(argv_port(argv))


def records(result: BackendResult, kind: str = "measured") -> list[dict]:
    rows = [json.loads(line) for line in result.raw_output.splitlines() if line.strip()]
    return [r for r in rows if r["kind"] == kind]


# --------------------------------------------------------------------------------------------
# Pure parts


def test_percentile_is_linear_interpolation_between_ranks():
    xs = [10.0, 20.0, 30.0, 40.0]
    assert percentile(xs, 50) == pytest.approx(25.0)
    assert percentile(xs, 90) == pytest.approx(37.0)  # rank 2.7
    assert percentile(xs, 99) == pytest.approx(39.7)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0 and percentile([3.0, 1.0, 2.0], 100) == 3.0
    assert client.percentile is percentile  # the latency metrics use the one implementation


def test_prompt_has_exactly_n_tokens_and_differs_per_request():
    prefix, body = [2], [10, 11, 12, 13, 14]
    for n in (1, 2, 5, 17):
        assert len(client.build_prompt(prefix, body, n, variant=0)) == n
    a, b = client.build_prompt(prefix, body, 8, 0), client.build_prompt(prefix, body, 8, 1)
    assert a[0] == b[0] == 2 and a != b
    assert a == [2, 10, 11, 12, 13, 14, 10, 11]


def test_default_context_covers_every_slot():
    assert server.default_context(8, 4, 0, 1) == 256
    assert server.default_context(255, 1, 0, 1) == 512  # + 1 spare position
    assert server.default_context(300, 100, 0, 2) == 1024


def _record(i, ttft, e2e, n, worker=0, timings=None):
    return client.RequestRecord(index=i, worker=worker, sent_at=float(i), ttft_s=ttft, e2e_s=e2e,
                                 token_times_s=[ttft], output_tokens=n, tokens_source="usage",
                                 streamed_token_chunks=n, server_timings=timings or {})


def test_metrics_and_phase_mapping_follow_the_definitions():
    recs = [_record(0, 0.1, 0.5, 5, timings={"prompt_per_second": 80.0, "predicted_per_second": 10.0}),
            _record(1, 0.2, 1.0, 5, timings={"prompt_per_second": 40.0, "predicted_per_second": 5.0})]
    m = client.latency_metrics(recs, concurrency=1, wall_s=2.0)
    assert m["ttft_ms_mean"] == pytest.approx(150.0)
    assert m["itl_ms_p50"] == pytest.approx((100.0 + 200.0) / 2)  # (500-100)/4 = 100, (1000-200)/4 = 200
    assert m["e2e_ms_p99"] == pytest.approx(500 + 0.99 * 500)
    assert m["output_tps_mean"] == pytest.approx((10.0 + 5.0) / 2)
    assert m["latency_requests"] == 2 and m["latency_concurrency"] == 1
    assert m["latency_throughput_tps"] == pytest.approx(10 / 2.0)
    assert m["server_prefill_tps"] == pytest.approx(60.0) and m["server_decode_tps"] == pytest.approx(7.5)
    phases = client.latency_phases(recs, n_prompt=8)
    pm = phase_metrics(BackendResult(phases=phases, raw_output="")).metrics
    assert pm["prefill_tps"] == pytest.approx((8 / 0.1 + 8 / 0.2) / 2)
    assert pm["decode_tps"] == pytest.approx((1000 / 100.0 + 1000 / 200.0) / 2)
    assert pm["decode_tokens"] == 4 and pm["prefill_tokens"] == 8
    assert phases["prefill"].window is None  # no device-clock windows: no energy pass


def test_no_server_metric_without_server_timings():
    m = client.latency_metrics([_record(0, 0.1, 0.5, 5)], concurrency=1)
    assert "server_prefill_tps" not in m and "server_decode_tps" not in m


class _FakeResponse:
    def __init__(self, text: str):
        self._buf = io.BytesIO(text.encode())

    def readline(self):
        return self._buf.readline()


def _chunk(text, finish=None, **extra):
    obj = {"choices": [{"text": text, "index": 0, "finish_reason": finish}], **extra}
    return f"data: {json.dumps(obj)}\n\n"


def test_stream_reader_counts_token_chunks_and_keeps_the_final_usage():
    ticks = iter(range(100))
    stream = (": ping\n\n" + _chunk(" a") + _chunk("") + _chunk(" b") +
              _chunk("", "length", usage={"completion_tokens": 3, "prompt_tokens": 8}, timings={"predicted_n": 3})
              + "data: [DONE]\n\n")
    token_times, final, end = client.StreamingClient.read_stream(_FakeResponse(stream), clock=lambda: next(ticks))
    assert len(token_times) == 3  # an empty-text token chunk counts, the final bookkeeping chunk does not
    assert final["usage"]["completion_tokens"] == 3
    assert end > token_times[-1]


def test_stream_reader_rejects_errors_and_garbage():
    with pytest.raises(client.RequestError, match="server error"):
        client.StreamingClient.read_stream(_FakeResponse('data: {"error": {"message": "boom"}}\n\n'))
    with pytest.raises(client.RequestError, match="unparseable"):
        client.StreamingClient.read_stream(_FakeResponse("data: {not json\n\n"))


@pytest.mark.e2e  # plans a trial on the bundled model, which `jbench setup` installs
def test_validation():
    backend = LlamaCppBackend({})
    assert not backend.validate(make_trial())
    problems = "\n".join(backend.validate(make_trial(n_gen=1)))
    assert "n_gen >= 2" in problems and "inter-token latency is undefined" in problems
    assert "server_extra_args" in "\n".join(backend.validate(make_trial(extra_args=["-v"])))
    assert "backend.depth" in "\n".join(backend.validate(make_trial(depth=16)))
    assert "backend.scenario 'fast'" in "\n".join(backend.validate(make_trial(scenario="fast")))
    assert "slot" in "\n".join(backend.validate(make_trial(context=16, latency_concurrency=2)))
    p = plan([*BASE, "backend.n_gen=1"])
    assert any("n_gen >= 2" in msg for msg in p.problems)  # before anything runs


@pytest.mark.e2e  # plans a trial on the bundled model, which `jbench setup` installs
def test_bench_trial_hash_ignores_latency_keys():
    bench = plan(["model.quant=Q4_0"]).trials[0]
    changed = dict(bench.config, backend=dict(bench.config["backend"], latency_requests=99, context=4096))
    assert config_hash(changed) == bench.config_hash
    lat = make_trial()
    assert lat.config_hash != bench.config_hash
    more = dict(lat.config, backend=dict(lat.config["backend"], latency_requests=99))
    assert config_hash(more) != lat.config_hash
    ready = dict(lat.config, backend=dict(lat.config["backend"], server_ready_timeout_s=5.0))
    assert config_hash(ready) == lat.config_hash


# --------------------------------------------------------------------------------------------
# Real llama-server, local device


@pytest.mark.e2e
def test_latency_scenario_against_real_llama_server(llama_build, bundled_model):
    trial = make_trial("backend.latency_requests=3")
    log, lines = trial_logger("real")
    backend = LlamaCppBackend(trial.config["backend"])
    assert backend.preflight(LocalConnection()) == []
    result = backend.run(trial, LocalConnection(), log)

    assert any("ready after" in line for line in lines.lines)
    assert_server_gone(lines.lines, result.command)
    argv = result.command
    assert os.path.basename(argv[0]) == "llama-server"
    assert argv[argv.index("-c") + 1] == "256" and argv[argv.index("--parallel") + 1] == "1"
    assert result.build.get("build_commit") == llama_build["build_commit"]
    assert "llama" in result.raw_stderr.lower()  # the server's own log

    rows = records(result)
    assert len(rows) == 3 and len(records(result, "warmup")) == 1
    for r in rows:
        assert r["output_tokens"] == 4 and r["tokens_source"] == "usage"
        assert r["prompt_tokens"] == 8 and r["cached_tokens"] == 0  # exactly n_prompt, nothing reused
        assert r["e2e_s"] >= r["ttft_s"] > 0
        times = r["token_times_s"]
        assert times == sorted(times) and times[0] == pytest.approx(r["ttft_s"]) and times[-1] <= r["e2e_s"]
        # ITL reproduced from the recorded timestamps: (e2e - TTFT) / (output tokens - 1)
        assert r["itl_ms"] == pytest.approx((r["e2e_s"] - times[0]) * 1000 / (r["output_tokens"] - 1))
        assert r["output_tps"] == pytest.approx(r["output_tokens"] / r["e2e_s"])
        assert r["server_timings"]["prompt_n"] == 8 and r["server_timings"]["predicted_n"] == 4

    m = result.metrics
    for name in ("ttft_ms", "itl_ms", "e2e_ms", "output_tps"):
        values = [r[name] for r in rows]
        for q in (50, 90, 99):
            assert m[f"{name}_p{q}"] == pytest.approx(percentile(values, q))
        assert m[f"{name}_mean"] == pytest.approx(sum(values) / len(values))
        assert m[f"{name}_p50"] <= m[f"{name}_p90"] <= m[f"{name}_p99"]
    assert m["e2e_ms_p50"] >= m["ttft_ms_p50"]
    assert m["latency_requests"] == 3 and m["latency_concurrency"] == 1
    assert m["server_prefill_tps"] > 0 and m["server_decode_tps"] > 0

    pm = phase_metrics(result).metrics
    assert pm["prefill_tps"] == pytest.approx(sum(8 / r["ttft_s"] for r in rows) / 3, rel=1e-6)
    assert pm["decode_tps"] == pytest.approx(sum(1000 / r["itl_ms"] for r in rows) / 3, rel=1e-6)


@pytest.mark.e2e
def test_concurrency_two_keeps_two_requests_in_flight(llama_build, bundled_model):
    trial = make_trial("backend.latency_requests=2", "backend.latency_concurrency=2",
                       "backend.latency_warmup_requests=0")
    log, lines = trial_logger("conc")
    result = LlamaCppBackend(trial.config["backend"]).run(trial, LocalConnection(), log)
    assert_server_gone(lines.lines, result.command)
    argv = result.command
    assert argv[argv.index("--parallel") + 1] == "2" and argv[argv.index("-c") + 1] == "512"
    rows = records(result)
    assert {r["worker"] for r in rows} == {0, 1}
    first_end = min(r["sent_at"] + r["e2e_s"] for r in rows)
    assert all(r["sent_at"] < first_end for r in rows)  # both were sent before either finished
    assert result.metrics["latency_concurrency"] == 2 and result.metrics["latency_requests"] == 2
    assert all(r["output_tokens"] == 4 for r in rows)


@pytest.mark.e2e
@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
def test_server_is_stopped_when_the_client_raises_mid_run(llama_build, bundled_model, monkeypatch, exc_type):
    real_complete = client.StreamingClient.complete
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise exc_type("client failure in the middle of the run")
        return real_complete(self, *args, **kwargs)

    monkeypatch.setattr(client.StreamingClient, "complete", failing)
    trial = make_trial("backend.latency_requests=3")
    log, lines = trial_logger(f"raise-{exc_type.__name__}")
    with pytest.raises(exc_type, match="client failure"):
        LlamaCppBackend(trial.config["backend"]).run(trial, LocalConnection(), log)
    assert len(calls) == 2
    assert_server_gone(lines.lines)
    port = int(re.search(r"--port (\d+)", next(line for line in lines.lines if "starting on device" in line)).group(1))
    assert port_closed(port)
    assert any("llama-server stopped" in line for line in lines.lines)


@pytest.mark.e2e
def test_server_is_stopped_on_ctrl_c_in_the_main_thread(llama_build, bundled_model, monkeypatch):
    """Ctrl-C (or the runner's SIGTERM turned into KeyboardInterrupt) lands in the main thread while the
    requests run in worker threads."""
    import _thread

    real_complete = client.StreamingClient.complete
    calls = []

    def interrupting(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            _thread.interrupt_main()
        return real_complete(self, *args, **kwargs)

    monkeypatch.setattr(client.StreamingClient, "complete", interrupting)
    trial = make_trial("backend.latency_requests=4")
    log, lines = trial_logger("ctrl-c")
    with pytest.raises(KeyboardInterrupt):
        LlamaCppBackend(trial.config["backend"]).run(trial, LocalConnection(), log)
    assert_server_gone(lines.lines)
    assert any("llama-server stopped" in line for line in lines.lines)


# --------------------------------------------------------------------------------------------
# Failure paths with the stand-in server


@pytest.mark.e2e
def test_server_that_never_becomes_ready_is_a_timeout_with_its_log(bundled_model):
    trial = make_trial(binary_dir=str(FAKE_SERVER_DIR), server_ready_timeout_s=2.0)
    log, lines = trial_logger("never-ready")
    started = time.monotonic()
    with pytest.raises(BackendError) as info:
        LlamaCppBackend(trial.config["backend"]).run(trial, LocalConnection(), log)
    assert time.monotonic() - started < 30
    err = info.value
    assert err.category == "timeout"
    assert "did not become ready within 2 s" in str(err) and "503" in str(err)
    assert "fake llama-server: listening on" in err.raw_output and "loading forever" in err.raw_output
    assert_server_gone(lines.lines)


@pytest.mark.e2e
def test_server_that_exits_before_ready_fails_at_once_with_its_log(bundled_model):
    trial = make_trial(binary_dir=str(FAKE_SERVER_DIR), server_ready_timeout_s=60.0,
                       server_extra_args=["--fake-mode", "exit"])
    log, lines = trial_logger("exits")
    started = time.monotonic()
    with pytest.raises(BackendError) as info:
        LlamaCppBackend(trial.config["backend"]).run(trial, LocalConnection(), log)
    assert time.monotonic() - started < 20  # not the 60 s readiness timeout
    assert info.value.category == "backend_crash"
    assert "failed to load model" in info.value.raw_output and "failed to load model" in str(info.value)


def test_missing_server_binary_is_reported_by_preflight(tmp_path):
    backend = LlamaCppBackend({"scenario": "latency", "binary_dir": str(tmp_path)})
    problems = backend.preflight(LocalConnection())
    assert problems and "llama-server not found" in problems[0]


# --------------------------------------------------------------------------------------------
# Over SSH (emulated Jetson: a real sshd on loopback; its commands run on this machine)


@pytest.mark.ssh
@pytest.mark.e2e
def test_latency_scenario_over_ssh_tunnel(llama_build, bundled_model, orin_nano):
    trial = make_trial("backend.latency_requests=2")
    log, lines = trial_logger("ssh")
    with connect(orin_nano.device_config(name="emu")) as conn:
        backend = LlamaCppBackend(trial.config["backend"])
        assert backend.preflight(conn) == []
        result = backend.run(trial, conn, log)
        assert_server_gone(lines.lines, result.command)  # same machine: the device's pid and port are ours
    rows = records(result)
    assert len(rows) == 2 and all(r["output_tokens"] == 4 and r["prompt_tokens"] == 8 for r in rows)
    assert result.metrics["ttft_ms_p50"] > 0 and result.metrics["e2e_ms_p50"] >= result.metrics["ttft_ms_p50"]


def test_the_servers_log_says_which_compute_path_the_roofline_probes():
    """llama-server's log names its GPU backend as llama-bench's `backends` field does: the latency and serving
    scenarios record it, so the roofline reads a GPU build's trials against the GPU probe, not the CPU's."""
    from jbench.backends.llamacpp.server import backends_of
    from jbench.device.bandwidth import compute_path

    # As llama.cpp CUDA builds print it (ggml_cuda_init, then the model loader placing the model).
    cuda = ("ggml_cuda_init: GGML_CUDA_FORCE_MMQ:    no\nggml_cuda_init: found 1 CUDA devices:\n"
            "  Device 0: NVIDIA H200, compute capability 9.0, VMM: yes\n"
            "llama_model_load_from_file_impl: using device CUDA0 (NVIDIA H200) - 142000 MiB free\n")
    assert backends_of(cuda) == "CUDA"
    assert backends_of("llama_model_load_from_file_impl: using device Vulkan0 (Orin) - 7000 MiB free") == "Vulkan"
    assert backends_of("ggml_cuda_init: no CUDA devices found, CUDA will be disabled\nmain: loading model\n") == "CPU"
    assert backends_of("") == "CPU"

    class Cfg:
        name, n_gpu_layers = "llamacpp", 99

    assert compute_path(Cfg(), backends_of(cuda)) == "gpu" and compute_path(Cfg(), backends_of("")) == "cpu"
