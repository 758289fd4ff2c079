"""From telemetry samples and phase windows to energy metrics and findings (pure functions).

Windows are (start, end) in device-clock epoch seconds, the same clock as the samples. Every
energy figure comes from window_energy() over the measured samples; when a window cannot give
one (no sensor, too few samples, gaps) the metric is absent and `energy.status` says why.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional

from jbench.core.results import Finding
from jbench.core.schema import ProfileConfig, ProfileSection, typed
from jbench.analysis.energy import WindowEnergy, above_idle_energy, tokens_per_joule, window_energy
from jbench.analysis.sensor import EdgeError, edge_error_bound, sensor_period, settled, window_needed


@dataclass
class EnergySettings:
    min_window_s: Optional[float] = None  # a fixed shortest prefill/decode window; None: only the edge-error bound
    min_samples: int = 5
    min_coverage: float = 0.9
    max_edge_error: Optional[float] = 0.02  # jbench.analysis.sensor.edge_error_bound's limit; None: not checked


@dataclass
class PhaseWindow:
    phase: str  # idle | load | prefill | decode | cooldown
    start: float
    end: float
    tokens: int = 0  # tokens processed inside the window (prefill/decode)
    source: str = "speed"  # speed pass or energy pass

    @property
    def duration(self) -> float:
        return self.end - self.start


def _series(samples: list[dict], key: str) -> tuple[list[float], list[float]]:
    pts = [(s["t"], float(s[key])) for s in samples if s.get(key) is not None and s.get("t") is not None]
    pts.sort()
    return [p[0] for p in pts], [p[1] for p in pts]


def _inside(samples: list[dict], window: PhaseWindow, key: str) -> list[float]:
    return [float(s[key]) for s in samples
            if s.get(key) is not None and window.start <= s["t"] <= window.end]


def counter_energy(samples: list[dict], t0: float, t1: float) -> Optional[float]:
    """Energy from a cumulative hardware counter (energy_j), interpolated at the window edges."""
    times, values = _series(samples, "energy_j")
    if len(times) < 2 or t0 < times[0] or t1 > times[-1]:
        return None

    def at(t: float) -> float:
        for i in range(1, len(times)):
            if times[i] >= t:
                a, b = times[i - 1], times[i]
                return values[i - 1] + (values[i] - values[i - 1]) * ((t - a) / (b - a) if b > a else 0.0)
        return values[-1]

    return at(t1) - at(t0)


# Throttling evidence (samples from the sysfs/hwmon source; tegrastats gives temperatures and the GPU clock).
OC_COUNTERS = ("oc1_event_cnt", "oc2_event_cnt", "oc3_event_cnt")
CLOCKS = (("gpu_freq_mhz", "gpu"), ("cpu_freq_mhz", "cpu"))
# A clock that fell more than this within a prefill/decode window is reported (DVFS noise stays below).
CLOCK_DROP_PCT = 5.0


def _counter_delta(samples: list[dict], window: PhaseWindow, key: str) -> Optional[float]:
    """Events of a cumulative counter during the window: the last reading inside it minus the last reading
    at or before its start (else the first inside). None with fewer than two readings or after a reset."""
    pts = sorted((s["t"], float(s[key])) for s in samples if s.get(key) is not None and s.get("t") is not None)
    before = [v for t, v in pts if t <= window.start]
    inside = [v for t, v in pts if window.start < t <= window.end]
    if not inside or (not before and len(inside) < 2):
        return None
    first = before[-1] if before else inside[0]
    delta = inside[-1] - first
    return delta if delta >= 0 else None  # a counter that went back was reset (reboot): no delta


def throttling_metrics(samples: list[dict], windows: list[PhaseWindow]) -> tuple[dict[str, float], dict[str, str]]:
    """Per window: soctherm over-current events (`<phase>_oc<k>_events`), the hottest zone
    (`<phase>_temp_max_c`), the lowest and highest GPU/CPU clock and the drop between them
    (`<phase>_gpu_freq_drop_pct`). A signal the telemetry lacks gives no metric; `throttling.status` says which."""
    metrics: dict[str, float] = {}
    have = {key for s in samples for key in s}
    for w in windows:
        for key in OC_COUNTERS:
            if key in have:
                delta = _counter_delta(samples, w, key)
                if delta is not None:
                    metrics[f"{w.phase}_{key[:3]}_events"] = delta
        temps = _inside(samples, w, "temp_max_c")
        if temps:
            metrics[f"{w.phase}_temp_max_c"] = max(temps)
        for key, name in CLOCKS:
            freqs = _inside(samples, w, key)
            if len(freqs) >= 2 and max(freqs) > 0:
                lo, hi = min(freqs), max(freqs)
                metrics[f"{w.phase}_{name}_freq_min_mhz"] = lo
                metrics[f"{w.phase}_{name}_freq_max_mhz"] = hi
                metrics[f"{w.phase}_{name}_freq_drop_pct"] = 100.0 * (hi - lo) / hi
    missing = [label for label, present in (
        ("soctherm_oc counters", any(k in have for k in OC_COUNTERS)),
        ("temperatures", "temp_max_c" in have),
        ("GPU clock", "gpu_freq_mhz" in have),
        ("CPU clock", "cpu_freq_mhz" in have)) if not present]
    status = "ok" if not missing else "not in this telemetry: " + ", ".join(missing)
    return metrics, {"throttling.status": status}


def throttling_findings(samples: list[dict], windows: list[PhaseWindow]) -> list[Finding]:
    """`throttling` when an over-current counter moved during any window, or a clock fell more than
    CLOCK_DROP_PCT during prefill or decode; the evidence holds the per-window figures."""
    metrics, _ = throttling_metrics(samples, windows)
    out: list[Finding] = []
    for w in windows:
        oc = {k: metrics[f"{w.phase}_{k[:3]}_events"] for k in OC_COUNTERS if metrics.get(f"{w.phase}_{k[:3]}_events")}
        drops = {name: metrics[f"{w.phase}_{name}_freq_drop_pct"] for _, name in CLOCKS
                 if w.phase in ("prefill", "decode")
                 and metrics.get(f"{w.phase}_{name}_freq_drop_pct", 0.0) > CLOCK_DROP_PCT}
        if not oc and not drops:
            continue
        parts = [f"{int(v)} {k[:3].upper()} over-current events" for k, v in oc.items()]
        parts += [f"{name.upper()} clock fell {metrics[f'{w.phase}_{name}_freq_max_mhz']:.0f} -> "
                  f"{metrics[f'{w.phase}_{name}_freq_min_mhz']:.0f} MHz ({v:.0f} %)" for name, v in drops.items()]
        evidence: dict = {"phase": w.phase, "window_s": w.duration, **{f"{k[:3]}_events": v for k, v in oc.items()}}
        for name in drops:
            for end in ("min", "max"):
                evidence[f"{name}_freq_{end}_mhz"] = metrics[f"{w.phase}_{name}_freq_{end}_mhz"]
        if f"{w.phase}_temp_max_c" in metrics:
            evidence["temp_max_c"] = metrics[f"{w.phase}_temp_max_c"]
        hint = (" (OC1 under-voltage, OC2 average, OC3 instantaneous over-current: the power supply or the power "
                "mode's current limit throttled the clocks)" if oc else "")
        out.append(Finding("throttling", f"{w.phase}: " + "; ".join(parts) + hint, evidence))
    return out


def phase_window_energy(times: list[float], power: list[float], w: PhaseWindow,
                        settings: EnergySettings, edge: Optional[EdgeError] = None) -> WindowEnergy:
    """`window_energy` over a window, with the rules every power source shares for a prefill/decode window: its
    edges' error bound (`edge`, jbench.analysis.sensor) within energy.max_edge_error, and no shorter than a fixed
    energy.min_window_s where one is set."""
    we = window_energy(times, power, w.start, w.end, min_samples=settings.min_samples,
                       min_coverage=settings.min_coverage)
    if w.phase not in ("prefill", "decode") or not we.ok:
        return we
    reason = ""
    if settings.min_window_s is not None and w.duration < settings.min_window_s:
        reason = f"window {w.duration:.2f} s shorter than energy.min_window_s={settings.min_window_s:g}"
    elif settings.max_edge_error is not None and edge is not None and not edge.bound <= settings.max_edge_error:
        reason = (f"window {w.duration:.3g} s too short for the sensor: its edges may be off by up to "
                  f"{100 * edge.bound:.2g} % of its energy (sensor period {1000 * edge.period_s:.3g} ms), over "
                  f"energy.max_edge_error={100 * settings.max_edge_error:g} %" if edge.ok
                  else f"no edge-error bound ({edge.status})")
    if reason:
        return WindowEnergy(math.nan, math.nan, we.duration_s, we.n_samples, we.coverage, reason)
    return we


def window_edge_error(samples: list[dict], w: PhaseWindow, period_s: Optional[float]) -> Optional[EdgeError]:
    """The edge-error bound of a window over the total-power readings (None without a sensor period)."""
    if period_s is None:
        return None
    times, power = _series(samples, "power_w")
    return edge_error_bound(times, power, w.start, w.end, period_s)


def energy_pass_needed(samples: list[dict], w: PhaseWindow, settings: EnergySettings) -> tuple[Optional[float], str]:
    """Whether a speed-pass window can give its phase's energy: (None, how) when it can, else (the window length an
    energy pass needs, why). Sized from the window's own edge-error bound (the steps stay, the energy grows with
    the length), never under energy.min_window_s where one is set."""
    times, power = _series(samples, "power_w")
    period = sensor_period(times, power)
    if period is None:
        return None, "no power readings"
    edge = edge_error_bound(times, power, w.start, w.end, period)
    n_in = sum(1 for t in times if w.start <= t <= w.end)
    floor = settings.min_window_s or 0.0
    target = settings.max_edge_error if settings.max_edge_error is not None else math.inf
    short = w.duration < floor
    if n_in >= settings.min_samples and edge.ok and edge.bound <= target and not short:
        return None, (f"the speed pass's {w.duration:.3g} s window (edge error within {100 * edge.bound:.2g} %, "
                      f"sensor period {1000 * period:.3g} ms)")
    bound = edge.bound if edge.ok else math.nan
    needed = max(floor, window_needed(w.duration, bound, min(target, 1.0), period, settings.min_samples))
    why = (f"{n_in} samples in {w.duration:.3g} s" if n_in < settings.min_samples else
           f"edge error up to {100 * edge.bound:.3g} %" if edge.ok and edge.bound > target else
           f"{w.duration:.3g} s < energy.min_window_s" if short else edge.status)
    return needed, why


def load_window_energy(samples: list[dict], windows: list[PhaseWindow],
                       settings: EnergySettings) -> dict[str, WindowEnergy]:
    """Energy of each load window (a serving level) over the total-power readings, judged like a phase's window
    (samples, coverage, edge-error bound); a window it cannot give says why in its status."""
    times, power = _series(samples, "power_w")
    if not times:
        return {w.phase: WindowEnergy(math.nan, math.nan, w.duration, 0, 0.0, "the telemetry has no total-power "
                                      "signal") for w in windows}
    period = sensor_period(times, power)
    out = {}
    for w in windows:
        edge = edge_error_bound(times, power, w.start, w.end, period) if period is not None else None
        out[w.phase] = phase_window_energy(times, power, w, settings, edge)
    return out


def power_settled(samples: list[dict], t_end: float, span_s: float, tolerance: float) -> bool:
    """Whether total power stopped moving over the last span_s before t_end (jbench.analysis.sensor.settled)."""
    times, power = _series(samples, "power_w")
    return bool(times) and times[0] <= t_end - span_s and settled(times, power, t_end, span_s, tolerance)


def power_period(samples: list[dict]) -> Optional[float]:
    """The total-power sensor's effective period over these samples (jbench.analysis.sensor.sensor_period)."""
    times, power = _series(samples, "power_w")
    return sensor_period(times, power)


def energy_metrics(samples: list[dict], windows: list[PhaseWindow], settings: EnergySettings,
                   sensor_problem: Optional[str] = None) -> tuple[dict[str, float], dict[str, str]]:
    """Metrics per docs/metrics.md and the energy.* tags that explain them, with the throttling metrics
    (`throttling_metrics`) of the same windows."""
    metrics, tags = _energy_metrics(samples, windows, settings, sensor_problem)
    if samples:
        t_metrics, t_tags = throttling_metrics(samples, windows)
        metrics.update(t_metrics)
        tags.update(t_tags)
    return metrics, tags


def _energy_metrics(samples: list[dict], windows: list[PhaseWindow], settings: EnergySettings,
                    sensor_problem: Optional[str]) -> tuple[dict[str, float], dict[str, str]]:
    metrics: dict[str, float] = {}
    statuses: dict[str, str] = {}
    if sensor_problem:
        return metrics, {"energy.status": f"not measured: {sensor_problem}"}
    times, power = _series(samples, "power_w")
    if not times:
        return metrics, {"energy.status": "not measured: the telemetry has no total-power signal"}
    by_phase: dict[str, WindowEnergy] = {}
    period = sensor_period(times, power)
    if period is not None:
        metrics["power_sensor_period_ms"] = 1000 * period
    for w in windows:
        edge = (edge_error_bound(times, power, w.start, w.end, period)
                if period is not None and w.phase in ("prefill", "decode") else None)
        we = phase_window_energy(times, power, w, settings, edge)
        by_phase[w.phase] = we
        metrics[f"{w.phase}_window_s"] = w.duration
        metrics[f"{w.phase}_window_samples"] = we.n_samples
        if edge is not None and edge.ok:
            metrics[f"{w.phase}_energy_edge_error_pct"] = 100 * edge.bound
        statuses[w.phase] = "ok" if we.ok else we.status
        if not we.ok:
            continue
        metrics[f"{w.phase}_energy_j"] = we.energy_j
        metrics[f"{w.phase}_avg_power_w"] = we.avg_power_w
        if w.tokens:
            metrics[f"{w.phase}_tokens_per_joule"] = tokens_per_joule(w.tokens, we)
            metrics[f"{w.phase}_joules_per_token"] = we.energy_j / w.tokens
        counter = counter_energy(samples, w.start, w.end)
        if counter is not None and counter > 0:
            metrics[f"{w.phase}_energy_counter_j"] = counter
            metrics[f"{w.phase}_energy_deviation_pct"] = 100.0 * (we.energy_j - counter) / counter
        # A rail that feeds both (VDD_CPU_GPU_CV) comes as cpu_gpu_cv_power_w alone (device/telemetry/rails.py).
        for rail_key, name in (("gpu_power_w", "gpu"), ("cpu_power_w", "cpu"), ("cpu_gpu_cv_power_w", "cpu_gpu_cv")):
            rt, rp = _series(samples, rail_key)
            if rt:
                re_ = window_energy(rt, rp, w.start, w.end, min_samples=settings.min_samples,
                                    min_coverage=settings.min_coverage)
                if re_.ok:
                    metrics[f"{w.phase}_{name}_energy_j"] = re_.energy_j
    idle = by_phase.get("idle")
    if idle is not None and idle.ok:
        metrics["idle_power_w"] = idle.avg_power_w
        for phase in ("prefill", "decode"):
            we = by_phase.get(phase)
            w = next((x for x in windows if x.phase == phase), None)
            if we is not None and we.ok and w is not None and w.tokens:
                above = above_idle_energy(we, idle.avg_power_w)
                # Above the window's own uncertainty (its edge-error bound, else float round-off): a difference
                # smaller than what the window can resolve would make tok/J above idle any number at all.
                edge_pct = metrics.get(f"{phase}_energy_edge_error_pct", 0.0)
                if above > we.energy_j * max(edge_pct / 100, 1e-9):
                    metrics[f"{phase}_energy_above_idle_j"] = above
                    metrics[f"{phase}_tokens_per_joule_above_idle"] = w.tokens / above
    bad = {p: s for p, s in statuses.items() if s != "ok"}
    tags = {"energy.status": "ok" if not bad else "; ".join(f"{p}: {s}" for p, s in bad.items())}
    for p, s in statuses.items():
        tags[f"energy.{p}.status"] = s
    return metrics, tags


def findings(samples: list[dict], windows: list[PhaseWindow], *, profile: ProfileSection = None,
             requested_mode: Optional[str] = None, actual_mode: Optional[str] = None) -> list[Finding]:
    """Named diagnoses with their evidence (docs/metrics.md, "Findings", lists them). profile: the trial's
    ProfileConfig, its plain section, or None (not a Jetson)."""
    out: list[Finding] = []
    decode = next((w for w in windows if w.phase == "decode"), None)
    if requested_mode is not None and actual_mode is not None and requested_mode != actual_mode:
        out.append(Finding("power_mode_mismatch", f"power mode is {actual_mode}, {requested_mode} was requested",
                           {"requested": requested_mode, "actual": actual_mode}))
    if decode is not None:
        gpu_load = _inside(samples, decode, "gpu_load_pct")
        cpu_load = _inside(samples, decode, "cpu_load_pct")
        gpu_freq = _inside(samples, decode, "gpu_freq_mhz")
        emc_load = _inside(samples, decode, "emc_load_pct")
        if gpu_load and cpu_load and statistics.fmean(gpu_load) < 5 and statistics.fmean(cpu_load) > 50:
            out.append(Finding("cpu_fallback", "GPU idle during decode while the CPU is busy: the runtime is "
                               "probably running on the CPU (built without CUDA?); rebuild the backend with CUDA",
                               {"gpu_load_pct_mean": statistics.fmean(gpu_load), "cpu_load_pct_mean": statistics.fmean(cpu_load)}))
        if gpu_freq and max(gpu_freq) == 0:
            out.append(Finding("gpu_clock_zero", "GPU clock at 0 MHz during decode: the GPU is parked; apply the max "
                               "power mode and jetson_clocks", {"gpu_freq_mhz_max": 0}))
        elif gpu_freq and gpu_load and statistics.fmean(gpu_load) > 50:
            lo, hi = min(gpu_freq), max(gpu_freq)
            if hi > 0 and (hi - lo) / hi > 0.05:
                out.append(Finding("clocks_not_locked", f"GPU clock varied {lo:.0f}-{hi:.0f} MHz during decode "
                                   "(DVFS): lock clocks with jetson_clocks for stable numbers",
                                   {"gpu_freq_mhz_min": lo, "gpu_freq_mhz_max": hi}))
        if emc_load and gpu_load and statistics.fmean(gpu_load) > 50 and statistics.fmean(emc_load) < 50:
            out.append(Finding("emc_underused", "memory controller under 50 % busy while the GPU is busy: weights may "
                               "sit in pageable memory or the kernels are not bandwidth-efficient",
                               {"emc_load_pct_mean": statistics.fmean(emc_load), "gpu_load_pct_mean": statistics.fmean(gpu_load)}))
        temps = _inside(samples, decode, "temp_max_c")
        limit = typed(ProfileConfig, profile, where="profile").throttle_temp_c
        if temps and limit is not None and max(temps) >= limit:
            out.append(Finding("thermal_throttling", f"temperature reached {max(temps):.1f} C (profile limit {limit:g} C) "
                               "during decode: clocks may be throttled", {"temp_max_c": max(temps), "limit_c": limit}))
        elif gpu_freq and gpu_load and len(gpu_freq) >= 6:
            third = len(gpu_freq) // 3
            first, last = statistics.fmean(gpu_freq[:third]), statistics.fmean(gpu_freq[-third:])
            loads_last = gpu_load[-max(1, len(gpu_load) // 3):]
            if first > 0 and last < 0.9 * first and statistics.fmean(loads_last) > 80:
                out.append(Finding("thermal_throttling", f"GPU clock fell from {first:.0f} to {last:.0f} MHz during "
                                   "decode while load stayed high", {"gpu_freq_first_mhz": first, "gpu_freq_last_mhz": last}))
    out.extend(throttling_findings(samples, windows))
    swap = [s["swap_used_mb"] for s in samples if s.get("swap_used_mb") is not None]
    if swap and max(swap) - min(swap) > 0:
        out.append(Finding("swap_used", f"swap use changed by {max(swap) - min(swap)} MB during the trial: memory is "
                           "short, numbers include paging", {"swap_used_mb_min": min(swap), "swap_used_mb_max": max(swap)}))
    return out


SERIES = {
    "power_w": "system/device/power_w",
    "gpu_load_pct": "system/device/gpu_load_pct",
    "gpu_freq_mhz": "system/device/gpu_freq_mhz",
    "emc_load_pct": "system/device/emc_load_pct",
    "temp_max_c": "system/device/temp_max_c",
}


def mlflow_series(samples: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """The main series as (device time, value) points for MLflow system metrics."""
    out: dict[str, list[tuple[float, float]]] = {}
    for key, name in SERIES.items():
        pts = [(s["t"], float(s[key])) for s in samples if s.get(key) is not None]
        if pts:
            out[name] = pts
    return out
