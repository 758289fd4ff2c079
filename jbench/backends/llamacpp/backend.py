"""llama.cpp through llama-bench (scenario "bench") or llama-server (scenario "latency", see server.py and client.py).

One llama-bench invocation per trial runs a prompt-processing test (-p, no generation) and a
generation test (-n, no prompt) as separate tests, each with warmup and -r repetitions, and
prints one JSON record per test (-o jsonl). Records are read by field name: the schema drifts
between llama.cpp builds (fields appear, flash_attn changed from bool to int, use_mmap became
load_mode), so nothing depends on field order or on fields jbench does not use.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from jbench.analysis.memory import parse_buffers
from jbench.analysis.settle import settle_phase
from jbench.device.connection import CommandTimeout, Connection
from jbench.device.rusage import peak_rss_argv, split_peak_rss
from jbench.device.telemetry.samplers import stamped
from jbench.models.store import ModelError, check_quant, resolve_model_file
from jbench.core.schema import bounded
from jbench.core.trial import Trial
from jbench.core.results import BackendResult
from jbench.backends.llamacpp import client, quality, server, serving
from jbench.core.quality import QualityOutcome, QualityRequest
from jbench.backends.llamacpp.bench import ParseError, parse_output, start_stamp
from jbench.backends.base import (Backend, BackendError, Capabilities, MemoryPass, command_failure, device_model_path,
                                  size_problems, timeout_failure)

BINARIES = ("llama-bench", "llama-quantize", "llama-server", "llama-perplexity", "llama-tokenize")
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# "auto" omits -fa (each build's own default); on/off as 1/0, which old and new builds accept.
FLASH_ATTN = {"auto": None, "on": "1", "off": "0"}
# llama-server spells it -fa on|off|auto; "auto" omits the flag.
SERVER_FLASH_ATTN = {"auto": None, "on": "on", "off": "off"}
SCENARIOS = ("bench", "latency", "serving")


@dataclass
class LlamaCppConfig:
    """llama.cpp driven through llama-bench (one invocation per trial, -o jsonl)."""

    name: str = field(default="llamacpp", metadata={"identity": True})
    # Directory holding llama-bench (and llama-quantize, llama-server). None: `jbench setup`'s build.
    binary_dir: Optional[str] = field(default=None, metadata={"identity": False})
    n_prompt: int = field(default=128, metadata={"identity": True})
    n_gen: int = field(default=64, metadata={"identity": True})
    depth: int = field(default=0, metadata={"identity": True})
    repetitions: int = field(default=3, metadata={"identity": "bench"})
    warmup: bool = field(default=True, metadata={"identity": "bench"})
    # Timed repetitions run before the measured ones, in the same context, and set aside while their rate has not
    # settled (jbench.analysis.settle): on a GPU the first repetition of a context runs at a third to a half of the
    # settled prefill rate after llama-bench's own warm-up. The bound of that detection; 0 turns it off.
    settle_repetitions: int = field(default=1, metadata={"identity": "bench", **bounded(0)})
    # Layers offloaded to the GPU; -1 (llama.cpp's own spelling) or more than the model has: all of them.
    n_gpu_layers: int = field(default=99, metadata={"identity": True, **bounded(-1, note="-1 offloads all layers")})
    # None: llama-bench's own default (the number of physical cores it detects).
    threads: Optional[int] = field(default=None, metadata={"identity": True})
    n_batch: Optional[int] = field(default=None, metadata={"identity": True})
    n_ubatch: Optional[int] = field(default=None, metadata={"identity": True})
    cache_type_k: str = field(default="f16", metadata={"identity": True})
    cache_type_v: str = field(default="f16", metadata={"identity": True})
    # "auto" lets llama.cpp decide; on/off force it.
    flash_attn: str = field(default="auto", metadata={"identity": True})
    # Extra llama-bench arguments, passed as separate argv items (never through a shell).
    extra_args: List[str] = field(default_factory=list, metadata={"identity": "bench"})
    timeout_s: float = field(default=1800.0, metadata={"identity": False})
    # "bench": llama-bench (prefill and decode tests). "latency": llama-server on the device, streaming
    # completions from the controller (TTFT, ITL, end-to-end; docs/metrics.md "Latency scenario").
    scenario: str = field(default="bench", metadata={"identity": True})
    # Latency scenario: measured requests, requests in flight (also the server's --parallel slots), and
    # unmeasured requests sent first, one at a time.
    latency_requests: int = field(default=8, metadata={"identity": "latency"})
    latency_concurrency: int = field(default=1, metadata={"identity": "latency"})
    latency_warmup_requests: int = field(default=1, metadata={"identity": "latency"})
    # Latency scenario: how long the server may take to answer GET /health with 200 (model load).
    server_ready_timeout_s: float = field(default=120.0, metadata={"identity": False})
    # Latency scenario: llama-server -c (all slots together; each of the N slots gets c / N).
    # None: (n_prompt + n_gen + depth + 1) rounded up to a multiple of 256, times latency_concurrency.
    context: Optional[int] = field(default=None, metadata={"identity": "latency"})
    # Latency scenario: extra llama-server arguments (extra_args are llama-bench's), separate argv items.
    server_extra_args: List[str] = field(default_factory=list, metadata={"identity": "latency"})



def default_binary_dir() -> Optional[str]:
    """bin/ of the build `jbench setup` made last, if any."""
    from jbench.models.provision import active_build

    build = active_build()
    return build["bin_dir"] if build else None


class LlamaCppBackend(Backend[LlamaCppConfig]):
    NAME = "llamacpp"
    CONFIG = LlamaCppConfig
    CAPABILITIES = Capabilities(
        kv_types=frozenset(KV_TYPES), flash_attention=True, context_depth=True, latency_scenario=True, gguf_models=True
    )

    def binary_dir(self) -> str:
        if self.config.binary_dir:
            return self.config.binary_dir
        found = default_binary_dir()
        if not found:
            raise BackendError(
                "missing_binary",
                "no llama.cpp build found: run `jbench setup` (or set backend.binary_dir to your own build's bin directory)",
            )
        return found

    def validate(self, trial: Trial) -> list[str]:
        cfg, model = self.config_of(trial), trial.cfg.model
        problems = []
        if (msg := check_quant(model.quant)) is not None:
            problems.append(msg)
        problems += size_problems(cfg)
        for key, kv_type in (("cache_type_k", cfg.cache_type_k), ("cache_type_v", cfg.cache_type_v)):
            if kv_type not in KV_TYPES:
                problems.append(f"backend.{key} '{kv_type}' is not a llama.cpp KV type. Valid: {', '.join(KV_TYPES)}")
        if cfg.flash_attn not in FLASH_ATTN:
            problems.append(f"backend.flash_attn '{cfg.flash_attn}' is not valid. Valid: {', '.join(FLASH_ATTN)}")
        elif cfg.cache_type_v not in ("f16", "f32", "bf16") and cfg.flash_attn == "off":
            problems.append("a quantized V cache (backend.cache_type_v) needs flash attention: set backend.flash_attn=on")
        if cfg.threads is not None and cfg.threads < 1:
            problems.append(f"backend.threads must be >= 1 (got {cfg.threads})")
        problems += self._validate_scenario(cfg)
        if cfg.scenario == "serving":
            problems += serving.validate(trial.cfg.serving)
            if cfg.extra_args:
                problems.append("backend.extra_args are llama-bench arguments and the serving scenario runs "
                                "llama-server: use backend.server_extra_args")
        if not problems:
            try:
                path, _ = resolve_model_file(model)
                if "," in path:
                    # llama-bench splits -m on commas (it sweeps lists of models).
                    problems.append(f"model path {path!r} contains a comma, which llama-bench reads as a list: rename the file")
            except ModelError as exc:
                problems.append(str(exc))
        return problems

    @staticmethod
    def _validate_scenario(cfg: LlamaCppConfig) -> list[str]:
        if cfg.scenario not in SCENARIOS:
            return [f"backend.scenario '{cfg.scenario}' is not valid. Valid: {', '.join(SCENARIOS)}"]
        if cfg.scenario != "latency":
            return []
        problems = []
        if cfg.n_gen < 2:
            problems.append(f"the latency scenario needs backend.n_gen >= 2: inter-token latency is undefined "
                            f"below 2 output tokens (got {cfg.n_gen})")
        if cfg.n_prompt < 1:
            problems.append(f"the latency scenario needs backend.n_prompt >= 1 (got {cfg.n_prompt})")
        if cfg.depth:
            problems.append("backend.depth is not supported by the latency scenario (every request processes its "
                            "whole prompt, the prompt cache is off): set backend.depth=0")
        for key, value, low in (("latency_requests", cfg.latency_requests, 1),
                                ("latency_concurrency", cfg.latency_concurrency, 1),
                                ("latency_warmup_requests", cfg.latency_warmup_requests, 0)):
            if value < low:
                problems.append(f"backend.{key} must be >= {low} (got {value})")
        if cfg.server_ready_timeout_s <= 0:
            problems.append(f"backend.server_ready_timeout_s must be > 0 (got {cfg.server_ready_timeout_s})")
        if cfg.context is not None:
            slots = server_slots(cfg)
            need = cfg.n_prompt + cfg.n_gen
            if cfg.context // slots < need:
                problems.append(f"backend.context={cfg.context} gives each of the {slots} server slot(s) "
                                f"{cfg.context // slots} tokens; a request needs n_prompt + n_gen = {need}")
        if cfg.extra_args:
            problems.append("backend.extra_args are llama-bench arguments and the latency scenario runs llama-server: "
                            "use backend.server_extra_args")
        return problems

    def preflight(self, conn: Connection) -> list[str]:
        try:
            bin_dir = self.binary_dir()
        except BackendError as exc:
            return [str(exc)]
        latency_scenario = self.config.scenario == "latency"
        binary = os.path.join(bin_dir, "llama-server" if latency_scenario else "llama-bench")
        if not conn.exists(binary):
            return [f"{binary} not found on device '{conn.name}': run `jbench setup` or fix backend.binary_dir"]
        if latency_scenario:
            res = conn.run(["python3", "-c", "pass"], timeout=30)
            if res.returncode != 0:
                return [f"the latency scenario needs python3 on device '{conn.name}' (to pick a free port and "
                        f"start llama-server): {res.stderr.strip()[-200:]}"]
        return []

    def build_id(self, conn: Connection) -> Optional[str]:
        """The commit the build prints (`llama-bench --version`: "version: 0.5.0-dev (build 0, commit 0c1e57098)",
        older builds "version: 4000 (abc1234)"): the same string llama-bench records as build_commit."""
        tool = "llama-server" if self.config.scenario == "latency" else "llama-bench"
        res = conn.run([os.path.join(self.binary_dir(), tool), "--version"], timeout=60)
        return parse_build_commit(res.stdout + res.stderr)

    def measure_quality(self, trial: Trial, conn: Connection, log: logging.Logger,
                        request: QualityRequest) -> QualityOutcome:
        """The trial's output quality with llama-perplexity against its reference (jbench.backends.llamacpp.quality)."""
        return quality.measure_quality(self, trial, conn, log, request)

    def server_command(self, trial: Trial, model_path: str, port: int) -> list[str]:
        """llama-server's argument list for the latency and serving scenarios."""
        cfg = self.config_of(trial)
        if cfg.scenario == "serving":
            slots = serving.server_slots(trial.cfg.serving)
            context = cfg.context or serving.context_size(trial.cfg.serving, slots)
        else:
            slots = server_slots(cfg)
            context = cfg.context or server.default_context(cfg.n_prompt, cfg.n_gen, cfg.depth, slots)
        return server.server_argv(
            os.path.join(self.binary_dir(), "llama-server"), model_path, port=port, context=context, parallel=slots,
            n_gpu_layers=cfg.n_gpu_layers, cache_type_k=cfg.cache_type_k, cache_type_v=cfg.cache_type_v,
            flash_attn=SERVER_FLASH_ATTN[cfg.flash_attn], threads=cfg.threads, n_batch=cfg.n_batch,
            n_ubatch=cfg.n_ubatch, extra_args=cfg.server_extra_args,
        )

    def command(self, trial: Trial, model_path: str, *, only_phase: Optional[str] = None,
                repetitions: Optional[int] = None, settle: bool = True) -> list[str]:
        """llama-bench's argument list; only_phase runs just prefill or decode (the energy pass). With settle, -r
        adds backend.settle_repetitions to the repetitions (set aside by `run` while cold)."""
        cfg = self.config_of(trial)
        reps = (repetitions or cfg.repetitions) + (cfg.settle_repetitions if settle else 0)
        n_prompt = 0 if only_phase == "decode" else cfg.n_prompt
        n_gen = 0 if only_phase == "prefill" else cfg.n_gen
        argv = [
            os.path.join(self.binary_dir(), "llama-bench"),
            "-m", model_path,
            "-p", str(n_prompt),
            "-n", str(n_gen),
            "-d", str(cfg.depth),
            "-r", str(reps),
            "-ngl", str(cfg.n_gpu_layers),
            "-ctk", cfg.cache_type_k,
            "-ctv", cfg.cache_type_v,
        ]
        flash_attn = FLASH_ATTN[cfg.flash_attn]
        if flash_attn is not None:
            argv += ["-fa", flash_attn]
        if cfg.threads is not None:
            argv += ["-t", str(cfg.threads)]
        if cfg.n_batch is not None:
            argv += ["-b", str(cfg.n_batch)]
        if cfg.n_ubatch is not None:
            argv += ["-ub", str(cfg.n_ubatch)]
        if not cfg.warmup:
            argv.append("--no-warmup")
        argv += [str(a) for a in cfg.extra_args]
        argv += ["-o", "jsonl"]
        return argv

    def run(self, trial: Trial, conn: Connection, log: logging.Logger, *, only_phase: Optional[str] = None,
            repetitions: Optional[int] = None) -> BackendResult:
        cfg = self.config_of(trial)
        model_path = device_model_path(trial, conn)
        if cfg.scenario == "latency":
            return self._run_latency(trial, conn, log, model_path, only_phase=only_phase)
        if cfg.scenario == "serving":
            return self._run_serving(trial, conn, log, model_path, only_phase=only_phase)
        argv = self.command(trial, model_path, only_phase=only_phase, repetitions=repetitions)
        log.info("running: %s", shlex.join(argv))
        try:
            # Stamped with the device clock: each record's time delimits its phase window for energy.
            res = conn.run(stamped(argv, start_marker=True), timeout=cfg.timeout_s)
        except CommandTimeout:
            raise timeout_failure("llama-bench", argv, cfg.timeout_s) from None
        log.info("llama-bench exited %d after %.2f s", res.returncode, res.duration_s)
        if res.returncode != 0:
            raise command_failure("llama-bench", res)
        try:
            phases, build, info = parse_output(res.stdout)
        except ParseError as exc:
            raise BackendError("unparseable_output", f"unparseable llama-bench output: {exc}", res.stdout, res.stderr) from None
        wanted = {p for p, n in (("prefill", cfg.n_prompt), ("decode", cfg.n_gen)) if n > 0}
        if only_phase:
            wanted &= {only_phase}
        if missing := wanted - set(phases):
            raise BackendError(
                "unparseable_output", f"llama-bench printed no {', '.join(sorted(missing))} record", res.stdout, res.stderr
            )
        for phase, pr in list(phases.items()):
            phases[phase], _ = settle_phase(pr, cfg.settle_repetitions)
            log.info("%s: %s", phase, phases[phase].settle)
        # Where the build ran from (tag backend.binary_dir): a nightly alarm's confirmation measures it again.
        return BackendResult(phases=phases, raw_output=res.stdout, raw_stderr=res.stderr,
                             build={**build, "binary_dir": self.binary_dir()}, info=info,
                             command=argv, start_time=start_stamp(res.stdout))


    def memory_pass(self, trial: Trial, conn: Connection, log: logging.Logger) -> Optional[MemoryPass]:
        """llama-bench once more with the trial's settings, one repetition, no warm-up, `-v` (llama.cpp's log, which
        llama-bench silences otherwise, prints every buffer's size), under the peak-RSS wrapper. A run of its own:
        verbose logging never touches a timed pass. BackendError when it fails (out_of_memory recognised)."""
        cfg = self.config_of(trial)
        if cfg.scenario in ("latency", "serving"):
            # llama-server prints the same buffer lines, but the scenario starts and stops its server inside
            # server.run_latency_scenario; a memory pass would start one more server just for its log and its peak,
            # which needs its own lifecycle there (not done yet). No account rather than a wrong one.
            return None
        model_path = device_model_path(trial, conn)
        argv = self.command(trial, model_path, repetitions=1, settle=False) + ["-v"]
        if "--no-warmup" not in argv:
            argv.append("--no-warmup")
        log.info("memory pass: %s", shlex.join(argv))
        try:
            res = conn.run(peak_rss_argv(argv), timeout=cfg.timeout_s)
        except CommandTimeout:
            raise timeout_failure("llama-bench (memory pass)", argv, cfg.timeout_s) from None
        peak_kib, stderr = split_peak_rss(res.stderr)
        log.info("memory pass: llama-bench exited %d after %.2f s, peak RSS %s KiB", res.returncode, res.duration_s,
                 peak_kib)
        if res.returncode != 0:
            raise command_failure("llama-bench (memory pass)", dataclasses.replace(res, stderr=stderr))
        return MemoryPass(command=argv, raw_stderr=stderr, peak_rss_kib=peak_kib, account=parse_buffers(stderr))

    @classmethod
    def planned_build(cls, cfg: LlamaCppConfig) -> Optional[str]:
        """`jbench setup`'s build commit when the trial runs that build (no backend.binary_dir); a build of the
        user's own is only known by asking it on the device."""
        if cfg.binary_dir:
            return None
        from jbench.models.provision import active_build

        build = active_build()
        return str(build["build_commit"]) if build and build.get("build_commit") else None

    @classmethod
    def buffer_settings(cls, cfg: LlamaCppConfig) -> Optional[dict[str, str]]:
        """What shapes llama.cpp's buffers: the context (llama-bench gives each test its own context of n_prompt +
        n_gen + depth tokens, the prompt test with n_gen 0 and the generation test with n_prompt 0, so the largest
        is max(n_prompt, n_gen) + depth; llama-server's is its -c), batch sizes, KV types, flash attention, layers
        on the GPU and any extra arguments."""
        if cfg.scenario == "latency":
            n_ctx = cfg.context or server.default_context(cfg.n_prompt, cfg.n_gen, cfg.depth, server_slots(cfg))
            extra = cfg.server_extra_args
        else:
            n_ctx = max(cfg.n_prompt, cfg.n_gen) + cfg.depth
            extra = cfg.extra_args
        return {"scenario": cfg.scenario, "n_ctx": str(n_ctx), "n_batch": str(cfg.n_batch),
                "n_ubatch": str(cfg.n_ubatch), "type_k": cfg.cache_type_k, "type_v": cfg.cache_type_v,
                "flash_attn": cfg.flash_attn, "n_gpu_layers": str(cfg.n_gpu_layers),
                "extra_args": shlex.join(str(a) for a in extra)}


    def _run_latency(self, trial: Trial, conn: Connection, log: logging.Logger, model_path: str, *,
                     only_phase: Optional[str] = None) -> BackendResult:
        """The latency scenario: llama-server on the device, streaming requests (jbench.backends.llamacpp.server)."""
        cfg = self.config_of(trial)
        if only_phase:
            # Latency phases carry no device-clock windows, so the energy pass never asks; if it does,
            # the whole scenario runs (a request always has both phases).
            log.info("latency scenario: only_phase=%s ignored, the whole scenario runs", only_phase)
        concurrency = server_slots(cfg)
        run = server.run_latency_scenario(
            conn, lambda port: self.server_command(trial, model_path, port),
            n_prompt=cfg.n_prompt, n_gen=cfg.n_gen, requests=cfg.latency_requests,
            concurrency=concurrency, warmup_requests=cfg.latency_warmup_requests,
            ready_timeout_s=cfg.server_ready_timeout_s, timeout_s=cfg.timeout_s, log=log,
        )
        extra = client.latency_metrics(run.records, concurrency, run.wall_s)
        log.info("latency: TTFT p50 %.1f ms, ITL p50 %.2f ms, e2e p50 %.1f ms over %d request(s) at concurrency %d",
                 extra.get("ttft_ms_p50", float("nan")), extra.get("itl_ms_p50", float("nan")),
                 extra.get("e2e_ms_p50", float("nan")), len(run.records), concurrency)
        info = {"scenario": "latency", "context": run.argv[run.argv.index("-c") + 1] if "-c" in run.argv else None,
                "server_slots": concurrency,
                "tokens_source": ",".join(sorted({r.tokens_source for r in run.records}))}
        return BackendResult(phases=client.latency_phases(run.records, cfg.n_prompt),
                             raw_output=run.records_jsonl(), raw_stderr=run.server_log,
                             build={**run.build, "binary_dir": self.binary_dir()},
                             info=info, command=run.argv, metrics=extra)


    def _run_serving(self, trial: Trial, conn: Connection, log: logging.Logger, model_path: str, *,
                     only_phase: Optional[str] = None) -> BackendResult:
        """The serving scenario (jbench.backends.llamacpp.serving): one server, load levels, a window per level."""
        cfg, load = self.config_of(trial), trial.cfg.serving
        if only_phase:
            log.info("serving scenario: only_phase=%s ignored, the whole scenario runs", only_phase)
        run = serving.run_serving(conn, lambda port: self.server_command(trial, model_path, port), load,
                                  ready_timeout_s=cfg.server_ready_timeout_s, timeout_s=cfg.timeout_s, log=log)
        # No phase speeds: a request's TTFT and TPOT are not a prefill or decode rate (lengths vary, requests share
        # the batch); each level's latencies and throughput are the Serving stage's table.
        slots = serving.server_slots(load)
        info = {"scenario": "serving", "server_slots": slots,
                "context": run.argv[run.argv.index("-c") + 1] if "-c" in run.argv else None}
        metrics = {"serving_clock_uncertainty_ms": 1000 * run.clock.uncertainty_s} if run.clock else {}
        return BackendResult(raw_output=run.records_jsonl, raw_stderr=run.server_log,
                             build={**run.build, "binary_dir": self.binary_dir()}, info=info, command=run.argv,
                             metrics=metrics, load_windows=run.windows, serving_levels=run.levels,
                             stepped=_overhead_series(run.overhead))


def _overhead_series(overhead: list[dict[str, float]]) -> dict[str, list[float]]:
    """The load generator's own cost per level, as stepped series (step = level in run order)."""
    keys = ("dispatch_lag_ms_p99", "client_cpu_per_request_ms")
    return {f"serving_loadgen_{k}": [o.get(k, float("nan")) for o in overhead] for k in keys
            if any(k in o for o in overhead)}


def server_slots(cfg: LlamaCppConfig) -> int:
    """llama-server's --parallel slots: the requests in flight (validate refuses fewer than 1)."""
    return max(1, cfg.latency_concurrency)


def parse_build_commit(version_text: str) -> Optional[str]:
    """The commit in llama.cpp's `--version` output, or None."""
    m = re.search(r"commit ([0-9a-fA-F]+)\)", version_text) or re.search(r"version: \S+ \(([0-9a-fA-F]+)\)",
                                                                        version_text)
    return m.group(1) if m else None


def binary_path(bin_dir: str, name: str) -> Path:
    return Path(bin_dir) / name
