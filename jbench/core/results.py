"""The result types every part of jbench shares.

One `Result` shape (metrics, findings, tags, artifacts, series) is what a backend, a telemetry pass and
every per-trial analysis hands back; the sweep merges them into the trial's record. One `Finding` type
carries a diagnosis wherever it comes from (telemetry, a backend's own output, an analysis). `Status`
and `Category` are the only spellings of a trial's state and of why it failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional


class Status(str, Enum):
    """A trial's state; the values are MLflow's run statuses plus SKIPPED (never started)."""

    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    KILLED = "KILLED"
    SKIPPED = "SKIPPED"

    def __str__(self) -> str:
        return self.value


class Category(str, Enum):
    """Why a trial failed or was skipped (tag `jbench.failure_category`, docs/metrics.md)."""

    UNPARSEABLE_OUTPUT = "unparseable_output"
    BACKEND_CRASH = "backend_crash"
    TIMEOUT = "timeout"
    MISSING_BINARY = "missing_binary"
    MISSING_MODEL = "missing_model"
    OUT_OF_MEMORY = "out_of_memory"
    POWER_STATE = "power_state"
    CONNECTION_LOST = "connection_lost"
    DEVICE = "device"
    INTERRUPTED = "interrupted"
    RESUMED = "resumed"
    OOM_SKIP = "oom_skip"
    QUALITY = "quality"  # the quality stage could not measure (llama-perplexity refused, crashed or printed no statistics)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Finding:
    """A named diagnosis with its evidence, e.g. cpu_fallback: 'GR3D 0 % while decoding ...'."""

    code: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    severity: str = "warning"  # info | warning | error

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "severity": self.severity, "evidence": self.evidence}


@dataclass
class Result:
    """What one step of a trial adds to its record.

    metrics: numbers named as in docs/metrics.md (NaN means not measured; it is never logged as a number);
    tags: strings (statuses, sources, reasons); findings: diagnoses; artifacts: {relative path: text};
    series: time series {metric: [(epoch s, value)]}; stepped: per-repetition values {metric: [v0, v1, ...]}.
    """

    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    artifacts: dict[str, str] = field(default_factory=dict)
    series: dict[str, list] = field(default_factory=dict)
    stepped: dict[str, list[float]] = field(default_factory=dict)

    def merge(self, other: "Result") -> "Result":
        """Add other's content to this one; returns self. Later values win for the same name: a metric, tag,
        artifact, series or stepped series of the same name, and a finding of the same code (the later finding
        takes the earlier one's place in the list, so a record holds one finding per code, the newest)."""
        self.metrics.update(other.metrics)
        self.tags.update(other.tags)
        at = {f.code: i for i, f in enumerate(self.findings)}
        for f in other.findings:
            if f.code in at:
                self.findings[at[f.code]] = f
            else:
                at[f.code] = len(self.findings)
                self.findings.append(f)
        self.artifacts.update(other.artifacts)
        self.series.update(other.series)
        self.stepped.update(other.stepped)
        return self


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
    # Leading repetitions set aside because their rate had not settled (jbench.analysis.settle), in run order; they
    # ran before samples_ns, so the window above starts after them.
    cold_samples_ns: list[int] = field(default_factory=list)
    settle: str = ""  # what the settle check found, in words ("" where no check ran)
    settled: Optional[bool] = None  # False: still moving after the allowed warm-up repetitions; None: not checked

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
class LoadWindow:
    """A stretch of a trial under one load (a serving level), on the device's clock, whose energy the Measure stage
    takes from the device's rails like a phase's."""

    name: str  # "level1", "level2", ... in run order
    start: float
    end: float
    output_tokens: int
    total_tokens: int  # prompt + output tokens of the requests that finished in it


@dataclass
class BackendResult(Result):
    """A backend's run: the phases it measured and the raw output behind them, plus the common Result
    fields (metrics beyond the phase speeds, e.g. the latency scenario's ttft_ms_p50 or the engine's
    gemv_weight_bytes_per_token; findings the backend made from its own output)."""

    phases: dict[str, PhaseResult] = field(default_factory=dict)
    raw_output: str = ""
    raw_stderr: str = ""
    build: dict[str, str] = field(default_factory=dict)  # build_commit, build_number, backends, ...
    info: dict[str, Any] = field(default_factory=dict)  # cpu_info, gpu_info, model_size, ...
    command: Optional[list[str]] = None
    start_time: Optional[float] = None  # device clock when the backend process started
    # The serving scenario: its load windows (energy per level) and its levels (jbench.analysis.serving.Level,
    # kept opaque here: core sits below analysis), which the Serving analysis stage turns into the answers.
    load_windows: list[LoadWindow] = field(default_factory=list)
    serving_levels: list[Any] = field(default_factory=list)
