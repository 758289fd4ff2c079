"""Window energy: synthetic series with known integrals, and the "not available" rules."""

from __future__ import annotations

import math

import pytest

from jbench.analysis.energy import (
    WindowEnergy,
    above_idle_energy,
    integrate_trapezoid,
    tokens_per_joule,
    window_energy,
)
from jbench.device.telemetry import parse_stream, total_input_power_mw

from .conftest import DATA


def _grid(t_start: float, t_end: float, hz: float) -> list[float]:
    n = round((t_end - t_start) * hz)
    return [t_start + k / hz for k in range(n + 1)]


# --- integrate_trapezoid ----------------------------------------------------------------------

def test_constant_power():
    t = _grid(0, 10, 10)
    p = [10.0] * len(t)
    assert integrate_trapezoid(t, p, 0, 10) == pytest.approx(100.0)
    assert integrate_trapezoid(t, p, 2.0, 7.0) == pytest.approx(50.0)
    assert integrate_trapezoid(t, p, 2.03, 2.07) == pytest.approx(0.4)  # both edges inside one interval


def test_linear_ramp_is_exact_even_with_edges_between_samples():
    t = _grid(0, 10, 2)  # 0.5 s steps
    p = [2 * x + 1 for x in t]  # integral of 2t+1 is t^2+t
    t0, t1 = 1.25, 8.6  # neither edge is a sample time
    exact = (t1**2 + t1) - (t0**2 + t0)
    assert exact == pytest.approx(79.7475)
    assert integrate_trapezoid(t, p, t0, t1) == pytest.approx(exact, rel=1e-12)


def test_edges_interpolated_on_a_peak():
    t, p = [0.0, 1.0, 2.0], [0.0, 10.0, 0.0]
    # p(0.5) = p(1.5) = 5: two trapezoids of 0.5 s x (5+10)/2
    assert integrate_trapezoid(t, p, 0.5, 1.5) == pytest.approx(7.5)


def test_step_with_duplicate_timestamp_is_exact_and_without_is_a_ramp():
    t = [0.0, 1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10]
    p = [0.0] * 6 + [20.0] * 6  # 0 W until t=5, then 20 W
    assert integrate_trapezoid(t, p, 0, 10) == pytest.approx(100.0)
    assert integrate_trapezoid(t, p, 4.5, 5.5) == pytest.approx(10.0)
    # One sample per second and no duplicate: the step is seen as a 1 s ramp (4 -> 5), +10 J.
    t2 = [float(k) for k in range(11)]
    p2 = [0.0 if k < 5 else 20.0 for k in range(11)]
    assert integrate_trapezoid(t2, p2, 0, 10) == pytest.approx(110.0)


def test_no_extrapolation_beyond_samples():
    t = [1.0, 2.0, 3.0]
    p = [5.0, 5.0, 5.0]
    assert integrate_trapezoid(t, p, 0.0, 10.0) == pytest.approx(10.0)  # only [1, 3] is measured
    assert math.isnan(integrate_trapezoid(t, p, 5.0, 6.0))  # nothing measured: not 0
    assert math.isnan(integrate_trapezoid([1.0], [5.0], 0.0, 2.0))
    assert integrate_trapezoid(t, p, 2.0, 2.0) == 0.0


def test_bad_input_raises():
    with pytest.raises(ValueError):
        integrate_trapezoid([0.0, 1.0], [1.0], 0, 1)
    with pytest.raises(ValueError):
        integrate_trapezoid([0.0, 2.0, 1.0], [1.0, 1.0, 1.0], 0, 1)
    with pytest.raises(ValueError):
        integrate_trapezoid([0.0, 1.0], [1.0, 1.0], 1, 0)
    with pytest.raises(ValueError):
        window_energy([0.0, 1.0], [1.0], 0, 1)


# --- window_energy ----------------------------------------------------------------------------

def test_window_energy_ok():
    t = _grid(0, 10, 10)
    p = [10.0] * len(t)
    e = window_energy(t, p, 2.0, 7.0)
    assert e.ok and e.status == "ok"
    assert e.energy_j == pytest.approx(50.0) and e.avg_power_w == pytest.approx(10.0)
    assert e.duration_s == pytest.approx(5.0) and e.n_samples == 51 and e.coverage == pytest.approx(1.0)


def test_window_energy_ramp_between_samples():
    t = _grid(0, 10, 2)
    p = [2 * x + 1 for x in t]
    e = window_energy(t, p, 1.25, 8.6)
    assert e.ok and e.n_samples == 15  # 1.5, 2.0, ..., 8.5
    assert e.energy_j == pytest.approx(79.7475) and e.avg_power_w == pytest.approx(79.7475 / 7.35)


def test_gap_breaks_coverage():
    t = [x for x in _grid(0, 10, 10) if not 3.0 < x < 6.0]  # 3 s hole in a 10 Hz series
    p = [10.0] * len(t)
    e = window_energy(t, p, 0.0, 10.0)
    assert not e.ok and "coverage" in e.status
    assert e.coverage == pytest.approx(0.7)
    assert math.isnan(e.energy_j) and math.isnan(e.avg_power_w)
    # Allowing a 5 s gap bridges it linearly (constant power: exact).
    bridged = window_energy(t, p, 0.0, 10.0, max_gap_s=5.0)
    assert bridged.ok and bridged.energy_j == pytest.approx(100.0) and bridged.coverage == pytest.approx(1.0)
    # A window clear of the hole is fine with the default gap limit.
    assert window_energy(t, p, 6.5, 9.5).ok


def test_too_few_samples():
    t = [float(k) for k in range(11)]
    p = [3.0] * 11
    e = window_energy(t, p, 2.5, 5.5)  # samples 3, 4, 5
    assert not e.ok and e.n_samples == 3 and "too few" in e.status
    assert math.isnan(e.energy_j) and math.isnan(e.avg_power_w)
    assert window_energy(t, p, 2.5, 5.5, min_samples=3).energy_j == pytest.approx(9.0)


def test_window_outside_or_beyond_samples():
    t = _grid(10, 20, 10)
    p = [4.0] * len(t)
    outside = window_energy(t, p, 0.0, 5.0)
    assert not outside.ok and "outside" in outside.status and outside.n_samples == 0
    assert math.isnan(outside.energy_j)
    after = window_energy(t, p, 25.0, 30.0)
    assert not after.ok and "outside" in after.status
    # Starts before the first sample: 9.5 s of 10 covered would pass coverage, but the missing edge
    # is unmeasured energy, so the window is not available.
    partial = window_energy(t, p, 9.5, 19.5)
    assert not partial.ok and "not fully inside" in partial.status
    assert math.isnan(partial.energy_j)


def test_no_samples_empty_window_and_non_finite_power():
    e = window_energy([], [], 0.0, 1.0)
    assert e.status == "no samples" and math.isnan(e.energy_j) and e.n_samples == 0
    t = _grid(0, 10, 10)
    p = [1.0] * len(t)
    empty = window_energy(t, p, 5.0, 5.0)
    assert not empty.ok and "empty window" in empty.status and math.isnan(empty.energy_j)
    assert "empty window" in window_energy(t, p, 6.0, 5.0).status
    p[50] = math.nan
    bad = window_energy(t, p, 2.0, 8.0)
    assert not bad.ok and "non-finite" in bad.status and math.isnan(bad.energy_j)


# --- derived figures --------------------------------------------------------------------------

def _ok(energy_j: float, duration_s: float) -> WindowEnergy:
    return WindowEnergy(energy_j, energy_j / duration_s, duration_s, 50, 1.0, "ok")


def test_tokens_per_joule():
    assert tokens_per_joule(500, _ok(50.0, 5.0)) == pytest.approx(10.0)
    not_ok = WindowEnergy(math.nan, math.nan, 5.0, 2, 1.0, "too few samples in window (2 < 5)")
    assert math.isnan(tokens_per_joule(500, not_ok))


def test_above_idle_energy():
    assert above_idle_energy(_ok(50.0, 5.0), 4.0) == pytest.approx(30.0)
    assert above_idle_energy(_ok(10.0, 5.0), 4.0) == pytest.approx(-10.0)  # reported, not clamped
    assert math.isnan(above_idle_energy(_ok(50.0, 5.0), math.nan))
    assert math.isnan(above_idle_energy(WindowEnergy(math.nan, math.nan, 5.0, 0, 0.0, "no samples"), 4.0))


def test_energy_from_a_real_tegrastats_run():
    """Orin Nano Super (R39.2.1) 4-line 1 Hz run from the corpus: VDD_IN 3582, 3462, 3462, 3462 mW."""
    corpus = DATA / "jetson-formats" / "tegrastats-orin-nano.txt"
    if not corpus.is_file():
        pytest.fail(f"tegrastats corpus missing: {corpus}")
    lines = [l for l in corpus.read_text().splitlines() if l.startswith("09-19-2026 13:33:0")]
    samples, skipped = parse_stream(lines)
    assert len(samples) == 4 and skipped == 0
    start = samples[0].timestamp
    times = [(s.timestamp - start).total_seconds() for s in samples]
    watts = [total_input_power_mw(s) / 1000 for s in samples]
    assert times == [0, 1, 2, 3] and watts == [3.582, 3.462, 3.462, 3.462]
    assert integrate_trapezoid(times, watts, 0, 3) == pytest.approx((3.582 + 3.462) / 2 + 3.462 * 2)
    # Four samples at 1 Hz are too few for the default rule: not available, with the reason.
    e = window_energy(times, watts, 0, 3)
    assert not e.ok and "too few" in e.status and math.isnan(e.energy_j)
    e4 = window_energy(times, watts, 0, 3, min_samples=4)
    assert e4.ok and e4.energy_j == pytest.approx(10.446)
