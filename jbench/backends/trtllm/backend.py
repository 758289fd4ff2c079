"""TensorRT-LLM: engine build (trtllm-build, cached on the device) and benchmark runs.

Two variants:

* ``trtllm-bench`` (TensorRT-LLM 0.12 and later): a synthetic dataset for the trial's input/output
  lengths made on the device with ``benchmarks/cpp/prepare_dataset.py --stdout ... token-norm-dist``
  (as documented in docs/source/performance/perf-benchmarking.md), then
  ``trtllm-bench --model HF [--model_path DIR] latency|throughput --dataset F --engine_dir D ...``;
  its text report is read with trtllm_parse.parse_trtllm_bench_report.
* ``jetson-v0.12`` (the v0.12.0-jetson branch, README4Jetson.md): ``gptSessionBenchmark`` (C++) or
  ``benchmarks/python/benchmark.py`` with ``--batch_size B --input_output_len I,O``; their
  ``[BENCHMARK]`` lines are read with trtllm_parse.parse_jetson_benchmark_lines.

The engine comes from ``trtllm-build --checkpoint_dir CKPT --output_dir D --max_batch_size B
--max_input_len I --max_seq_len S [build_args]``, where CKPT is the TensorRT-LLM checkpoint that the
model config maps the trial's quant to (``model.files.<QUANT>``; convert_checkpoint.py / quantize.py
make it, outside jbench). Engines are cached on the device under backend.engine_cache_dir, one
directory per key (model, quant, checkpoint, max lengths, batch size, build args, TensorRT-LLM
version, device name) with a manifest ``jbench-engine.json`` written after a successful build; a
directory without a matching manifest is rebuilt.

Rates come from trtllm_parse.phase_metrics (definitions and caveats in docs/backends.md). TensorRT-LLM
reports rates, not per-repetition wall times: each run of the benchmark gives one sample per phase,
``samples_ns = tokens / rate``, and phases carry no device-clock window (no per-phase energy).
Everything runs as argument lists. The few fixed shell snippets (write stdin or a command's stdout to a
file, read the device name, `command -v`) contain no config value: paths and commands come in as "$@".

This module has not been run against a real TensorRT-LLM: it is tested with stand-in executables
that replay recorded public outputs (tests/fixtures/trtllm/).
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import re
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional, Union

from jbench.device.connection import CommandResult, CommandTimeout, Connection
from jbench.models.store import ModelError, resolve_model_file
from jbench.core.results import BackendResult, PhaseResult
from jbench.core.trial import Trial
from jbench.backends.base import Backend, BackendError, Capabilities, command_failure, device_model_path, timeout_failure
from jbench.backends.trtllm.parse import (
    JetsonBenchmarkRecord,
    PhaseMetrics,
    TrtllmParseError,
    parse_jetson_benchmark_lines,
    parse_trtllm_bench_report,
    phase_metrics,
)

VARIANTS = ("trtllm-bench", "jetson-v0.12")
MODES = ("latency", "throughput")
JETSON_PROGRAMS = ("gptSessionBenchmark", "benchmark.py")
# TensorRT-LLM quantization algorithms (QuantAlgo names; FP16/BF16 = no quantization). The checkpoint
# that model.files maps the quant to must have been made with that algorithm.
QUANTS = ("FP16", "BF16", "W8A16", "W4A16", "W4A16_AWQ", "W4A16_GPTQ", "W8A8_SQ_PER_CHANNEL", "W4A8_AWQ",
          "FP8", "NVFP4")
# Orin (sm87) has no FP8/FP4 tensor cores; README4Jetson.md documents int4 (W4A16) and int4_gptq (W4A16_GPTQ).
JETSON_QUANTS = ("FP16", "BF16", "W8A16", "W4A16", "W4A16_AWQ", "W4A16_GPTQ")
MANIFEST = "jbench-engine.json"
# Arguments jbench sets itself in trtllm-build's command line.
_BUILD_OWNED = ("--checkpoint_dir", "--output_dir", "--max_batch_size", "--max_input_len", "--max_seq_len")
_VERSION_CODE = "import tensorrt_llm; print(tensorrt_llm.__version__)"
# Fixed scripts (no config value is pasted into them; paths come in as "$1").
_WRITE_STDIN = 'cat > "$1.tmp" && mv "$1.tmp" "$1"'
_STDOUT_TO_FILE = 'out="$1"; shift; "$@" > "$out.tmp" && mv "$out.tmp" "$out"'
_DEVICE_NAME = ("if [ -r /proc/device-tree/model ]; then tr -d '\\000' < /proc/device-tree/model; "
                "elif command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi --query-gpu=name --format=csv,noheader "
                "| head -n 1; else uname -n; fi")


@dataclass
class TrtllmConfig:
    """TensorRT-LLM through trtllm-bench or the v0.12.0-jetson benchmark programs (docs/backends.md)."""

    name: str = field(default="trtllm", metadata={"identity": True})
    # trtllm-bench | jetson-v0.12
    variant: str = field(default="trtllm-bench", metadata={"identity": True})
    # trtllm-bench subcommand: latency (batch 1, TTFT/ITL) | throughput (needs streaming for decode_tps)
    mode: str = field(default="latency", metadata={"identity": True})
    # jetson-v0.12: gptSessionBenchmark | benchmark.py
    jetson_program: str = field(default="gptSessionBenchmark", metadata={"identity": True})
    n_prompt: int = field(default=128, metadata={"identity": True})  # input length (ISL)
    n_gen: int = field(default=128, metadata={"identity": True})  # output length (OSL)
    # Not supported (TensorRT-LLM benchmarks start from an empty KV cache): must stay 0.
    depth: int = field(default=0, metadata={"identity": True})
    # Separate runs of the benchmark; each gives one sample per phase.
    repetitions: int = field(default=1, metadata={"identity": True})
    # Warmup requests (trtllm-bench --warmup) or iterations (--warm_up of the Jetson programs).
    warmup: int = field(default=2, metadata={"identity": True})
    # Engine max batch size; the Jetson programs' --batch_size.
    batch_size: int = field(default=1, metadata={"identity": True})
    # Requests in the synthetic dataset (trtllm-bench).
    num_requests: int = field(default=64, metadata={"identity": True})
    # Iterations averaged into one [BENCHMARK] line (Jetson programs' --num_runs; --duration 0 is passed).
    num_runs: int = field(default=10, metadata={"identity": True})
    # trtllm-bench throughput only: --concurrency (None: not passed) and --streaming (TTFT/TPOT).
    concurrency: Optional[int] = field(default=1, metadata={"identity": True})
    streaming: bool = field(default=True, metadata={"identity": True})
    # trtllm-bench --model (Hugging Face name: tokenizer and reporting) and --model_path (a local HF directory).
    hf_model: Optional[str] = field(default=None, metadata={"identity": True})
    model_path: Optional[str] = field(default=None, metadata={"identity": False})
    # trtllm-bench --backend (None: not passed; newer releases default to pytorch, so engines need "tensorrt").
    bench_backend: Optional[str] = field(default=None, metadata={"identity": True})
    # A prebuilt engine directory (no build, no cache); None builds from the model's checkpoint.
    engine_dir: Optional[str] = field(default=None, metadata={"identity": False})
    engine_cache_dir: str = field(default="~/.cache/jbench/trtllm-engines", metadata={"identity": False})
    # None: n_prompt and n_prompt + n_gen of the trial.
    max_input_len: Optional[int] = field(default=None, metadata={"identity": True})
    max_seq_len: Optional[int] = field(default=None, metadata={"identity": True})
    # More trtllm-build arguments, e.g. [--gemm_plugin, float16] (part of the cache key).
    build_args: List[str] = field(default_factory=list, metadata={"identity": True})
    # None: read on the device (python -c "import tensorrt_llm; print(tensorrt_llm.__version__)").
    trtllm_version: Optional[str] = field(default=None, metadata={"identity": True})
    # None: read on the device (device-tree model, else nvidia-smi GPU name, else host name).
    device_name: Optional[str] = field(default=None, metadata={"identity": False})
    # Directory of trtllm-build / trtllm-bench on the device; None: the device's PATH.
    bin_dir: Optional[str] = field(default=None, metadata={"identity": False})
    python: str = field(default="python3", metadata={"identity": False})
    # benchmarks/cpp/prepare_dataset.py of the TensorRT-LLM checkout on the device (trtllm-bench without dataset).
    prepare_dataset: Optional[str] = field(default=None, metadata={"identity": False})
    # An existing dataset file on the device (skips prepare_dataset).
    dataset: Optional[str] = field(default=None, metadata={"identity": True})
    # jetson-v0.12: directory holding gptSessionBenchmark (cpp/build/benchmarks) or benchmark.py (benchmarks/python).
    benchmark_dir: Optional[str] = field(default=None, metadata={"identity": False})
    # benchmark.py -m (the engine's model name; "dec" for a prebuilt decoder engine).
    benchmark_model: str = field(default="dec", metadata={"identity": True})
    enable_cuda_graph: bool = field(default=True, metadata={"identity": True})
    # Appended to the benchmark command, one argv item each.
    extra_args: List[str] = field(default_factory=list, metadata={"identity": True})
    timeout_s: float = field(default=3600.0, metadata={"identity": False})
    build_timeout_s: float = field(default=7200.0, metadata={"identity": False})


# --------------------------------------------------------------------------------------------
# Pure helpers


def engine_cache_key(*, model: str, quant: str, checkpoint: Optional[str], max_input_len: int, max_seq_len: int,
                     max_batch_size: int, version: str, device: str, build_args: List[str]) -> tuple[str, dict]:
    """(key, the fields it hashes): SHA-256 of the canonical JSON of everything that makes the engine."""
    fields_ = {"model": model, "quant": quant, "checkpoint": checkpoint, "max_input_len": int(max_input_len),
               "max_seq_len": int(max_seq_len), "max_batch_size": int(max_batch_size), "trtllm_version": version,
               "device": device, "build_args": [str(a) for a in build_args]}
    canonical = json.dumps(fields_, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16], fields_


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "x"


def max_lengths(cfg: TrtllmConfig) -> tuple[int, int]:
    return (cfg.max_input_len or cfg.n_prompt, cfg.max_seq_len or cfg.n_prompt + cfg.n_gen)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _strip_version(text: str) -> str:
    """The version from python -c output (the import may print '[TensorRT-LLM] TensorRT-LLM version: X' first)."""
    last = _last_line(text)
    m = re.search(r"version:\s*(\S+)", last)
    return m.group(1) if m else last


# --------------------------------------------------------------------------------------------
# The backend


class TrtllmBackend(Backend[TrtllmConfig]):
    NAME = "trtllm"
    CONFIG = TrtllmConfig
    CAPABILITIES = Capabilities(
        quants=frozenset(QUANTS),
        # KV-cache precision is fixed in the checkpoint/engine; jbench does not set it.
        kv_types=frozenset({"f16"}),
        flash_attention=False,
        context_depth=False,
        latency_scenario=False,
        extra={"variants": VARIANTS, "jetson_quants": JETSON_QUANTS, "energy_windows": False},
    )

    def __init__(self, config: Union[TrtllmConfig, Mapping[str, Any]]):
        super().__init__(config)
        self._facts: dict[str, tuple[str, str]] = {}  # device name -> (trtllm version, device name)

    # ---- paths

    def _bin(self, name: str) -> str:
        d = self.config.bin_dir
        return posixpath.join(d, name) if d else name

    def _program(self) -> list[str]:
        cfg = self.config
        d = cfg.benchmark_dir or ""
        if cfg.jetson_program == "benchmark.py":
            return [cfg.python, posixpath.join(d, "benchmark.py")]
        return [posixpath.join(d, "gptSessionBenchmark")]

    # ---- validate / preflight

    def validate(self, trial: Trial) -> list[str]:
        cfg, model = self.config_of(trial), trial.cfg.model
        p: list[str] = []
        for key, value, valid in (("variant", cfg.variant, VARIANTS), ("mode", cfg.mode, MODES),
                                  ("jetson_program", cfg.jetson_program, JETSON_PROGRAMS)):
            if value not in valid:
                p.append(f"backend.{key} '{value}' is not valid. Valid: {', '.join(valid)}")
        for key, count in (("n_prompt", cfg.n_prompt), ("n_gen", cfg.n_gen), ("repetitions", cfg.repetitions),
                           ("batch_size", cfg.batch_size), ("num_requests", cfg.num_requests),
                           ("num_runs", cfg.num_runs)):
            if count < 1:
                p.append(f"backend.{key} must be >= 1 (got {count})")
        if cfg.warmup < 0:
            p.append(f"backend.warmup must be >= 0 (got {cfg.warmup})")
        if cfg.depth != 0:
            p.append(f"backend.depth={cfg.depth}: the trtllm backend does not support context depth (its "
                     f"benchmarks start from an empty KV cache); set backend.depth=0")
        for key, seconds in (("timeout_s", cfg.timeout_s), ("build_timeout_s", cfg.build_timeout_s)):
            if seconds <= 0:
                p.append(f"backend.{key} must be > 0 (got {seconds})")
        quant = str(model.quant)
        valid_quants = JETSON_QUANTS if cfg.variant == "jetson-v0.12" else QUANTS
        if quant not in valid_quants:
            extra = (" (Orin has no FP8/FP4 support)" if cfg.variant == "jetson-v0.12" and quant in QUANTS else "")
            p.append(f"model.quant '{quant}' is not a TensorRT-LLM quantization the {cfg.variant} variant supports"
                     f"{extra}. Valid: {', '.join(valid_quants)}")
        if cfg.variant == "trtllm-bench":
            if not cfg.hf_model:
                p.append("backend.hf_model is not set: trtllm-bench needs --model (the Hugging Face model name, used "
                         "for the tokenizer and the report)")
            if not cfg.dataset and not cfg.prepare_dataset:
                p.append("backend.prepare_dataset is not set: give the path of TensorRT-LLM's "
                         "benchmarks/cpp/prepare_dataset.py on the device, or an existing backend.dataset")
            if cfg.mode == "throughput":
                if not cfg.streaming:
                    p.append("backend.mode=throughput without backend.streaming: the report then has no "
                             "generation-phase rate (TPOT), so decode_tps cannot be measured; set backend.streaming=true "
                             "or backend.mode=latency")
                if cfg.concurrency is not None and cfg.concurrency < 1:
                    p.append(f"backend.concurrency must be >= 1 or null (got {cfg.concurrency})")
                elif cfg.concurrency and not cfg.engine_dir and cfg.concurrency > cfg.batch_size:
                    p.append(f"backend.concurrency={cfg.concurrency} exceeds the engine's max batch size "
                             f"(backend.batch_size={cfg.batch_size}): raise backend.batch_size")
        else:
            if not cfg.benchmark_dir:
                p.append("backend.benchmark_dir is not set: the directory of gptSessionBenchmark (cpp/build/benchmarks) "
                         "or benchmark.py (benchmarks/python) on the device")
            if cfg.mode != "latency":
                p.append("backend.mode applies to trtllm-bench only; the jetson-v0.12 programs run static batches "
                         "(leave backend.mode=latency)")
        if not cfg.engine_dir:
            max_in, max_seq = max_lengths(cfg)
            if cfg.n_prompt > max_in or cfg.n_prompt + cfg.n_gen > max_seq:
                p.append(f"the trial (n_prompt={cfg.n_prompt}, n_gen={cfg.n_gen}) does not fit the engine's "
                         f"max_input_len={max_in} / max_seq_len={max_seq}")
            owned = [a for a in cfg.build_args if str(a).split("=")[0] in _BUILD_OWNED]
            if owned:
                p.append(f"backend.build_args sets {', '.join(owned)}, which jbench sets itself "
                         f"({', '.join(_BUILD_OWNED)}): use backend.batch_size / max_input_len / max_seq_len")
            if quant in valid_quants:
                try:
                    resolve_model_file(model)
                except ModelError as exc:
                    p.append(f"{exc} (for trtllm the file is the TensorRT-LLM checkpoint directory of that quant)")
        return p

    def _exists_or_on_path(self, conn: Connection, path: str) -> bool:
        if "/" in path:
            return conn.exists(conn.expand_path(path))
        res = conn.run(["sh", "-c", 'command -v "$1"', "sh", path], timeout=30)
        return res.returncode == 0 and bool(res.stdout.strip())

    def reads_model_file(self, trial: Trial) -> bool:
        # A prebuilt engine (backend.engine_dir) is run as it is: the checkpoint is not read.
        return not self.config_of(trial).engine_dir

    def preflight(self, conn: Connection) -> list[str]:
        cfg = self.config
        needed: list[tuple[str, str]] = []
        if not cfg.engine_dir:
            needed.append((self._bin("trtllm-build"), "backend.bin_dir"))
        if cfg.variant == "trtllm-bench":
            needed.append((self._bin("trtllm-bench"), "backend.bin_dir"))
            if not cfg.dataset and cfg.prepare_dataset:
                needed.append((cfg.prepare_dataset, "backend.prepare_dataset"))
        elif cfg.benchmark_dir:
            needed.append((self._program()[-1], "backend.benchmark_dir"))
        problems = []
        for path, key in needed:
            if not self._exists_or_on_path(conn, path):
                problems.append(f"{path} not found on device '{conn.name}': TensorRT-LLM is not installed there, "
                                f"or fix {key}")
        if cfg.engine_dir and not conn.exists(conn.expand_path(cfg.engine_dir)):
            problems.append(f"engine directory {cfg.engine_dir} not found on device '{conn.name}': fix backend.engine_dir")
        return problems

    # ---- device facts

    def build_id(self, conn: Connection) -> Optional[str]:
        """The TensorRT-LLM version on the device (configured or read there)."""
        try:
            return "tensorrt_llm " + self.device_facts(conn)[0]
        except BackendError:
            return None

    def device_facts(self, conn: Connection) -> tuple[str, str]:
        """(TensorRT-LLM version, device name), configured or read on the device (once per connection)."""
        if conn.name in self._facts:
            return self._facts[conn.name]
        cfg = self.config
        version = cfg.trtllm_version
        if not version:
            res = self._run(conn, [cfg.python, "-c", _VERSION_CODE], 300, "reading the TensorRT-LLM version",
                            limit_key=None)
            if res.returncode != 0 or not _last_line(res.stdout):
                raise BackendError("missing_binary",
                                   f"cannot import tensorrt_llm with {cfg.python} on device '{conn.name}' (set "
                                   f"backend.python, or backend.trtllm_version): {_last_line(res.stderr)}",
                                   res.stdout, res.stderr)
            version = _strip_version(res.stdout)
        device = cfg.device_name
        if not device:
            res = self._run(conn, ["sh", "-c", _DEVICE_NAME], 60, "reading the device name", limit_key=None)
            device = _last_line(res.stdout) or conn.name
        self._facts[conn.name] = (version, device)
        return version, device

    def _run(self, conn: Connection, argv: list[str], timeout: float, what: str, *,
             stdin: Optional[str] = None, limit_key: Optional[str] = "backend.timeout_s",
             shown: Optional[list[str]] = None) -> CommandResult:
        """conn.run; past its limit a `timeout` naming the command (shown: the one inside a shell wrapper) and
        the setting of the limit (None: a limit of jbench's own)."""
        try:
            return conn.run(argv, timeout=timeout, stdin=stdin)
        except CommandTimeout:
            raise timeout_failure(what, shown or argv, timeout, limit_key) from None

    # ---- engine

    def build_command(self, checkpoint: str, output_dir: str, cfg: TrtllmConfig) -> list[str]:
        max_in, max_seq = max_lengths(cfg)
        return [self._bin("trtllm-build"), "--checkpoint_dir", checkpoint, "--output_dir", output_dir,
                "--max_batch_size", str(cfg.batch_size), "--max_input_len", str(max_in),
                "--max_seq_len", str(max_seq), *[str(a) for a in cfg.build_args]]

    def prepare_engine(self, trial: Trial, conn: Connection, log: logging.Logger) -> tuple[str, str, dict]:
        """(engine directory, 'prebuilt' | 'cached' | 'built', manifest): builds only when no engine with the
        same key is cached on the device."""
        cfg, model = self.config_of(trial), trial.cfg.model
        if cfg.engine_dir:
            path = conn.expand_path(cfg.engine_dir)
            if not conn.exists(path):
                raise BackendError("missing_model", f"engine directory {path} not found on device '{conn.name}'")
            return path, "prebuilt", {}
        checkpoint = device_model_path(trial, conn, "TensorRT-LLM checkpoint")
        version, device = self.device_facts(conn)
        max_in, max_seq = max_lengths(cfg)
        key, key_fields = engine_cache_key(model=model.name, quant=str(model.quant), checkpoint=checkpoint,
                                           max_input_len=max_in, max_seq_len=max_seq,
                                           max_batch_size=cfg.batch_size, version=version, device=device,
                                           build_args=cfg.build_args)
        root = conn.expand_path(cfg.engine_cache_dir)
        engine_dir = posixpath.join(root, f"{_safe(model.name)}-{_safe(str(model.quant))}-{key}")
        manifest_path = posixpath.join(engine_dir, MANIFEST)
        if conn.exists(manifest_path):
            res = self._run(conn, ["cat", manifest_path], 60, "reading the engine manifest", limit_key=None)
            try:
                manifest = json.loads(res.stdout)
            except ValueError:
                manifest = {}
            if manifest.get("key") == key:
                log.info("TensorRT-LLM engine cached: %s (key %s)", engine_dir, key)
                return engine_dir, "cached", manifest
            log.info("engine manifest %s does not match key %s: rebuilding", manifest_path, key)
        argv = self.build_command(checkpoint, engine_dir, cfg)
        self._run(conn, ["mkdir", "-p", engine_dir], 60, "creating the engine directory", limit_key=None)
        log.info("building TensorRT-LLM engine: %s", shlex.join(argv))
        started = time.monotonic()
        res = self._run(conn, argv, cfg.build_timeout_s, "trtllm-build", limit_key="backend.build_timeout_s")
        if res.returncode != 0:
            raise command_failure("trtllm-build", res, check_stdout=True)
        manifest = {"key": key, "fields": key_fields, "command": argv, "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "build_s": round(time.monotonic() - started, 3), "jbench": "trtllm backend"}
        res = self._run(conn, ["sh", "-c", _WRITE_STDIN, "sh", manifest_path], 60, "writing the engine manifest",
                        stdin=json.dumps(manifest, indent=2, sort_keys=True), limit_key=None)
        if res.returncode != 0:
            raise BackendError("backend_crash", f"cannot write {manifest_path} on device '{conn.name}': "
                               f"{_last_line(res.stderr)}", res.stdout, res.stderr)
        log.info("engine built in %.1f s: %s", manifest["build_s"], engine_dir)
        return engine_dir, "built", manifest

    # ---- dataset (trtllm-bench)

    def dataset_command(self, cfg: TrtllmConfig) -> list[str]:
        """prepare_dataset.py's synthetic generator for exactly n_prompt input and n_gen output tokens."""
        tokenizer = cfg.model_path or cfg.hf_model
        return [cfg.python, cfg.prepare_dataset, "--stdout", "--tokenizer", str(tokenizer), "token-norm-dist",
                "--input-mean", str(cfg.n_prompt), "--output-mean", str(cfg.n_gen), "--input-stdev", "0",
                "--output-stdev", "0", "--num-requests", str(cfg.num_requests)]

    def prepare_dataset(self, trial: Trial, conn: Connection, log: logging.Logger) -> str:
        cfg = self.config_of(trial)
        if cfg.dataset:
            path = conn.expand_path(cfg.dataset)
            if not conn.exists(path):
                raise BackendError("missing_model", f"dataset {path} not found on device '{conn.name}'")
            return path
        tok = cfg.model_path or cfg.hf_model
        tag = hashlib.sha256(str(tok).encode()).hexdigest()[:8]
        root = posixpath.join(conn.expand_path(cfg.engine_cache_dir), "datasets")
        path = posixpath.join(root, f"synthetic_{cfg.n_prompt}_{cfg.n_gen}_{cfg.num_requests}_{tag}.jsonl")
        if conn.exists(path):
            log.info("dataset cached: %s", path)
            return path
        self._run(conn, ["mkdir", "-p", root], 60, "creating the dataset directory", limit_key=None)
        argv = self.dataset_command(cfg)
        log.info("preparing dataset: %s > %s", shlex.join(argv), path)
        res = self._run(conn, ["sh", "-c", _STDOUT_TO_FILE, "sh", path, *argv], cfg.timeout_s, "prepare_dataset.py",
                        shown=argv)
        if res.returncode != 0:
            raise BackendError("backend_crash", f"prepare_dataset.py exited with code {res.returncode}: "
                               f"{_last_line(res.stderr)}", res.stdout, res.stderr)
        return path

    # ---- benchmark

    def bench_command(self, cfg: TrtllmConfig, engine_dir: str, dataset: Optional[str]) -> list[str]:
        """The benchmark's argument list for one run."""
        if cfg.variant == "trtllm-bench":
            argv = [self._bin("trtllm-bench"), "--model", str(cfg.hf_model)]
            if cfg.model_path:
                argv += ["--model_path", cfg.model_path]
            argv += [cfg.mode, "--dataset", str(dataset), "--engine_dir", engine_dir,
                     "--num_requests", str(cfg.num_requests), "--warmup", str(cfg.warmup)]
            if cfg.bench_backend:
                argv += ["--backend", cfg.bench_backend]
            if cfg.mode == "throughput":
                if cfg.concurrency is not None:
                    argv += ["--concurrency", str(cfg.concurrency)]
                if cfg.streaming:
                    argv.append("--streaming")
        else:
            argv = self._program()
            if cfg.jetson_program == "benchmark.py":
                argv += ["-m", cfg.benchmark_model]
            argv += ["--engine_dir", engine_dir, "--batch_size", str(cfg.batch_size),
                     "--input_output_len", f"{cfg.n_prompt},{cfg.n_gen}", "--warm_up", str(cfg.warmup),
                     "--num_runs", str(cfg.num_runs), "--duration", "0"]
            if cfg.enable_cuda_graph:
                argv.append("--enable_cuda_graph")
        return argv + [str(a) for a in cfg.extra_args]

    def _parse(self, cfg: TrtllmConfig, stdout: str, stderr: str) -> tuple[PhaseMetrics, dict[str, Any]]:
        """Phase metrics of one run's output, and facts for info; BackendError when there is no decode rate."""
        facts: dict[str, Any] = {}
        try:
            if cfg.variant == "trtllm-bench":
                report = parse_trtllm_bench_report(stdout, required=())
                for name, value, want in (("input", report.avg_input_len, cfg.n_prompt),
                                          ("output", report.avg_output_len, cfg.n_gen)):
                    if value is not None and abs(value - want) > 0.5:
                        raise BackendError(
                            "unparseable_output",
                            f"trtllm-bench report's average {name} length is {value:g} tokens, the trial asked for "
                            f"{want}: the dataset does not match the trial (backend.dataset?)", stdout, stderr)
                pm = phase_metrics(report)
                facts.update(trtllm_version_reported=report.version, trtllm_report_backend=report.backend)
            else:
                records = parse_jetson_benchmark_lines(stdout)
                rec = _matching_record(records, cfg)
                if rec is None:
                    got = "; ".join(f"batch_size {r.batch_size} input {r.input_length} output {r.output_length}"
                                    for r in records)
                    raise BackendError(
                        "unparseable_output",
                        f"no [BENCHMARK] line for batch_size {cfg.batch_size} input_length {cfg.n_prompt} "
                        f"output_length {cfg.n_gen} (got: {got})", stdout, stderr)
                if rec.oom:
                    raise BackendError("out_of_memory", f"{rec.tool} ran out of memory (latency N/A): {rec.line}",
                                       stdout, stderr)
                pm = phase_metrics(rec)
                facts.update(benchmark_tool=rec.tool, gpu_peak_mem_gb=rec.gpu_peak_mem_gb)
        except TrtllmParseError as exc:
            raise BackendError("unparseable_output", f"unparseable TensorRT-LLM output: {exc}", stdout, stderr) from None
        if pm.decode_tps is None or not pm.decode_tps > 0:
            raise BackendError("unparseable_output",
                               "TensorRT-LLM output has no decode rate: " + "; ".join(pm.caveats), stdout, stderr)
        return pm, facts

    def run(self, trial: Trial, conn: Connection, log: logging.Logger, *, only_phase: Optional[str] = None,
            repetitions: Optional[int] = None) -> BackendResult:
        cfg = self.config_of(trial)
        engine_dir, cache_state, manifest = self.prepare_engine(trial, conn, log)
        dataset = self.prepare_dataset(trial, conn, log) if cfg.variant == "trtllm-bench" else None
        argv = self.bench_command(cfg, engine_dir, dataset)
        reps = repetitions or cfg.repetitions
        outputs: list[str] = []
        errors: list[str] = []
        samples: dict[str, list[int]] = {"prefill": [], "decode": []}
        last: Optional[PhaseMetrics] = None
        facts: dict[str, Any] = {}
        for i in range(reps):
            log.info("running (%d/%d): %s", i + 1, reps, shlex.join(argv))
            res = self._run(conn, argv, cfg.timeout_s, argv[0])
            outputs.append(f"# jbench: run {i + 1}/{reps}: {shlex.join(argv)}\n{res.stdout}")
            errors.append(res.stderr)
            raw, raw_err = "\n".join(outputs), "\n".join(errors)
            if res.returncode != 0:
                tool = posixpath.basename(argv[1] if argv[0] == cfg.python and len(argv) > 1 else argv[0])
                raise command_failure(tool, res, raw, raw_err, check_stdout=True)
            try:
                pm, facts = self._parse(cfg, res.stdout, res.stderr)
            except BackendError as exc:
                exc.raw_output, exc.raw_stderr = raw, raw_err
                raise
            # TensorRT-LLM reports rates: one sample per run, the time that rate gives the trial's tokens.
            samples["decode"].append(max(1, round(cfg.n_gen * 1e9 / pm.decode_tps)))
            if pm.prefill_tps:
                samples["prefill"].append(max(1, round(cfg.n_prompt * 1e9 / pm.prefill_tps)))
            last = pm
        assert last is not None
        phases: dict[str, PhaseResult] = {}
        for phase, n in (("prefill", cfg.n_prompt), ("decode", cfg.n_gen)):
            if only_phase and phase != only_phase:
                continue
            if samples[phase] and len(samples[phase]) == reps:
                phases[phase] = PhaseResult(phase=phase, n_tokens=n, samples_ns=samples[phase], depth=0, end_time=None)
        version, device = self._facts.get(conn.name, (cfg.trtllm_version, cfg.device_name))
        info: dict[str, Any] = {
            "trtllm_variant": cfg.variant, "engine_dir": engine_dir, "engine_cache": cache_state,
            "trtllm_decode_source": last.decode_source, "trtllm_prefill_source": last.prefill_source,
            "trtllm_single_stream": last.single_stream, "trtllm_caveats": list(last.caveats),
            **{k: v for k, v in facts.items() if v is not None},
        }
        if "prefill" not in phases and (not only_phase or only_phase == "prefill"):
            info["trtllm_prefill_absent"] = next((c for c in last.caveats if c.startswith("prefill_tps absent")),
                                                 "no prefill figure in the output")
            log.warning("prefill not measured: %s", info["trtllm_prefill_absent"])
        for caveat in last.caveats:
            log.info("caveat: %s", caveat)
        build = {k: v for k, v in (("trtllm_version", version), ("trtllm_device", device),
                                   ("engine_key", manifest.get("key"))) if v}
        return BackendResult(phases=phases, raw_output="\n".join(outputs), raw_stderr="\n".join(errors), build=build,
                             info=info, command=argv)


def _matching_record(records: List[JetsonBenchmarkRecord], cfg: TrtllmConfig) -> Optional[JetsonBenchmarkRecord]:
    for rec in records:
        if (rec.batch_size, rec.input_length, rec.output_length) == (cfg.batch_size, cfg.n_prompt, cfg.n_gen):
            return rec
    return None


__all__ = ["TrtllmBackend", "TrtllmConfig", "engine_cache_key", "max_lengths", "QUANTS", "JETSON_QUANTS", "VARIANTS",
           "MODES", "JETSON_PROGRAMS", "MANIFEST"]
