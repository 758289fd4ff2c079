"""Every metric jbench records, declared once: name, unit, description, better direction, provider, inputs.

A declaration's name is either a metric name (`trial_wall_s`) or a pattern whose `{placeholder}`s take the
values listed in `PLACEHOLDERS` (`{phase}_tps` is `prefill_tps` and `decode_tps`; `ttft_ms_p{q}` is
`ttft_ms_p50`, `ttft_ms_p90`, `ttft_ms_p99`). The value sets are finite, so every concrete name jbench can
record is known here (`declared_names()`), and a concrete name belongs to exactly one declaration.

`provider` is the NAME of the stage that puts the metric into a trial's record (`measure`, `phase_speed`,
`roofline`), or `runner` for what the trial runner records around the stages. `requires`
lists the metrics a declaration is computed from, written with the same placeholders as its name: a stage
that provides `roofline_fraction` needs `decode_tps` first, so `stage_dependencies()` gives the graph that
`graphlib.TopologicalSorter` orders stages by.

docs/metrics.md holds one table per `group` (name | unit | description), checked against these
declarations by tests/test_metrics_declared.py; `python -m jbench.core.metrics` prints the tables.

Nothing here imports another jbench package.
"""

from __future__ import annotations

import difflib
import itertools
import re
import string
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, Literal, Optional

__all__ = [
    "PLACEHOLDERS", "UNITS", "HIGHER", "LOWER", "GROUPS", "DECLARATIONS", "MEASURE", "PHASE_SPEED", "ROOFLINE",
    "RUNNER", "QUALITY", "MEMORY", "MetricDecl", "UnknownMetric",
    "metric", "find", "is_declared", "unit_of", "declared_names", "declarations", "provided_by", "required_by",
    "stage_dependencies", "metrics_table",
]

# The values each placeholder of a declared name takes.
PLACEHOLDERS: dict[str, tuple[str, ...]] = {
    # The measured phases of a trial (llama-bench's pp and tg tests, a latency request's TTFT and ITL).
    "phase": ("prefill", "decode"),
    # Energy windows on the device's clock: the phases plus the idle baseline, model load and cooldown.
    "window": ("idle", "load", "prefill", "decode", "cooldown"),
    # Latency percentiles (jbench.backends.llamacpp.client.PERCENTILES).
    "q": ("50", "90", "99"),
    # soctherm over-current counters: 1 under-voltage, 2 average, 3 instantaneous over-current.
    "k": ("1", "2", "3"),
}

# The units a declaration may use, with what each means.
UNITS: dict[str, str] = {
    "tok/s": "tokens per second",
    "tok": "tokens",
    "tok/J": "tokens per joule",
    "req/s": "requests per second",
    "J/tok": "joules per token",
    "J": "joules",
    "W": "watts",
    "ms": "milliseconds",
    "s": "seconds",
    "B/tok": "bytes per token",
    "bit/weight": "bits per model weight (parameter)",
    "GB/s": "10^9 bytes per second",
    "MHz": "megahertz",
    "°C": "degrees Celsius",
    "%": "percent",
    "1": "a count or a ratio (dimensionless)",
    "1/tok": "a count per token",
    "nat": "natural units of information (KL divergence, natural logarithm)",
    "MiB": "2^20 bytes",
}

HIGHER: Literal["higher"] = "higher"
LOWER: Literal["lower"] = "lower"

# Stage and workflow names that provide metrics (runner stages' NAME; `sweep` and `bisect` record their own).
# `runner`: the trial runner itself (jbench.runner.trials), around the stages.
MEASURE, PHASE_SPEED, ROOFLINE, RUNNER = "measure", "phase_speed", "roofline", "runner"
QUALITY, MEMORY, SERVING = "quality", "memory", "serving"

# docs/metrics.md's tables, in the order the document shows them: group -> its heading in the document.
GROUPS: dict[str, str] = {
    "speed": "Speed",
    "statistics": "Statistics over repetitions",
    "energy": "Energy",
    "energy_pass": "Energy pass speed match",
    "throttling": "Throttling evidence",
    "wall": "Wall power",
    "telemetry_series": "Telemetry series",
    "roofline": "Roofline",
    "latency": "Latency scenario",
    "engine": "Engine GEMV trace",
    "quality": "Output quality",
    "memory": "Memory",
    "serving": "Serving scenario",
}

_FIELDS = re.compile(r"\{(\w+)\}")


class UnknownMetric(KeyError):
    """A metric name no declaration covers."""

    def __str__(self) -> str:  # KeyError's own str() quotes the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class MetricDecl:
    """One declared metric or family of metrics (a name pattern with placeholders)."""

    name: str  # `decode_tps`, or a pattern such as `{phase}_tps` (placeholders from PLACEHOLDERS)
    unit: str  # a key of UNITS
    description: str  # one line: what the number is and how it is computed
    provider: str  # the stage (or workflow) NAME that records it
    group: str  # its table in docs/metrics.md (a key of GROUPS)
    better: Optional[Literal["higher", "lower"]] = None  # None: no direction (a count, a setting, a bound)
    requires: tuple[str, ...] = ()  # metrics it is computed from, with the same placeholders as `name`
    stepped: bool = False  # logged as one value per repetition (step = repetition index), not one value
    backend: Optional[str] = None  # only this backend (or scenario's backend) records it

    @property
    def placeholders(self) -> tuple[str, ...]:
        """The placeholder names of the pattern, in order (empty for a plain name)."""
        return tuple(_FIELDS.findall(self.name))

    @property
    def is_pattern(self) -> bool:
        return bool(self.placeholders)

    @property
    def sign(self) -> int:
        """+1 when higher is better, -1 when lower is better, 0 without a direction."""
        return {HIGHER: 1, LOWER: -1}.get(self.better or "", 0)

    @cached_property
    def _regex(self) -> re.Pattern[str]:
        parts = []
        for literal, field, _, _ in string.Formatter().parse(self.name):
            parts.append(re.escape(literal))
            if field is not None:
                parts.append(f"(?P<{field}>{'|'.join(map(re.escape, PLACEHOLDERS[field]))})")
        return re.compile("".join(parts))

    def match(self, name: str) -> Optional[dict[str, str]]:
        """The placeholder values that make this declaration's pattern `name`, or None."""
        found = self._regex.fullmatch(name)
        return found.groupdict() if found else None

    def bind(self, values: dict[str, str]) -> str:
        """The concrete name for the given placeholder values."""
        return self.name.format(**values) if self.is_pattern else self.name

    def names(self) -> list[str]:
        """Every concrete name this declaration covers."""
        fields = list(dict.fromkeys(self.placeholders))
        return [self.bind(dict(zip(fields, combo))) for combo in itertools.product(*(PLACEHOLDERS[f] for f in fields))]

    def inputs(self, name: str) -> tuple[str, ...]:
        """The concrete metrics the concrete metric `name` is computed from."""
        values = self.match(name)
        if values is None:
            raise UnknownMetric(f"{name} is not a name of {self.name}")
        return tuple(req.format(**values) for req in self.requires)


def _d(name: str, unit: str, description: str, provider: str, group: str, **kw) -> MetricDecl:
    return MetricDecl(name, unit, description, provider, group, **kw)


DECLARATIONS: tuple[MetricDecl, ...] = (
    # --- speed: jbench.runner.analyses.phase_metrics over a BackendResult's phases; the sweep's trial time
    _d("{phase}_tps", "tok/s", "mean over repetitions i of tokens / t_i (prefill: n_prompt, decode: n_gen tokens; "
       "t_i = samples_ns[i] / 1e9 of the phase's record)", PHASE_SPEED, "speed", better=HIGHER),
    _d("{phase}_tps_std", "tok/s", "sample standard deviation (n − 1 denominator) of the per-repetition rates; absent "
       "with one repetition", PHASE_SPEED, "speed", requires=("{phase}_tps",)),
    _d("{phase}_tps_median", "tok/s", "median of the per-repetition rates", PHASE_SPEED, "speed", better=HIGHER),
    _d("{phase}_tps_rep", "tok/s", "each settled repetition's rate, a stepped metric (step = repetition index from 0)",
       PHASE_SPEED, "speed", better=HIGHER, stepped=True),
    _d("{phase}_ms_mean", "ms", "mean wall time of one repetition of the phase", PHASE_SPEED, "speed", better=LOWER),
    _d("{phase}_tokens", "tok", "tokens processed in one repetition (n_prompt, n_gen)", PHASE_SPEED, "speed"),
    _d("{phase}_repetitions", "1", "number of timed repetitions behind the figures", PHASE_SPEED, "speed"),
    _d("{phase}_cold_repetitions", "1", "leading timed repetitions set aside because their rate had not settled "
       "(jbench.analysis.settle: off the median of the repetitions after backend.settle_repetitions by more than "
       "max(3 %, 3 robust SDs)); absent where no settle check ran", PHASE_SPEED, "speed"),
    _d("{phase}_cold_tps", "tok/s", "mean rate of those cold repetitions (not in `{phase}_tps`); absent when none "
       "was cold", PHASE_SPEED, "speed"),
    _d("trial_wall_s", "s", "controller wall time of the whole trial (backend invocation incl. model load, warmup "
       "and parsing)", RUNNER, "speed"),
    # --- statistics over repetitions: phase_metrics too
    _d("{phase}_tps_ci95_low", "tok/s", "lower end of the 95 % confidence interval of the rate, on the log scale (a "
       "rate is positive, its noise multiplicative): exp(m − t(0.975, n − 1) · s / √n) with m, s the mean and sample "
       "standard deviation of ln(rate) over the repetitions; always > 0; absent with one repetition", PHASE_SPEED,
       "statistics", requires=("{phase}_tps", "{phase}_tps_std", "{phase}_repetitions")),
    _d("{phase}_tps_ci95_high", "tok/s", "upper end of that interval: exp(m + t(0.975, n − 1) · s / √n); absent "
       "with one repetition", PHASE_SPEED, "statistics",
       requires=("{phase}_tps", "{phase}_tps_std", "{phase}_repetitions")),
    _d("{phase}_tps_cv", "1", "coefficient of variation std / mean of the per-repetition rates; over sweep.max_cv "
       "the trial is tagged jbench.noisy=true with the reason", PHASE_SPEED, "statistics", better=LOWER,
       requires=("{phase}_tps", "{phase}_tps_std")),
    # --- energy per window: jbench.analysis.telemetry.energy_metrics (the Measure stage)
    _d("{window}_energy_j", "J", "trapezoid integral of total board input power over exactly the window (linear "
       "interpolation at its edges)", MEASURE, "energy"),
    _d("{window}_avg_power_w", "W", "`{window}_energy_j` / window length", MEASURE, "energy",
       requires=("{window}_energy_j", "{window}_window_s")),
    _d("{window}_window_s", "s", "window length", MEASURE, "energy"),
    _d("{window}_window_samples", "1", "telemetry samples inside the window", MEASURE, "energy"),
    _d("idle_power_w", "W", "average board power over the idle window: the baseline of the above-idle figures",
       MEASURE, "energy", requires=("idle_avg_power_w",)),
    _d("{phase}_tokens_per_joule", "tok/J", "tokens processed in the window (tokens per repetition × repetitions) "
       "/ `{phase}_energy_j`; absent when the energy window ran at another speed than the speed pass", MEASURE,
       "energy", better=HIGHER, requires=("{phase}_energy_j",)),
    _d("{phase}_joules_per_token", "J/tok", "`{phase}_energy_j` / tokens processed in the window", MEASURE, "energy",
       better=LOWER, requires=("{phase}_energy_j",)),
    _d("{phase}_energy_above_idle_j", "J", "`{phase}_energy_j` − `idle_power_w` × window length (logged only when "
       "larger than the window energy's own uncertainty: its edge-error bound, else float round-off)", MEASURE, "energy", requires=("{phase}_energy_j", "idle_power_w")),
    _d("{phase}_tokens_per_joule_above_idle", "tok/J", "tokens processed in the window / "
       "`{phase}_energy_above_idle_j`", MEASURE, "energy", better=HIGHER,
       requires=("{phase}_energy_above_idle_j",)),
    _d("{window}_gpu_energy_j", "J", "the same integral over the GPU rail (the profile's gpu_rail, else the "
       "module's usual rail) where the telemetry source has it", MEASURE, "energy"),
    _d("{window}_cpu_energy_j", "J", "the same integral over the CPU rail (the profile's cpu_rail, else the "
       "module's usual rail) where the telemetry source has it", MEASURE, "energy"),
    _d("{window}_cpu_gpu_cv_energy_j", "J", "the same integral over a rail that feeds CPU, GPU and CV together "
       "(VDD_CPU_GPU_CV on Xavier NX, Orin NX, Orin Nano, or one rail a profile names for both): reported once, never "
       "as both GPU and CPU energy", MEASURE,
       "energy"),
    _d("measure_wall_s", "s", "wall time of the Measure stage: idle baseline, speed pass, energy passes and "
       "cooldown, the device time telemetry costs a trial", MEASURE, "energy_pass", better=LOWER),
    _d("power_sensor_period_ms", "ms", "the total-power sensor's effective period: the longer of the median sampling "
       "interval and the median time between changed readings (jbench.analysis.sensor)", MEASURE, "energy"),
    _d("{phase}_energy_edge_error_pct", "%", "the most the window's two edges can put into `{phase}_energy_j`: (power "
       "step at each edge, within one sensor period) × sensor period / 2, over the window's energy; over "
       "energy.max_edge_error the window's energy is withheld", MEASURE, "energy", better=LOWER,
       requires=("power_sensor_period_ms",)),
    _d("{window}_energy_counter_j", "J", "a hardware energy counter's increase over the window (NVML "
       "nvmlDeviceGetTotalEnergyConsumption), interpolated at the edges", MEASURE, "energy"),
    _d("{window}_energy_deviation_pct", "%", "100 · (integrated − counter) / counter", MEASURE, "energy",
       requires=("{window}_energy_j", "{window}_energy_counter_j")),
    # --- the energy pass's speed against the speed pass's: jbench.runner.measure
    _d("{phase}_energy_window_tps", "tok/s", "tokens in the energy pass's window / window length: the rate its "
       "energy was drawn at", MEASURE, "energy_pass"),
    _d("{phase}_energy_speed_difference_pct", "%", "100 · abs(energy window rate − speed pass rate) / speed pass rate; "
       "over energy.speed_tolerance the phase's per-token energy figures are withheld", MEASURE, "energy_pass",
       better=LOWER, requires=("{phase}_energy_window_tps",)),
    # --- throttling evidence per window: jbench.analysis.telemetry.throttling_metrics
    _d("{window}_oc{k}_events", "1", "events of soctherm counter oc{k}_event_cnt (1 under-voltage, 2 average, 3 "
       "instantaneous over-current): its last reading in the window − its last reading at or before the window "
       "start (else the first inside); absent after a reset or with fewer than 2 readings", MEASURE,
       "throttling", better=LOWER),
    _d("{window}_temp_max_c", "°C", "hottest thermal zone reading in the window", MEASURE, "throttling",
       better=LOWER),
    _d("{window}_gpu_freq_min_mhz", "MHz", "lowest GPU clock in the window", MEASURE, "throttling"),
    _d("{window}_gpu_freq_max_mhz", "MHz", "highest GPU clock in the window", MEASURE, "throttling"),
    _d("{window}_gpu_freq_drop_pct", "%", "100 · (max − min) / max of the GPU clock in the window", MEASURE,
       "throttling", better=LOWER, requires=("{window}_gpu_freq_min_mhz", "{window}_gpu_freq_max_mhz")),
    _d("{window}_cpu_freq_min_mhz", "MHz", "lowest clock of the fastest CPU core per reading in the window",
       MEASURE, "throttling"),
    _d("{window}_cpu_freq_max_mhz", "MHz", "highest clock of the fastest CPU core per reading in the window",
       MEASURE, "throttling"),
    _d("{window}_cpu_freq_drop_pct", "%", "100 · (max − min) / max of that CPU clock in the window", MEASURE,
       "throttling", better=LOWER, requires=("{window}_cpu_freq_min_mhz", "{window}_cpu_freq_max_mhz")),
    # --- wall meter: jbench.analysis.wall (the Measure stage, with wall_power.source set)
    _d("{window}_wall_energy_j", "J", "wall energy over exactly the window: the meter's own counter where its "
       "resolution is fine enough, else the integral (tag wall.{window}.energy_method says which)", MEASURE, "wall"),
    _d("{window}_wall_avg_power_w", "W", "`{window}_wall_energy_j` / window length", MEASURE, "wall",
       requires=("{window}_wall_energy_j",)),
    _d("{window}_wall_energy_coverage", "1", "share of the window covered by the meter's readings (gaps over 3× "
       "the median interval are not covered)", MEASURE, "wall", better=HIGHER),
    _d("{window}_energy_coverage", "1", "the same share for the board's power series, recorded beside the wall "
       "meter's", MEASURE, "wall", better=HIGHER),
    _d("{window}_wall_window_samples", "1", "meter readings inside the window", MEASURE, "wall"),
    _d("{window}_wall_energy_integrated_j", "J", "trapezoid integral of the meter's power over the window",
       MEASURE, "wall"),
    _d("{window}_wall_energy_counter_j", "J", "increase of the meter's own energy counter over the window "
       "(Shelly aenergy.total, Tasmota Total)", MEASURE, "wall"),
    _d("{phase}_wall_tokens_per_joule", "tok/J", "tokens processed in the window / `{phase}_wall_energy_j`",
       MEASURE, "wall", better=HIGHER, requires=("{phase}_wall_energy_j",)),
    _d("{phase}_wall_joules_per_token", "J/tok", "`{phase}_wall_energy_j` / tokens processed in the window",
       MEASURE, "wall", better=LOWER, requires=("{phase}_wall_energy_j",)),
    _d("idle_wall_power_w", "W", "average wall power over the idle window (= `idle_wall_avg_power_w`)", MEASURE,
       "wall", requires=("idle_wall_avg_power_w",)),
    # --- telemetry series, one point per sample on the device's clock: jbench.analysis.telemetry.mlflow_series
    _d("system/device/power_w", "W", "total board input power of each telemetry sample", MEASURE,
       "telemetry_series"),
    _d("system/device/gpu_load_pct", "%", "GPU load of each telemetry sample", MEASURE, "telemetry_series"),
    _d("system/device/gpu_freq_mhz", "MHz", "GPU clock of each telemetry sample", MEASURE, "telemetry_series"),
    _d("system/device/emc_load_pct", "%", "memory controller (EMC) load of each telemetry sample", MEASURE,
       "telemetry_series"),
    _d("system/device/temp_max_c", "°C", "hottest thermal zone of each telemetry sample", MEASURE,
       "telemetry_series"),
    # --- roofline: jbench.runner.analyses.trial_roofline
    _d("roofline_weight_bytes_per_token", "B/tok", "sum over the GGUF tensor table of every tensor read per decoded "
       "token (the token-embedding table is one gathered row, read in full when the LM head is tied to it)", ROOFLINE,
       "roofline"),
    _d("roofline_bits_per_weight", "bit/weight", "8 × bytes / elements over every tensor of the GGUF file: its real "
       "bits per weight (Q4_0 and Q4_K_M name the same 4.5-bit main type; their other tensors differ)", ROOFLINE,
       "roofline"),
    _d("roofline_kv_bytes_per_token", "B/tok", "2 (K, V) × layers × KV heads × head dim × bytes per element of the "
       "KV types, per token of context", ROOFLINE, "roofline"),
    _d("roofline_bytes_per_token", "B/tok", "weights + KV bytes read per decoded token at the trial's depth "
       "(sliding-window layers read at most their window)", ROOFLINE, "roofline",
       requires=("roofline_weight_bytes_per_token", "roofline_kv_bytes_per_token")),
    _d("roofline_decode_tps", "tok/s", "bandwidth / `roofline_bytes_per_token`: the decode ceiling", ROOFLINE,
       "roofline", requires=("roofline_bandwidth_gbs", "roofline_bytes_per_token")),
    _d("roofline_bandwidth_gbs", "GB/s", "the read bandwidth the ceiling uses (device.bandwidth_gbs, a calibration, "
       "an auto-calibration or the datasheet: tag roofline.bandwidth_source)", ROOFLINE, "roofline"),
    _d("roofline_bandwidth_median_gbs", "GB/s", "median run of the calibration behind the ceiling", ROOFLINE,
       "roofline"),
    _d("roofline_bandwidth_min_gbs", "GB/s", "slowest run of the calibration behind the ceiling", ROOFLINE,
       "roofline"),
    _d("roofline_bandwidth_spread", "1", "(max − min) / median over the calibration's runs", ROOFLINE, "roofline",
       better=LOWER),
    _d("roofline_measured_over_ceiling", "1", "`decode_tps` / `roofline_decode_tps`, always recorded (above 1: "
       "the finding ceiling_below_measured)", ROOFLINE, "roofline", requires=("decode_tps", "roofline_decode_tps")),
    _d("roofline_fraction", "1", "the same ratio, recorded only when it is at most 1 (above 1 the trial carries the "
       "finding ceiling_below_measured instead)", ROOFLINE, "roofline",
       better=HIGHER, requires=("decode_tps", "roofline_decode_tps")),
    # --- latency scenario (llama.cpp): jbench.backends.llamacpp.client.latency_metrics, recorded by Measure
    _d("ttft_ms_p{q}", "ms", "percentile q of the requests' TTFT (first streamed token's arrival − send)", MEASURE,
       "latency", better=LOWER, backend="llamacpp"),
    _d("ttft_ms_mean", "ms", "mean TTFT over the requests", MEASURE, "latency", better=LOWER, backend="llamacpp"),
    _d("itl_ms_p{q}", "ms", "percentile q of the requests' ITL ((e2e − TTFT) / (output tokens − 1))", MEASURE,
       "latency", better=LOWER, backend="llamacpp"),
    _d("itl_ms_mean", "ms", "mean ITL over the requests", MEASURE, "latency", better=LOWER, backend="llamacpp"),
    _d("e2e_ms_p{q}", "ms", "percentile q of the requests' end-to-end latency (end of stream − send)", MEASURE,
       "latency", better=LOWER, backend="llamacpp"),
    _d("e2e_ms_mean", "ms", "mean end-to-end latency over the requests", MEASURE, "latency", better=LOWER,
       backend="llamacpp"),
    _d("output_tps_p{q}", "tok/s", "percentile q of one request's output tokens / e2e", MEASURE, "latency",
       better=HIGHER, backend="llamacpp"),
    _d("output_tps_mean", "tok/s", "mean over the requests of output tokens / e2e", MEASURE, "latency",
       better=HIGHER, backend="llamacpp"),
    _d("latency_requests", "1", "measured requests", MEASURE, "latency", backend="llamacpp"),
    _d("latency_concurrency", "1", "requests in flight (= server slots)", MEASURE, "latency", backend="llamacpp"),
    _d("latency_output_tokens_mean", "tok", "mean output tokens per request (n_gen unless the server ignored "
       "ignore_eos)", MEASURE, "latency", backend="llamacpp"),
    _d("latency_wall_s", "s", "first send to last end of stream over the measured requests", MEASURE, "latency",
       backend="llamacpp"),
    _d("latency_throughput_tps", "tok/s", "all measured output tokens / `latency_wall_s` (aggregate, meaningful "
       "with concurrency > 1)", MEASURE, "latency", better=HIGHER, requires=("latency_wall_s",),
       backend="llamacpp"),
    _d("server_prefill_tps", "tok/s", "mean over requests of llama-server's own timings.prompt_per_second (server "
       "clock); absent when the server reports no timings", MEASURE, "latency", better=HIGHER, backend="llamacpp"),
    _d("server_decode_tps", "tok/s", "mean over requests of llama-server's own timings.predicted_per_second (server "
       "clock); absent when the server reports no timings", MEASURE, "latency", better=HIGHER, backend="llamacpp"),
    _d("draft_acceptance", "1", "speculative decoding (backend.draft / spec_type): the draft tokens the target "
       "accepted / the draft tokens proposed, summed over the requests from llama-server's own timings.draft_n_accepted "
       "and draft_n; absent when no request reported them", MEASURE, "latency", better=HIGHER, backend="llamacpp"),
    _d("draft_tokens_per_output_token", "1", "draft tokens proposed / output tokens, over the requests that reported "
       "llama-server's draft counters", MEASURE, "latency", backend="llamacpp"),
    # --- the in-house engine's GEMV trace (backend.trace=true): jbench.backends.engine.backend, recorded by Measure
    _d("gemv_launches_per_token", "1/tok", "GEMV launches in one decoded token's block of the trace", MEASURE,
       "engine", backend="engine"),
    _d("gemv_weight_bytes_per_token", "B/tok", "sum of M × K × bytes per weight of the type (gguf block sizes) over "
       "that block", MEASURE, "engine", backend="engine"),
    _d("gemv_implied_bandwidth_gbs", "GB/s", "`gemv_weight_bytes_per_token` × the measured decode rate / 1e9 "
       "(weights only: KV reads are not in the trace)", MEASURE, "engine", backend="engine",
       requires=("gemv_weight_bytes_per_token",)),
    _d("gemv_ceiling_tps", "tok/s", "bandwidth / `gemv_weight_bytes_per_token` (an upper bound)", MEASURE, "engine",
       backend="engine", requires=("gemv_weight_bytes_per_token",)),
    _d("gemv_fraction_of_ceiling", "1", "the measured decode rate / `gemv_ceiling_tps`", MEASURE, "engine",
       better=HIGHER, backend="engine", requires=("gemv_ceiling_tps",)),
    # --- output quality: jbench.runner.quality (llama-perplexity's KL-divergence statistics against a reference)
    _d("quality_kld_mean", "nat", "mean over the scored tokens of KL(reference ‖ trial) between their next-token "
       "distributions (llama-perplexity `Mean    KLD`)", QUALITY, "quality", better=LOWER, backend="llamacpp"),
    _d("quality_kld_mean_err", "nat", "its uncertainty as llama-perplexity prints it (± : standard error of the "
       "mean)", QUALITY, "quality", requires=("quality_kld_mean",), backend="llamacpp"),
    _d("quality_kld_median", "nat", "median over the scored tokens of that KL divergence (`Median  KLD`)", QUALITY,
       "quality", better=LOWER, backend="llamacpp"),
    _d("quality_kld_p99", "nat", "its 99th percentile over the scored tokens (`99.0%   KLD`)", QUALITY, "quality",
       better=LOWER, backend="llamacpp"),
    _d("quality_kld_max", "nat", "its maximum over the scored tokens (`Maximum KLD`)", QUALITY, "quality",
       better=LOWER, backend="llamacpp"),
    _d("quality_same_top_pct", "%", "share of scored tokens whose most likely next token is the reference's (`Same "
       "top p`)", QUALITY, "quality", better=HIGHER, backend="llamacpp"),
    _d("quality_same_top_pct_err", "%", "its uncertainty: 100 · √(p (1 − p) / (n − 1)) as llama-perplexity prints "
       "it", QUALITY, "quality", requires=("quality_same_top_pct",), backend="llamacpp"),
    _d("quality_rms_dp_pct", "%", "root mean square over the scored tokens of the difference between the trial's "
       "and the reference's probability of the corpus's next token (`RMS Δp`)", QUALITY, "quality", better=LOWER,
       backend="llamacpp"),
    _d("quality_rms_dp_pct_err", "%", "its uncertainty as llama-perplexity prints it", QUALITY, "quality",
       requires=("quality_rms_dp_pct",), backend="llamacpp"),
    _d("quality_ppl", "1", "perplexity of the trial over the scored tokens (`Mean PPL(Q)`)", QUALITY, "quality",
       better=LOWER, backend="llamacpp"),
    _d("quality_ppl_err", "1", "its uncertainty as llama-perplexity prints it", QUALITY, "quality",
       requires=("quality_ppl",), backend="llamacpp"),
    _d("quality_ppl_base", "1", "perplexity of the reference over the same tokens (`Mean PPL(base)`)", QUALITY,
       "quality", backend="llamacpp"),
    _d("quality_ppl_base_err", "1", "its uncertainty as llama-perplexity prints it", QUALITY, "quality",
       requires=("quality_ppl_base",), backend="llamacpp"),
    _d("quality_ppl_ratio", "1", "`Mean PPL(Q)/PPL(base)`: the trial's perplexity over the reference's (1: no loss)",
       QUALITY, "quality", better=LOWER, backend="llamacpp"),
    _d("quality_ppl_ratio_err", "1", "its uncertainty as llama-perplexity prints it (correlated errors of both "
       "passes accounted for)", QUALITY, "quality", requires=("quality_ppl_ratio",), backend="llamacpp"),
    _d("quality_scored_tokens", "tok", "tokens scored: chunks × (context − 1 − context // 2), from the chunks and "
       "context llama-perplexity reports", QUALITY, "quality", backend="llamacpp"),
    _d("quality_wall_s", "s", "wall time of the trial's llama-perplexity pass (and of the reference pass when this "
       "trial computed the reference logits); absent when the quality was reused", QUALITY, "quality",
       better=LOWER, backend="llamacpp"),
    _d("quality_reference_logits_mib", "MiB", "size of the reference logits file on the device: a 20-byte header, 4 "
       "bytes per corpus token read, and (n_vocab rounded up to even + 4) × 2 bytes per scored token", QUALITY, "quality", backend="llamacpp"),
    # --- memory: the backend's own account and the process's peak (jbench.runner.memory), the device's use over its
    # idle baseline (the Measure stage's telemetry)
    _d("memory_peak_rss_mib", "MiB", "peak resident set of the backend process (getrusage ru_maxrss of the memory "
       "pass, which allocates what the speed pass does: mapped weights that were touched, KV cache, compute and "
       "output buffers in host memory)", MEMORY, "memory", better=LOWER),
    _d("memory_model_buffer_mib", "MiB", "the backend's own account of its weight buffers (llama.cpp `model buffer "
       "size`, summed over buffer types: mapped, repacked, GPU)", MEMORY, "memory", better=LOWER),
    _d("memory_kv_buffer_mib", "MiB", "its KV-cache buffers (llama.cpp `KV buffer size`, summed over the caches of "
       "one context; the largest context of the pass)", MEMORY, "memory", better=LOWER),
    _d("memory_compute_buffer_mib", "MiB", "its compute buffers (llama.cpp `compute buffer size`, summed over "
       "devices; the largest context of the pass)", MEMORY, "memory", better=LOWER),
    _d("memory_output_buffer_mib", "MiB", "its output (logits) buffer (llama.cpp `output buffer size`; the largest "
       "context of the pass)", MEMORY, "memory"),
    _d("memory_backend_total_mib", "MiB", "model + KV + compute + output buffers: everything the backend accounts "
       "for", MEMORY, "memory", requires=("memory_model_buffer_mib", "memory_kv_buffer_mib",
                                           "memory_compute_buffer_mib", "memory_output_buffer_mib")),
    _d("memory_unexplained_mib", "MiB", "measured peak (`memory_peak_rss_mib`, plus the device memory over idle on a "
       "discrete GPU) − `memory_backend_total_mib`: runtime, code, allocator slack", MEMORY, "memory",
       requires=("memory_peak_rss_mib", "memory_backend_total_mib")),
    _d("memory_predicted_mib", "MiB", "the planner's prediction: weights (model file) + KV cache at the trial's "
       "context (GGUF header) + compute and output buffers (measured for this configuration before, else none: tag "
       "memory.prediction)", MEMORY, "memory"),
    _d("memory_prediction_error_pct", "%", "100 · (measured − predicted) / measured, measured as in "
       "`memory_unexplained_mib`: positive when the prediction was short", MEMORY, "memory",
       requires=("memory_peak_rss_mib", "memory_predicted_mib")),
    _d("memory_cma_idle_mib", "MiB", "contiguous memory (CMA) in use before the pass: CmaTotal − CmaFree of "
       "/proc/meminfo; absent where the kernel has no CMA", MEMORY, "memory"),
    _d("memory_ram_idle_mib", "MiB", "RAM in use over the idle window (OS and other processes): the mean of the "
       "telemetry's used-RAM readings", MEASURE, "memory"),
    _d("memory_ram_over_idle_mib", "MiB", "highest used-RAM reading from model load to the end of decode − "
       "`memory_ram_idle_mib`: the trial's share of (unified) RAM, GPU allocations on a Jetson included", MEASURE,
       "memory", better=LOWER, requires=("memory_ram_idle_mib",)),
    _d("memory_swap_over_idle_mib", "MiB", "highest swap in use from model load to the end of decode − its idle "
       "mean", MEASURE, "memory", better=LOWER),
    _d("memory_gpu_over_idle_mib", "MiB", "highest GPU memory in use (NVML) from model load to the end of decode − "
       "its idle mean: the trial's device memory on a discrete GPU", MEASURE, "memory", better=LOWER),
    # --- serving scenario: jbench.runner.serving over the levels (jbench.analysis.serving) and their energy windows;
    # per-level figures are stepped metrics, step = the level in run order
    _d("serving_level_load", "1", "each level's load: requests in flight (serving.load=concurrency) or requests per "
       "second (rate)", SERVING, "serving", stepped=True),
    _d("serving_request_throughput_rps", "req/s", "each level's completed requests / its wall time (first send to "
       "last stream end)", SERVING, "serving", better=HIGHER, stepped=True),
    _d("serving_output_tps", "tok/s", "each level's output tokens (the server's usage) / its wall time", SERVING,
       "serving", better=HIGHER, stepped=True),
    _d("serving_total_tps", "tok/s", "each level's prompt + output tokens / its wall time", SERVING, "serving",
       better=HIGHER, stepped=True),
    _d("serving_goodput_rps", "req/s", "each level's requests that met every serving.slo target / its wall time",
       SERVING, "serving", better=HIGHER, stepped=True),
    _d("serving_slo_attainment", "1", "each level's share of requests that met every serving.slo target (absent "
       "without a target)", SERVING, "serving", better=HIGHER, stepped=True),
    _d("serving_ttft_ms_p{q}", "ms", "each level's percentile q of time to first token", SERVING, "serving",
       better=LOWER, stepped=True),
    _d("serving_tpot_ms_p{q}", "ms", "each level's percentile q over requests of time per output token after the "
       "first: (e2e − TTFT) / (output tokens − 1)", SERVING, "serving", better=LOWER, stepped=True),
    _d("serving_itl_ms_p{q}", "ms", "each level's percentile q of the gaps between consecutive streamed tokens, "
       "pooled over its requests", SERVING, "serving", better=LOWER, stepped=True),
    _d("serving_e2e_ms_p{q}", "ms", "each level's percentile q of end-to-end latency", SERVING, "serving",
       better=LOWER, stepped=True),
    _d("serving_avg_power_w", "W", "each level's mean total power over its window on the device's rails", SERVING,
       "serving", stepped=True),
    _d("serving_output_tokens_per_joule", "tok/J", "each level's output tokens / the energy of its window", SERVING,
       "serving", better=HIGHER, stepped=True),
    _d("serving_total_tokens_per_joule", "tok/J", "each level's prompt + output tokens / the energy of its window",
       SERVING, "serving", better=HIGHER, stepped=True),
    _d("serving_joules_per_output_token", "J/tok", "the energy of each level's window / its output tokens", SERVING,
       "serving", better=LOWER, stepped=True),
    _d("serving_levels_run", "1", "levels run (a grid's levels, or the levels the SLO search chose, replicates "
       "included)", SERVING, "serving"),
    _d("serving_max_output_tps", "tok/s", "the highest level output tok/s", SERVING, "serving", better=HIGHER),
    _d("serving_knee_load", "1", "the load where throughput stops growing in proportion (jbench.analysis.serving."
       "knee); tag serving.knee_load says how it was found", SERVING, "serving"),
    _d("serving_knee_load_low", "1", "lower end of its bootstrap interval over each level's requests", SERVING,
       "serving"),
    _d("serving_knee_load_high", "1", "upper end of that interval", SERVING, "serving"),
    _d("serving_slo_capacity", "1", "the highest load whose share of requests meeting every serving.slo target is at "
       "least serving.slo.attainment (isotonic fit over the levels); tag serving.slo_capacity says whether it was "
       "bracketed", SERVING, "serving", better=HIGHER),
    _d("serving_slo_capacity_low", "1", "lower end of its bootstrap interval", SERVING, "serving"),
    _d("serving_slo_capacity_high", "1", "upper end of that interval", SERVING, "serving"),
    _d("serving_capacity_output_tps", "tok/s", "output tok/s at the SLO capacity (mean of its runs)", SERVING,
       "serving", better=HIGHER),
    _d("serving_capacity_goodput_rps", "req/s", "goodput at the SLO capacity", SERVING, "serving", better=HIGHER),
    _d("serving_capacity_output_tokens_per_joule", "tok/J", "output tokens per joule at the SLO capacity: the "
       "operating point's efficiency", SERVING, "serving", better=HIGHER),
    _d("serving_clock_uncertainty_ms", "ms", "how far the levels' windows may sit off on the device's clock (half the "
       "best round trip of the clock reads, widened by drift)", MEASURE, "serving"),
    _d("serving_server_peak_rss_mib", "MiB", "the server process's peak resident set over the whole trial (VmHWM of "
       "/proc/<pid>/status on the device, read just before jbench stops it): its host memory under the trial's slots "
       "and load (on a Jetson, CUDA buffers in the shared DRAM may not all show as resident); absent for a container "
       "or a server jbench did not start", MEASURE, "serving", better=LOWER),
    _d("serving_loadgen_dispatch_lag_ms_p99", "ms", "the load generator's own cost per level: percentile 99 of how "
       "late a request left: after it was due (open loop), after its worker became free (closed loop)", MEASURE, "serving", stepped=True),
    _d("serving_loadgen_client_cpu_per_request_ms", "ms", "the load generator's CPU time per request on the "
       "controller, per level", MEASURE, "serving", stepped=True),
    _d("serving_draft_acceptance", "1", "each level's speculative-decoding acceptance: draft tokens accepted / "
       "proposed, summed over its completed requests from llama-server's own timings (draft_n_accepted, draft_n); "
       "absent without a draft", SERVING, "serving", better=HIGHER, stepped=True, backend="llamacpp"),
    _d("serving_draft_tokens_per_output_token", "1", "each level's draft tokens proposed / output tokens, over its "
       "requests that reported the server's draft counters", SERVING, "serving", stepped=True, backend="llamacpp"),)


def _index(decls: tuple[MetricDecl, ...]) -> dict[str, MetricDecl]:
    """Every concrete name and every pattern -> its declaration; a name claimed twice is a declaration error."""
    out: dict[str, MetricDecl] = {}
    for decl in decls:
        for name in dict.fromkeys([decl.name, *decl.names()]):
            if name in out:
                raise ValueError(f"metric {name} is declared twice: by {out[name].name} and by {decl.name}")
            out[name] = decl
    return out


_BY_NAME: dict[str, MetricDecl] = _index(DECLARATIONS)


def find(name: str) -> Optional[MetricDecl]:
    """The declaration of a concrete name (`decode_tps`) or of a pattern as declared (`{phase}_tps`), else None."""
    return _BY_NAME.get(name)


def metric(name: str) -> MetricDecl:
    """The declaration of a concrete name or a declared pattern; UnknownMetric names the closest declared ones."""
    decl = _BY_NAME.get(name)
    if decl is None:
        close = difflib.get_close_matches(name, list(_BY_NAME), n=3)
        raise UnknownMetric(f"metric '{name}' is not declared in jbench.core.metrics"
                            + (f"; did you mean {', '.join(close)}?" if close else ""))
    return decl


def is_declared(name: str) -> bool:
    return name in _BY_NAME


def unit_of(name: str) -> str:
    """The unit of a concrete or pattern name (a key of UNITS); UnknownMetric when it is not declared."""
    return metric(name).unit


def declarations() -> Iterator[MetricDecl]:
    """Every declaration, in declaration order."""
    return iter(DECLARATIONS)


def declared_names() -> list[str]:
    """Every concrete metric name jbench can record, in declaration order."""
    return [name for decl in DECLARATIONS for name in decl.names()]


def provided_by(provider: str) -> list[str]:
    """The concrete names a stage (or workflow) records: what it PROVIDES."""
    return [name for decl in DECLARATIONS if decl.provider == provider for name in decl.names()]


def required_by(provider: str) -> list[str]:
    """The concrete names a stage's metrics are computed from that another provider records: what it REQUIRES."""
    out: dict[str, None] = {}
    for decl in DECLARATIONS:
        if decl.provider != provider:
            continue
        for name in decl.names():
            out.update((req, None) for req in decl.inputs(name) if metric(req).provider != provider)
    return list(out)


def stage_dependencies() -> dict[str, set[str]]:
    """provider -> the providers it needs to have run first; the graph graphlib.TopologicalSorter takes."""
    graph: dict[str, set[str]] = {}
    for decl in DECLARATIONS:
        graph.setdefault(decl.provider, set()).update(metric(req).provider for req in required_by(decl.provider))
    return graph


def metrics_table(group: str) -> str:
    """docs/metrics.md's table of one group: name | unit | description, one row per declaration."""
    if group not in GROUPS:
        raise KeyError(f"unknown metrics group '{group}'. Valid: {', '.join(GROUPS)}")
    lines = [f"<!-- metrics: {group} -->", "| name | unit | description |", "|---|---|---|"]
    lines += [f"| `{d.name}` | {d.unit} | {d.description} |" for d in DECLARATIONS if d.group == group]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Print every group's table (to paste into docs/metrics.md)."""
    for group, heading in GROUPS.items():
        print(f"{heading}:\n\n{metrics_table(group)}")


if __name__ == "__main__":
    main()
