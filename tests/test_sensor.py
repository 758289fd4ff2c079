"""What a power sensor resolves (jbench.analysis.sensor) and the energy-pass decision built on it
(jbench.analysis.telemetry.energy_pass_needed, phase_window_energy)."""

from __future__ import annotations

import math

import pytest

from jbench.analysis.sensor import edge_error_bound, sensor_period, settled, window_needed
from jbench.analysis.telemetry import EnergySettings, PhaseWindow, energy_metrics, energy_pass_needed


def _square(period: float, t_on: float, t_off: float, *, idle: float = 60.0, busy: float = 200.0,
            t_end: float = 10.0, hold: int = 1) -> list[dict]:
    """Readings every `period` s of a draw that steps from idle to busy at t_on and back at t_off; a sensor that
    updates every `hold` readings repeats its value in between."""
    samples, value = [], idle
    n = int(round(t_end / period))
    for i in range(n + 1):
        t = i * period
        if i % hold == 0:  # a new reading: the draw, with a little noise
            value = (busy if t_on <= t < t_off else idle) + (i // hold % 3) * 0.01
        samples.append({"t": 1000.0 + t, "power_w": value})
    return samples


def test_sensor_period_is_the_sampling_interval_or_the_update_period_whichever_is_longer():
    fast = _square(0.01, 2.0, 4.0)
    t = [s["t"] for s in fast]
    p = [s["power_w"] for s in fast]
    assert sensor_period(t, p) == pytest.approx(0.01, rel=0.01)
    held = _square(0.01, 2.0, 4.0, hold=10)  # read every 10 ms, updates every 100 ms
    assert sensor_period([s["t"] for s in held], [s["power_w"] for s in held]) == pytest.approx(0.1, rel=0.01)
    assert sensor_period([1.0], [5.0]) is None


def test_edge_error_bound_shrinks_with_the_window_and_grows_with_the_period():
    fast = _square(0.01, 2.0, 2.5)
    slow = _square(0.1, 2.0, 2.5)
    long = _square(0.01, 2.0, 7.0)

    def bound(samples, t0, t1, period):
        return edge_error_bound([s["t"] for s in samples], [s["power_w"] for s in samples], 1000 + t0, 1000 + t1,
                                period).bound

    b_fast = bound(fast, 2.0, 2.5, 0.01)
    # Two full steps of 140 W at 200 W over 0.5 s: (280 * 0.01 / 2) / (200 * 0.5) = 1.4 %
    assert b_fast == pytest.approx(0.014, rel=0.05)
    assert bound(slow, 2.0, 2.5, 0.1) == pytest.approx(10 * b_fast, rel=0.2)
    assert bound(long, 2.0, 7.0, 0.01) == pytest.approx(b_fast / 10, rel=0.1)


def test_a_window_inside_a_steady_draw_has_no_edge_error_but_its_edges_steps_count():
    flat = _square(0.01, 0.0, 100.0)
    e = edge_error_bound([s["t"] for s in flat], [s["power_w"] for s in flat], 1003.0, 1004.0, 0.01)
    assert e.ok and e.bound < 1e-4
    assert not edge_error_bound([], [], 0.0, 1.0, 0.01).ok


def test_window_needed_scales_the_measured_window_to_the_target_with_a_floor():
    assert window_needed(0.5, 0.014, 0.02, 0.01, 5) == pytest.approx(0.35)
    assert window_needed(0.5, 0.001, 0.02, 0.01, 5) == pytest.approx(0.05)  # min_samples periods
    # No bound measured: the worst case, steps as large as the draw (period / target).
    assert window_needed(0.03, math.nan, 0.02, 0.1, 5) == pytest.approx(5.0)


def test_settled_needs_both_halves_and_no_trend():
    t = [i * 0.01 for i in range(200)]
    flat = [60.0 + (i % 2) * 0.2 for i in range(200)]
    falling = [80.0 - 0.1 * i for i in range(200)]
    assert settled(t, flat, 1.99, 1.0, 0.03)
    assert not settled(t, falling, 1.99, 1.0, 0.03)
    assert not settled(t[:4], flat[:4], 0.03, 1.0, 0.03)  # too few readings


def test_a_fast_sensor_takes_energy_from_the_speed_pass_and_a_slow_one_asks_for_a_sized_pass():
    settings = EnergySettings()
    w = PhaseWindow("decode", 1002.0, 1003.0, tokens=300)
    fast = _square(0.01, 2.0, 3.0)
    needed, how = energy_pass_needed(fast, w, settings)
    assert needed is None and "speed pass" in how
    slow = _square(0.1, 2.0, 3.0)
    needed, why = energy_pass_needed(slow, w, settings)
    # 1 s with a 100 ms period: edges up to (2 * 140 * 0.1 / 2) / 200 = 7 %, so 3.5 s meets 2 %.
    assert needed == pytest.approx(3.5, rel=0.1) and "edge error" in why
    assert energy_pass_needed([{"t": 1000.0 + i, "temp_c": 40.0} for i in range(10)], w, settings) == (
        None, "no power readings")


def test_a_fixed_min_window_still_applies_on_top_of_the_bound():
    w = PhaseWindow("decode", 1002.0, 1003.0, tokens=300)
    needed, why = energy_pass_needed(_square(0.01, 2.0, 3.0), w, EnergySettings(min_window_s=5.0))
    assert needed == pytest.approx(5.0) and "min_window_s" in why


def test_energy_metrics_withhold_a_window_whose_edges_exceed_the_bound_and_publish_it():
    samples = _square(0.1, 2.0, 3.0)
    windows = [PhaseWindow("idle", 1000.5, 1001.5), PhaseWindow("decode", 1002.0, 1003.0, tokens=300)]
    metrics, tags = energy_metrics(samples, windows, EnergySettings())
    assert metrics["decode_energy_edge_error_pct"] == pytest.approx(7.0, rel=0.1)
    assert "decode_energy_j" not in metrics and "decode_tokens_per_joule" not in metrics
    assert "max_edge_error=2 %" in tags["energy.decode.status"]
    assert metrics["power_sensor_period_ms"] == pytest.approx(100, rel=0.01)
    fine, fine_tags = energy_metrics(_square(0.01, 2.0, 3.0), windows, EnergySettings())
    assert fine_tags["energy.decode.status"] == "ok"
    assert fine["decode_energy_j"] == pytest.approx(200.0, rel=0.02)
    assert fine["decode_energy_edge_error_pct"] < 2


def test_the_nvml_sampler_reads_power_and_the_counter_fast_and_the_rest_every_interval(monkeypatch):
    import sys
    import time
    import types

    from jbench.device.telemetry.samplers import NvmlSampler

    energy = {"mj": 0}

    def counter(_h):
        energy["mj"] += 700  # 70 W for 10 ms
        return energy["mj"]

    field = types.SimpleNamespace(nvmlReturn=0, value=types.SimpleNamespace(uiVal=70_000))
    fake = types.SimpleNamespace(
        NVML_FI_DEV_POWER_INSTANT=186, NVML_SUCCESS=0, NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2, NVML_TEMPERATURE_GPU=0,
        NVMLError=RuntimeError, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: "gpu0", nvmlDeviceGetFieldValues=lambda h, ids: [field],
        nvmlDeviceGetPowerUsage=lambda h: 69_000, nvmlDeviceGetTotalEnergyConsumption=counter,
        nvmlDeviceGetClockInfo=lambda h, c: 1980, nvmlDeviceGetTemperature=lambda h, s: 40,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=0, memory=0),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=1048576 * 500),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = NvmlSampler(interval_ms=100, power_interval_ms=10).start()
    assert sampler.wait_for_samples(40, timeout_s=10)
    samples = sampler.stop()
    assert all(s["power_w"] == 70.0 and "energy_j" in s for s in samples)
    full = [s for s in samples if "gpu_freq_mhz" in s]
    # Every reading has power and the counter; about one in ten the clocks, load, temperature and memory too.
    assert 1 <= len(full) < len(samples) / 3
    assert full[0]["power_avg_w"] == 69.0 and full[0]["gpu_mem_used_mb"] == 500
    assert sampler.power_field == "power_instant"
    assert time.time() >= samples[-1]["t"]


def test_a_window_shorter_than_a_period_sizes_its_pass_from_its_edges_not_the_worst_case():
    # Prefill of 12 ms inside a 100-ms sensor's readings: one step of 140 W up (idle to busy) near its start, and
    # the draw stays busy after it (decode follows), so only one edge steps.
    samples = _square(0.1, 2.0, 6.0)
    w = PhaseWindow("prefill", 1002.005, 1002.017, tokens=128)
    needed, why = energy_pass_needed(samples, w, EnergySettings())
    worst = 0.1 / 0.02  # steps as large as the draw at both edges
    assert needed is not None and 0.5 <= needed < worst
    assert "samples in" in why


def test_a_slower_wall_meter_sizes_the_energy_pass_when_the_board_would_not():
    import types

    from jbench.device.telemetry.wall import ClockOffset
    from jbench.runner.measure import _needs_energy_pass, _Wall

    class Readings:
        def __init__(self, samples, interval):
            self.samples, self.interval = samples, interval

        def wait_past(self, t, timeout_s):
            return True

        def shifted(self, offset_s):
            return [{**s, "t": s["t"] + offset_s} for s in self.samples]

    ctx = types.SimpleNamespace(cfg=types.SimpleNamespace(telemetry=types.SimpleNamespace(interval_ms=100)))
    w = PhaseWindow("decode", 1002.0, 1003.0, tokens=300)
    board = Readings(_square(0.01, 2.0, 3.0), 0.01)
    assert _needs_energy_pass(ctx, board, w, EnergySettings(), None)[0] is None
    # The meter reads every 500 ms on the controller, whose clock is 7 s behind the device's.
    meter = Readings([dict(s, t=s["t"] - 7.0) for s in _square(0.5, 2.0, 3.0)], 0.5)
    wall = _Wall("shelly", meter, ClockOffset(7.0, 0.001, 0.002, 8))
    needed, why = _needs_energy_pass(ctx, board, w, EnergySettings(), wall)
    assert needed is not None and needed > 5 and why.startswith("the wall meter:")


def test_an_energy_pass_at_another_speed_whose_window_fell_short_still_grows_once():
    # The speed pass's one repetition was slow (0.8 s for 8 tokens, a loaded moment); sized from it, the energy pass
    # ran 3 repetitions of 40 ms: a 0.12 s window, too few readings for any energy. Its speed differs, so its
    # tokens/J are withheld, but its power is real: it runs once more, sized from its own repetitions.
    import logging
    import types

    from jbench.core.results import BackendResult, PhaseResult
    from jbench.runner.measure import _energy_pass

    clock = {"t": 1001.0}
    calls = []

    def run(trial, conn, log, only_phase, repetitions):
        calls.append(repetitions)
        clock["t"] += 0.5 + repetitions * 0.04
        # Like the in-house engine: the whole pass is one sample of 8 x repetitions tokens, so sizing the next pass
        # from its samples would take the pass's length as one repetition's.
        pr = PhaseResult("decode", 8 * repetitions, [40_000_000 * repetitions], end_time=clock["t"], settled=True)
        return BackendResult(phases={"decode": pr})

    class Board:
        samples = [{"t": 1000.0 + 0.05 * i, "power_w": 9.0} for i in range(2000)]

        def wait_past(self, t, timeout_s):
            return True

    energy_cfg = types.SimpleNamespace(speed_tolerance=0.05, speed_match_retries=1)
    ctx = types.SimpleNamespace(cfg=types.SimpleNamespace(energy=energy_cfg,
                                                          telemetry=types.SimpleNamespace(interval_ms=50)),
                                log=logging.getLogger("test"), backend=types.SimpleNamespace(run=run),
                                trial=None, conn=None)
    speed = PhaseResult("decode", 8, [800_000_000], end_time=1001.0, settled=True)
    sources: dict[str, str] = {}
    w, match = _energy_pass(ctx, Board(), None, "decode", speed, PhaseWindow("decode", 1000.2, 1001.0, tokens=8),
                            1.5, "8 samples", EnergySettings(), {}, sources)
    assert calls[0] == 3 and len(calls) == 2 and calls[1] > 3
    assert w.duration >= 0.25 and w.tokens == 8 * calls[1]  # five 50-ms readings fit in it
    # Sized from 40 ms per repetition of 8 tokens, not the 0.12 s sample of the first pass (that gave 3 again).
    assert 0.25 <= calls[1] * 0.04 < 1.5
    assert match is not None and not match.ok  # still another speed: tokens/J withheld by the caller
