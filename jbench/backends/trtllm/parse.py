"""TensorRT-LLM benchmark output parsing (pure functions, no device, no TensorRT-LLM import).

Three kinds of output are read:

* the text report of ``trtllm-bench throughput`` / ``trtllm-bench latency``
  (:func:`parse_trtllm_bench_report`): sections introduced by a banner of three lines
  (``=====`` / ``= TITLE`` / ``=====``) holding ``Label: value`` lines;
* the ``--report_json`` file of ``trtllm-bench`` (:func:`parse_trtllm_bench_json`);
* the ``[BENCHMARK] key value key value ...`` lines of the benchmark programs used on the
  Jetson branch v0.12.0-jetson, ``benchmarks/cpp/gptSessionBenchmark`` and
  ``benchmarks/python/benchmark.py`` (:func:`parse_jetson_benchmark_lines`), the one-pair lines
  of ``gptManagerBenchmark`` (:func:`parse_gpt_manager_benchmark_lines`), and the reference
  tables of ``README4Jetson.md`` (:func:`parse_jetson_reference_table`).

Layout drift (seen in the public outputs kept under ``tests/data/trtllm/``):

* 0.12: sections ENGINE DETAILS, WORLD + RUNTIME INFORMATION, STATISTICS; ``Token Throughput
  (tokens/sec)``, ``Total Latency (seconds)``.
* 0.16/0.17: STATISTICS became PERFORMANCE OVERVIEW, ``Total Latency (ms)``; the separator may be
  tabs; the PyTorch flow titles its first section ``PyTorch backend``. The 0.16 *latency* report has
  GENERAL / THROUGHPUT / LATENCY OVERVIEW, GENERATION LATENCY BREAKDOWN and ACCEPTANCE BREAKDOWN.
* 0.19+ (PyTorch flow): REQUEST DETAILS, ``Total Output Throughput``, ``Total Token Throughput`` now
  meaning input + output tokens, per-user and per-GPU throughput, ``[Latency] P50 : x`` lines; with
  ``--streaming``: TTFT/TPOT averages and ``[TTFT]``/``[TPOT]``/``[GTPS]`` percentile lines.
  Labels keep changing (``Per User Output Throughput (tokens/sec/user)`` then ``... [w/ ctx]
  (tps/user)``; ``Per User Output Speed [1/TPOT] (tokens/sec/user)`` or ``(tps/user)``;
  ``TensorRT-LLM Version`` then ``TensorRT LLM Version``), and newer releases add a MACHINE DETAILS
  section whose body is not ``Label: value``.

Labels are therefore matched by (whitespace- and case-normalised) name, never by position, and
every ``Label: value`` line is kept in :attr:`TrtllmBenchReport.sections`. A value that is absent
or unparseable is ``None``; it is never replaced by 0.

``Total Token Throughput (tokens/sec)`` changed meaning: in the 0.16 latency report it is output
tokens / total time (100 x 2048 / 6345.6 s = 32.27, as printed), from 0.19 on it is (input + output)
tokens / total time (22153.54 = 2 x 11076.77 at ISL = OSL = 128). The parser takes output throughput
from ``Total Output Throughput`` when the report has it, else from ``Token Throughput`` (0.12-0.17),
else (0.16 latency layout, which has no other output-rate line) from ``Total Token Throughput``.

Phase metrics (:func:`phase_metrics`) map a report onto jbench's ``decode_tps`` / ``prefill_tps``;
their exact definitions are in that function's docstring.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

__all__ = [
    "TrtllmParseError",
    "TrtllmBenchReport",
    "JetsonBenchmarkRecord",
    "JetsonReferenceRow",
    "PhaseMetrics",
    "parse_trtllm_bench_report",
    "parse_trtllm_bench_json",
    "parse_jetson_benchmark_lines",
    "parse_gpt_manager_benchmark_lines",
    "parse_jetson_reference_table",
    "phase_metrics",
    "DEFAULT_REQUIRED",
]


class TrtllmParseError(ValueError):
    """Output that cannot be read as the expected TensorRT-LLM benchmark output.

    The message names the missing or malformed field (and the label it is printed under)."""


# --------------------------------------------------------------------------------------------
# Small value helpers

_NONE_WORDS = {"", "none", "n/a", "na", "nan", "null", "-"}


def _num(value: Any) -> Optional[float]:
    """A finite float from a printed value ('128.0000', '5.0689E+14', '90.00%', '1.00'), else None."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        out = float(value)
    else:
        text = str(value).strip()
        if text.lower() in _NONE_WORDS:
            return None
        token = text.split()[0].rstrip("%").replace(",", "")
        try:
            out = float(token)
        except ValueError:
            return None
    return out if math.isfinite(out) else None


def _int(value: Any) -> Optional[int]:
    out = _num(value)
    if out is None or out != int(out):
        return None
    return int(out)


def _norm_label(label: str) -> str:
    return " ".join(label.replace("\t", " ").split()).lower()


_STAT_NAMES = {
    "minimum": "min", "min": "min",
    "maximum": "max", "max": "max",
    "average": "avg", "avg": "avg", "mean": "avg",
}


def _norm_stat(name: str) -> str:
    key = name.strip().lower()
    key = re.sub(r"\s*\(.*\)$", "", key)  # 'MIN (ms)' -> 'min'
    return _STAT_NAMES.get(key, key)


# --------------------------------------------------------------------------------------------
# trtllm-bench text report

_RULE = re.compile(r"^\s*={10,}\s*$")
# logger lines interleaved with the report, e.g. '[01/18/2025-01:01:42] [TRT-LLM] [I] ...'
_LOG_LINE = re.compile(r"^\[\d{2}/\d{2}/\d{4}-\d{2}:\d{2}:\d{2}\]|^\[TensorRT-LLM\]")
_VERSION_LOG = re.compile(r"\[TensorRT-LLM\]\s*TensorRT[- ]LLM version:\s*(\S+)", re.IGNORECASE)
_KV = re.compile(r"^(?P<key>[^:]+?)\s*:\s*(?P<value>.*)$")
_PCT_KEY = re.compile(r"^\[(?P<tag>[A-Za-z]+)\]\s+(?P<stat>[A-Za-z0-9]+)$")

# field -> accepted labels (normalised), first match wins
_LABELS: dict[str, tuple[str, ...]] = {
    "version": ("tensorrt-llm version", "tensorrt llm version"),
    "model": ("model",),
    "model_path": ("model path",),
    "engine_dir": ("engine directory",),
    "request_throughput_rps": ("request throughput (req/sec)",),
    "total_output_throughput": ("total output throughput (tokens/sec)",),
    "token_throughput": ("token throughput (tokens/sec)",),
    "total_token_throughput": ("total token throughput (tokens/sec)",),
    "per_user_output_tps": (
        "per user output throughput [w/ ctx] (tps/user)",
        "per user output throughput (tokens/sec/user)",
    ),
    "per_user_output_speed_tps": (
        "per user output speed [1/tpot] (tokens/sec/user)",
        "per user output speed (tps/user)",
    ),
    "per_gpu_output_tps": ("per gpu output throughput (tps/gpu)", "per gpu output throughput (tokens/sec/gpu)"),
    "generation_tps": ("generation token throughput (tokens/sec)",),
    "total_latency_ms": ("total latency (ms)",),
    "total_latency_s": ("total latency (seconds)",),
    "avg_request_latency_ms": ("average request latency (ms)",),
    "ttft_ms": ("average time-to-first-token [ttft] (ms)", "average time-to-first-token (ms)"),
    "tpot_ms": ("average time-per-output-token [tpot] (ms)",),
    "itl_ms": ("average inter-token latency (ms)",),
    "acceptance_rate": ("acceptance rate (speculative)",),
    "num_requests": ("number of requests",),
    "avg_concurrent_requests": ("number of concurrent requests",),
    "avg_input_len": ("average input length (tokens)",),
    "avg_output_len": ("average output length (tokens)",),
    "max_runtime_batch_size": ("max runtime batch size",),
    "max_runtime_tokens": ("max runtime tokens",),
}

# how a missing required field is named in the error message (the label(s) it is printed under)
_FIELD_LABELS = {
    "request_throughput_rps": "'Request Throughput (req/sec)'",
    "total_output_tps": "'Total Output Throughput (tokens/sec)' or 'Token Throughput (tokens/sec)'",
    "ttft_ms": "'Average time-to-first-token [TTFT] (ms)'",
    "tpot_ms": "'Average time-per-output-token [TPOT] (ms)'",
    "num_requests": "'Number of requests'",
    "avg_input_len": "'Average Input Length (tokens)'",
    "avg_output_len": "'Average Output Length (tokens)'",
    "version": "'TensorRT-LLM Version'",
    "model": "'Model'",
}

DEFAULT_REQUIRED: tuple[str, ...] = ("request_throughput_rps", "total_output_tps")


@dataclass(frozen=True)
class TrtllmBenchReport:
    """One trtllm-bench report. Rates are per second, times in ms; None = not printed.

    ``total_output_tps``: output (generated) tokens / total benchmark time, all requests.
    ``total_token_tps``: (input + output) tokens / total time; only set where the report defines it
    so (0.19+ layout, next to ``Total Output Throughput``).
    ``per_user_output_tps``: per-request output tokens / per-request end-to-end latency, averaged
    over requests (``Per User Output Throughput [w/ ctx]``): it includes the TTFT (queueing + prefill).
    ``per_user_output_speed_tps``: per-request generation-phase speed (``Per User Output Speed``,
    ``[1/TPOT]``), TTFT excluded; printed only with ``--streaming``.
    ``generation_tps``: ``Generation Token Throughput`` of the 0.16 latency report (mean over requests
    of the generation-phase token rate).
    """

    version: Optional[str]
    model: Optional[str]
    # text: title of the engine/backend section ('ENGINE DETAILS', 'PyTorch backend', 'PYTORCH BACKEND');
    # json: engine.backend ('TRT', 'Pytorch')
    backend: Optional[str]
    engine: dict[str, str]  # that section's raw 'Label: value' pairs
    world: dict[str, str]  # WORLD + RUNTIME INFORMATION, raw
    request_throughput_rps: Optional[float]
    total_output_tps: Optional[float]
    total_token_tps: Optional[float] = None
    per_user_output_tps: Optional[float] = None
    per_user_output_speed_tps: Optional[float] = None
    per_gpu_output_tps: Optional[float] = None
    generation_tps: Optional[float] = None
    total_latency_ms: Optional[float] = None
    avg_request_latency_ms: Optional[float] = None
    ttft_ms: Optional[float] = None
    tpot_ms: Optional[float] = None
    itl_ms: Optional[float] = None
    acceptance_rate: Optional[float] = None
    num_requests: Optional[int] = None
    avg_concurrent_requests: Optional[float] = None
    avg_input_len: Optional[float] = None
    avg_output_len: Optional[float] = None
    max_runtime_batch_size: Optional[int] = None
    ttft_percentiles_ms: dict[str, float] = field(default_factory=dict)  # keys: min max avg p50 p90 p95 p99
    tpot_percentiles_ms: dict[str, float] = field(default_factory=dict)
    gen_tps_percentiles: dict[str, float] = field(default_factory=dict)  # [GTPS], tokens/s per user
    request_latency_percentiles_ms: dict[str, float] = field(default_factory=dict)  # [Latency]
    generation_latency_percentiles_ms: dict[str, float] = field(default_factory=dict)  # 0.16 latency report
    sections: dict[str, dict[str, str]] = field(default_factory=dict)  # every 'Label: value' by section
    unparsed_lines: dict[str, list[str]] = field(default_factory=dict)  # other non-blank lines by section
    source_format: str = "text"  # 'text' or 'json'


def _split_sections(text: str) -> tuple[dict[str, dict[str, str]], dict[str, list[str]]]:
    lines = text.splitlines()
    sections: dict[str, dict[str, str]] = {}
    unparsed: dict[str, list[str]] = {}
    current: Optional[str] = None
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        if _RULE.match(line):
            # banner: rule, title, rule. A rule not followed by a title closes the section.
            if i + 2 < n and lines[i + 1].strip() and not _RULE.match(lines[i + 1]) and _RULE.match(lines[i + 2]):
                title = lines[i + 1].strip().lstrip("=").strip() or "UNTITLED"
                name, k = title, 2
                while name in sections:
                    name, k = f"{title} #{k}", k + 1
                sections[name], unparsed[name] = {}, []
                current = name
                i += 3
                continue
            current = None
            i += 1
            continue
        stripped = line.strip()
        i += 1
        if current is None or not stripped or _LOG_LINE.match(stripped):
            continue
        m = _KV.match(stripped)
        if m and m.group("key").strip():
            key, value = m.group("key").strip(), m.group("value").strip()
            name, k = key, 2
            while name in sections[current]:
                name, k = f"{key} #{k}", k + 1
            sections[current][name] = value
        else:
            unparsed[current].append(stripped)
    return sections, unparsed


def _section_items(sections: Mapping[str, Mapping[str, str]]) -> list[tuple[str, str, str]]:
    return [(sec, _norm_label(key), value) for sec, kv in sections.items() for key, value in kv.items()]


def _lookup(items: Sequence[tuple[str, str, str]], labels: Iterable[str]) -> Optional[str]:
    wanted = tuple(labels)
    for label in wanted:  # label priority first, then document order
        for _sec, key, value in items:
            if key == label:
                return value
    return None


def _percentiles(sections: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for kv in sections.values():
        for key, value in kv.items():
            m = _PCT_KEY.match(key)
            num = _num(value)
            if m and num is not None:
                out.setdefault(m.group("tag").lower(), {}).setdefault(_norm_stat(m.group("stat")), num)
    return out


def _check_required(report_values: Mapping[str, Any], required: Sequence[str], what: str) -> None:
    for name in required:
        if name not in report_values:
            raise TrtllmParseError(f"{what}: unknown required field {name!r}")
        if report_values[name] is None:
            label = _FIELD_LABELS.get(name, repr(name))
            raise TrtllmParseError(f"{what}: missing {name} (printed as {label})")


def parse_trtllm_bench_report(text: str, required: Sequence[str] = DEFAULT_REQUIRED) -> TrtllmBenchReport:
    """Parse the text report that ``trtllm-bench throughput`` / ``latency`` prints at the end of a run.

    ``text`` may be the whole console output: log lines and anything outside the banner-delimited
    sections are ignored (the ``[TensorRT-LLM] TensorRT-LLM version: X`` log line is used as the
    version when the report itself prints none). ``required`` names fields that must be present
    (default: request throughput and output-token throughput); a missing one raises
    :class:`TrtllmParseError` naming the field and its label. Text with no report section at all
    raises too.
    """
    if not isinstance(text, str):
        raise TrtllmParseError(f"trtllm-bench report: expected text, got {type(text).__name__}")
    sections, unparsed = _split_sections(text)
    if not sections:
        raise TrtllmParseError("trtllm-bench report: no report section ('=====' / '= TITLE' / '=====') found")
    items = _section_items(sections)

    def get(name: str) -> Optional[str]:
        return _lookup(items, _LABELS[name])

    labels_present = {key for _s, key, _v in items}
    titles = {_norm_label(t) for t in sections}

    # output-token throughput, by layout (see module docstring)
    total_token_tps: Optional[float] = None
    if "total output throughput (tokens/sec)" in labels_present:
        total_output = _num(get("total_output_throughput"))
        total_token_tps = _num(get("total_token_throughput"))
    elif "token throughput (tokens/sec)" in labels_present:
        total_output = _num(get("token_throughput"))
    elif "throughput overview" in titles:  # 0.16 latency layout: 'Total Token Throughput' = output tokens
        total_output = _num(get("total_token_throughput"))
    else:
        total_output = None

    total_latency_ms = _num(get("total_latency_ms"))
    if total_latency_ms is None:
        seconds = _num(get("total_latency_s"))
        total_latency_ms = seconds * 1000.0 if seconds is not None else None

    backend_title = next(
        (t for t in sections if "ENGINE DETAILS" in t.upper() or "BACKEND" in t.upper()), None
    )
    engine = dict(sections[backend_title]) if backend_title else {}
    world_title = next((t for t in sections if "WORLD" in t.upper()), None)
    world = dict(sections[world_title]) if world_title else {}

    version = get("version")
    if version is None:
        m = _VERSION_LOG.search(text)
        version = m.group(1) if m else None
    model = _lookup(_section_items({backend_title: engine}), _LABELS["model"]) if backend_title else None

    pct = _percentiles(sections)
    gen_lat: dict[str, float] = {}
    for title, kv in sections.items():
        if "GENERATION LATENCY BREAKDOWN" in title.upper():
            for key, value in kv.items():
                num = _num(value)
                if num is not None:
                    gen_lat.setdefault(_norm_stat(key), num)

    ttft = _num(get("ttft_ms"))
    if ttft is None:
        ttft = pct.get("ttft", {}).get("avg")
    tpot = _num(get("tpot_ms"))
    if tpot is None:
        tpot = pct.get("tpot", {}).get("avg")

    values: dict[str, Any] = dict(
        version=version,
        model=model,
        backend=backend_title,
        engine=engine,
        world=world,
        request_throughput_rps=_num(get("request_throughput_rps")),
        total_output_tps=total_output,
        total_token_tps=total_token_tps,
        per_user_output_tps=_num(get("per_user_output_tps")),
        per_user_output_speed_tps=_num(get("per_user_output_speed_tps")),
        per_gpu_output_tps=_num(get("per_gpu_output_tps")),
        generation_tps=_num(get("generation_tps")),
        total_latency_ms=total_latency_ms,
        avg_request_latency_ms=_num(get("avg_request_latency_ms")),
        ttft_ms=ttft,
        tpot_ms=tpot,
        itl_ms=_num(get("itl_ms")),
        acceptance_rate=_num(get("acceptance_rate")),
        num_requests=_int(get("num_requests")),
        avg_concurrent_requests=_num(get("avg_concurrent_requests")),
        avg_input_len=_num(get("avg_input_len")),
        avg_output_len=_num(get("avg_output_len")),
        max_runtime_batch_size=_int(get("max_runtime_batch_size")),
        ttft_percentiles_ms=pct.get("ttft", {}),
        tpot_percentiles_ms=pct.get("tpot", {}),
        gen_tps_percentiles=pct.get("gtps", {}),
        request_latency_percentiles_ms=pct.get("latency", {}),
        generation_latency_percentiles_ms=gen_lat,
        sections=sections,
        unparsed_lines=unparsed,
        source_format="text",
    )
    _check_required(values, required, "trtllm-bench report")
    return TrtllmBenchReport(**values)


# --------------------------------------------------------------------------------------------
# trtllm-bench --report_json


def _pct_dict(obj: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            num = _num(value)
            if num is not None:
                out.setdefault(_norm_stat(str(key)), num)
    return out


def _flat_str(obj: Any) -> dict[str, str]:
    if not isinstance(obj, Mapping):
        return {}
    return {str(k): ("" if v is None else str(v)) for k, v in obj.items() if not isinstance(v, (Mapping, list))}


def parse_trtllm_bench_json(obj_or_text: Union[str, bytes, Mapping[str, Any]],
                            required: Sequence[str] = DEFAULT_REQUIRED) -> TrtllmBenchReport:
    """Parse the ``--report_json`` file of trtllm-bench (a dict, or its JSON text).

    No real report file was found in public material; the key names follow
    ``ReportUtility.get_statistics_dict`` in ``tensorrt_llm/bench/dataclasses/reporting.py``
    (NVIDIA/TensorRT-LLM, 0.2x-1.x): top-level ``engine``, ``world_info``, ``request_info``,
    ``performance``, optional ``streaming_metrics`` and ``decoding_stats``, ``dataset``. Keys are read
    by name; missing ones give None; ``required`` as for :func:`parse_trtllm_bench_report`.
    """
    if isinstance(obj_or_text, (str, bytes)):
        try:
            obj = json.loads(obj_or_text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TrtllmParseError(f"trtllm-bench JSON report: not JSON ({exc})") from None
    else:
        obj = obj_or_text
    if not isinstance(obj, Mapping):
        raise TrtllmParseError(f"trtllm-bench JSON report: expected an object, got {type(obj).__name__}")
    known = ("engine", "world_info", "request_info", "performance", "streaming_metrics")
    if not any(isinstance(obj.get(k), Mapping) for k in known):
        raise TrtllmParseError(f"trtllm-bench JSON report: none of the sections {', '.join(known)} found")

    def sec(name: str) -> Mapping[str, Any]:
        value = obj.get(name)
        return value if isinstance(value, Mapping) else {}

    engine, world, req, perf, stream = (sec(k) for k in known)
    version = engine.get("version")
    values: dict[str, Any] = dict(
        version=None if version is None else str(version),
        model=None if engine.get("model") is None else str(engine.get("model")),
        backend=None if engine.get("backend") is None else str(engine.get("backend")),
        engine=_flat_str(engine),
        world=_flat_str(world),
        request_throughput_rps=_num(perf.get("request_throughput_req_s")),
        total_output_tps=_num(perf.get("system_output_throughput_tok_s")),
        total_token_tps=_num(perf.get("system_total_throughput_tok_s")),
        per_user_output_tps=_num(perf.get("output_throughput_per_user_tok_s")),
        per_user_output_speed_tps=_num(stream.get("token_output_speed_tok_s")),
        per_gpu_output_tps=_num(perf.get("output_throughput_per_gpu_tok_s")),
        generation_tps=None,
        total_latency_ms=_num(perf.get("total_latency_ms")),
        avg_request_latency_ms=_num(perf.get("avg_request_latency_ms")),
        ttft_ms=_num(stream.get("avg_ttft_ms")),
        tpot_ms=_num(stream.get("avg_tpot_ms")),
        itl_ms=None,
        acceptance_rate=None,
        num_requests=_int(req.get("num_requests")),
        avg_concurrent_requests=_num(req.get("avg_num_concurrent_requests")),
        avg_input_len=_num(req.get("avg_input_length")),
        avg_output_len=_num(req.get("avg_output_length")),
        max_runtime_batch_size=_int(world.get("max_batch_size")),
        ttft_percentiles_ms=_pct_dict(stream.get("ttft_percentiles")),
        tpot_percentiles_ms=_pct_dict(stream.get("tpot_percentiles")),
        gen_tps_percentiles=_pct_dict(stream.get("gen_tps_percentiles")),
        request_latency_percentiles_ms=_pct_dict(perf.get("request_latency_percentiles_ms")),
        generation_latency_percentiles_ms={},
        sections={str(k): _flat_str(v) for k, v in obj.items() if isinstance(v, Mapping)},
        unparsed_lines={},
        source_format="json",
    )
    _check_required(values, required, "trtllm-bench JSON report")
    return TrtllmBenchReport(**values)


# --------------------------------------------------------------------------------------------
# [BENCHMARK] lines of gptSessionBenchmark / benchmarks/python/benchmark.py (v0.12.0-jetson era)

_BENCH_TAG = "[BENCHMARK]"

# printed key -> canonical field (both programs and their versions)
_BENCH_KEYS = {
    "batch_size": "batch_size",
    "input_length": "input_length",
    "output_length": "output_length",
    "latency(ms)": "latency_ms",
    "tokensPerSec": "tokens_per_sec",
    "tokens_per_sec": "tokens_per_sec",
    "generation_time(ms)": "generation_time_ms",
    "generationTokensPerSec": "generation_tokens_per_sec",
    "generation_tokens_per_second": "generation_tokens_per_sec",
    "total_generated_tokens": "total_generated_tokens",
    "gpu_peak_mem(gb)": "gpu_peak_mem_gb",
    "percentile95(ms)": "latency_p95_ms",
    "percentile99(ms)": "latency_p99_ms",
}


@dataclass(frozen=True)
class JetsonBenchmarkRecord:
    """One ``[BENCHMARK]`` result line of gptSessionBenchmark or benchmarks/python/benchmark.py.

    Definitions, from the programs' source:
    gptSessionBenchmark (benchmarks/cpp/gptSessionBenchmark.cpp, 0.10-0.12):
      ``latency(ms)`` = mean wall time of one ``session.generate`` (context + generation) over the runs;
      ``tokensPerSec`` = batch_size * output_length / latency;
      ``generation_time(ms)`` = mean generation-phase time (GenerationProfiler);
      ``generationTokensPerSec`` = batch_size * output_length / generation_time (counts all
      output_length tokens, including the first one, which the context phase produced);
      ``gpu_peak_mem(gb)`` = peak device memory in GB (1e9 bytes). ``latency(ms) N/A tokensPerSec N/A``
      is printed after an out-of-memory error (``oom`` = True).
    benchmarks/python/benchmark.py: ``tokens_per_sec`` = batch_size * output_length / latency;
      ``total_generated_tokens`` = tokens generated after the first (19.0 for batch 1, output 20);
      ``generation_tokens_per_second`` = total_generated_tokens / generation_time.
    """

    tool: str  # 'gptSessionBenchmark' or 'benchmark.py' (the latter prints model_name)
    batch_size: int
    input_length: int
    output_length: int
    latency_ms: Optional[float]
    tokens_per_sec: Optional[float] = None
    generation_time_ms: Optional[float] = None
    generation_tokens_per_sec: Optional[float] = None
    total_generated_tokens: Optional[float] = None
    gpu_peak_mem_gb: Optional[float] = None
    latency_p95_ms: Optional[float] = None
    latency_p99_ms: Optional[float] = None
    model_name: Optional[str] = None
    precision: Optional[str] = None
    quantization: Optional[str] = None
    compute_cap: Optional[str] = None
    oom: bool = False
    fields: dict[str, str] = field(default_factory=dict)  # every printed key -> value
    line: str = ""


def _bench_pairs(line: str) -> Optional[list[str]]:
    idx = line.find(_BENCH_TAG)
    if idx < 0:
        return None
    return line[idx + len(_BENCH_TAG):].split()


def parse_jetson_benchmark_lines(text: str) -> list[JetsonBenchmarkRecord]:
    """Records from the ``[BENCHMARK] batch_size B input_length I output_length O ...`` lines.

    Lines are found anywhere in ``text`` (log lines, comment prefixes and the one-pair lines of
    gptManagerBenchmark are skipped). Values are read by key, so added or reordered keys are fine.
    A ``[BENCHMARK]`` line with ``batch_size`` but no ``input_length`` / ``output_length``, or with
    an odd number of tokens, raises :class:`TrtllmParseError`; so does text with no record at all.
    """
    if not isinstance(text, str):
        raise TrtllmParseError(f"[BENCHMARK] lines: expected text, got {type(text).__name__}")
    records: list[JetsonBenchmarkRecord] = []
    for raw in text.splitlines():
        tokens = _bench_pairs(raw)
        if tokens is None or "batch_size" not in tokens[0::2]:
            continue
        line = raw.strip()
        if len(tokens) % 2:
            raise TrtllmParseError(f"[BENCHMARK] line: odd number of key/value tokens: {line!r}")
        fields_: dict[str, str] = {}
        for key, value in zip(tokens[0::2], tokens[1::2]):
            fields_.setdefault(key, value)
        canon: dict[str, str] = {}
        for key, value in fields_.items():
            name = _BENCH_KEYS.get(key)
            if name is not None:
                canon.setdefault(name, value)
        ints = {}
        for name in ("batch_size", "input_length", "output_length"):
            ints[name] = _int(canon.get(name))
            if ints[name] is None:
                raise TrtllmParseError(f"[BENCHMARK] line: missing {name}: {line!r}")
        latency_raw = canon.get("latency_ms")
        records.append(JetsonBenchmarkRecord(
            tool="benchmark.py" if "model_name" in fields_ else "gptSessionBenchmark",
            batch_size=ints["batch_size"],
            input_length=ints["input_length"],
            output_length=ints["output_length"],
            latency_ms=_num(latency_raw),
            tokens_per_sec=_num(canon.get("tokens_per_sec")),
            generation_time_ms=_num(canon.get("generation_time_ms")),
            generation_tokens_per_sec=_num(canon.get("generation_tokens_per_sec")),
            total_generated_tokens=_num(canon.get("total_generated_tokens")),
            gpu_peak_mem_gb=_num(canon.get("gpu_peak_mem_gb")),
            latency_p95_ms=_num(canon.get("latency_p95_ms")),
            latency_p99_ms=_num(canon.get("latency_p99_ms")),
            model_name=fields_.get("model_name"),
            precision=fields_.get("precision"),
            quantization=fields_.get("quantization"),
            compute_cap=fields_.get("compute_cap"),
            oom=latency_raw is not None and latency_raw.strip().upper() == "N/A",
            fields=fields_,
            line=line,
        ))
    if not records:
        raise TrtllmParseError("[BENCHMARK] lines: no result line with batch_size/input_length/output_length found")
    return records


def parse_gpt_manager_benchmark_lines(text: str) -> dict[str, Union[float, str]]:
    """The one-pair ``[BENCHMARK] key value`` summary lines of gptManagerBenchmark, as a dict.

    Numeric values become floats; the first occurrence of a key wins (gptManagerBenchmark prints
    ``num_samples`` twice). Raises :class:`TrtllmParseError` when there is none.
    """
    out: dict[str, Union[float, str]] = {}
    for raw in text.splitlines() if isinstance(text, str) else ():
        tokens = _bench_pairs(raw)
        if tokens is None or len(tokens) != 2:
            continue
        key, value = tokens
        num = _num(value)
        out.setdefault(key, num if num is not None else value)
    if not out:
        raise TrtllmParseError("gptManagerBenchmark: no '[BENCHMARK] key value' line found")
    return out


@dataclass(frozen=True)
class JetsonReferenceRow:
    """One row of the reference tables in README4Jetson.md (v0.12.0-jetson).

    ``context_ms`` is the table's 'Context (ms)', ``decode_tps`` its 'Decode (token/s)'."""

    config: Optional[str]  # the '## ' heading above the table, e.g. 'INT4 GPTQ'
    batch_size: int
    input_length: int
    output_length: int
    context_ms: float
    decode_tps: float


_TABLE_COLUMNS = {
    "batch size": "batch_size",
    "input length": "input_length",
    "output length": "output_length",
    "context (ms)": "context_ms",
    "decode (token/s)": "decode_tps",
}


def parse_jetson_reference_table(text: str) -> list[JetsonReferenceRow]:
    """Rows of the markdown tables of README4Jetson.md, columns matched by header name."""
    rows: list[JetsonReferenceRow] = []
    config: Optional[str] = None
    columns: Optional[list[Optional[str]]] = None
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("## "):
            config, columns = line[3:].strip(), None
            continue
        if not line.startswith("|"):
            columns = None if not line else columns
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        names = [_TABLE_COLUMNS.get(_norm_label(c)) for c in cells]
        if "batch_size" in names:
            columns = names
            continue
        if columns is None or all(set(c) <= set(":- ") for c in cells):
            continue
        values = {name: cell for name, cell in zip(columns, cells) if name}
        missing = [n for n in _TABLE_COLUMNS.values() if _num(values.get(n)) is None]
        if missing:
            raise TrtllmParseError(f"README4Jetson table row: missing {', '.join(missing)}: {line!r}")
        rows.append(JetsonReferenceRow(
            config=config,
            batch_size=int(_num(values["batch_size"])),
            input_length=int(_num(values["input_length"])),
            output_length=int(_num(values["output_length"])),
            context_ms=float(_num(values["context_ms"])),
            decode_tps=float(_num(values["decode_tps"])),
        ))
    if not rows:
        raise TrtllmParseError("README4Jetson table: no table with a 'Batch Size' column found")
    return rows


# --------------------------------------------------------------------------------------------
# Mapping onto jbench's phase metrics


@dataclass(frozen=True)
class PhaseMetrics:
    """decode_tps / prefill_tps derived from one TensorRT-LLM result, with where each came from.

    A value that the output does not support is None (never 0); ``caveats`` says why, and what
    the numbers include. ``single_stream`` is True when one request was in flight at a time
    (batch size 1, or trtllm-bench's average concurrency <= 1.05), False when more were, None when
    the output does not say.
    """

    decode_tps: Optional[float]
    decode_source: Optional[str]
    prefill_tps: Optional[float]
    prefill_source: Optional[str]
    single_stream: Optional[bool]
    caveats: tuple[str, ...] = ()

    def as_metrics(self) -> dict[str, float]:
        """Only the metrics that exist, named as in docs/metrics.md."""
        out = {}
        if self.decode_tps is not None:
            out["decode_tps"] = self.decode_tps
        if self.prefill_tps is not None:
            out["prefill_tps"] = self.prefill_tps
        return out


_TTFT_CAVEAT = (
    "prefill_tps is a proxy: avg input tokens / avg TTFT; trtllm-bench's TTFT runs from request "
    "submission to the first output token, so it includes queueing, scheduling and the first "
    "decode step, not only the prefill; it understates prefill speed"
)


def _single_stream(report: TrtllmBenchReport) -> Optional[bool]:
    if report.avg_concurrent_requests is not None:
        return report.avg_concurrent_requests <= 1.05
    if report.max_runtime_batch_size is not None:
        return True if report.max_runtime_batch_size == 1 else None
    return None


def _report_phase(report: TrtllmBenchReport) -> PhaseMetrics:
    caveats: list[str] = []
    single = _single_stream(report)
    decode, decode_src = None, None
    if report.per_user_output_speed_tps is not None:
        decode, decode_src = report.per_user_output_speed_tps, "per_user_output_speed_tps"
    elif report.tpot_ms:
        decode, decode_src = 1000.0 / report.tpot_ms, "1000/tpot_ms"
    elif report.generation_tps is not None and single:
        decode, decode_src = report.generation_tps, "generation_tps"
    elif report.itl_ms:
        decode, decode_src = 1000.0 / report.itl_ms, "1000/itl_ms"
    if decode is None:
        caveats.append(
            "decode_tps absent: the report has no generation-phase rate (TPOT, ITL or per-user output "
            "speed; they need --streaming or the latency subcommand); 'Per User Output Throughput' "
            "and 'Total Output Throughput' include TTFT/queueing and are not used"
        )
    elif not single:
        caveats.append(
            "decode_tps is the per-request generation speed while other requests shared the batch "
            f"(single_stream={single}); it is not a one-user decode rate"
        )
    if decode_src == "1000/tpot_ms":
        caveats.append("decode_tps = 1000 / mean TPOT, which is <= the mean of per-request speeds")

    prefill, prefill_src = None, None
    if report.ttft_ms and report.avg_input_len:
        if single:
            prefill = report.avg_input_len / (report.ttft_ms / 1000.0)
            prefill_src = "avg_input_len/ttft_ms"
            caveats.append(_TTFT_CAVEAT)
        else:
            caveats.append(
                "prefill_tps absent: TTFT was measured with several requests in flight "
                f"(single_stream={single}), so it is dominated by queueing, not prefill"
            )
    elif not report.ttft_ms:
        caveats.append("prefill_tps absent: the report has no TTFT (needs --streaming or the latency subcommand)")
    else:
        caveats.append("prefill_tps absent: the report has no average input length")
    return PhaseMetrics(decode, decode_src, prefill, prefill_src, single, tuple(caveats))


def _record_phase(rec: JetsonBenchmarkRecord) -> PhaseMetrics:
    caveats: list[str] = []
    single = rec.batch_size == 1
    decode, decode_src = None, None
    if rec.generation_tokens_per_sec is not None and rec.batch_size > 0:
        decode = rec.generation_tokens_per_sec / rec.batch_size
        decode_src = "generation_tokens_per_sec/batch_size"
        if rec.tool == "gptSessionBenchmark":
            caveats.append(
                "gptSessionBenchmark counts all output_length tokens over the generation time, "
                "including the token made by the context phase: decode_tps is high by up to "
                "output_length/(output_length-1)"
            )
    else:
        caveats.append(
            "decode_tps absent: the line has no generation time; tokensPerSec/tokens_per_sec "
            "include the context phase"
        )
    prefill, prefill_src = None, None
    if rec.latency_ms is not None and rec.generation_time_ms is not None and rec.latency_ms > rec.generation_time_ms:
        context_ms = rec.latency_ms - rec.generation_time_ms
        prefill = rec.batch_size * rec.input_length / (context_ms / 1000.0)
        prefill_src = "batch_size*input_length/(latency_ms-generation_time_ms)"
        caveats.append(
            "prefill_tps: the context time is latency - generation time, so it carries the run's setup overhead"
        )
    else:
        caveats.append("prefill_tps absent: the line has no latency/generation time split")
    if rec.oom:
        caveats.append("the run ran out of memory (latency N/A)")
    return PhaseMetrics(decode, decode_src, prefill, prefill_src, single, tuple(caveats))


def _row_phase(row: JetsonReferenceRow) -> PhaseMetrics:
    prefill = row.batch_size * row.input_length / (row.context_ms / 1000.0) if row.context_ms > 0 else None
    return PhaseMetrics(
        decode_tps=row.decode_tps / row.batch_size if row.batch_size else None,
        decode_source="decode_tps/batch_size",
        prefill_tps=prefill,
        prefill_source="batch_size*input_length/context_ms" if prefill is not None else None,
        single_stream=row.batch_size == 1,
        caveats=("reference numbers published by NVIDIA, not measured by jbench",),
    )


def phase_metrics(result: Union[TrtllmBenchReport, JetsonBenchmarkRecord, JetsonReferenceRow]) -> PhaseMetrics:
    """Map one result onto jbench's ``decode_tps`` and ``prefill_tps`` (tokens/s, see docs/metrics.md).

    trtllm-bench report (:class:`TrtllmBenchReport`):

    * ``decode_tps`` (generation speed of one request), first available of:
      1. ``per_user_output_speed_tps`` (``Per User Output Speed [1/TPOT]``; mean over requests of
         generation-phase tokens/s, TTFT excluded);
      2. ``1000 / tpot_ms`` (mean time per output token after the first);
      3. ``generation_tps`` of the 0.16 latency report (batch size 1 only);
      4. ``1000 / itl_ms`` (mean inter-token latency, 0.16 latency report).
      ``Per User Output Throughput`` ([w/ ctx]) and total output throughput are never used: they
      include TTFT and queueing. Under concurrency > 1 the value is a per-user speed in a shared
      batch (a caveat says so), not a one-user decode rate.
    * ``prefill_tps`` (proxy) = ``avg_input_len / (ttft_ms / 1000)``, only when ``single_stream`` is
      True. TTFT is measured from request submission to the first token, so it includes queueing,
      scheduling and the first decode step: the proxy understates prefill speed; with several
      requests in flight TTFT is mostly queueing, so no prefill figure is given then.

    gptSessionBenchmark / benchmark.py line (:class:`JetsonBenchmarkRecord`):

    * ``decode_tps`` = ``generation_tokens_per_sec / batch_size`` (per-sequence generation speed,
      as printed by the tool; see the record's docstring for what the tools count);
    * ``prefill_tps`` = ``batch_size * input_length / ((latency_ms - generation_time_ms) / 1000)``
      (all prompt tokens of the batch over the context-phase time).

    README4Jetson reference row (:class:`JetsonReferenceRow`): ``decode_tps`` = 'Decode (token/s)' /
    batch size; ``prefill_tps`` = batch size * input length / 'Context (ms)'.
    """
    if isinstance(result, TrtllmBenchReport):
        return _report_phase(result)
    if isinstance(result, JetsonBenchmarkRecord):
        return _record_phase(result)
    if isinstance(result, JetsonReferenceRow):
        return _row_phase(result)
    raise TypeError(f"phase_metrics: unsupported result type {type(result).__name__}")
