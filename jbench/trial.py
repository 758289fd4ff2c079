"""The types every part of jbench shares: a Trial (what to run) and its results."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

# A trial's identity (which config fields count, the build and the model digest) is declared on the
# schemas and computed in jbench.identity; config_hash stays importable from here for existing callers.
from jbench.identity import config_hash  # noqa: F401


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
