"""llama.cpp latency scenario: llama-server on the device, streaming completions from the controller.

The server's process (a free port picked on the device, a launcher that reports its pid, readiness by GET /health,
a guaranteed stop, the tunnel of an SSH device) is jbench.backends.serving.process.DeviceServer's, shared with every
serving backend; LlamaServer is that with llama-server's name and health path.

Requests and latency metrics: client.py.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from jbench.backends.base import BackendError
from jbench.backends.serving.process import DeviceServer, pick_free_port, request_failures, with_env

__all__ = ["LlamaServer", "server_argv", "default_context", "with_env", "pick_free_port", "build_of",
           "prompt_source_and_props", "run_latency_scenario", "LatencyRun"]
from jbench.device.connection import Connection
from jbench.backends.llamacpp.client import (
    RequestRecord,
    StreamingClient,
    build_prompt,
    prompt_tokens_source,
    run_requests,
)


_BUILD_INFO = re.compile(r"b(\d+)-([0-9a-fA-F]+)")


def default_context(n_prompt: int, n_gen: int, depth: int, slots: int, multiple: int = 256) -> int:
    """llama-server -c: per slot n_prompt + n_gen + depth (+1 spare) rounded up to `multiple`, times the slots
    (with --parallel N and no unified KV cache llama-server gives each slot c / N)."""
    per_slot = n_prompt + n_gen + depth + 1
    per_slot = ((per_slot + multiple - 1) // multiple) * multiple
    return per_slot * max(1, slots)


def server_argv(server_bin: str, model_path: str, *, port: int, context: int, parallel: int, n_gpu_layers: int,
                cache_type_k: str, cache_type_v: str, flash_attn: Optional[str], threads: Optional[int] = None,
                n_batch: Optional[int] = None, n_ubatch: Optional[int] = None,
                extra_args: Sequence[str] = (), host: str = "127.0.0.1", draft_path: Optional[str] = None,
                spec_type: Optional[str] = None, draft_max: Optional[int] = None,
                draft_min: Optional[int] = None) -> list[str]:
    """llama-server's argument list. flash_attn: "on"/"off", or None to leave the build's default. draft_path (-md),
    spec_type (--spec-type), draft_max/draft_min (--spec-draft-n-max/-min): speculative decoding, None leaves each
    at the server's default."""
    argv = [server_bin, "-m", model_path, "--host", host, "--port", str(port), "-c", str(context),
            "-ngl", str(n_gpu_layers), "-ctk", cache_type_k, "-ctv", cache_type_v, "--parallel", str(parallel)]
    if flash_attn is not None:
        argv += ["-fa", flash_attn]
    if threads is not None:
        argv += ["-t", str(threads)]
    if n_batch is not None:
        argv += ["-b", str(n_batch)]
    if n_ubatch is not None:
        argv += ["-ub", str(n_ubatch)]
    if draft_path is not None:
        argv += ["-md", draft_path]
    if spec_type is not None:
        argv += ["--spec-type", spec_type]
    if draft_max is not None:
        argv += ["--spec-draft-n-max", str(draft_max)]
    if draft_min is not None:
        argv += ["--spec-draft-n-min", str(draft_min)]
    argv += [str(a) for a in extra_args]
    return argv


class LlamaServer(DeviceServer):
    """llama-server on the device (jbench.backends.serving.process.DeviceServer): ready when GET /health is 200."""

    NAME = "llama-server"
    HEALTH_PATH = "/health"

    def client(self, timeout: float = 300.0) -> StreamingClient:
        assert self.address is not None, "server not started"
        return StreamingClient(*self.address, timeout=timeout)


@dataclass
class LatencyRun:
    records: list[RequestRecord]
    warmup_records: list[RequestRecord]
    wall_s: float
    server_log: str
    argv: list[str]
    build: dict[str, str]
    prompt_tokens: int

    def records_jsonl(self) -> str:
        lines = [json.dumps({"kind": "warmup", **json.loads(r.to_json())}, sort_keys=True) for r in self.warmup_records]
        lines += [json.dumps({"kind": "measured", **json.loads(r.to_json())}, sort_keys=True) for r in self.records]
        return "\n".join(lines) + "\n"


def prompt_source_and_props(server: LlamaServer, timeout_s: float) -> tuple[list[int], list[int], dict]:
    """A ready server's tokenizer prefix and body tokens (prompt_tokens_source) and its /props."""
    client = server.client(timeout=timeout_s)
    try:
        prefix, body = prompt_tokens_source(client)
        return prefix, body, client.props()
    finally:
        client.close()


# llama.cpp's own lines when a GPU backend serves the model: ggml's CUDA init naming its devices, or the model loader
# placing the model on a device ("using device CUDA0 (NVIDIA ...)"); Vulkan, Metal and SYCL builds print theirs.
_CUDA_INIT = re.compile(r"ggml_cuda_init: found [1-9]")
_DEVICE = re.compile(r"using device (CUDA|Vulkan|Metal|SYCL|ROCm)\d")


def backends_of(server_log: str) -> str:
    """What llama-bench reports as `backends`, read from llama-server's log: the GPU backend the model loader placed
    the model on (CUDA, Vulkan, ...), or CUDA when ggml initialised CUDA devices, else "CPU". The roofline chooses its
    bandwidth probe by it (jbench.device.bandwidth.compute_path), as for llama-bench trials."""
    log = server_log or ""
    m = _DEVICE.search(log)
    if m:
        return m.group(1)
    return "CUDA" if _CUDA_INIT.search(log) else "CPU"


def build_of(props: dict) -> dict[str, str]:
    """build_number and build_commit from the server's /props build_info ("b1234-abcdef0"), else empty."""
    m = _BUILD_INFO.search(str(props.get("build_info", "")))
    return {"build_number": m.group(1), "build_commit": m.group(2)} if m else {}


def run_latency_scenario(conn: Connection, argv_for_port: Callable[[int], list[str]], *, n_prompt: int, n_gen: int,
                         requests: int, concurrency: int, warmup_requests: int, ready_timeout_s: float,
                         timeout_s: float, log: Optional[logging.Logger] = None) -> LatencyRun:
    """Start llama-server, run warmup (sequential, not measured) and measured requests, always stop it."""
    log = log or logging.getLogger("jbench.latency")
    server = LlamaServer(conn, argv_for_port, ready_timeout_s=ready_timeout_s, log=log)
    try:
        with request_failures(server, "latency"):
            server.start()
            prefix, body, props = prompt_source_and_props(server, timeout_s)
            total = warmup_requests + requests
            prompts = [build_prompt(prefix, body, n_prompt, variant=i) for i in range(total)]
            warm: list[RequestRecord] = []
            if warmup_requests:
                warm, _ = run_requests(server.address, prompts[:warmup_requests], n_gen, 1, timeout_s=timeout_s)
                log.info("warmup: %d request(s), TTFT %s ms", len(warm), ", ".join(f"{r.ttft_ms:.1f}" for r in warm))
            records, wall = run_requests(server.address, prompts[warmup_requests:], n_gen, concurrency,
                                         timeout_s=timeout_s, first_index=warmup_requests)
    finally:
        server.stop()
    for r in records:
        if r.output_tokens != n_gen:
            log.warning("request %d returned %d tokens instead of %d (ITL uses the actual count)", r.index,
                        r.output_tokens, n_gen)
        if r.output_tokens < 2:
            raise BackendError("unparseable_output", f"request {r.index} returned {r.output_tokens} token(s): "
                               "ITL is undefined", raw_output=server.log_text())
        if r.prompt_tokens is not None and r.prompt_tokens != n_prompt:
            log.warning("request %d: the server reports %d prompt tokens, jbench sent %d", r.index, r.prompt_tokens,
                        n_prompt)
        if r.cached_tokens:
            log.warning("request %d: the server reused %d cached prompt tokens", r.index, r.cached_tokens)
    return LatencyRun(records=records, warmup_records=warm, wall_s=wall, server_log=server.log_text(),
                      argv=list(server.argv or []), build=build_of(props), prompt_tokens=n_prompt)
