"""Wall energy per phase window, next to the board's (pure functions).

The wall meter's samples are already on the device's clock (shifted by the measured offset), so the
phase windows of the board's telemetry apply unchanged. Energy comes from `window_energy` (the same
trapezoid and coverage rules as the board), or from the meter's own energy counter where the
counter's resolution is fine enough for the window: two edges each read to within one step of the
last digit, so the counter is used only when 2 x resolution <= max_counter_error x energy. Which one
was used is the tag `wall.<phase>.energy_method`.
"""

from __future__ import annotations

import math
from typing import Optional

from jbench.analysis.energy import window_energy
from jbench.analysis.sensor import edge_error_bound, sensor_period
from jbench.analysis.telemetry import EnergySettings, PhaseWindow, _series, counter_energy, phase_window_energy

# A counter is preferred when its quantisation error is at most this share of the window's energy.
MAX_COUNTER_ERROR = 0.01


def wall_energy_metrics(samples: list[dict], windows: list[PhaseWindow], settings: EnergySettings,
                        counter_resolution_j: Optional[float] = None,
                        max_counter_error: float = MAX_COUNTER_ERROR) -> tuple[dict[str, float], dict[str, str]]:
    """`<phase>_wall_*` metrics and `wall.<phase>.*` tags (docs/metrics.md, "Wall power")."""
    metrics: dict[str, float] = {}
    tags: dict[str, str] = {}
    times, power = _series(samples, "power_w")
    if not times:
        return metrics, {"wall.energy.status": "not measured: the wall meter gave no power samples"}
    bad: dict[str, str] = {}
    period = sensor_period(times, power)  # the meter's own: a window its edges cannot resolve gives no energy
    for w in windows:
        edge = (edge_error_bound(times, power, w.start, w.end, period)
                if period is not None and w.phase in ("prefill", "decode") else None)
        we = phase_window_energy(times, power, w, settings, edge)
        metrics[f"{w.phase}_wall_window_samples"] = we.n_samples
        if not math.isnan(we.coverage):
            metrics[f"{w.phase}_wall_energy_coverage"] = we.coverage
        status = we.status
        tags[f"wall.{w.phase}.status"] = status
        if status != "ok":
            bad[w.phase] = status
            continue
        energy, method = we.energy_j, "integrated power"
        counter = counter_energy(samples, w.start, w.end)
        if counter is not None and counter > 0:
            metrics[f"{w.phase}_wall_energy_counter_j"] = counter
            if counter_resolution_j and 2 * counter_resolution_j <= max_counter_error * counter:
                energy, method = counter, f"counter (resolution {counter_resolution_j:.3g} J)"
            else:
                method += (f" (the counter's resolution {counter_resolution_j:.3g} J is too coarse for "
                           f"{counter:.3g} J)" if counter_resolution_j else " (counter resolution unknown)")
        metrics[f"{w.phase}_wall_energy_integrated_j"] = we.energy_j
        metrics[f"{w.phase}_wall_energy_j"] = energy
        metrics[f"{w.phase}_wall_avg_power_w"] = energy / we.duration_s
        tags[f"wall.{w.phase}.energy_method"] = method
        if w.tokens and energy > 0:
            metrics[f"{w.phase}_wall_tokens_per_joule"] = w.tokens / energy
            metrics[f"{w.phase}_wall_joules_per_token"] = energy / w.tokens
    if "idle_wall_avg_power_w" in metrics:
        metrics["idle_wall_power_w"] = metrics["idle_wall_avg_power_w"]
    tags["wall.energy.status"] = "ok" if not bad else "; ".join(f"{p}: {s}" for p, s in bad.items())
    return metrics, tags


def board_coverage_metrics(samples: list[dict], windows: list[PhaseWindow],
                           settings: EnergySettings) -> dict[str, float]:
    """`<phase>_energy_coverage` of the board's power series, so both sides report their coverage."""
    times, power = _series(samples, "power_w")
    out: dict[str, float] = {}
    if not times:
        return out
    for w in windows:
        we = window_energy(times, power, w.start, w.end, min_samples=settings.min_samples,
                           min_coverage=settings.min_coverage)
        if not math.isnan(we.coverage):
            out[f"{w.phase}_energy_coverage"] = we.coverage
    return out
