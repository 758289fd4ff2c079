"""Energy of a phase from a sampled power series (pure functions, no I/O).

Energy (J) is the trapezoid-rule integral of power (W) over exactly the phase window [t0, t1]; the
window edges are linearly interpolated between the samples that straddle them. A figure that was not
measured is never reported as a number: too few samples, a window the samples do not cover, or gaps
in the series give NaN with the reason in `WindowEnergy.status` (domain.md, "Energy").
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Sequence

__all__ = ["WindowEnergy", "integrate_trapezoid", "window_energy", "tokens_per_joule", "above_idle_energy",
           "SpeedMatch", "speed_match", "withhold_per_token_energy"]

OK = "ok"


@dataclass(frozen=True)
class WindowEnergy:
    energy_j: float  # NaN unless status == "ok"
    avg_power_w: float  # energy_j / duration_s; NaN unless status == "ok"
    duration_s: float  # t1 - t0 (0 for an empty or inverted window)
    n_samples: int  # samples with t0 <= t <= t1
    coverage: float  # fraction of [t0, t1] covered by sample intervals no longer than max_gap_s
    status: str  # "ok" or the reason the energy is not available

    @property
    def ok(self) -> bool:
        return self.status == OK


def _check_series(times_s: Sequence[float], power_w: Sequence[float]) -> None:
    if len(times_s) != len(power_w):
        raise ValueError(f"times_s and power_w differ in length ({len(times_s)} != {len(power_w)})")
    for a, b in zip(times_s, times_s[1:]):
        if not b >= a:  # also catches NaN timestamps
            raise ValueError("times_s must be non-decreasing and finite")


def _interp(times_s: Sequence[float], power_w: Sequence[float], t: float) -> float:
    """Power at time t (times_s[0] <= t <= times_s[-1]) by linear interpolation."""
    j = bisect_left(times_s, t)
    if j < len(times_s) and times_s[j] == t:
        return float(power_w[j])
    ta, tb = times_s[j - 1], times_s[j]
    pa, pb = power_w[j - 1], power_w[j]
    return float(pa + (pb - pa) * (t - ta) / (tb - ta))


def integrate_trapezoid(times_s: Sequence[float], power_w: Sequence[float], t0: float, t1: float) -> float:
    """Energy (J) over [t0, t1] by the trapezoid rule, edges interpolated linearly.

    Nothing is extrapolated: the integral runs over the part of [t0, t1] that lies within
    [times_s[0], times_s[-1]] (`window_energy` reports how much of the window that is).
    Returns NaN when fewer than two samples exist or the window does not overlap them, since
    there is then nothing measured to integrate (0 would read as "no energy used").
    Raises ValueError for mismatched lengths, unsorted times, or t1 < t0.
    """
    _check_series(times_s, power_w)
    if not (math.isfinite(t0) and math.isfinite(t1)) or t1 < t0:
        raise ValueError(f"need finite t0 <= t1, got [{t0}, {t1}]")
    if len(times_s) < 2:
        return math.nan
    lo, hi = max(t0, times_s[0]), min(t1, times_s[-1])
    if lo > hi:
        return math.nan
    if lo == hi:
        return 0.0
    # Points: interpolated left edge, the samples strictly inside, interpolated right edge.
    first, last = bisect_right(times_s, lo), bisect_left(times_s, hi)
    ts = [lo, *times_s[first:last], hi]
    ps = [_interp(times_s, power_w, lo), *(float(p) for p in power_w[first:last]), _interp(times_s, power_w, hi)]
    return math.fsum((ts[k + 1] - ts[k]) * (ps[k + 1] + ps[k]) / 2.0 for k in range(len(ts) - 1))


def _coverage(times_s: Sequence[float], t0: float, t1: float, max_gap_s: float) -> float:
    """Fraction of [t0, t1] lying inside sample intervals of length <= max_gap_s."""
    covered = 0.0
    start = max(bisect_right(times_s, t0) - 1, 0)
    for k in range(start, len(times_s) - 1):
        a, b = times_s[k], times_s[k + 1]
        if a >= t1:
            break
        if b - a <= max_gap_s:
            covered += max(0.0, min(b, t1) - max(a, t0))
    return covered / (t1 - t0)


def _not_available(duration: float, n: int, coverage: float, reason: str) -> WindowEnergy:
    return WindowEnergy(math.nan, math.nan, duration, n, coverage, reason)


def window_energy(
    times_s: Sequence[float],
    power_w: Sequence[float],
    t0: float,
    t1: float,
    *,
    min_samples: int = 5,
    min_coverage: float = 0.9,
    max_gap_s: float | None = None,
) -> WindowEnergy:
    """Energy of the window [t0, t1] with the checks that make it trustworthy.

    - n_samples counts samples with t0 <= t <= t1; fewer than `min_samples` -> not available.
    - The window must lie within [times_s[0], times_s[-1]]: an edge beyond the samples is not
      measured (no extrapolation) -> not available, even if coverage would pass.
    - coverage: the share of the window spanned by sample intervals no longer than `max_gap_s`
      (default 3x the median positive interval of the whole series). Under `min_coverage` -> not available.
    - When available, energy is `integrate_trapezoid` over the window (a gap short enough to pass the
      coverage test is bridged linearly) and avg_power_w = energy_j / duration_s.
    energy_j and avg_power_w are NaN, never 0, whenever status != "ok".
    """
    _check_series(times_s, power_w)
    if not (math.isfinite(t0) and math.isfinite(t1)):
        raise ValueError(f"need finite t0 and t1, got [{t0}, {t1}]")
    duration = max(t1 - t0, 0.0)
    if not times_s:
        return _not_available(duration, 0, 0.0, "no samples")
    if t1 <= t0:
        return _not_available(duration, 0, math.nan, f"empty window (t1 {t1} <= t0 {t0})")
    n_in = bisect_right(times_s, t1) - bisect_left(times_s, t0)
    if t1 < times_s[0] or t0 > times_s[-1]:
        return _not_available(
            duration, n_in, 0.0, f"window [{t0}, {t1}] outside samples [{times_s[0]}, {times_s[-1]}]"
        )
    if max_gap_s is None:
        intervals = [b - a for a, b in zip(times_s, times_s[1:]) if b > a]
        max_gap_s = 3.0 * statistics.median(intervals) if intervals else 0.0
    coverage = _coverage(times_s, t0, t1, max_gap_s) if len(times_s) >= 2 else 0.0
    if n_in < min_samples:
        return _not_available(duration, n_in, coverage, f"too few samples in window ({n_in} < {min_samples})")
    if t0 < times_s[0] or t1 > times_s[-1]:
        # The uncovered edge would be missing from the integral (no extrapolation), so the energy of
        # "exactly [t0, t1]" was not measured: the sampler started late or stopped early.
        return _not_available(
            duration, n_in, coverage,
            f"window [{t0}, {t1}] not fully inside samples [{times_s[0]}, {times_s[-1]}]",
        )
    if coverage < min_coverage:
        return _not_available(
            duration, n_in, coverage,
            f"coverage {coverage:.3f} < {min_coverage} (gaps over {max_gap_s:.3g} s)",
        )
    energy = integrate_trapezoid(times_s, power_w, t0, t1)
    if not math.isfinite(energy):
        return _not_available(duration, n_in, coverage, "non-finite power samples in window")
    return WindowEnergy(energy, energy / duration, duration, n_in, coverage, OK)


def tokens_per_joule(tokens: float, energy: WindowEnergy) -> float:
    """Tokens produced per joule drawn in the same window; NaN when the energy is not available."""
    if not energy.ok or not energy.energy_j > 0:
        return math.nan
    return tokens / energy.energy_j


def above_idle_energy(energy: WindowEnergy, idle_power_w: float) -> float:
    """Energy above the idle baseline: energy_j - idle_power_w * duration_s.

    NaN when either is NaN or the energy is not available. May be negative when the baseline was
    measured higher than the phase's draw; that is reported, not clamped, so it stays visible.
    """
    if not energy.ok or math.isnan(idle_power_w):
        return math.nan
    return energy.energy_j - idle_power_w * energy.duration_s


@dataclass(frozen=True)
class SpeedMatch:
    """How the tok/s of an energy window compares with the speed pass it stands for."""

    speed_tps: float  # the speed pass: tokens / summed repetition time
    window_tps: float  # the energy window: tokens / window duration
    difference: float  # |window - speed| / speed (NaN when either rate is not positive)
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.difference <= self.tolerance  # False for NaN: an unknown speed never matches

    @property
    def reason(self) -> str:
        return (f"energy window ran at {self.window_tps:.4g} tok/s, the speed pass at {self.speed_tps:.4g} tok/s "
                f"({100 * self.difference:.1f} % apart, over energy.speed_tolerance={100 * self.tolerance:g} %)")


def speed_match(speed_tokens: float, speed_s: float, window_tokens: float, window_s: float,
                tolerance: float) -> SpeedMatch:
    """Compare two aggregate rates (tokens over the time that produced them).

    Tokens per joule are only the speed pass's efficiency when the energy was drawn at the speed
    the speed pass reports; a window that ran slower (a loaded device, a cold cache, a clock that
    dropped) draws its energy over more time per token and gives another figure altogether.
    """
    speed = speed_tokens / speed_s if speed_s > 0 and speed_tokens > 0 else math.nan
    window = window_tokens / window_s if window_s > 0 and window_tokens > 0 else math.nan
    diff = abs(window - speed) / speed if speed > 0 and window > 0 else math.nan
    return SpeedMatch(speed, window, diff, tolerance)


# Metric names that divide energy by tokens (or tokens by energy) of a phase's window.
_PER_TOKEN = ("tokens_per_joule", "joules_per_token", "tokens_per_j")


def withhold_per_token_energy(metrics: dict[str, float], phase: str) -> list[str]:
    """Set every per-token energy figure of `phase` (board, above idle, wall) to NaN; returns their names.

    The window's energy itself stays: it is the true energy of what ran, just not at the reported speed.
    """
    names = [k for k in metrics if k.startswith(f"{phase}_") and any(p in k for p in _PER_TOKEN)]
    for k in names:
        metrics[k] = math.nan
    return names

