"""Memory per trial: the buffer account read from llama.cpp's verbose log, the device's use over idle from telemetry,
the audit's arithmetic, the peak-RSS wrapper run for real, the measured-buffer cache and the planner's memory check
that counts it, and (e2e) a real memory pass and the memory stage on the bundled model."""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import subprocess
from pathlib import Path

import pytest

from jbench.analysis.memory import (AuditLine, BufferAccount, audit, audit_markdown, memory_metrics, parse_buffers,
                                    predict, telemetry_memory)
from jbench.analysis.telemetry import PhaseWindow
from jbench.device.rusage import MARKER, peak_rss_argv, split_peak_rss
from jbench.models import memory_facts
from jbench.models.memory_facts import MeasuredBuffers, MemoryKey

from .conftest import DATA

CAPTURE = DATA / "llamacpp" / "memory" / "q4_k_m-p16-n4.stderr.txt"


# --------------------------------------------------------------------------------------------
# The buffer account


def test_the_buffers_of_a_real_verbose_llama_bench_run_are_read():
    # llama.cpp 0c1e57098, Q4_K_M, -p 16 -n 4 (the .cmd file beside it): one model load, a context per test.
    account = parse_buffers(CAPTURE.read_text())
    assert account is not None and account.loads == 1 and account.contexts == 2
    assert account.model == {"CPU_Mapped": 235.16, "CPU_REPACK": 12.66}
    assert account.kv == {"CPU": 0.75 + 3.75}  # Gemma 3's full and sliding-window caches of one context, summed
    assert account.compute == {"CPU": 16.08}  # the prompt test's context (16 tokens a batch), not the 4.02 MiB one
    assert account.output == {"CPU": 1.00}
    assert account.total("model") == pytest.approx(247.82) and account.device_buffers() == {}
    assert json.loads(account.as_json()) == {"model": {"CPU_Mapped": 235.16, "CPU_REPACK": 12.66}, "kv": {"CPU": 4.5},
                                             "compute": {"CPU": 16.08}, "output": {"CPU": 1.0}}


def test_other_builds_prefixes_and_gpu_buffers_are_grouped_into_contexts():
    # Lines in the forms of other llama.cpp builds' format strings (llama_kv_cache_unified:, KV before output, CUDA
    # buffers beside pinned host ones), made for this test: two contexts, the second with the larger KV cache.
    text = "\n".join([
        "load_tensors: offloaded 19/19 layers to GPU",
        "load_tensors:        CUDA0 model buffer size =   230.00 MiB",
        "load_tensors:   CPU_Mapped model buffer size =    80.00 MiB",
        "llama_kv_cache_unified:      CUDA0 KV buffer size =     2.00 MiB",
        "llama_context:  CUDA_Host  output buffer size =     1.00 MiB",
        "llama_context:      CUDA0 compute buffer size =    60.00 MiB",
        "llama_context:  CUDA_Host compute buffer size =     5.00 MiB",
        "llama_kv_cache_unified:      CUDA0 KV buffer size =     8.00 MiB",
        "llama_context:  CUDA_Host  output buffer size =     1.00 MiB",
        "llama_context:      CUDA0 compute buffer size =    20.00 MiB",
        "llama_context:  CUDA_Host compute buffer size =     2.00 MiB",
        "~llama_context:      CUDA0 compute buffer size is  60.0000 MiB, matches expectation of  60.0000 MiB",
    ])
    account = parse_buffers(text)
    assert account is not None and account.contexts == 2 and account.loads == 1
    assert account.model == {"CUDA0": 230.0, "CPU_Mapped": 80.0}
    assert account.kv == {"CUDA0": 8.0}  # the second context's: KV peaked there
    assert account.compute == {"CUDA0": 60.0, "CUDA_Host": 5.0}  # the first context's: compute peaked there
    assert account.device_buffers() == {"CUDA0": 230.0 + 8.0 + 60.0}


def test_a_log_without_buffer_lines_has_no_account():
    assert parse_buffers("") is None
    assert parse_buffers("llama_kv_cache: size =    0.75 MiB (   256 cells,   3 layers,  1/1 seqs)\n") is None


# --------------------------------------------------------------------------------------------
# The device's use over idle (the Measure stage's telemetry)


def _windows():
    return [PhaseWindow("idle", 0.0, 10.0), PhaseWindow("load", 10.0, 12.0), PhaseWindow("prefill", 12.0, 14.0),
            PhaseWindow("decode", 14.0, 20.0), PhaseWindow("cooldown", 20.0, 30.0)]


def _samples(**signals):
    """One sample a second over 0..30 s; each signal a function of t (None: no reading)."""
    out = []
    for t in range(31):
        s = {"t": float(t)}
        for key, fn in signals.items():
            s[key] = fn(t)
        out.append(s)
    return out


def test_ram_swap_and_gpu_memory_over_idle():
    samples = _samples(ram_used_mb=lambda t: 1000 + (t % 2) * 10 if t <= 10 else (1500 if t == 16 else 1300),
                       swap_used_mb=lambda t: 0 if t <= 10 else 20,
                       gpu_mem_used_mb=lambda t: 100.0 if t <= 10 else 612.5)
    metrics, tags = telemetry_memory(samples, _windows())
    idle = sum(1000 + (t % 2) * 10 for t in range(11)) / 11
    assert metrics["memory_ram_idle_mib"] == pytest.approx(idle)
    assert metrics["memory_ram_over_idle_mib"] == pytest.approx(1500 - idle)  # the highest, not the last
    assert metrics["memory_swap_over_idle_mib"] == 20 and metrics["memory_gpu_over_idle_mib"] == 512.5
    assert tags == {"memory.ram.status": "ok", "memory.swap.status": "ok", "memory.gpu.status": "ok"}


def test_the_cooldown_does_not_count_and_a_missing_signal_says_why():
    # The highest reading after decode ended (cooldown) is not the trial's; tegrastats has no GPU memory figure.
    samples = _samples(ram_used_mb=lambda t: 2000 if t > 20 else 1000, swap_used_mb=lambda t: None)
    metrics, tags = telemetry_memory(samples, _windows())
    assert metrics == {"memory_ram_idle_mib": 1000, "memory_ram_over_idle_mib": 0}
    assert tags["memory.swap.status"] == "not measured: the telemetry source gives no swap readings"
    assert tags["memory.gpu.status"] == "not measured: the telemetry source gives no GPU memory (NVML) readings"


def test_no_idle_window_or_no_samples_leave_every_figure_absent():
    samples = _samples(ram_used_mb=lambda t: 1000)
    metrics, tags = telemetry_memory(samples, [w for w in _windows() if w.phase != "idle"])
    assert metrics == {} and set(tags.values()) == {
        "not measured: no idle window (telemetry.idle_s=0, or no sample to end it)"}
    metrics, tags = telemetry_memory([], _windows())
    assert metrics == {} and tags["memory.ram.status"] == "not measured: no telemetry samples"
    # Readings that stop before the idle window: no baseline.
    late = [s for s in _samples(ram_used_mb=lambda t: 1000) if s["t"] > 10]
    metrics, tags = telemetry_memory(late, _windows())
    assert metrics == {} and tags["memory.ram.status"] == "not measured: no used-RAM reading inside the idle window"


# --------------------------------------------------------------------------------------------
# The metrics and the audit


def _account(**kinds) -> BufferAccount:
    base = {"model": {"CPU_Mapped": 235.16, "CPU_REPACK": 12.66}, "kv": {"CPU": 4.5}, "compute": {"CPU": 16.08},
            "output": {"CPU": 1.0}}
    base.update(kinds)
    return BufferAccount(**base, loads=1, contexts=2)


def test_the_audit_adds_up_to_the_measured_peak():
    prediction = predict(253113024, 20 * 18432, 16.08, 1.0, measured_from="on local at 2026-01-01T00:00:00Z")
    metrics, tags = memory_metrics(_account(), 319712, None, prediction)
    peak = 319712 / 1024
    assert metrics["memory_peak_rss_mib"] == peak
    assert metrics["memory_backend_total_mib"] == pytest.approx(235.16 + 12.66 + 4.5 + 16.08 + 1.0)
    assert metrics["memory_unexplained_mib"] == pytest.approx(peak - metrics["memory_backend_total_mib"])
    predicted = 253113024 / 2**20 + 20 * 18432 / 2**20 + 16.08 + 1.0
    assert metrics["memory_predicted_mib"] == pytest.approx(predicted)
    assert metrics["memory_prediction_error_pct"] == pytest.approx(100 * (peak - predicted) / peak)
    assert tags["memory.status"] == "ok" and "compute 16.08 MiB measured (on local at" in tags["memory.prediction"]
    lines = {line.label: line for line in audit(metrics, tags)}
    parts = ["model weights", "KV cache", "compute buffers", "output buffer", "unexplained remainder"]
    assert sum(lines[p].mib for p in parts) == pytest.approx(lines["peak RSS of the backend process"].mib)
    assert lines["model weights"].source == "llama.cpp model buffers: CPU_Mapped 235.16 + CPU_REPACK 12.66"
    assert lines["OS and other processes at idle"].mib is None  # nothing from telemetry given here
    table = audit_markdown(list(lines.values()))
    assert "| model weights | 247.82 | llama.cpp model buffers" in table and "| CMA in use at idle | — |" in table


def test_gpu_buffers_need_a_gpu_reading_to_be_explained():
    account = _account(model={"CUDA0": 230.0, "CPU_Mapped": 80.0}, compute={"CUDA0": 60.0, "CUDA_Host": 5.0})
    metrics, tags = memory_metrics(account, 200 * 1024, None, None)
    assert "memory_unexplained_mib" not in metrics and "memory_backend_total_mib" in metrics
    assert "CUDA0 290.00 MiB" in tags["memory.status"] and "outside the process's resident set" in tags["memory.status"]
    metrics, tags = memory_metrics(account, 200 * 1024, 310.0, None)  # NVML: GPU memory over idle
    assert metrics["memory_unexplained_mib"] == pytest.approx(200 + 310 - metrics["memory_backend_total_mib"])
    assert tags["memory.status"] == "ok" and "NVML" in tags["memory.measured"]


def test_a_prediction_without_measured_buffers_says_so_and_missing_parts_are_named():
    prediction = predict(2**30, 2**20, None, None)
    assert prediction.mib == 1025 and not prediction.complete
    assert prediction.describe().endswith("compute and output buffers not included (never measured for this "
                                          "configuration)")
    metrics, tags = memory_metrics(_account(output={}), None, None, prediction)
    assert "memory_backend_total_mib" not in metrics and "memory_peak_rss_mib" not in metrics
    assert "memory_prediction_error_pct" not in metrics and metrics["memory_predicted_mib"] == 1025
    assert "no output buffer size" in tags["memory.status"] and "no peak RSS" in tags["memory.status"]
    metrics, tags = memory_metrics(None, 1024, None, None)
    assert metrics == {"memory_peak_rss_mib": 1.0} and "printed no buffer sizes" in tags["memory.status"]


def test_the_audit_of_a_stored_run_treats_nan_as_absent():
    nan = float("nan")
    lines = audit({"memory_peak_rss_mib": 300.0, "memory_unexplained_mib": nan, "memory_ram_idle_mib": nan},
                  {"memory.status": "not measured: the memory pass ran out of memory (...)",
                   "memory.ram.status": "not measured: no idle window (telemetry.idle_s=0, or no sample to end it)"})
    by = {line.label: line for line in lines}
    assert by["unexplained remainder"] == AuditLine("unexplained remainder", None,
                                                    "not measured: the memory pass ran out of memory (...)")
    assert by["OS and other processes at idle"].source.startswith("not measured: no idle window")
    assert by["peak RSS of the backend process"].mib == 300.0


# --------------------------------------------------------------------------------------------
# The peak-RSS wrapper, run for real here


def _wrapped(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(peak_rss_argv(argv), capture_output=True, text=True, timeout=60)


def test_the_wrapper_reports_a_childs_peak_and_keeps_its_exit_code_and_output():
    res = _wrapped(["python3", "-c", "import sys; b = b'x' * (60 << 20); sys.stderr.write('last line without eol')",
                    "a b;echo not-a-shell"])
    peak, stderr = split_peak_rss(res.stderr)
    assert res.returncode == 0 and peak is not None and peak >= 60 * 1024  # KiB
    assert stderr == "last line without eol" and MARKER not in stderr
    small = split_peak_rss(_wrapped(["python3", "-c", "pass"]).stderr)[0]
    assert small is not None and small < 60 * 1024  # the figure is the child's, not a constant
    res = _wrapped(["python3", "-c", "import sys; print(sys.argv[1]); sys.exit(3)", "a b;echo not-a-shell"])
    assert res.returncode == 3 and res.stdout == "a b;echo not-a-shell\n"  # argv items, never a shell line
    assert split_peak_rss(res.stderr)[0] is not None


def test_a_child_killed_by_a_signal_exits_128_plus_n_and_a_missing_command_127():
    res = _wrapped(["python3", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"])
    assert res.returncode == 128 + 15 and split_peak_rss(res.stderr)[0] is not None
    res = _wrapped(["/nonexistent/llama-bench"])
    assert res.returncode == 127 and split_peak_rss(res.stderr) == (None, res.stderr)
    assert "No such file" in res.stderr


def test_split_keeps_the_commands_own_stderr_exactly():
    assert split_peak_rss("a\nb\n" + f"\n{MARKER} 4242\n") == (4242, "a\nb\n")
    assert split_peak_rss("no marker\n") == (None, "no marker\n")
    with pytest.raises(ValueError):
        peak_rss_argv([])


# --------------------------------------------------------------------------------------------
# The measured-buffer cache and the planner's memory check


def _key(**settings) -> MemoryKey:
    base = {"scenario": "bench", "n_ctx": "16", "n_batch": "None", "n_ubatch": "None", "type_k": "f16",
            "type_v": "f16", "flash_attn": "auto", "n_gpu_layers": "99", "extra_args": ""}
    return MemoryKey.of("llamacpp", "0c1e57098", "local", {**base, **settings})


def test_the_cache_keeps_buffers_per_configuration_and_model(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_facts, "cache_path", lambda: tmp_path / "memory_facts.json")
    assert memory_facts.lookup(_key(), "sha-a") is None and not memory_facts.known(_key())
    found = MeasuredBuffers(compute_mib=16.08, output_mib=1.0, kv_mib=4.5, measured_at="2026-01-01T00:00:00Z",
                            device="local")
    memory_facts.store(_key(), "sha-a", found)
    assert memory_facts.lookup(_key(), "sha-a") == found and memory_facts.known(_key())
    assert memory_facts.lookup(_key(), "sha-b") is None  # another model file
    assert memory_facts.lookup(_key(n_ctx="512"), "sha-a") is None and not memory_facts.known(_key(n_ctx="512"))
    memory_facts.store(_key(), "sha-a", MeasuredBuffers(compute_mib=20.0, output_mib=1.0))
    assert memory_facts.lookup(_key(), "sha-a").compute_mib == 20.0  # a new measurement replaces the old
    (tmp_path / "memory_facts.json").write_text("{not json")
    assert memory_facts.lookup(_key(), "sha-a") is None  # a broken cache is an empty one


def test_the_memory_check_counts_measured_compute_and_output_buffers(tmp_path, monkeypatch):
    from jbench.backends.llamacpp.backend import LlamaCppBackend
    from jbench.core.trial import trial_config
    from jbench.models.digest import file_digest
    from jbench.sweeps.plan import memory_check

    from .gguf_files import unloadable_gguf

    monkeypatch.setenv("JBENCH_CACHE_DIR", str(tmp_path / "cache"))  # model facts, digests, this cache: all here
    monkeypatch.setattr("jbench.models.provision.active_build", lambda: {"build_commit": "0c1e57098"})
    model = unloadable_gguf(tmp_path / "tiny.gguf")  # a few KB of weights, 512 B of f16 KV a token
    cfg = trial_config({
        "device": {"name": "tiny", "kind": "ssh", "host": "127.0.0.1", "profile": "tiny_board"},
        "profile": {"name": "tiny_board", "module": "Tiny", "soc": "t0", "gpu_arch": "none",
                    "memory_bandwidth_gbs": 10, "ram_gb": 0.1},
        "backend": {"name": "llamacpp", "n_prompt": 16, "n_gen": 4},
        "model": {"name": "tiny", "quant": "F32", "files": {"F32": str(model)}}})
    reserve = 0.05e9
    assert memory_check(cfg, reserve) is None  # file + KV fit in 100 MB less the reserve
    settings = LlamaCppBackend.buffer_settings(cfg.backend)
    assert settings["n_ctx"] == "16"  # llama-bench's larger test context: max(n_prompt, n_gen) + depth
    key = MemoryKey.of("llamacpp", "0c1e57098", "tiny", settings)
    memory_facts.store(key, file_digest(str(model)),
                       MeasuredBuffers(compute_mib=60.0, output_mib=1.0, measured_at="2026-01-01T00:00:00Z",
                                       device="tiny"))
    msg = memory_check(cfg, reserve)
    assert msg is not None and msg.startswith("model + KV cache at context 20 + measured compute and output buffers "
                                              "need 0.06 GB, more than Tiny (0.1 GB) allows")
    assert "compute 60.00 MiB and output 1.00 MiB measured on tiny at 2026-01-01T00:00:00Z" in msg
    assert "KV: estimated from the GGUF header" in msg
    # Another build's or another device's measurement is not this trial's.
    monkeypatch.setattr("jbench.models.provision.active_build", lambda: {"build_commit": "1111111"})
    assert memory_check(cfg, reserve) is None


# --------------------------------------------------------------------------------------------
# A real memory pass and the memory stage (llama.cpp, the bundled Q4_K_M)


def _trial(*overrides: str):
    from jbench.sweeps.plan import plan

    p = plan(["model.quant=Q4_K_M", "backend.n_prompt=16", "backend.n_gen=4", "backend.repetitions=3",
              "backend.timeout_s=120", *overrides], use_grid=False)
    assert not p.problems, p.problems
    return p.trials[0]


def _log() -> logging.Logger:
    return logging.Logger("jbench.test.memory", logging.DEBUG)


@pytest.mark.e2e
def test_a_real_memory_pass_measures_peak_rss_and_the_buffers(llama_build, bundled_model):
    from jbench.backends.llamacpp.backend import LlamaCppBackend
    from jbench.device.local import LocalConnection

    trial = _trial()
    backend = LlamaCppBackend(trial.cfg.backend)
    with LocalConnection() as conn:
        found = backend.memory_pass(trial, conn, _log())
    assert found is not None and found.account is not None
    assert found.command[-2:] == ["-v", "--no-warmup"] and found.command[found.command.index("-r") + 1] == "1"
    assert found.account.model.get("CPU_Mapped", 0) > 200 and found.account.contexts == 2
    assert found.account.total("kv") and found.account.total("compute") and found.account.total("output")
    assert found.peak_rss_kib is not None and found.peak_rss_kib / 1024 >= found.account.total("model")
    assert MARKER not in found.raw_stderr and "model buffer size" in found.raw_stderr


class _Session:
    """What the memory stage reads of a DeviceSession: the connection, the build id and the model's digest."""

    def __init__(self, conn, build: str):
        from jbench.models.digest import model_digest

        self.connection, self.build = conn, build
        self._digest = model_digest

    def build_id(self, config) -> str:
        return self.build

    def model_digest(self, model):
        return self._digest(model)


def _context(trial, backend, conn):
    from jbench.core.results import BackendResult
    from jbench.runner.context import TrialContext

    ctx = TrialContext(trial=trial, cfg=trial.cfg, session=_Session(conn, "0c1e57098"), backend=backend, log=_log())
    ctx.backend_result = BackendResult()  # the measurement ran (the stage applies only then)
    return ctx


@pytest.mark.e2e
def test_the_memory_stage_records_the_pass_and_the_next_prediction_counts_it(llama_build, bundled_model, tmp_path,
                                                                               monkeypatch):
    from jbench.backends.llamacpp.backend import LlamaCppBackend
    from jbench.device.local import LocalConnection
    from jbench.runner.memory import ARTIFACT, Memory

    monkeypatch.setattr(memory_facts, "cache_path", lambda: tmp_path / "memory_facts.json")
    trial = _trial()
    backend = LlamaCppBackend(trial.cfg.backend)
    with LocalConnection() as conn:
        first = _context(trial, backend, conn)
        unmeasured = _context(trial, backend, conn)
        unmeasured.backend_result = None  # the Measure stage failed: the trial stopped before the analyses
        assert Memory().applies(first) and not Memory().applies(unmeasured)
        Memory().run(first)
        second = _context(trial, backend, conn)
        Memory().run(second)
    m, t = first.record.metrics, first.record.tags
    assert t["memory.status"] == "ok" and t["memory.cma.status"].startswith("not measured")  # no CMA on this kernel
    assert m["memory_peak_rss_mib"] >= m["memory_model_buffer_mib"] > 200
    assert m["memory_unexplained_mib"] == pytest.approx(m["memory_peak_rss_mib"] - m["memory_backend_total_mib"])
    assert "never measured for this configuration" in t["memory.prediction"]
    assert "model buffer size" in first.record.artifacts[ARTIFACT]
    # The first pass stored its compute and output buffers; the second trial's prediction counts them.
    assert second.record.tags["memory.prediction"].count("measured (on local at") == 2
    assert second.record.metrics["memory_predicted_mib"] == pytest.approx(
        m["memory_predicted_mib"] + m["memory_compute_buffer_mib"] + m["memory_output_buffer_mib"])
    assert abs(second.record.metrics["memory_prediction_error_pct"]) < abs(m["memory_prediction_error_pct"])


def _limited_llama_bench(tmp_path: Path, bin_dir: str, address_space: int) -> str:
    """A bin directory whose llama-bench is the real one under an address-space limit (prlimit --as)."""
    shim_dir = tmp_path / "bin"
    shim_dir.mkdir()
    shim = shim_dir / "llama-bench"
    shim.write_text(f"#!/bin/sh\nexec prlimit --as={address_space} {os.path.join(bin_dir, 'llama-bench')} \"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    return str(shim_dir)


@pytest.mark.e2e
def test_a_memory_pass_out_of_memory_leaves_the_trial_standing_with_the_reason(llama_build, bundled_model, tmp_path,
                                                                               monkeypatch):
    from jbench.backends.base import BackendError
    from jbench.backends.llamacpp.backend import LlamaCppBackend
    from jbench.device.local import LocalConnection
    from jbench.runner.memory import Memory

    monkeypatch.setattr(memory_facts, "cache_path", lambda: tmp_path / "memory_facts.json")
    # 300 MB of address space: the weights' mmap fails ("mmap failed: Cannot allocate memory"), a real llama.cpp OOM.
    bin_dir = _limited_llama_bench(tmp_path, llama_build["bin_dir"], 300_000_000)
    trial = _trial(f"backend.binary_dir={bin_dir}")
    backend = LlamaCppBackend(trial.cfg.backend)
    with LocalConnection() as conn:
        with pytest.raises(BackendError) as failed:
            backend.memory_pass(trial, conn, _log())
        assert failed.value.category == "out_of_memory" and MARKER not in failed.value.raw_stderr
        ctx = _context(trial, backend, conn)
        Memory().run(ctx)  # does not raise: the trial's measurement stands
    status = ctx.record.tags["memory.status"]
    assert status.startswith("not measured: the memory pass ran out of memory") and "exited with code" in status
    assert not [k for k in ctx.record.metrics if k not in ("memory_predicted_mib", "memory_cma_idle_mib")]
    assert "memory_predicted_mib" in ctx.record.metrics and math.isfinite(ctx.record.metrics["memory_predicted_mib"])


# --------------------------------------------------------------------------------------------
# `jbench memory RUN_ID` over a stored run


def _stored_runs(results: Path) -> tuple[str, str]:
    """A local store with two trial runs: one with memory figures, one recorded without them."""
    from jbench.tracking.writer import Tracker

    prediction = predict(253113024, 20 * 18432, None, None)
    metrics, tags = memory_metrics(_account(), 319712, None, prediction)
    tracker = Tracker(None, results)
    exp = tracker.experiment_id("adhoc")
    with_memory = tracker.start_run(exp, "Q4_K_M", tags={"jbench.kind": "trial", **tags, "memory.ram.status":
                                                        "not measured: no telemetry samples"})
    tracker.log(with_memory, metrics={**metrics, "decode_tps": 70.0})
    tracker.end_run(with_memory, "FINISHED")
    without = tracker.start_run(exp, "Q8_0", tags={"jbench.kind": "trial"})
    tracker.log(without, metrics={"decode_tps": 60.0})
    tracker.end_run(without, "FINISHED")
    return with_memory, without


@pytest.mark.slow  # a local MLflow store created and read: about 9 s
def test_the_memory_command_prints_one_runs_audit(tmp_path):
    from click.testing import CliRunner

    from jbench.cli import main

    with_memory, without = _stored_runs(tmp_path / "results")
    runner = CliRunner()
    res = runner.invoke(main, ["memory", with_memory[:8], "--results-dir", str(tmp_path / "results")])
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"Memory of run {with_memory[:12]} (Q4_K_M)\n")
    assert "| model weights | 247.82 | llama.cpp model buffers: CPU_Mapped 235.16 + CPU_REPACK 12.66 |" in res.output
    assert "| OS and other processes at idle | — | not measured: no telemetry samples |" in res.output
    res = runner.invoke(main, ["memory", with_memory, "-o", "json", "--results-dir", str(tmp_path / "results")])
    data = json.loads(res.output)
    lines = {line["label"]: line["mib"] for line in data["lines"]}
    assert data["run_id"] == with_memory and lines["peak RSS of the backend process"] == 319712 / 1024
    assert lines["CMA in use at idle"] is None
    res = runner.invoke(main, ["memory", without, "--results-dir", str(tmp_path / "results")])
    assert res.exit_code == 2 and f"run {without[:12]} has no memory figures" in res.output
    res = runner.invoke(main, ["memory", "0123456789abcdef", "--results-dir", str(tmp_path / "results")])
    assert res.exit_code == 2 and "selects no trial runs" in res.output


def test_the_recorded_log_keeps_what_accounts_for_memory_and_says_what_it_left_out():
    from jbench.analysis.memory import log_excerpt, parse_buffers

    text = CAPTURE.read_text()
    excerpt = log_excerpt(text)
    # The same account from the excerpt as from the whole log, at a few hundredths of its size.
    assert parse_buffers(excerpt) == parse_buffers(text) and len(excerpt) < len(text) / 100
    assert excerpt.startswith("[jbench] the lines of the memory pass's stderr") and "of 2220 lines" in excerpt
    assert "create_tensor: loading tensor" not in excerpt
    failed = log_excerpt("load_tensors: loading\nggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate\nbye\n",
                         tail=2)
    assert "failed to allocate" in failed and failed.rstrip().endswith("bye") and "then its last 2 lines" in failed
