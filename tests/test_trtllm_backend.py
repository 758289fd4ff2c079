"""The TensorRT-LLM backend (`backend=trtllm`) with replaying stand-ins (tests/fixtures/trtllm/).

No TensorRT-LLM runs here: the stand-in programs record their argv and print recorded public outputs
(tests/data/trtllm/, each with its cited source). What is tested is the commands jbench constructs, the
engine cache, validation, and how the recorded outputs become PhaseResults. Expected rates are computed
here by hand from the numbers printed in the fixtures.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from jbench.backends.base import BackendError
from jbench.backends.trtllm.backend import MANIFEST, TrtllmBackend, engine_cache_key
from jbench.device.local import LocalConnection
from jbench.sweeps.plan import plan

from .conftest import jbench_cli

HERE = Path(__file__).resolve().parent
TRT = HERE / "fixtures" / "trtllm"
HF = "meta-llama/Llama-3.3-70B-Instruct"
log = logging.getLogger("jbench.test.trtllm")


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """Config dir with a checkpoint per quant, the stand-in call log, and a helper to plan one trial."""
    ckpt = tmp_path / "ckpt-int4"
    ckpt.mkdir()
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "llama_trt.yaml").write_text(json.dumps({
        "defaults": ["model_schema", "_self_"], "name": "llama_trt", "quant": "W4A16",
        "files": {"W4A16": str(ckpt), "FP8": str(ckpt), "FP16": str(tmp_path / "no-such-ckpt")}}))
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("TRTLLM_STANDIN_LOG", str(calls))
    for var in ("TRTLLM_STANDIN_OUTPUT", "TRTLLM_STANDIN_FAIL", "TRTLLM_STANDIN_VERSION"):
        monkeypatch.delenv(var, raising=False)

    class S:
        base = ["backend=trtllm", "model=llama_trt", f"backend.bin_dir={TRT}", f"backend.python={TRT / 'python3'}",
                f"backend.prepare_dataset={TRT / 'prepare_dataset.py'}", f"backend.hf_model={HF}",
                f"backend.engine_cache_dir={tmp_path / 'engines'}", "backend.num_requests=4"]
        checkpoint = ckpt
        cache = tmp_path / "engines"
        config_dirs = [conf]

        @staticmethod
        def plan(*overrides: str):
            return plan([*S.base, *overrides], [conf], use_grid=False)

        @staticmethod
        def trial(*overrides: str):
            p = S.plan(*overrides)
            assert p.problems == [], p.problems
            t = p.trials[0]
            return t, TrtllmBackend(t.cfg.backend)

        @staticmethod
        def calls(prog: str | None = None) -> list[dict]:
            if not calls.exists():
                return []
            out = [json.loads(line) for line in calls.read_text().splitlines()]
            return [c for c in out if prog is None or c["prog"] == prog]

    return S


LATENCY = ("backend.n_prompt=2048", "backend.n_gen=2048")  # the recorded 0.16 latency report: ISL = OSL = 2048


# --------------------------------------------------------------------------------------------
# Command construction (exact argv)


def test_build_and_bench_commands_latency(standin):
    trial, b = standin.trial(*LATENCY, "+backend.build_args=[--gemm_plugin,float16]")
    cfg = trial.cfg.backend
    assert b.build_command("/ck", "/eng", cfg) == [
        f"{TRT}/trtllm-build", "--checkpoint_dir", "/ck", "--output_dir", "/eng", "--max_batch_size", "1",
        "--max_input_len", "2048", "--max_seq_len", "4096", "--gemm_plugin", "float16"]
    assert b.dataset_command(cfg) == [
        f"{TRT}/python3", f"{TRT}/prepare_dataset.py", "--stdout", "--tokenizer", HF, "token-norm-dist",
        "--input-mean", "2048", "--output-mean", "2048", "--input-stdev", "0", "--output-stdev", "0",
        "--num-requests", "4"]
    assert b.bench_command(cfg, "/eng", "/d.jsonl") == [
        f"{TRT}/trtllm-bench", "--model", HF, "latency", "--dataset", "/d.jsonl", "--engine_dir", "/eng",
        "--num_requests", "4", "--warmup", "2"]


def test_bench_command_throughput_streaming(standin):
    trial, b = standin.trial("backend.mode=throughput", "backend.batch_size=8", "backend.concurrency=1",
                             "backend.model_path=/hf/llama", "backend.bench_backend=tensorrt",
                             "backend.extra_args=[--kv_cache_free_gpu_mem_fraction,0.5]")
    assert b.bench_command(trial.cfg.backend, "/eng", "/d.jsonl") == [
        f"{TRT}/trtllm-bench", "--model", HF, "--model_path", "/hf/llama", "throughput", "--dataset", "/d.jsonl",
        "--engine_dir", "/eng", "--num_requests", "4", "--warmup", "2", "--backend", "tensorrt",
        "--concurrency", "1", "--streaming", "--kv_cache_free_gpu_mem_fraction", "0.5"]
    # the dataset's tokenizer is the local model when one is given
    assert b.dataset_command(trial.cfg.backend)[4] == "/hf/llama"


def test_jetson_commands(standin):
    trial, b = standin.trial("backend.variant=jetson-v0.12", "backend.benchmark_dir=/trt/cpp/build/benchmarks",
                             "backend.n_prompt=128", "backend.n_gen=128")
    assert b.bench_command(trial.cfg.backend, "/eng", None) == [
        "/trt/cpp/build/benchmarks/gptSessionBenchmark", "--engine_dir", "/eng", "--batch_size", "1",
        "--input_output_len", "128,128", "--warm_up", "2", "--num_runs", "10", "--duration", "0",
        "--enable_cuda_graph"]
    trial, b = standin.trial("backend.variant=jetson-v0.12", "backend.jetson_program=benchmark.py",
                             "backend.benchmark_dir=/trt/benchmarks/python", "backend.enable_cuda_graph=false",
                             "backend.num_runs=5")
    assert b.bench_command(trial.cfg.backend, "/eng", None) == [
        f"{TRT}/python3", "/trt/benchmarks/python/benchmark.py", "-m", "dec", "--engine_dir", "/eng",
        "--batch_size", "1", "--input_output_len", "128,128", "--warm_up", "2", "--num_runs", "5", "--duration", "0"]


def test_config_values_stay_single_arguments(standin, tmp_path):
    odd = tmp_path / "ckpt; rm -rf ~"
    odd.mkdir()
    (standin.config_dirs[0] / "model" / "odd.yaml").write_text(json.dumps({
        "defaults": ["model_schema", "_self_"], "name": "odd model", "quant": "W4A16", "files": {"W4A16": str(odd)}}))
    trial, b = standin.trial(*LATENCY, "model=odd", "backend.hf_model='org/name with space'")
    result = b.run(trial, LocalConnection(), log)
    build = standin.calls("trtllm-build")[-1]["argv"]
    assert build[build.index("--checkpoint_dir") + 1] == str(odd)
    bench = standin.calls("trtllm-bench")[-1]["argv"]
    assert bench[bench.index("--model") + 1] == "org/name with space"
    assert Path(result.info["engine_dir"]).name.startswith("odd_model-W4A16-")


# --------------------------------------------------------------------------------------------
# Engine cache


KEY_ARGS = dict(model="m", quant="W4A16", checkpoint="/ck", max_input_len=128, max_seq_len=256, max_batch_size=1,
                version="0.12.0", device="NVIDIA Jetson AGX Orin", build_args=[])


@pytest.mark.parametrize("field, value", [("model", "m2"), ("quant", "FP16"), ("checkpoint", "/ck2"),
                                          ("max_input_len", 256), ("max_seq_len", 512), ("max_batch_size", 2),
                                          ("version", "0.12.0-jetson"), ("device", "Orin Nano"),
                                          ("build_args", ["--gemm_plugin", "float16"])])
def test_cache_key_changes_with_what_makes_the_engine(field, value):
    key, fields = engine_cache_key(**KEY_ARGS)
    assert len(key) == 16 and fields["trtllm_version"] == "0.12.0" and fields["device"] == "NVIDIA Jetson AGX Orin"
    assert engine_cache_key(**KEY_ARGS)[0] == key
    assert engine_cache_key(**{**KEY_ARGS, field: value})[0] != key


@pytest.mark.slow
def test_build_once_then_cached(standin):
    trial, b = standin.trial(*LATENCY)
    first = b.run(trial, LocalConnection(), log)
    assert first.info["engine_cache"] == "built"
    manifest = json.loads((Path(first.info["engine_dir"]) / MANIFEST).read_text())
    assert manifest["key"] == first.build["engine_key"]
    assert manifest["fields"]["trtllm_version"] == "0.12.0"  # read on the device through `python3 -c`
    assert manifest["fields"]["checkpoint"] == str(standin.checkpoint)
    assert manifest["command"][0] == f"{TRT}/trtllm-build"
    # a new backend instance (a new sweep) finds the engine on the device
    trial2, b2 = standin.trial(*LATENCY)
    second = b2.run(trial2, LocalConnection(), log)
    assert second.info["engine_cache"] == "cached" and second.info["engine_dir"] == first.info["engine_dir"]
    assert len(standin.calls("trtllm-build")) == 1
    assert len(standin.calls("prepare_dataset.py")) == 1  # the dataset is cached too
    assert len(standin.calls("trtllm-bench")) == 2
    # the version is read once per backend instance and connection
    assert len([c for c in standin.calls("python3") if c["argv"][0] == "-c"]) == 2


@pytest.mark.slow
def test_other_version_or_lengths_build_another_engine(standin, monkeypatch):
    trial, b = standin.trial(*LATENCY)
    first = b.run(trial, LocalConnection(), log)
    monkeypatch.setenv("TRTLLM_STANDIN_VERSION", "0.12.0-jetson")
    trial, b = standin.trial(*LATENCY)
    second = b.run(trial, LocalConnection(), log)
    assert second.info["engine_cache"] == "built" and second.build["trtllm_version"] == "0.12.0-jetson"
    assert second.info["engine_dir"] != first.info["engine_dir"]
    trial, b = standin.trial(*LATENCY, "backend.trtllm_version=9.9", "backend.device_name=Orin Nano")
    third = b.run(trial, LocalConnection(), log)
    assert third.build["trtllm_version"] == "9.9" and third.build["trtllm_device"] == "Orin Nano"
    assert len(standin.calls("trtllm-build")) == 3
    assert len([c for c in standin.calls("python3") if c["argv"][0] == "-c"]) == 2  # configured: not read


@pytest.mark.slow
def test_mismatched_manifest_or_failed_build_rebuilds(standin, monkeypatch):
    trial, b = standin.trial(*LATENCY)
    first = b.run(trial, LocalConnection(), log)
    manifest = Path(first.info["engine_dir"]) / MANIFEST
    manifest.write_text(json.dumps({"key": "something-else"}))
    trial, b = standin.trial(*LATENCY)
    assert b.run(trial, LocalConnection(), log).info["engine_cache"] == "built"
    assert len(standin.calls("trtllm-build")) == 2
    # a failed build leaves no manifest: the next trial builds again
    manifest.unlink()
    monkeypatch.setenv("TRTLLM_STANDIN_FAIL", "trtllm-build")
    trial, b = standin.trial(*LATENCY)
    with pytest.raises(BackendError) as err:
        b.run(trial, LocalConnection(), log)
    assert err.value.category == "backend_crash" and "trtllm-build exited with code 1" in str(err.value)
    assert "TRTLLM_STANDIN_FAIL" in err.value.raw_stderr
    assert not manifest.exists()
    monkeypatch.delenv("TRTLLM_STANDIN_FAIL")
    trial, b = standin.trial(*LATENCY)
    assert b.run(trial, LocalConnection(), log).info["engine_cache"] == "built"


def test_prebuilt_engine_dir_is_used_as_is(standin, tmp_path):
    engine = tmp_path / "my-engine"
    engine.mkdir()
    trial, b = standin.trial(*LATENCY, f"backend.engine_dir={engine}", "model.quant=FP16")  # FP16 has no checkpoint
    result = b.run(trial, LocalConnection(), log)
    assert result.info["engine_cache"] == "prebuilt" and result.info["engine_dir"] == str(engine)
    assert standin.calls("trtllm-build") == [] and "engine_key" not in result.build


def test_missing_checkpoint_is_missing_model(standin):
    # Refused when planned (a local device); a trial run anyway (a file gone since) fails as missing_model.
    p = standin.plan(*LATENCY, "model.quant=FP16")
    assert [m for m in p.problems if "no-such-ckpt not found" in m], p.problems
    trial = p.trials[0]
    b = TrtllmBackend(trial.config["backend"])
    with pytest.raises(BackendError) as err:
        b.run(trial, LocalConnection(), log)
    assert err.value.category == "missing_model" and "no-such-ckpt" in str(err.value)


# --------------------------------------------------------------------------------------------
# Parsing through the stand-in


def test_latency_report_becomes_phases(standin):
    trial, b = standin.trial(*LATENCY, "backend.repetitions=2")
    r = b.run(trial, LocalConnection(), log)
    dec, pre = r.phases["decode"], r.phases["prefill"]
    # 0.16 latency report: Generation Token Throughput 32.3338 tok/s; TTFT 147.7502 ms for 2048 input tokens
    assert dec.n_tokens == 2048 and dec.samples_ns == [round(2048 * 1e9 / 32.3338)] * 2
    assert dec.samples_tps == pytest.approx([32.3338] * 2, rel=1e-9)
    assert pre.samples_tps == pytest.approx([2048 / 0.1477502] * 2, rel=1e-9)
    assert dec.window is None and pre.window is None  # rates, not timed windows: no per-phase energy
    assert r.info["trtllm_decode_source"] == "generation_tps"
    assert r.info["trtllm_prefill_source"] == "avg_input_len/ttft_ms"
    assert any("proxy" in c for c in r.info["trtllm_caveats"])
    assert r.info["trtllm_version_reported"] == "0.16.0"
    assert r.raw_output.count("= LATENCY OVERVIEW") == 2


def test_streaming_throughput_under_concurrency_has_no_prefill(standin):
    trial, b = standin.trial("backend.mode=throughput", "backend.batch_size=128", "backend.concurrency=100")
    r = b.run(trial, LocalConnection(), log)
    # 0.21 streaming report: Per User Output Speed 137.1475 tps/user, 94.6 requests in flight on average
    assert set(r.phases) == {"decode"}
    assert r.phases["decode"].samples_tps == pytest.approx([137.1475], rel=1e-9)
    assert r.info["trtllm_single_stream"] is False
    assert r.info["trtllm_prefill_absent"].startswith("prefill_tps absent: TTFT was measured with several requests")
    bench = standin.calls("trtllm-bench")[-1]["argv"]
    assert bench[bench.index("--concurrency") + 1] == "100" and "--streaming" in bench


def test_jetson_benchmark_py_line(standin):
    trial, b = standin.trial("backend.variant=jetson-v0.12", "backend.jetson_program=benchmark.py",
                             f"backend.benchmark_dir={TRT}", "backend.n_prompt=60", "backend.n_gen=20")
    r = b.run(trial, LocalConnection(), log)
    # benchmark.py README line for batch 1, 60/20: generation_tokens_per_second 172.43; latency 117.115 ms,
    # generation_time 110.189 ms -> context 6.926 ms for 60 tokens
    assert r.phases["decode"].samples_tps == pytest.approx([172.43], rel=1e-9)
    assert r.phases["prefill"].samples_tps == pytest.approx([60 / ((117.115 - 110.189) / 1000)], rel=1e-6)
    assert r.info["benchmark_tool"] == "benchmark.py"
    call = standin.calls("benchmark.py")[-1]["argv"]
    assert call[:2] == ["-m", "dec"] and call[call.index("--input_output_len") + 1] == "60,20"
    assert standin.calls("trtllm-bench") == [] and standin.calls("prepare_dataset.py") == []


def test_jetson_gpt_session_line_without_generation_time_is_unparseable(standin):
    trial, b = standin.trial("backend.variant=jetson-v0.12", f"backend.benchmark_dir={TRT}",
                             "backend.n_prompt=60", "backend.n_gen=20")
    with pytest.raises(BackendError) as err:
        b.run(trial, LocalConnection(), log)
    assert err.value.category == "unparseable_output" and "no decode rate" in str(err.value)
    assert "tokensPerSec 506.69" in err.value.raw_output


def test_jetson_no_line_for_the_trial_is_unparseable(standin):
    trial, b = standin.trial("backend.variant=jetson-v0.12", "backend.jetson_program=benchmark.py",
                             f"backend.benchmark_dir={TRT}", "backend.n_prompt=128", "backend.n_gen=128")
    with pytest.raises(BackendError) as err:
        b.run(trial, LocalConnection(), log)
    assert err.value.category == "unparseable_output"
    assert "no [BENCHMARK] line for batch_size 1 input_length 128 output_length 128" in str(err.value)


def test_report_for_other_lengths_is_unparseable(standin):
    trial, b = standin.trial("backend.n_prompt=128", "backend.n_gen=128")  # the latency report is 2048/2048
    with pytest.raises(BackendError) as err:
        b.run(trial, LocalConnection(), log)
    assert err.value.category == "unparseable_output" and "does not match the trial" in str(err.value)


def test_garbage_output_is_unparseable(standin, monkeypatch):
    monkeypatch.setenv("TRTLLM_STANDIN_OUTPUT", "jetson_v0.12.0-jetson_readme_reference_tables.txt")
    trial, b = standin.trial(*LATENCY)
    with pytest.raises(BackendError) as err:
        b.run(trial, LocalConnection(), log)
    assert err.value.category == "unparseable_output" and "no report section" in str(err.value)


# --------------------------------------------------------------------------------------------
# Validation: what the backend does not support is rejected before anything runs


@pytest.mark.parametrize("overrides, problem", [
    (["backend.depth=512"], "does not support context depth"),
    (["model.quant=Q4_K_M"], "model.quant 'Q4_K_M' is not a TensorRT-LLM quantization"),
    (["backend.variant=jetson-v0.12", "backend.benchmark_dir=/b", "model.quant=FP8"], "(Orin has no FP8/FP4 support)"),
    (["backend.mode=throughput", "backend.streaming=false"], "decode_tps cannot be measured"),
    (["backend.mode=throughput", "backend.concurrency=4"], "exceeds the engine's max batch size"),
    (["backend.variant=jetson-v0.12", "backend.benchmark_dir=/b", "backend.mode=throughput"],
     "backend.mode applies to trtllm-bench only"),
    (["backend.variant=jetson-v0.12"], "backend.benchmark_dir is not set"),
    (["backend.variant=tensorrt"], "backend.variant 'tensorrt' is not valid. Valid: trtllm-bench, jetson-v0.12"),
    (["backend.hf_model=null"], "backend.hf_model is not set"),
    (["backend.prepare_dataset=null"], "backend.prepare_dataset is not set"),
    (["+backend.build_args=[--max_seq_len,9]"], "backend.build_args sets --max_seq_len"),
    (["backend.max_input_len=64"], "does not fit the engine's max_input_len=64"),
    (["backend.n_gen=0"], "backend.n_gen must be >= 1"),
])
def test_validate_rejects_what_is_not_supported(standin, overrides, problem):
    p = standin.plan(*overrides)
    assert any(problem in x for x in p.problems), p.problems


def test_capabilities_declare_the_limits():
    caps = TrtllmBackend.CAPABILITIES
    assert not caps.context_depth and not caps.flash_attention and not caps.latency_scenario
    assert "W4A16_GPTQ" in caps.quants and "FP8" not in caps.extra["jetson_quants"]


def test_preflight_names_missing_programs(standin, tmp_path):
    trial, b = standin.trial(*LATENCY)
    with LocalConnection() as conn:
        assert b.preflight(conn) == []
    trial, b = standin.trial(*LATENCY, f"backend.bin_dir={tmp_path / 'nowhere'}")
    with LocalConnection() as conn:
        problems = b.preflight(conn)
    assert len(problems) == 2 and "trtllm-build not found" in problems[0] and "TensorRT-LLM is not installed" in problems[0]


@pytest.mark.e2e
def test_cli_run_into_mlflow(standin, tmp_path):
    res = jbench_cli(["run", "--config-dir", str(standin.config_dirs[0]), *standin.base, *LATENCY,
                      "telemetry.source=none"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "results"),
                                "TRTLLM_STANDIN_LOG": str(tmp_path / "cli-calls.jsonl")})
    assert res.returncode == 0, res.stdout + res.stderr
    client = MlflowClient(f"sqlite:///{tmp_path}/results/mlflow.db")
    exp = client.get_experiment_by_name("adhoc")
    run = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("jbench.kind") == "trial"][0]
    assert run.info.status == "FINISHED"
    assert run.data.metrics["decode_tps"] == pytest.approx(32.3338, rel=1e-9)
    assert run.data.metrics["prefill_tps"] == pytest.approx(2048 / 0.1477502, rel=1e-9)
    assert run.data.tags["backend.trtllm_version"] == "0.12.0" and len(run.data.tags["backend.engine_key"]) == 16
