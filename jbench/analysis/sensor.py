"""What a power sensor can resolve, from its own readings (pure functions, no I/O).

A phase window's energy is the integral of sampled power between its edges. Inside the window a steady draw is
integrated well by any sampler; the error sits at the two edges, where the draw steps (idle to prefill, prefill to
decode, decode to teardown) somewhere between two readings the integral joins by a straight line. If the draw steps
by dP at an unknown point of an interval of length p, the straight line misses at most dP * p / 4 joules; a sensor
that averages over its own update period smears the step over up to that period, so jbench takes p as the longer of
the sampling interval and the sensor's update period (`sensor_period`: the median time between changed readings)
and counts dP * p / 2 per edge. `edge_error_bound` gives that bound for a window, measured on the window's own
edges, as a fraction of the window's energy; it shrinks as 1 / window length, so `window_needed` sizes a window
to a target bound from one that was measured. `settled` says whether a stretch of readings has stopped moving (an
idle baseline, a cooldown).

The bound holds for a sensor that reports the power at its timestamps (or an average over its update period);
a sensor that lags its timestamps by more than its period is not covered by it.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Optional, Sequence

from jbench.analysis.energy import integrate_trapezoid

__all__ = ["sensor_period", "EdgeError", "edge_error_bound", "window_needed", "settled"]

# Fewer changed readings than this and the update period is not measured (the sampling interval stands in).
MIN_CHANGES = 5


def sensor_period(times_s: Sequence[float], values: Sequence[float]) -> Optional[float]:
    """The sensor's effective period: the larger of the median sampling interval and the median time between
    readings that changed. None with fewer than two samples. A sensor read faster than it updates repeats its
    last reading; one read slower than it updates changes at every sample."""
    if len(times_s) < 2:
        return None
    intervals = [b - a for a, b in zip(times_s, times_s[1:]) if b > a]
    if not intervals:
        return None
    sampling = statistics.median(intervals)
    changes = [t for t, prev, cur in zip(times_s[1:], values, values[1:]) if cur != prev]
    if len(changes) < MIN_CHANGES:
        return sampling
    return max(sampling, statistics.median(b - a for a, b in zip(changes, changes[1:])))


@dataclass(frozen=True)
class EdgeError:
    """The edge-error bound of one window."""

    bound: float  # the bound as a fraction of the window's energy (NaN when not computable)
    period_s: float  # the sensor period it assumed
    step_w: float  # the power steps at the two edges, summed
    status: str = "ok"  # "ok" or why no bound

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _step_at(times_s: Sequence[float], power_w: Sequence[float], t: float, period_s: float) -> float:
    """The draw's step across an edge at t: the spread (max - min) of the readings within one period either side
    of it, the readings that straddle it included."""
    lo = max(0, bisect_left(times_s, t - period_s) - 1)
    hi = min(len(times_s), bisect_right(times_s, t + period_s) + 1)
    near = power_w[lo:hi]
    return (max(near) - min(near)) if near else math.nan


def edge_error_bound(times_s: Sequence[float], power_w: Sequence[float], t0: float, t1: float,
                     period_s: float) -> EdgeError:
    """The largest error the two edges of [t0, t1] can put into its integrated energy, as a fraction of it:
    (step at t0 + step at t1) * period / 2 / (mean power * window length)."""
    if not (t1 > t0) or len(times_s) < 2 or not period_s > 0:
        return EdgeError(math.nan, period_s, math.nan, "no samples around the window")
    if t0 < times_s[0] or t1 > times_s[-1]:
        return EdgeError(math.nan, period_s, math.nan, "the window is not inside the samples")
    # The window's mean draw from the interpolated series: defined even for a window shorter than one period,
    # which is what sizes its energy pass.
    mean = integrate_trapezoid(times_s, power_w, t0, t1) / (t1 - t0)
    if not mean > 0:
        return EdgeError(math.nan, period_s, math.nan, "no positive power over the window")
    step = _step_at(times_s, power_w, t0, period_s) + _step_at(times_s, power_w, t1, period_s)
    return EdgeError(step * period_s / 2 / (mean * (t1 - t0)), period_s, step)


def window_needed(measured_s: float, measured_bound: float, target: float, period_s: float,
                  min_samples: int) -> float:
    """The window length whose edge-error bound meets `target`, from a window of `measured_s` whose bound was
    `measured_bound` (the edges' steps stay, the energy grows with the length); never shorter than `min_samples`
    sensor periods. The worst case (steps as large as the draw itself) where no bound was measured."""
    floor = min_samples * period_s
    if not (measured_bound >= 0 and measured_s > 0 and target > 0):
        return max(floor, period_s / target if target > 0 else math.inf)
    return max(floor, measured_s * measured_bound / target)


def settled(times_s: Sequence[float], values: Sequence[float], t_end: float, span_s: float,
            tolerance: float, min_samples: int = 3) -> bool:
    """True when the readings of the last `span_s` before t_end have stopped moving: the means of its two halves
    differ by no more than `tolerance` (a fraction) of their mean. False with fewer than `min_samples` readings in
    either half."""
    mid, start = t_end - span_s / 2, t_end - span_s
    first = [v for t, v in zip(times_s, values) if start <= t < mid]
    second = [v for t, v in zip(times_s, values) if mid <= t <= t_end]
    if len(first) < min_samples or len(second) < min_samples:
        return False
    a, b = statistics.fmean(first), statistics.fmean(second)
    scale = abs(a + b) / 2
    return scale > 0 and abs(a - b) <= tolerance * scale
