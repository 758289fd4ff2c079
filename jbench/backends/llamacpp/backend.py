"""llama.cpp through llama-bench (scenario "bench") or llama-server (scenario "latency", see server.py and client.py).

One llama-bench invocation per trial runs a prompt-processing test (-p, no generation) and a
generation test (-n, no prompt) as separate tests, each with warmup and -r repetitions, and
prints one JSON record per test (-o jsonl). Records are read by field name: the schema drifts
between llama.cpp builds (fields appear, flash_attn changed from bool to int, use_mmap became
load_mode), so nothing depends on field order or on fields jbench does not use.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import re
import shlex
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from jbench.analysis.memory import parse_buffers
from jbench.analysis.settle import settle_phase
from jbench.device.connection import CommandTimeout, Connection
from jbench.device.rusage import peak_rss_argv, split_peak_rss
from jbench.device.telemetry.samplers import stamped
from jbench.models.store import ModelError, check_quant, resolve_model_file
from jbench.core.schema import ModelConfig, ModelSection, bounded, typed
from jbench.core.trial import Trial
from jbench.core.results import BackendResult
from jbench.backends.llamacpp import client, quality, server, serving
from jbench.backends.serving import levels
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
SERVER_SCENARIOS = ("latency", "serving")  # the scenarios that run llama-server
# This build's --spec-type values (common/speculative.cpp). draft-*: a draft model (-md) proposes tokens; eagle3,
# mtp, dflash and dspark need a draft GGUF made for them. ngram-*: draft-free lookup in the context so far.
SPEC_TYPES = ("none", "draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark", "ngram-simple",
              "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
    # Speculative decoding on llama-server (latency and serving scenarios; docs/serving.md "Techniques"): the draft
    # model (-md), a quant name of the trial's own model (Q4_0: that file of model.name) or a GGUF path. It must
    # share the target's vocabulary (checked at plan time). None: no draft model.
    draft: Optional[str] = field(default=None, metadata={"identity": SERVER_SCENARIOS})
    # --spec-draft-n-max / --spec-draft-n-min (this build's names; --draft-max was removed); None: the server's own.
    draft_max: Optional[int] = field(default=None, metadata={"identity": SERVER_SCENARIOS})
    draft_min: Optional[int] = field(default=None, metadata={"identity": SERVER_SCENARIOS})
    # --spec-type: one of SPEC_TYPES. None: draft-simple with a draft model, else no speculation. The ngram-* types
    # need no draft model (their own knobs, --spec-ngram-*, go in server_extra_args).
    spec_type: Optional[str] = field(default=None, metadata={"identity": SERVER_SCENARIOS})
    # Environment of every llama.cpp process the backend starts (llama-bench, llama-server, llama-perplexity's trial pass), e.g.
    # {GGML_CUDA_DISABLE_GRAPHS: "1"}: CUDA graphs off in a CUDA build (docs/backends.md).
    env: Dict[str, str] = field(default_factory=dict, metadata={"identity": True})



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
        problems += env_problems(cfg.env)
        problems += speculative_problems(cfg, model)
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

    def server_command(self, trial: Trial, model_path: str, port: int, draft_path: Optional[str] = None) -> list[str]:
        """llama-server's argument list for the latency and serving scenarios (draft_path: backend.draft on the
        device), behind `env NAME=VALUE` items for backend.env."""
        cfg = self.config_of(trial)
        if cfg.scenario == "serving":
            slots = serving.server_slots(trial.cfg.serving)
            context = cfg.context or serving.context_size(trial.cfg.serving, slots)
        else:
            slots = server_slots(cfg)
            context = cfg.context or server.default_context(cfg.n_prompt, cfg.n_gen, cfg.depth, slots)
        argv = server.server_argv(
            os.path.join(self.binary_dir(), "llama-server"), model_path, port=port, context=context, parallel=slots,
            n_gpu_layers=cfg.n_gpu_layers, cache_type_k=cfg.cache_type_k, cache_type_v=cfg.cache_type_v,
            flash_attn=SERVER_FLASH_ATTN[cfg.flash_attn], threads=cfg.threads, n_batch=cfg.n_batch,
            n_ubatch=cfg.n_ubatch, extra_args=cfg.server_extra_args, draft_path=draft_path,
            spec_type=speculative_type(cfg), draft_max=cfg.draft_max, draft_min=cfg.draft_min,
        )
        return server.with_env(argv, env_items(cfg.env))

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
        if cfg.scenario in SERVER_SCENARIOS:
            draft_path = self.device_draft_path(trial, conn)
            if draft_path:
                log.info("draft model: %s (--spec-type %s)", draft_path, speculative_type(cfg))
            run = self._run_latency if cfg.scenario == "latency" else self._run_serving
            return run(trial, conn, log, model_path, draft_path=draft_path, only_phase=only_phase)
        argv = self.command(trial, model_path, only_phase=only_phase, repetitions=repetitions)
        log.info("running: %s", shlex.join(argv))
        try:
            # Stamped with the device clock: each record's time delimits its phase window for energy.
            res = conn.run(stamped(argv, start_marker=True), timeout=cfg.timeout_s, env=env_items(cfg.env) or None)
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
            res = conn.run(peak_rss_argv(argv), timeout=cfg.timeout_s, env=env_items(cfg.env) or None)
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


    def device_draft_path(self, trial: Trial, conn: Connection) -> Optional[str]:
        """backend.draft as a file on the device (None without one); BackendError missing_model when it is absent."""
        draft = self.config_of(trial).draft
        if not draft:
            return None
        try:
            path = conn.expand_path(draft_file(trial.cfg.model, draft))
        except ModelError as exc:
            raise BackendError("missing_model", f"backend.draft={draft}: {exc}") from None
        if not conn.exists(path):
            raise BackendError("missing_model", f"draft model {path} not found on device '{conn.name}'")
        return path

    def _run_latency(self, trial: Trial, conn: Connection, log: logging.Logger, model_path: str, *,
                     draft_path: Optional[str] = None, only_phase: Optional[str] = None) -> BackendResult:
        """The latency scenario: llama-server on the device, streaming requests (jbench.backends.llamacpp.server)."""
        cfg = self.config_of(trial)
        if only_phase:
            # Latency phases carry no device-clock windows, so the energy pass never asks; if it does,
            # the whole scenario runs (a request always has both phases).
            log.info("latency scenario: only_phase=%s ignored, the whole scenario runs", only_phase)
        concurrency = server_slots(cfg)
        run = server.run_latency_scenario(
            conn, lambda port: self.server_command(trial, model_path, port, draft_path),
            n_prompt=cfg.n_prompt, n_gen=cfg.n_gen, requests=cfg.latency_requests,
            concurrency=concurrency, warmup_requests=cfg.latency_warmup_requests,
            ready_timeout_s=cfg.server_ready_timeout_s, timeout_s=cfg.timeout_s, log=log,
        )
        extra = client.latency_metrics(run.records, concurrency, run.wall_s)
        # Acceptance from the server's own counters; absent (never 0) when no request reported them.
        extra.update(serving.draft_metrics(run.records))
        log.info("latency: TTFT p50 %.1f ms, ITL p50 %.2f ms, e2e p50 %.1f ms over %d request(s) at concurrency %d",
                 extra.get("ttft_ms_p50", float("nan")), extra.get("itl_ms_p50", float("nan")),
                 extra.get("e2e_ms_p50", float("nan")), len(run.records), concurrency)
        info = {"scenario": "latency", "context": run.argv[run.argv.index("-c") + 1] if "-c" in run.argv else None,
                "server_slots": concurrency, "backends": server.backends_of(run.server_log),
                "tokens_source": ",".join(sorted({r.tokens_source for r in run.records}))}
        return BackendResult(phases=client.latency_phases(run.records, cfg.n_prompt),
                             raw_output=run.records_jsonl(), raw_stderr=run.server_log,
                             build={**run.build, "binary_dir": self.binary_dir()},
                             info=info, command=run.argv, metrics=extra)


    def _run_serving(self, trial: Trial, conn: Connection, log: logging.Logger, model_path: str, *,
                     draft_path: Optional[str] = None, only_phase: Optional[str] = None) -> BackendResult:
        """The serving scenario (jbench.backends.llamacpp.serving): one server, load levels, a window per level."""
        cfg, load = self.config_of(trial), trial.cfg.serving
        if only_phase:
            log.info("serving scenario: only_phase=%s ignored, the whole scenario runs", only_phase)
        run = serving.run_serving(conn, lambda port: self.server_command(trial, model_path, port, draft_path), load,
                                  ready_timeout_s=cfg.server_ready_timeout_s, timeout_s=cfg.timeout_s, log=log)
        # No phase speeds: a request's TTFT and TPOT are not a prefill or decode rate (lengths vary, requests share
        # the batch); each level's latencies and throughput are the Serving stage's table.
        slots = serving.server_slots(load)
        info = {"scenario": "serving", "server_slots": slots, "backends": server.backends_of(run.server_log),
                "context": run.argv[run.argv.index("-c") + 1] if "-c" in run.argv else None,
                # Each level's speculative-decoding figures from the server's counters (the Serving stage's table).
                "serving_draft": [serving.draft_metrics(records) for records in run.level_records]}
        metrics = {"serving_clock_uncertainty_ms": 1000 * run.clock.uncertainty_s} if run.clock else {}
        if run.peak_rss_kib is not None:
            metrics["serving_server_peak_rss_mib"] = run.peak_rss_kib / 1024
        return BackendResult(raw_output=run.records_jsonl, raw_stderr=run.server_log,
                             build={**run.build, "binary_dir": self.binary_dir()}, info=info, command=run.argv,
                             metrics=metrics, load_windows=run.windows, serving_levels=run.levels,
                             stepped=levels.overhead_series(run.overhead))


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


# -- speculative decoding and environment knobs ---------------------------------------------------------------------

def env_problems(env: Dict[str, str]) -> list[str]:
    """backend.env: names a process environment accepts, values that are strings (a number is taken as its text)."""
    problems = []
    for name, value in (env or {}).items():
        if not _ENV_NAME.fullmatch(str(name)):
            problems.append(f"backend.env: {name!r} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
        if value is None or isinstance(value, (dict, list)):
            problems.append(f"backend.env.{name}: {value!r} is not a string value")
    return problems


def env_items(env: Dict[str, str]) -> dict[str, str]:
    """backend.env as the str -> str mapping a process takes (Hydra may give 1 for "1")."""
    return {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in (env or {}).items()}


def draft_is_path(draft: str) -> bool:
    return "/" in draft or draft.endswith(".gguf")


def draft_file(model: ModelSection, draft: str) -> str:
    """The draft model's file (on the controller's view of the store, as resolve_model_file gives the target's): a
    path as given, or the trial's own model at quant `draft`. ModelError when the quant is not known."""
    if draft_is_path(draft):
        return os.path.expanduser(draft)
    section = typed(ModelConfig, model, where="model")
    path, _ = resolve_model_file(dataclasses.replace(section, quant=draft))
    return path


def speculative_type(cfg: LlamaCppConfig) -> Optional[str]:
    """The --spec-type llama-server gets: the configured one, or draft-simple with a draft model (this build loads
    a -md model but drafts nothing while --spec-type stays at its default, none)."""
    if cfg.spec_type is not None:
        return cfg.spec_type
    return "draft-simple" if cfg.draft else None


def speculative_problems(cfg: LlamaCppConfig, model: ModelSection) -> list[str]:
    """Every problem of the speculative-decoding keys, before any device is touched: the scenario, the type, the
    draft bounds, the draft file and its vocabulary against the target's."""
    keys = {k: getattr(cfg, k) for k in ("draft", "draft_max", "draft_min", "spec_type") if getattr(cfg, k) is not None}
    if not keys:
        return []
    if cfg.scenario not in SERVER_SCENARIOS:
        return [f"backend.{', backend.'.join(keys)} apply to llama-server (backend.scenario=latency or serving); "
                f"llama-bench (scenario {cfg.scenario}) has no draft model"]
    problems = []
    spec = speculative_type(cfg)
    if cfg.spec_type is not None and cfg.spec_type not in SPEC_TYPES:
        problems.append(f"backend.spec_type '{cfg.spec_type}' is not a --spec-type of this llama.cpp build. "
                        f"Valid: {', '.join(SPEC_TYPES)}")
    elif spec is not None and spec.startswith("draft-") and not cfg.draft:
        problems.append(f"backend.spec_type={spec} needs a draft model: set backend.draft (a quant such as Q4_0, or "
                        "a GGUF path)")
    elif cfg.draft and spec is not None and not spec.startswith("draft-"):
        problems.append(f"backend.draft is set but backend.spec_type={spec} does not use a draft model: "
                        "leave spec_type unset (draft-simple) or set backend.draft=null")
    for key in ("draft_max", "draft_min"):
        value = getattr(cfg, key)
        if value is not None and value < 0:
            problems.append(f"backend.{key} must be >= 0 (got {value})")
    if cfg.draft_max is not None and cfg.draft_min is not None and cfg.draft_min > cfg.draft_max:
        problems.append(f"backend.draft_min={cfg.draft_min} is above backend.draft_max={cfg.draft_max}")
    if (cfg.draft_max is not None or cfg.draft_min is not None) and spec in (None, "none"):
        problems.append("backend.draft_max / draft_min bound a draft: set backend.draft (or a backend.spec_type)")
    if cfg.draft:
        problems += _draft_file_problems(cfg.draft, model)
    return problems


def _draft_file_problems(draft: str, model: ModelSection) -> list[str]:
    if not draft_is_path(draft) and (msg := check_quant(draft)) is not None:
        return [f"backend.draft: {msg}"]
    try:
        path = draft_file(model, draft)
        target, _ = resolve_model_file(model)
    except ModelError as exc:
        return [f"backend.draft={draft}: {exc}"]
    if not os.path.exists(path):
        return [f"backend.draft={draft}: {path} does not exist"]
    if not os.path.exists(os.path.expanduser(target)):
        # The target lives only on the device (model.files / path_template there): its vocabulary is checked by
        # llama-server when it loads both (it refuses a draft of another vocabulary type).
        return []
    try:
        mine, theirs = vocabulary(path), vocabulary(os.path.expanduser(target))
    except (OSError, ValueError) as exc:
        return [f"backend.draft={draft}: cannot read the vocabulary of {path}: {exc}"]
    if mine != theirs:
        how = (f"{mine.size} tokens vs the model's {theirs.size}" if mine.size != theirs.size else
               f"the same size ({mine.size} tokens) but other tokens" if mine.digest != theirs.digest else
               f"tokenizer {mine.model!r} vs the model's {theirs.model!r}")
        return [f"backend.draft={draft} ({path}) has another vocabulary than the model ({target}): {how}; "
                "a draft must share the target's vocabulary"]
    return []


@dataclass(frozen=True)
class Vocabulary:
    model: Optional[str]  # tokenizer.ggml.model (llama, gpt2, ...)
    size: int  # tokenizer.ggml.tokens length
    digest: str  # SHA-256 over the token strings, each length-prefixed, in id order


def vocabulary(path: str) -> Vocabulary:
    """A GGUF file's vocabulary from its header, read in one buffered pass that stops at the token list (the model
    facts keep only its length; gguf.GGUFReader takes seconds on a 262k-token vocabulary)."""
    st = os.stat(path)
    return _vocabulary(os.path.abspath(path), st.st_size, st.st_mtime_ns)


_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STR, _ARR = 8, 9


@functools.lru_cache(maxsize=32)
def _vocabulary(path: str, size: int, mtime_ns: int) -> Vocabulary:
    with open(path, "rb", buffering=1 << 20) as f:
        def take(n: int) -> bytes:
            data = f.read(n)
            if len(data) != n:
                raise ValueError("truncated GGUF header")
            return data

        def u32() -> int:
            return struct.unpack("<I", take(4))[0]

        def u64() -> int:
            return struct.unpack("<Q", take(8))[0]

        def text() -> bytes:
            n = u64()
            if n > size:
                raise ValueError("corrupt GGUF header (a string runs past the end of the file)")
            return take(n)

        def skip(vtype: int) -> None:
            if vtype == _STR:
                text()
            elif vtype == _ARR:
                etype, count = u32(), u64()
                if etype in _FIXED:
                    f.seek(_FIXED[etype] * count, os.SEEK_CUR)
                else:
                    for _ in range(count):
                        skip(etype)
            elif vtype in _FIXED:
                take(_FIXED[vtype])
            else:
                raise ValueError(f"unknown GGUF value type {vtype}")

        if take(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        take(4)  # version
        u64()  # tensors
        tok_model: Optional[str] = None
        tokens: Optional[tuple[int, str]] = None
        for _ in range(u64()):
            key, vtype = text().decode("utf-8", "replace"), u32()
            if key == "tokenizer.ggml.model" and vtype == _STR:
                tok_model = text().decode("utf-8", "replace")
            elif key == "tokenizer.ggml.tokens" and vtype == _ARR:
                etype, count = u32(), u64()
                if etype != _STR:
                    raise ValueError("tokenizer.ggml.tokens is not a list of strings")
                h = hashlib.sha256()
                for _ in range(count):
                    token = text()
                    h.update(struct.pack("<Q", len(token)))
                    h.update(token)
                tokens = (count, h.hexdigest())
            else:
                skip(vtype)
            if tok_model is not None and tokens is not None:
                break
    if tokens is None:
        raise ValueError("no tokenizer.ggml.tokens in its header")
    return Vocabulary(model=tok_model, size=tokens[0], digest=tokens[1])
