"""One trial's memory: the backend's own buffer account, the process's peak, the device's use over idle, the
planner's prediction, and the audit that puts them side by side (pure functions, no I/O).

The buffer account (`parse_buffers`) is read from llama.cpp's verbose log by the text of its lines, never by the
function that prints them (`load_tensors:`, `llama_kv_cache:`, `llama_kv_cache_unified:`, `llama_context:`,
`sched_reserve:` vary between builds):

    <NAME> model buffer size = <x> MiB      weights, per buffer type (CPU_Mapped, CPU_REPACK, CUDA0, ...)
    <NAME> KV buffer size = <x> MiB         KV cache, one line per cache and device (Gemma 3: SWA and full)
    <NAME> compute buffer size = <x> MiB    the scheduler's compute buffers, per device
    <NAME>  output buffer size = <x> MiB    logits and embeddings of one context

Model lines belong to one model load; the other lines to one context (llama-bench makes one per test: one for
the prompt test, one for the generation test). A context's compute lines come last (the scheduler reserves them
after the KV cache and the output buffer exist), so an output or KV line after a compute line starts the next
context; a model line after any context line starts the next load. A trial reports, per category, the figures of
the load or context whose total in that category is the largest: the memory the backend needed at its peak, each
category taken where it peaked (the prompt test's context has the larger compute buffer, both tests' KV caches are
the same size once llama.cpp pads the context).

Units: llama.cpp prints MiB. getrusage's ru_maxrss is KiB on Linux. tegrastats prints `RAM used/totalMB`, which is
MiB: it divides /proc/meminfo's kB (KiB) by 1024 (a 64 GB AGX Orin prints a total of 62841MB, the 61.4 GiB its
MemTotal holds; as 10^6 bytes it would be 58.5 GiB, gigabytes short of what the module's carve-outs take). NVML's
used bytes are divided by 2^20 in the sampler. So every telemetry reading is taken as MiB without conversion.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Mapping, Optional

from jbench.analysis.telemetry import PhaseWindow

KINDS = ("model", "kv", "compute", "output")
_KIND = {"model": "model", "KV": "kv", "compute": "compute", "output": "output"}
# `<NAME> <kind> buffer size = <x> MiB`; NAME is the word before the kind (the function prefix comes before it).
# `~llama_context: CPU compute buffer size is 16.0782 MiB, matches expectation` (a destructor's check) and
# `llama_kv_cache: size = 0.75 MiB (...)` (a summary of the lines counted) have no `buffer size =` and are skipped.
_LINE = re.compile(r"(?P<name>\S+)\s+(?P<kind>model|KV|compute|output) buffer size\s*=\s*(?P<mib>\d+(?:\.\d+)?)\s*MiB")


def is_host_buffer(name: str) -> bool:
    """Whether a llama.cpp buffer type lives in host memory, inside the process's resident set (CPU, CPU_Mapped,
    CPU_REPACK, CUDA_Host pinned memory), rather than in a GPU's memory (CUDA0, Vulkan0, ...)."""
    low = name.lower()
    return low.startswith("cpu") or low.endswith("_host")


@dataclass(frozen=True)
class BufferAccount:
    """The backend's buffers by category, each {buffer type: MiB} of the load or context where the category peaked
    (module doc); `loads` and `contexts`: how many the log showed."""

    model: dict[str, float] = field(default_factory=dict)
    kv: dict[str, float] = field(default_factory=dict)
    compute: dict[str, float] = field(default_factory=dict)
    output: dict[str, float] = field(default_factory=dict)
    loads: int = 0
    contexts: int = 0

    def of(self, kind: str) -> dict[str, float]:
        return {"model": self.model, "kv": self.kv, "compute": self.compute, "output": self.output}[kind]

    def total(self, kind: str) -> Optional[float]:
        """The category's MiB summed over buffer types; None when the log printed none."""
        parts = self.of(kind)
        return math.fsum(parts.values()) if parts else None

    def device_buffers(self) -> dict[str, float]:
        """MiB per buffer type outside host memory (GPU buffers), over every category."""
        out: dict[str, float] = {}
        for kind in KINDS:
            for name, mib in self.of(kind).items():
                if not is_host_buffer(name):
                    out[name] = out.get(name, 0.0) + mib
        return out

    def as_json(self) -> str:
        """The `memory.buffers` tag: {"model": {"CPU_Mapped": 235.16, ...}, "kv": ..., "compute": ..., "output": ...}."""
        return json.dumps({kind: {k: round(v, 4) for k, v in self.of(kind).items()} for kind in KINDS},
                          sort_keys=False)


def _add(parts: dict[str, float], name: str, mib: float) -> None:
    parts[name] = parts.get(name, 0.0) + mib


def _largest(groups: list[dict[str, float]]) -> dict[str, float]:
    """The group with the largest total (the first of equal ones); {} when none has any."""
    best: dict[str, float] = {}
    for g in groups:
        if g and (not best or math.fsum(g.values()) > math.fsum(best.values())):
            best = g
    return dict(best)


# What the memory pass's artifact keeps of llama.cpp's verbose log: the buffer lines the figures come from, and any
# line that reports a problem. The rest (one line per tensor created, per graph input, per GGUF key: ~2,200 lines,
# ~250 KiB for a 270M model) would make every trial's record that much larger and says nothing about memory.
_KEEP = re.compile(r"buffer size|error|warn|fail|out of memory|cannot|unable|abort", re.IGNORECASE)


def log_excerpt(text: str, tail: int = 0) -> str:
    """The lines of a verbose backend log that account for memory or report a problem (and the last `tail` lines,
    for a pass that failed), under a header that says how many of how many lines were kept."""
    lines = text.splitlines()
    kept = [line for line in lines if _KEEP.search(line)]
    last = lines[-tail:] if tail else []
    header = (f"[jbench] the lines of the memory pass's stderr that account for memory or report a problem: "
              f"{len(kept)} of {len(lines)} lines" + (f", then its last {len(last)} lines" if last else ""))
    return "\n".join([header, *kept, *(["[jbench] last lines:"] + last if last else [])]) + "\n"


def parse_buffers(text: str) -> Optional[BufferAccount]:
    """The buffer account in a backend's (verbose) log; None when the log has no buffer line at all."""
    loads: list[dict[str, float]] = []
    contexts: list[dict[str, dict[str, float]]] = []
    context_since_load = False
    for line in text.splitlines():
        m = _LINE.search(line)
        if m is None:
            continue
        kind, name, mib = _KIND[m.group("kind")], m.group("name"), float(m.group("mib"))
        if kind == "model":
            if not loads or context_since_load:
                loads.append({})
                context_since_load = False
            _add(loads[-1], name, mib)
            continue
        if not contexts or (kind != "compute" and contexts[-1]["compute"]):
            contexts.append({"kv": {}, "compute": {}, "output": {}})
        context_since_load = True
        _add(contexts[-1][kind], name, mib)
    if not loads and not contexts:
        return None
    return BufferAccount(model=_largest(loads), kv=_largest([c["kv"] for c in contexts]),
                         compute=_largest([c["compute"] for c in contexts]),
                         output=_largest([c["output"] for c in contexts]), loads=len(loads), contexts=len(contexts))


# --------------------------------------------------------------------------------------------
# The device's use over its idle baseline, from the Measure stage's telemetry

_ACTIVE = ("load", "prefill", "decode")


def _over_idle(samples: list[dict], key: str, idle: PhaseWindow, start: float, end: float,
               what: str) -> tuple[Optional[float], Optional[float], str]:
    """(idle mean, highest reading in [start, end] − idle mean, status) of one signal."""
    readings = [(s["t"], float(s[key])) for s in samples if s.get(key) is not None and s.get("t") is not None]
    if not readings:
        return None, None, f"not measured: the telemetry source gives no {what} readings"
    at_idle = [v for t, v in readings if idle.start <= t <= idle.end]
    if not at_idle:
        return None, None, f"not measured: no {what} reading inside the idle window"
    active = [v for t, v in readings if start <= t <= end]
    base = statistics.fmean(at_idle)
    if not active:
        return base, None, f"not measured: no {what} reading from model load to the end of decode"
    return base, max(active) - base, "ok"


def telemetry_memory(samples: list[dict], windows: list[PhaseWindow]) -> tuple[dict[str, float], dict[str, str]]:
    """memory_ram_idle_mib, memory_ram_over_idle_mib, memory_swap_over_idle_mib, memory_gpu_over_idle_mib from
    telemetry samples (`ram_used_mb`, `swap_used_mb`: tegrastats; `gpu_mem_used_mb`: NVML; all MiB, module doc)
    and the trial's phase windows; each absent with its reason in `memory.{ram,swap,gpu}.status`.

    Idle: the mean over the idle window. Over idle: the highest reading from the start of the first load, prefill
    or decode window to the end of the last one (energy passes included: each is the same workload) minus that."""
    metrics: dict[str, float] = {}
    tags: dict[str, str] = {}
    idle = next((w for w in windows if w.phase == "idle"), None)
    active = [w for w in windows if w.phase in _ACTIVE]
    reason = None
    if not samples:
        reason = "not measured: no telemetry samples"
    elif idle is None:
        reason = "not measured: no idle window (telemetry.idle_s=0, or no sample to end it)"
    elif not active:
        reason = "not measured: no load, prefill or decode window"
    if reason is not None:
        return metrics, {"memory.ram.status": reason, "memory.swap.status": reason, "memory.gpu.status": reason}
    assert idle is not None
    start, end = min(w.start for w in active), max(w.end for w in active)
    base, over, tags["memory.ram.status"] = _over_idle(samples, "ram_used_mb", idle, start, end, "used-RAM")
    if base is not None:
        metrics["memory_ram_idle_mib"] = base
    if over is not None:
        metrics["memory_ram_over_idle_mib"] = over
    _, over, tags["memory.swap.status"] = _over_idle(samples, "swap_used_mb", idle, start, end, "swap")
    if over is not None:
        metrics["memory_swap_over_idle_mib"] = over
    _, over, tags["memory.gpu.status"] = _over_idle(samples, "gpu_mem_used_mb", idle, start, end,
                                                    "GPU memory (NVML)")
    if over is not None:
        metrics["memory_gpu_over_idle_mib"] = over
    return metrics, tags


# --------------------------------------------------------------------------------------------
# The planner's prediction

MIB = 1024 * 1024


@dataclass(frozen=True)
class Prediction:
    """What the planner expects a trial to take: weights (the model file) + KV cache (GGUF header, at the trial's
    context) + compute and output buffers where this configuration was measured before (None: not known)."""

    weights_mib: float
    kv_mib: float
    compute_mib: Optional[float] = None
    output_mib: Optional[float] = None
    measured_from: str = ""  # where compute and output come from (device, time, build), when they are known

    @property
    def mib(self) -> float:
        return self.weights_mib + self.kv_mib + (self.compute_mib or 0.0) + (self.output_mib or 0.0)

    @property
    def complete(self) -> bool:
        return self.compute_mib is not None and self.output_mib is not None

    def describe(self) -> str:
        """The `memory.prediction` tag: each part, and which are estimated and which measured."""
        parts = [f"weights {self.weights_mib:.2f} MiB (model file size)",
                 f"KV {self.kv_mib:.2f} MiB (estimated from the GGUF header at the trial's context)"]
        src = f" ({self.measured_from})" if self.measured_from else ""
        if self.compute_mib is not None:
            parts.append(f"compute {self.compute_mib:.2f} MiB measured{src}")
        if self.output_mib is not None:
            parts.append(f"output {self.output_mib:.2f} MiB measured{src}")
        text = " + ".join(parts)
        missing = [k for k, v in (("compute", self.compute_mib), ("output", self.output_mib)) if v is None]
        if missing:
            text += f"; {' and '.join(missing)} buffers not included (never measured for this configuration)"
        return text


def predict(model_bytes: float, kv_bytes: float, compute_mib: Optional[float], output_mib: Optional[float], *,
            measured_from: str = "") -> Prediction:
    """The prediction from the model file's size and the KV cache's bytes, plus measured buffers when known."""
    return Prediction(weights_mib=model_bytes / MIB, kv_mib=kv_bytes / MIB, compute_mib=compute_mib,
                      output_mib=output_mib, measured_from=measured_from)


# --------------------------------------------------------------------------------------------
# One trial's memory metrics


def memory_metrics(account: Optional[BufferAccount], peak_rss_kib: Optional[int], gpu_over_idle_mib: Optional[float],
                   prediction: Optional[Prediction]) -> tuple[dict[str, float], dict[str, str]]:
    """The memory stage's metrics and tags (docs/metrics.md, "Memory"): buffers, their total, the peak, the
    unexplained remainder and the prediction's error; `memory.status` says what is missing and why.

    Measured = peak RSS; where the backend holds buffers in GPU memory (CUDA0, ...) those are outside the resident
    set, so measured = peak RSS + the GPU memory over idle (NVML), and without that reading (a Jetson: tegrastats
    has no GPU figure; the GPU's share is in memory_ram_over_idle_mib) the remainder and the error are absent."""
    metrics: dict[str, float] = {}
    tags: dict[str, str] = {}
    problems: list[str] = []
    if peak_rss_kib is not None:
        metrics["memory_peak_rss_mib"] = peak_rss_kib / 1024
    else:
        problems.append("no peak RSS (the wrapper printed none)")
    total = None
    if account is None:
        problems.append("the backend printed no buffer sizes")
    else:
        tags["memory.buffers"] = account.as_json()
        model, kv = account.total("model"), account.total("kv")
        compute, output = account.total("compute"), account.total("output")
        if model is not None:
            metrics["memory_model_buffer_mib"] = model
        if kv is not None:
            metrics["memory_kv_buffer_mib"] = kv
        if compute is not None:
            metrics["memory_compute_buffer_mib"] = compute
        if output is not None:
            metrics["memory_output_buffer_mib"] = output
        missing = [k for k in KINDS if account.total(k) is None]
        if missing:
            problems.append(f"the backend printed no {', '.join(missing)} buffer size")
        else:
            total = math.fsum(account.total(k) or 0.0 for k in KINDS)
            metrics["memory_backend_total_mib"] = total
    measured = None
    on_gpu = account.device_buffers() if account is not None else {}
    if peak_rss_kib is not None:
        if not on_gpu:
            measured = peak_rss_kib / 1024
            tags["memory.measured"] = "peak RSS of the memory pass"
        elif gpu_over_idle_mib is not None:
            measured = peak_rss_kib / 1024 + gpu_over_idle_mib
            tags["memory.measured"] = "peak RSS of the memory pass + GPU memory over idle of the speed pass (NVML)"
        else:
            shown = ", ".join(f"{k} {v:.2f} MiB" for k, v in on_gpu.items())
            problems.append(f"no unexplained remainder or prediction error: the backend's GPU buffers ({shown}) are "
                            "outside the process's resident set and no GPU memory reading covers them (NVML on a "
                            "discrete GPU; on a Jetson see memory_ram_over_idle_mib)")
    if measured is not None and total is not None:
        metrics["memory_unexplained_mib"] = measured - total
    if prediction is not None:
        metrics["memory_predicted_mib"] = prediction.mib
        tags["memory.prediction"] = prediction.describe()
        if measured:
            metrics["memory_prediction_error_pct"] = 100.0 * (measured - prediction.mib) / measured
    tags["memory.status"] = "; ".join(problems) if problems else "ok"
    return metrics, tags


# --------------------------------------------------------------------------------------------
# The audit: one trial's memory as one map


@dataclass(frozen=True)
class AuditLine:
    label: str
    mib: Optional[float]  # None: not measured (source says why)
    source: str


def _num(metrics: Mapping[str, float], key: str) -> Optional[float]:
    value = metrics.get(key)
    if value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _tag(tags: Mapping[str, str], key: str) -> Optional[str]:
    value = tags.get(key)
    return value if isinstance(value, str) and value else None


def _buffer_source(tags: Mapping[str, str], kind: str, what: str) -> str:
    raw = _tag(tags, "memory.buffers")
    try:
        parts = json.loads(raw).get(kind) if raw else None
    except (ValueError, AttributeError):
        parts = None
    if parts:
        return f"{what}: " + " + ".join(f"{name} {mib:.2f}" for name, mib in parts.items())
    return f"{what}: not printed ({_tag(tags, 'memory.status') or 'no memory pass recorded'})"


def _or_status(value: Optional[float], ok: str, tags: Mapping[str, str], *status_keys: str) -> str:
    if value is not None:
        return ok
    for key in status_keys:
        status = _tag(tags, key)
        if status and status != "ok":
            return status
    return "not recorded"


def audit(metrics: Mapping[str, float], tags: Mapping[str, str]) -> list[AuditLine]:
    """The map of one trial's memory, from its recorded metrics and tags (NaN or absent: not measured): the device
    at idle (OS and other processes, CMA), the backend's parts (weights, KV cache, compute, output), the remainder
    of the measured peak they do not explain, then the measured totals and the planner's prediction."""
    g = lambda key: _num(metrics, key)  # noqa: E731
    lines = [
        AuditLine("OS and other processes at idle", g("memory_ram_idle_mib"),
                  _or_status(g("memory_ram_idle_mib"), "telemetry: mean used RAM over the idle window", tags,
                             "memory.ram.status", "energy.status")),
        AuditLine("CMA in use at idle", g("memory_cma_idle_mib"),
                  _or_status(g("memory_cma_idle_mib"), "/proc/meminfo CmaTotal − CmaFree before the memory pass "
                             "(part of the used RAM above)", tags, "memory.cma.status")),
        AuditLine("model weights", g("memory_model_buffer_mib"), _buffer_source(tags, "model", "llama.cpp model buffers")),
        AuditLine("KV cache", g("memory_kv_buffer_mib"), _buffer_source(tags, "kv", "llama.cpp KV buffers")),
        AuditLine("compute buffers", g("memory_compute_buffer_mib"),
                  _buffer_source(tags, "compute", "llama.cpp compute buffers")),
        AuditLine("output buffer", g("memory_output_buffer_mib"),
                  _buffer_source(tags, "output", "llama.cpp output buffers")),
        AuditLine("unexplained remainder", g("memory_unexplained_mib"),
                  _or_status(g("memory_unexplained_mib"), "measured peak − the four parts above (runtime, code, "
                             "allocator slack; negative: mapped weights never touched)", tags, "memory.status")),
        AuditLine("backend total (its own account)", g("memory_backend_total_mib"),
                  _or_status(g("memory_backend_total_mib"), "weights + KV + compute + output", tags, "memory.status")),
        AuditLine("peak RSS of the backend process", g("memory_peak_rss_mib"),
                  _or_status(g("memory_peak_rss_mib"), "getrusage ru_maxrss of the memory pass", tags,
                             "memory.status")),
        AuditLine("GPU memory over idle", g("memory_gpu_over_idle_mib"),
                  _or_status(g("memory_gpu_over_idle_mib"), "NVML, highest during the speed pass − idle mean", tags,
                             "memory.gpu.status", "energy.status")),
        AuditLine("RAM over idle", g("memory_ram_over_idle_mib"),
                  _or_status(g("memory_ram_over_idle_mib"), "telemetry, highest during the speed pass − idle mean "
                             "(GPU allocations on a Jetson included)", tags, "memory.ram.status", "energy.status")),
        AuditLine("swap over idle", g("memory_swap_over_idle_mib"),
                  _or_status(g("memory_swap_over_idle_mib"), "telemetry, highest during the speed pass − idle mean",
                             tags, "memory.swap.status", "energy.status")),
    ]
    predicted, error = g("memory_predicted_mib"), g("memory_prediction_error_pct")
    source = _tag(tags, "memory.prediction") or "not recorded"
    if predicted is not None and error is not None:
        source = f"{source}; error {error:+.1f} % of measured"
    lines.append(AuditLine("predicted by the planner", predicted, source))
    return lines


def audit_markdown(lines: list[AuditLine]) -> str:
    """The audit as a markdown table: part | MiB | source (— where a figure is absent)."""
    out = ["| part | MiB | source |", "|---|---:|---|"]
    for line in lines:
        mib = "—" if line.mib is None else f"{line.mib:.2f}"
        out.append(f"| {line.label} | {mib} | {line.source.replace('|', '/')} |")
    return "\n".join(out) + "\n"
