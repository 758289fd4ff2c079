"""The types every part of jbench shares: a Trial (what to run) and its results."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

# Keys that do not change what a trial measures; they stay out of its identity hash.
_NON_SEMANTIC = {
    "tracking": None,
    "sweep": None,
    "profile": None,
    "telemetry": None,
    "energy": None,
    "thermal": None,
    "quality": None,
    "round": None,
    "experiment": None,
    "backend": {"timeout_s", "binary_dir", "server_ready_timeout_s"},
    "model": {"display_name", "files", "path_template", "package", "package_version", "ladder"},
    "device": {"host", "user", "port", "key", "tags", "known_hosts", "accept_new_host_key", "connect_timeout_s",
               "keepalive_s", "jump", "sudo_password_env", "paths", "bandwidth_gbs"},
}


# Backend keys that only matter in one scenario (backend.scenario, llama.cpp's "bench" or "latency"). A bench
# trial drops the latency keys and `scenario` itself, so its hash is the one it had before scenarios existed.
_SCENARIO_ONLY = {
    "bench": {"scenario", "latency_requests", "latency_concurrency", "latency_warmup_requests", "context",
              "server_extra_args"},
    "latency": {"repetitions", "warmup", "extra_args"},
}


def semantic_config(config: dict) -> dict:
    """The part of a resolved trial config that determines what is measured."""
    out = {}
    for section, value in config.items():
        if section in _NON_SEMANTIC and _NON_SEMANTIC[section] is None:
            continue
        drop = _NON_SEMANTIC.get(section) or set()
        if section == "backend" and isinstance(value, dict) and value.get("scenario") in _SCENARIO_ONLY:
            drop = drop | _SCENARIO_ONLY[value["scenario"]]
        if isinstance(value, dict):
            out[section] = {k: v for k, v in value.items() if k not in drop}
        else:
            out[section] = value
    return out


def config_hash(config: dict) -> str:
    """Stable identity of a trial: SHA-256 of its semantic config as canonical JSON (key order free)."""
    canonical = json.dumps(semantic_config(config), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and empty dicts stay values."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


@dataclass(frozen=True)
class Trial:
    """One cell of a sweep: a fully resolved config and where it came from."""

    index: int  # 1-based position in the sweep's run order
    config: dict  # resolved, plain containers
    choices: dict  # Hydra group choices (device=local, model=gemma3_270m, ...)
    point: dict  # the sweep values that define this cell, e.g. {"model.quant": "Q4_0"}
    config_hash: str

    @property
    def label(self) -> str:
        if not self.point:
            return "(single trial)"
        return " ".join(f"{k}={v}" for k, v in self.point.items())

    def section(self, name: str) -> dict:
        return self.config[name]


@dataclass
class PhaseResult:
    """Speed of one phase (prefill or decode) over the measured repetitions."""

    phase: str
    n_tokens: int  # tokens processed per repetition
    samples_ns: list[int]  # wall time of each repetition, as the backend measured it
    depth: int = 0
    # Device-clock time (epoch s) when the backend reported this phase's result; with the sum of the
    # repetition times it delimits the phase's measurement window for energy.
    end_time: Optional[float] = None

    @property
    def window(self) -> Optional[tuple[float, float]]:
        if self.end_time is None:
            return None
        return (self.end_time - sum(self.samples_ns) / 1e9, self.end_time)

    @property
    def tokens_in_window(self) -> int:
        return self.n_tokens * len(self.samples_ns)

    @property
    def samples_tps(self) -> list[float]:
        return [self.n_tokens / (ns / 1e9) for ns in self.samples_ns if ns > 0]


@dataclass
class BackendResult:
    phases: dict[str, PhaseResult]
    raw_output: str
    raw_stderr: str = ""
    build: dict[str, str] = field(default_factory=dict)  # build_commit, build_number, backends, ...
    info: dict[str, Any] = field(default_factory=dict)  # cpu_info, gpu_info, model_size, ...
    command: Optional[list[str]] = None
    start_time: Optional[float] = None  # device clock when the backend process started
    # Metrics beyond the phase metrics, already named as in docs/metrics.md (e.g. the latency scenario's
    # ttft_ms_p50, itl_ms_mean, ...); logged as they are.
    extra_metrics: dict[str, float] = field(default_factory=dict)
    # Diagnoses the backend itself made from its output (e.g. the engine's GEMV-trace analysis): each a dict
    # with at least `code` and `message` (also `severity`, `evidence`). Meant to be logged as `finding.<code>` tags.
    findings: list[dict[str, Any]] = field(default_factory=list)
    # Extra numeric results beyond the phase speeds (e.g. gemv_weight_bytes_per_token), named as in
    # docs/backends.md; meant to be logged as MLflow metrics. Never holds a placeholder 0 for "not measured".
    metrics: dict[str, float] = field(default_factory=dict)


def nan_if_none(value: Optional[float]) -> float:
    return math.nan if value is None else value
