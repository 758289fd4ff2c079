"""TensorRT-LLM output parsers, against public outputs kept in tests/data/trtllm/.

Every fixture starts with '# source:' / '# version:' / '# note:' / '# command:' lines naming where
it was copied from; the rest is the published output, unedited. Expected values below are the
numbers printed in those outputs. Layout-drift and error cases work on modified copies made here
in the tests (never stored as fixtures).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from jbench.backends.trtllm.parse import (
    JetsonBenchmarkRecord,
    JetsonReferenceRow,
    TrtllmBenchReport,
    TrtllmParseError,
    parse_gpt_manager_benchmark_lines,
    parse_jetson_benchmark_lines,
    parse_jetson_reference_table,
    parse_trtllm_bench_json,
    parse_trtllm_bench_report,
    phase_metrics,
)

DATA = Path(__file__).parent / "data" / "trtllm"
HEADER_PREFIXES = ("# source:", "# version:", "# note:", "# command:")

BENCH_REPORTS = sorted(p.name for p in DATA.glob("trtllm-bench_*.txt"))
LINE_FIXTURES = [
    "gptSessionBenchmark_readme_expected.txt",
    "python_benchmark_readme_expected_sm80.txt",
    "python_benchmark_readme_expected_generation.txt",
    "thirdparty_0.11.0_python_benchmark_and_gptManagerBenchmark.txt",
    "thirdparty_gptSessionBenchmark_runs.txt",
]


def raw(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


def body(name: str) -> str:
    """The fixture without its leading citation lines."""
    lines = raw(name).splitlines(keepends=True)
    i = 0
    while i < len(lines) and lines[i].startswith(HEADER_PREFIXES):
        i += 1
    return "".join(lines[i:])


def approx(x, rel=1e-9):
    return pytest.approx(x, rel=rel)


# --------------------------------------------------------------------------------------------
# Fixture hygiene


def test_every_fixture_cites_source_and_version():
    names = sorted(p.name for p in DATA.iterdir() if p.is_file())
    assert len(names) >= 14
    for name in names:
        head = raw(name).splitlines()[:3]
        assert head[0].startswith("# source: "), name
        assert head[1].startswith("# version: "), name
        assert head[2].startswith("# note: "), name


def test_report_fixture_list_covers_the_layouts():
    assert BENCH_REPORTS == [
        "trtllm-bench_0.12.0_throughput.txt",
        "trtllm-bench_0.16.0_latency.txt",
        "trtllm-bench_0.16.0_throughput.txt",
        "trtllm-bench_0.17.0_throughput_console.txt",
        "trtllm-bench_0.17.0_throughput_pytorch.txt",
        "trtllm-bench_0.21.0rc0_throughput_streaming.txt",
        "trtllm-bench_multimodal_throughput_pytorch.txt",
        "trtllm-bench_perf-overview_performance-only.txt",
    ]


@pytest.mark.parametrize("name", BENCH_REPORTS)
def test_whole_file_and_body_parse_the_same(name):
    # the citation lines sit outside any report section and change nothing
    a, b = parse_trtllm_bench_report(raw(name)), parse_trtllm_bench_report(body(name))
    assert a == b


# --------------------------------------------------------------------------------------------
# trtllm-bench reports: values as printed


def test_0_12_statistics_layout():
    r = parse_trtllm_bench_report(body("trtllm-bench_0.12.0_throughput.txt"))
    assert r.version == "0.12.0"
    assert r.model == "meta-llama/Llama-2-7b-hf"
    assert r.backend == "ENGINE DETAILS"
    assert r.engine["Quantization"] == "FP8" and r.engine["Max Sequence Length"] == "4098"
    assert r.request_throughput_rps == approx(182.8588064724305)
    assert r.total_output_tps == approx(23405.927228471104)  # 'Token Throughput (tokens/sec)'
    assert r.total_token_tps is None
    assert r.total_latency_ms == approx(16.406100739 * 1000)  # 'Total Latency (seconds)'
    assert r.num_requests == 3000
    assert r.avg_input_len == 128.0 and r.avg_output_len == 128.0
    assert r.max_runtime_batch_size == 4096
    assert r.world["KV Memory Percentage"] == "99.0%"
    assert r.ttft_ms is None and r.tpot_ms is None and r.per_user_output_tps is None
    assert list(r.sections) == ["ENGINE DETAILS", "WORLD + RUNTIME INFORMATION", "STATISTICS"]


def test_0_16_throughput_tab_separated():
    r = parse_trtllm_bench_report(body("trtllm-bench_0.16.0_throughput.txt"))
    assert r.version == "0.16.0"
    assert r.model == "/scratch/Llama-3.3-70B-Instruct/"
    assert r.engine["Engine Directory"] == "/scratch/grid_search_engines/baseline"
    assert r.request_throughput_rps == approx(0.7743)
    assert r.total_output_tps == approx(1585.7480)
    assert r.total_latency_ms == approx(1291504.1051)
    assert r.num_requests == 1000
    assert r.avg_input_len == 2048.0 and r.avg_output_len == 2048.0
    assert r.world["TP Size"] == "4"
    assert r.world["Issue Rate (req/sec)"] == "7.9353E+13"


def test_0_16_latency_report():
    r = parse_trtllm_bench_report(body("trtllm-bench_0.16.0_latency.txt"))
    assert r.version == "0.16.0"
    assert r.max_runtime_batch_size == 1
    assert r.num_requests == 100
    assert r.avg_request_latency_ms == approx(63456.0704)
    assert r.request_throughput_rps == approx(0.0158)
    # this layout's 'Total Token Throughput' is output tokens / time (see the consistency test)
    assert r.total_output_tps == approx(32.2742)
    assert r.total_token_tps is None
    assert r.generation_tps == approx(32.3338)
    assert r.total_latency_ms == approx(6345624.0554)
    assert r.ttft_ms == approx(147.7502)
    assert r.itl_ms == approx(30.9274)
    assert r.tpot_ms is None
    assert r.acceptance_rate == approx(1.00)
    assert r.generation_latency_percentiles_ms == {
        "min": approx(63266.8804), "max": approx(63374.7770), "avg": approx(63308.3201),
        "p90": approx(63307.1885), "p95": approx(63331.7136), "p99": approx(63374.7770),
    }
    assert r.sections["ACCEPTANCE BREAKDOWN"]["P99"] == "1.00"
    assert list(r.sections)[2:5] == ["GENERAL OVERVIEW", "THROUGHPUT OVERVIEW", "LATENCY OVERVIEW"]


def test_0_17_console_output_with_log_lines():
    r = parse_trtllm_bench_report(body("trtllm-bench_0.17.0_throughput_console.txt"))
    assert r.version == "0.17.0"
    assert r.model == "meta-llama/Llama-3.1-8B"
    assert r.engine["KV Cache Dtype"] == "FP8"
    assert r.request_throughput_rps == approx(221.8002)
    assert r.total_output_tps == approx(28390.4265)
    assert r.total_latency_ms == approx(13525.6862)
    assert r.num_requests == 3000
    # log lines before and after the report are not part of any section
    assert all("TRT-LLM" not in k for kv in r.sections.values() for k in kv)
    assert all(not lines for lines in r.unparsed_lines.values())


def test_0_17_pytorch_backend_section():
    r = parse_trtllm_bench_report(body("trtllm-bench_0.17.0_throughput_pytorch.txt"))
    assert r.backend == "PyTorch backend"
    assert r.version == "0.17.0"
    assert r.engine["Model Path"] == "/Ckpt/Path/To/Llama-3.1-8B"
    assert r.engine["KV Cache Dtype"] == "None"
    assert r.request_throughput_rps == approx(161.6059)
    assert r.total_output_tps == approx(20685.5510)
    assert r.total_latency_ms == approx(18563.6825)
    assert r.max_runtime_batch_size == 2048


def test_0_21_streaming_report():
    r = parse_trtllm_bench_report(body("trtllm-bench_0.21.0rc0_throughput_streaming.txt"))
    assert r.version == "0.21.0rc0"
    assert r.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert r.backend == "PYTORCH BACKEND"
    assert r.num_requests == 100
    assert r.avg_concurrent_requests == approx(94.6050)
    assert r.request_throughput_rps == approx(86.5373)
    assert r.total_output_tps == approx(11076.7700)
    assert r.total_token_tps == approx(22153.5399)
    assert r.per_user_output_tps == approx(117.1544)  # [w/ ctx]
    assert r.per_user_output_speed_tps == approx(137.1475)
    assert r.per_gpu_output_tps == approx(11076.7700)
    assert r.avg_request_latency_ms == approx(1093.2284)
    assert r.ttft_ms == approx(162.6706)
    assert r.tpot_ms == approx(7.3272)
    assert r.ttft_percentiles_ms == {
        "min": approx(93.9210), "max": approx(232.4339), "avg": approx(162.6706), "p50": approx(159.7857),
        "p90": approx(220.0530), "p95": approx(226.9148), "p99": approx(232.4339),
    }
    assert r.tpot_percentiles_ms["p50"] == approx(7.6079)
    assert r.tpot_percentiles_ms["max"] == approx(8.1306)
    assert r.gen_tps_percentiles["avg"] == approx(137.1475)
    assert r.request_latency_percentiles_ms["p99"] == approx(1137.6817)
    assert r.sections["DATASET DETAILS"]["Dataset Path"] == "/workspace/benchmark_toolkit/synthetic_data.jsonl"
    assert "-- Request Latency Breakdown (ms) -----------------------" in r.unparsed_lines["PERFORMANCE OVERVIEW"]


def test_multimodal_report_without_backend_section():
    r = parse_trtllm_bench_report(body("trtllm-bench_multimodal_throughput_pytorch.txt"))
    assert r.version is None and r.model is None and r.backend is None and r.engine == {}
    assert list(r.sections)[0] == "REQUEST DETAILS"
    assert r.num_requests == 10
    assert r.avg_concurrent_requests == approx(5.3019)
    assert r.avg_input_len == approx(411.6) and r.avg_output_len == approx(128.7)
    assert r.request_throughput_rps == approx(1.4439)
    assert r.total_output_tps == approx(185.8351)
    assert r.per_user_output_tps == approx(38.1959)  # '(tokens/sec/user)' label of this layout
    assert r.per_gpu_output_tps == approx(185.8351)
    assert r.total_token_tps == approx(780.1607)
    assert r.request_latency_percentiles_ms == {
        "p50": approx(3936.3022), "p90": approx(5514.4701), "p95": approx(5514.4701), "p99": approx(5514.4701),
        "min": approx(2397.1047), "max": approx(5514.4701), "avg": approx(3671.8441),
    }
    assert r.ttft_ms is None and r.tpot_ms is None
    assert r.world["EP Size"] == "None"
    assert r.sections["DATASET DETAILS"]["MIN"].split() == ["167.0000", "119.0000", "300.0000"]


def test_perf_overview_performance_section_only():
    r = parse_trtllm_bench_report(body("trtllm-bench_perf-overview_performance-only.txt"))
    assert r.version is None and r.num_requests is None and r.avg_input_len is None
    assert r.request_throughput_rps == approx(43.2089)
    assert r.total_output_tps == approx(5530.7382)
    assert r.per_user_output_tps == approx(2.0563)
    assert r.per_user_output_speed_tps == approx(5.4656)  # '[1/TPOT] (tokens/sec/user)' label
    assert r.total_token_tps == approx(94022.5497)
    assert r.ttft_ms == approx(52667.0339)
    assert r.tpot_ms == approx(182.9639)
    assert r.ttft_percentiles_ms["p99"] == approx(106563.4497)
    assert r.request_latency_percentiles_ms["avg"] == approx(75903.4456)


@pytest.mark.parametrize("name", BENCH_REPORTS)
def test_printed_rates_agree_with_printed_counts(name):
    """Checks the label semantics chosen per layout against the numbers themselves:
    output throughput = requests x avg output length / total time, request throughput = requests / time."""
    r = parse_trtllm_bench_report(body(name))
    assert r.total_latency_ms is not None, "every report prints its total latency"
    seconds = r.total_latency_ms / 1000.0
    if r.num_requests is None:
        # A report that prints no request count (perf-overview's PERFORMANCE OVERVIEW block alone): the rate and the
        # total time must still imply a whole number of requests, and 1/TPOT must be the per-user speed.
        assert name == "trtllm-bench_perf-overview_performance-only.txt", f"{name}: request count not parsed"
        implied = r.request_throughput_rps * seconds
        assert implied == pytest.approx(round(implied), rel=1e-4) and round(implied) == 5000
        assert r.per_user_output_speed_tps == pytest.approx(1000.0 / r.tpot_ms, rel=1e-3)
        return
    assert r.request_throughput_rps == pytest.approx(r.num_requests / seconds, rel=0.01)
    assert r.total_output_tps == pytest.approx(r.num_requests * r.avg_output_len / seconds, rel=0.005)
    if r.total_token_tps is not None:
        total = r.num_requests * (r.avg_input_len + r.avg_output_len) / seconds
        assert r.total_token_tps == pytest.approx(total, rel=0.005)


# --------------------------------------------------------------------------------------------
# Layout drift: modified copies of real reports


def _drop_line(text: str, startswith: str) -> str:
    lines = text.splitlines(keepends=True)
    kept = [ln for ln in lines if not ln.startswith(startswith)]
    assert len(kept) == len(lines) - 1, startswith
    return "".join(kept)


def test_drift_line_removed_still_parses():
    text = _drop_line(body("trtllm-bench_0.21.0rc0_throughput_streaming.txt"), "Total Latency (ms):")
    r = parse_trtllm_bench_report(text)
    assert r.total_latency_ms is None
    assert r.request_throughput_rps == approx(86.5373)
    assert r.ttft_ms == approx(162.6706)


def test_drift_lines_reordered_within_section():
    text = body("trtllm-bench_0.16.0_throughput.txt")
    lines = text.splitlines(keepends=True)
    start = lines.index("Number of requests:\t\t1000\n")
    block = lines[start:start + 6]
    assert block[-1].startswith("Total Latency")
    text = "".join(lines[:start] + block[::-1] + lines[start + 6:])
    assert parse_trtllm_bench_report(text) == parse_trtllm_bench_report(body("trtllm-bench_0.16.0_throughput.txt"))


def test_drift_sections_reordered():
    text = body("trtllm-bench_0.17.0_throughput_pytorch.txt")
    rule = "===========================================================\n"
    parts = text.split(rule + "= ")
    head, sections = parts[0], parts[1:]
    assert len(sections) == 3
    reordered = head + "".join(rule + "= " + s for s in sections[::-1])
    a, b = parse_trtllm_bench_report(reordered), parse_trtllm_bench_report(text)
    assert (a.version, a.request_throughput_rps, a.total_output_tps, a.num_requests) == (
        b.version, b.request_throughput_rps, b.total_output_tps, b.num_requests)


def test_drift_newer_label_spellings():
    # later reporting.py prints 'TensorRT LLM Version' and 'Per User Output Speed (tps/user)'
    text = body("trtllm-bench_perf-overview_performance-only.txt").replace(
        "Per User Output Speed [1/TPOT] (tokens/sec/user):", "Per User Output Speed (tps/user):")
    r = parse_trtllm_bench_report(text)
    assert r.per_user_output_speed_tps == approx(5.4656)
    text = body("trtllm-bench_0.17.0_throughput_pytorch.txt").replace("TensorRT-LLM Version:", "TensorRT LLM Version:")
    assert parse_trtllm_bench_report(text).version == "0.17.0"


def test_drift_whitespace_crlf_and_banner_without_equals_prefix():
    original = parse_trtllm_bench_report(body("trtllm-bench_0.16.0_latency.txt"))
    text = body("trtllm-bench_0.16.0_latency.txt").replace("\t", "    ").replace("\n", "\r\n")
    text = text.replace("= LATENCY OVERVIEW", "LATENCY OVERVIEW")
    r = parse_trtllm_bench_report(text)
    assert (r.ttft_ms, r.itl_ms, r.total_output_tps, r.request_throughput_rps) == (
        original.ttft_ms, original.itl_ms, original.total_output_tps, original.request_throughput_rps)
    assert "LATENCY OVERVIEW" in r.sections


def test_drift_unknown_section_and_extra_lines_are_kept():
    text = body("trtllm-bench_0.17.0_throughput_pytorch.txt")
    rule = "===========================================================\n"
    extra = rule + "= MACHINE DETAILS \n" + rule + "some gpu, memory 80.00 GB, 2.60 GHz\n\n"
    text = text.replace(rule + "= WORLD", extra + rule + "= WORLD", 1)
    text = text.replace("Total Latency (ms):", "Some New Metric (units):             1.5\nTotal Latency (ms):")
    r = parse_trtllm_bench_report(text)
    assert r.unparsed_lines["MACHINE DETAILS"] == ["some gpu, memory 80.00 GB, 2.60 GHz"]
    assert r.sections["PERFORMANCE OVERVIEW"]["Some New Metric (units)"] == "1.5"
    assert r.total_latency_ms == approx(18563.6825)


def test_version_from_log_line_when_report_prints_none():
    text = "[TensorRT-LLM] TensorRT-LLM version: 0.17.0\n" + body("trtllm-bench_multimodal_throughput_pytorch.txt")
    assert parse_trtllm_bench_report(text).version == "0.17.0"


# --------------------------------------------------------------------------------------------
# Missing fields and garbage


def test_missing_request_throughput_names_the_field():
    text = _drop_line(body("trtllm-bench_0.17.0_throughput_console.txt"), "Request Throughput (req/sec):")
    with pytest.raises(TrtllmParseError, match=r"request_throughput_rps.*Request Throughput \(req/sec\)"):
        parse_trtllm_bench_report(text)


def test_missing_output_throughput_names_the_field():
    text = _drop_line(body("trtllm-bench_0.12.0_throughput.txt"), "Token Throughput (tokens/sec):")
    with pytest.raises(TrtllmParseError, match="total_output_tps"):
        parse_trtllm_bench_report(text)


def test_unparseable_rate_is_missing_not_zero():
    text = body("trtllm-bench_0.16.0_throughput.txt").replace("Request Throughput (req/sec):\t0.7743",
                                                             "Request Throughput (req/sec):\tN/A")
    with pytest.raises(TrtllmParseError, match="request_throughput_rps"):
        parse_trtllm_bench_report(text)
    r = parse_trtllm_bench_report(text, required=("total_output_tps",))
    assert r.request_throughput_rps is None


def test_caller_can_require_more_fields():
    with pytest.raises(TrtllmParseError, match="ttft_ms"):
        parse_trtllm_bench_report(body("trtllm-bench_0.17.0_throughput_console.txt"), required=("ttft_ms",))
    r = parse_trtllm_bench_report(body("trtllm-bench_0.21.0rc0_throughput_streaming.txt"),
                                  required=("ttft_ms", "tpot_ms", "num_requests", "version"))
    assert r.tpot_ms == approx(7.3272)
    with pytest.raises(TrtllmParseError, match="unknown required field"):
        parse_trtllm_bench_report(body("trtllm-bench_0.21.0rc0_throughput_streaming.txt"), required=("nope",))


@pytest.mark.parametrize("garbage", [
    "",
    "\n\n",
    "Segmentation fault (core dumped)\n",
    "[TensorRT-LLM] TensorRT-LLM version: 0.17.0\n[01/18/2025-01:01:13] [TRT-LLM] [E] CUDA out of memory\n",
    '{"performance": {"request_throughput_req_s": 1.0}}',
    "===========================================================\n",
    "\x00\x01\x02 binary junk \xff",
])
def test_garbage_text_raises(garbage):
    with pytest.raises(TrtllmParseError):
        parse_trtllm_bench_report(garbage)


def test_non_text_raises():
    with pytest.raises(TrtllmParseError):
        parse_trtllm_bench_report(None)  # type: ignore[arg-type]


def test_truncated_report_raises():
    text = body("trtllm-bench_0.21.0rc0_throughput_streaming.txt")
    cut = text[: text.index("= PERFORMANCE OVERVIEW")]
    with pytest.raises(TrtllmParseError, match="request_throughput_rps"):
        parse_trtllm_bench_report(cut)


# --------------------------------------------------------------------------------------------
# --report_json: no real file is public; this dict is built here with the key names of
# ReportUtility.get_statistics_dict (tensorrt_llm/bench/dataclasses/reporting.py) and filled with
# the numbers of the real 0.21.0rc0 text report, so text and JSON parsing can be cross-checked.


def _json_like_streaming_fixture() -> dict:
    return {
        "engine": {"model": "meta-llama/Llama-3.1-8B-Instruct", "model_path": "None", "engine_dir": "None",
                   "version": "0.21.0rc0", "backend": "Pytorch", "dtype": "bfloat16",
                   "kv_cache_dtype": None, "quantization": None},
        "world_info": {"tp_size": 1, "pp_size": 1, "ep_size": None, "world_size": 1, "max_batch_size": 3840,
                       "max_num_tokens": 7680, "scheduling_policy": "GUARANTEED_NO_EVICT",
                       "kv_cache_percentage": 0.9, "issue_rate": 1.0526e15},
        "request_info": {"num_requests": 100, "avg_num_concurrent_requests": 94.6050,
                         "avg_input_length": 128.0, "avg_output_length": 128.0},
        "performance": {"total_latency_ms": 1155.5715, "avg_request_latency_ms": 1093.2284,
                        "request_throughput_req_s": 86.5373, "system_output_throughput_tok_s": 11076.7700,
                        "system_total_throughput_tok_s": 22153.5399,
                        "output_throughput_per_user_tok_s": 117.1544,
                        "output_throughput_per_gpu_tok_s": 11076.7700,
                        "request_latency_percentiles_ms": {"p50": 1091.7905, "p90": 1130.7200, "p95": 1133.0074,
                                                           "p99": 1137.6817, "minimum": 1050.1519,
                                                           "maximum": 1137.6817, "average": 1093.2284}},
        "streaming_metrics": {"token_output_speed_tok_s": 137.1475, "avg_ttft_ms": 162.6706, "avg_tpot_ms": 7.3272,
                              "tpot_percentiles": {"p50": 7.6079, "p90": 8.1246, "p95": 8.1289, "p99": 8.1306,
                                                   "minimum": 6.6450, "maximum": 8.1306, "average": 7.3272},
                              "ttft_percentiles": {"p50": 159.7857, "p90": 220.0530, "p95": 226.9148,
                                                   "p99": 232.4339, "minimum": 93.9210, "maximum": 232.4339,
                                                   "average": 162.6706},
                              "gen_tps_percentiles": {"p50": 131.4444, "p90": 150.4112, "p95": 150.4606,
                                                      "p99": 150.4894, "minimum": 122.9921, "maximum": 150.4894,
                                                      "average": 137.1475}},
        "dataset": {"num_requests": 100},
    }


def test_json_report_matches_text_report():
    text = parse_trtllm_bench_report(body("trtllm-bench_0.21.0rc0_throughput_streaming.txt"))
    obj = _json_like_streaming_fixture()
    for j in (parse_trtllm_bench_json(obj), parse_trtllm_bench_json(json.dumps(obj))):
        assert j.source_format == "json"
        for name in ("version", "model", "request_throughput_rps", "total_output_tps", "total_token_tps",
                     "per_user_output_tps", "per_user_output_speed_tps", "per_gpu_output_tps",
                     "total_latency_ms", "avg_request_latency_ms", "ttft_ms", "tpot_ms", "num_requests",
                     "avg_concurrent_requests", "avg_input_len", "avg_output_len", "max_runtime_batch_size",
                     "ttft_percentiles_ms", "tpot_percentiles_ms", "gen_tps_percentiles",
                     "request_latency_percentiles_ms"):
            assert getattr(j, name) == getattr(text, name), name
        assert phase_metrics(j) == phase_metrics(text)
        assert j.sections["world_info"]["scheduling_policy"] == "GUARANTEED_NO_EVICT"


def test_json_missing_and_garbage():
    obj = _json_like_streaming_fixture()
    del obj["performance"]["request_throughput_req_s"]
    with pytest.raises(TrtllmParseError, match="request_throughput_rps"):
        parse_trtllm_bench_json(obj)
    for bad in ("", "not json", "[1, 2]", "{}", '{"foo": 1}', b"\xff\xfe"):
        with pytest.raises(TrtllmParseError):
            parse_trtllm_bench_json(bad)


# --------------------------------------------------------------------------------------------
# [BENCHMARK] lines (gptSessionBenchmark / benchmarks/python/benchmark.py)


def test_gpt_session_readme_latency_only_lines():
    recs = parse_jetson_benchmark_lines(raw("gptSessionBenchmark_readme_expected.txt"))
    assert [(r.tool, r.batch_size, r.input_length, r.output_length, r.latency_ms) for r in recs] == [
        ("gptSessionBenchmark", 1, 60, 20, 40.81),
        ("gptSessionBenchmark", 1, 60, 20, 792.14),
    ]
    assert recs[0].tokens_per_sec is None and recs[0].generation_tokens_per_sec is None
    pm = phase_metrics(recs[0])
    assert pm.decode_tps is None and pm.prefill_tps is None and pm.as_metrics() == {}


def test_gpt_session_thirdparty_runs():
    recs = parse_jetson_benchmark_lines(raw("thirdparty_gptSessionBenchmark_runs.txt"))
    assert [(r.output_length, r.latency_ms, r.tokens_per_sec, r.gpu_peak_mem_gb) for r in recs] == [
        (20, 39.47, 506.69, 23.06),
        (100, 195.73, 510.92, 23.06),
        (20, 50.90, 392.91, 23.34),
    ]
    # tokensPerSec = batch * output_length / latency, as in gptSessionBenchmark.cpp
    for r in recs:
        assert r.tokens_per_sec == pytest.approx(r.batch_size * r.output_length / (r.latency_ms / 1000), rel=2e-3)


def test_python_benchmark_sm80_lines():
    recs = parse_jetson_benchmark_lines(raw("python_benchmark_readme_expected_sm80.txt"))
    assert [(r.batch_size, r.tokens_per_sec, r.latency_ms, r.gpu_peak_mem_gb) for r in recs] == [
        (1, 483.54, 41.362, 4.2), (8, 3477.28, 46.013, 4.28), (64, 19698.07, 64.981, 4.8)]
    r = recs[0]
    assert r.tool == "benchmark.py" and r.model_name == "gpt_350m" and r.compute_cap == "sm80"
    assert r.latency_p95_ms == 41.537 and r.latency_p99_ms == 42.102
    assert r.fields["build_time(s)"] == "25.67" and r.fields["num_kv_heads"] == "16"


def test_python_benchmark_generation_lines_and_phase_metrics():
    recs = parse_jetson_benchmark_lines(raw("python_benchmark_readme_expected_generation.txt"))
    assert [(r.batch_size, r.generation_time_ms, r.total_generated_tokens, r.generation_tokens_per_sec)
            for r in recs] == [(1, 110.189, 19.0, 172.43), (8, 98.194, 152.0, 1547.951),
                               (64, 111.078, 1216.0, 10947.303)]
    assert recs[0].quantization == "QuantMode.FP8_QDQ|FP8_KV_CACHE"
    assert recs[0].fields["build_time(s)"] == "None"
    # benchmark.py: generation_tokens_per_second = total_generated_tokens / generation_time
    for r in recs:
        assert r.generation_tokens_per_sec == pytest.approx(r.total_generated_tokens / (r.generation_time_ms / 1000),
                                                            rel=1e-3)
    pm = phase_metrics(recs[1])
    assert pm.decode_tps == approx(1547.951 / 8)
    assert pm.decode_source == "generation_tokens_per_sec/batch_size"
    assert pm.prefill_tps == approx(8 * 60 / ((108.214 - 98.194) / 1000))
    assert pm.single_stream is False
    assert phase_metrics(recs[0]).single_stream is True


def test_thirdparty_0_11_python_line_and_gpt_manager_lines():
    text = raw("thirdparty_0.11.0_python_benchmark_and_gptManagerBenchmark.txt")
    (rec,) = parse_jetson_benchmark_lines(text)
    assert (rec.model_name, rec.batch_size, rec.input_length, rec.output_length) == ("llama_7b", 64, 128, 128)
    assert rec.tokens_per_sec == 7373.14 and rec.generation_tokens_per_sec == 8271.238
    assert rec.gpu_peak_mem_gb == 20.546 and rec.compute_cap == "sm90"
    mgr = parse_gpt_manager_benchmark_lines(text)
    assert mgr["num_samples"] == 500 and mgr["num_error_samples"] == 0
    assert mgr["token_throughput(token/sec)"] == 2870.80
    assert mgr["seq_throughput(seq/sec)"] == 9.55
    assert mgr["p99_sequence_latency(ms)"] == 3108.04
    assert "batch_size" not in mgr


def test_benchmark_line_drift_reordered_and_prefixed():
    line = raw("python_benchmark_readme_expected_generation.txt").splitlines()[3]
    tag, rest = line.split(" ", 1)
    tokens = rest.split()
    pairs = list(zip(tokens[0::2], tokens[1::2]))[::-1]
    reordered = "[01/01/2025-00:00:00] [TRT-LLM] [I] " + tag + " " + " ".join(f"{k} {v}" for k, v in pairs)
    (a,) = parse_jetson_benchmark_lines(reordered)
    (b,) = parse_jetson_benchmark_lines(line)
    assert (a.batch_size, a.latency_ms, a.generation_tokens_per_sec) == (b.batch_size, b.latency_ms,
                                                                         b.generation_tokens_per_sec)


def test_gpt_session_oom_line_format():
    # the OOM line is built from gptSessionBenchmark.cpp's printf format
    # "[BENCHMARK] batch_size %d input_length %d output_length %d latency(ms) N/A tokensPerSec N/A\n"
    fmt = "[BENCHMARK] batch_size %d input_length %d output_length %d latency(ms) N/A tokensPerSec N/A"
    (rec,) = parse_jetson_benchmark_lines(fmt % (64, 128, 128))
    assert rec.oom and rec.latency_ms is None and rec.tokens_per_sec is None
    assert phase_metrics(rec).as_metrics() == {}


def test_benchmark_line_errors():
    with pytest.raises(TrtllmParseError, match="no result line"):
        parse_jetson_benchmark_lines("Benchmarking done. Iteration: 10, duration: 1.00 sec.\n")
    with pytest.raises(TrtllmParseError, match="no result line"):
        parse_jetson_benchmark_lines(raw("trtllm-bench_0.12.0_throughput.txt"))
    with pytest.raises(TrtllmParseError, match="input_length"):
        parse_jetson_benchmark_lines("[BENCHMARK] batch_size 1 output_length 20 latency(ms) 40.81")
    with pytest.raises(TrtllmParseError, match="odd number"):
        parse_jetson_benchmark_lines("[BENCHMARK] batch_size 1 input_length 60 output_length 20 latency(ms)")
    with pytest.raises(TrtllmParseError):
        parse_gpt_manager_benchmark_lines("nothing here")
    with pytest.raises(TrtllmParseError):
        parse_jetson_benchmark_lines(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", LINE_FIXTURES)
def test_every_line_fixture_parses(name):
    recs = parse_jetson_benchmark_lines(raw(name))
    assert recs and all(isinstance(r, JetsonBenchmarkRecord) for r in recs)
    for r in recs:
        assert r.latency_ms is not None and r.latency_ms > 0
        assert "[BENCHMARK]" in r.line


# --------------------------------------------------------------------------------------------
# README4Jetson reference tables


def test_jetson_reference_tables():
    rows = parse_jetson_reference_table(raw("jetson_v0.12.0-jetson_readme_reference_tables.txt"))
    assert all(isinstance(r, JetsonReferenceRow) for r in rows)
    assert [(r.config, r.input_length, r.output_length, r.context_ms, r.decode_tps) for r in rows] == [
        ("INT4 Default", 128, 128, 91.0, 35.9),
        ("INT4 Default", 512, 512, 260.0, 35.2),
        ("INT4 Default", 1024, 512, 582.0, 34.7),
        ("INT4 GPTQ", 128, 128, 105.0, 34.5),
        ("INT4 GPTQ", 512, 512, 292.0, 33.7),
        ("INT4 GPTQ", 1024, 512, 337.0, 33.3),
    ]
    pm = phase_metrics(rows[0])
    assert pm.as_metrics() == {"decode_tps": 35.9, "prefill_tps": approx(128 / 0.091)}
    with pytest.raises(TrtllmParseError):
        parse_jetson_reference_table("no table here\n")


# --------------------------------------------------------------------------------------------
# Phase metrics of trtllm-bench reports


def test_phase_metrics_latency_report_single_stream():
    pm = phase_metrics(parse_trtllm_bench_report(body("trtllm-bench_0.16.0_latency.txt")))
    assert pm.single_stream is True
    assert pm.decode_tps == approx(32.3338) and pm.decode_source == "generation_tps"
    assert pm.prefill_tps == approx(2048 / 0.1477502)
    assert pm.prefill_source == "avg_input_len/ttft_ms"
    assert any("TTFT" in c for c in pm.caveats)
    # 1000 / ITL agrees with the printed generation throughput of this batch-1 run
    assert 1000 / 30.9274 == pytest.approx(pm.decode_tps, rel=1e-3)


def test_phase_metrics_streaming_under_concurrency():
    pm = phase_metrics(parse_trtllm_bench_report(body("trtllm-bench_0.21.0rc0_throughput_streaming.txt")))
    assert pm.single_stream is False
    assert pm.decode_tps == approx(137.1475) and pm.decode_source == "per_user_output_speed_tps"
    assert pm.prefill_tps is None and pm.prefill_source is None
    assert pm.as_metrics() == {"decode_tps": approx(137.1475)}
    assert any("queueing" in c for c in pm.caveats)


def test_phase_metrics_tpot_fallback():
    text = _drop_line(body("trtllm-bench_0.21.0rc0_throughput_streaming.txt"), "Per User Output Speed (tps/user):")
    pm = phase_metrics(parse_trtllm_bench_report(text))
    assert pm.decode_tps == approx(1000 / 7.3272) and pm.decode_source == "1000/tpot_ms"


@pytest.mark.parametrize("name", [
    "trtllm-bench_0.12.0_throughput.txt",
    "trtllm-bench_0.16.0_throughput.txt",
    "trtllm-bench_0.17.0_throughput_console.txt",
    "trtllm-bench_0.17.0_throughput_pytorch.txt",
    "trtllm-bench_multimodal_throughput_pytorch.txt",
])
def test_phase_metrics_absent_without_streaming_figures(name):
    pm = phase_metrics(parse_trtllm_bench_report(body(name)))
    assert pm.decode_tps is None and pm.prefill_tps is None
    assert pm.as_metrics() == {}
    assert pm.caveats


def test_phase_metrics_never_zero_or_nan():
    for name in BENCH_REPORTS:
        for value in phase_metrics(parse_trtllm_bench_report(body(name))).as_metrics().values():
            assert value > 0 and math.isfinite(value)


def test_phase_metrics_rejects_other_types():
    with pytest.raises(TypeError):
        phase_metrics({"decode_tps": 1.0})  # type: ignore[arg-type]
    assert isinstance(parse_trtllm_bench_report(body(BENCH_REPORTS[0])), TrtllmBenchReport)
