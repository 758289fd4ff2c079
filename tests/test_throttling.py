"""Throttling evidence per phase window (jbench/analysis/telemetry.py, pure): over-current counter deltas,
hottest zone, clock drops, the `throttling` finding; wired into energy_metrics and findings."""

from __future__ import annotations

import pytest

from jbench.analysis.telemetry import (
    EnergySettings,
    PhaseWindow,
    energy_metrics,
    findings,
    throttling_findings,
    throttling_metrics,
)


def _samples(oc3=None, gpu=None, temps=None, power=8.0, t0=100.0, step=0.1):
    n = max(len(x) for x in (oc3 or [], gpu or [], temps or [], [0]))
    out = []
    for i in range(n):
        s = {"t": t0 + i * step, "power_w": power}
        for key, series in (("oc3_event_cnt", oc3), ("gpu_freq_mhz", gpu), ("temp_max_c", temps)):
            if series is not None and i < len(series) and series[i] is not None:
                s[key] = series[i]
        out.append(s)
    return out


def test_oc_delta_counts_from_the_reading_before_the_window():
    # Readings at t=100.0 .. 100.9; the window opens at 100.25: baseline is the 100.2 reading (1002).
    samples = _samples(oc3=[1000, 1001, 1002, 1010, 1020, 1030, 1030, 1030, 1030, 1030])
    m, tags = throttling_metrics(samples, [PhaseWindow("decode", 100.25, 100.85)])
    assert m["decode_oc3_events"] == 28
    assert "soctherm_oc" not in tags["throttling.status"] or tags["throttling.status"] != "ok"


def test_counter_reset_or_single_reading_gives_no_delta():
    reset = _samples(oc3=[500, 510, 3, 4])
    assert "decode_oc3_events" not in throttling_metrics(reset, [PhaseWindow("decode", 100.05, 100.35)])[0]
    one = _samples(oc3=[None, None, 7, None])
    assert "decode_oc3_events" not in throttling_metrics(one, [PhaseWindow("decode", 100.15, 100.35)])[0]


def test_quiet_counters_are_zero_events_and_no_finding():
    samples = _samples(oc3=[5] * 10, gpu=[1020] * 10, temps=[50] * 10)
    windows = [PhaseWindow("decode", 100.0, 100.9)]
    m, tags = throttling_metrics(samples, windows)
    assert m["decode_oc3_events"] == 0 and m["decode_gpu_freq_drop_pct"] == 0 and m["decode_temp_max_c"] == 50
    assert throttling_findings(samples, windows) == []
    assert tags["throttling.status"] == "not in this telemetry: CPU clock"


def test_oc_events_and_a_clock_drop_make_a_finding_with_evidence():
    samples = _samples(oc3=[0, 0, 40, 90, 90, 90], gpu=[1020, 1020, 918, 816, 816, 816], temps=[60, 61, 63, 64, 64, 64])
    windows = [PhaseWindow("idle", 99.0, 99.9), PhaseWindow("decode", 100.0, 100.5)]
    (f,) = throttling_findings(samples, windows)
    assert f.code == "throttling" and f.message.startswith("decode: 90 OC3 over-current events")
    assert "GPU clock fell 1020 -> 816 MHz (20 %)" in f.message
    assert f.evidence["oc3_events"] == 90 and f.evidence["gpu_freq_min_mhz"] == 816 and f.evidence["temp_max_c"] == 64
    m, _ = throttling_metrics(samples, windows)
    assert m["decode_gpu_freq_drop_pct"] == pytest.approx(20.0)
    assert not any(k.startswith("idle_") for k in m)  # no readings inside idle: no metric, not zeros


def test_clock_drop_outside_prefill_decode_is_a_metric_not_a_finding():
    samples = _samples(gpu=[1020, 300, 1020, 300])
    windows = [PhaseWindow("idle", 100.0, 100.3)]
    assert throttling_metrics(samples, windows)[0]["idle_gpu_freq_drop_pct"] == pytest.approx(100 * 720 / 1020)
    assert throttling_findings(samples, windows) == []


def test_wired_into_energy_metrics_and_findings():
    samples = _samples(oc3=[0] * 30 + [12] * 30, gpu=[1020] * 60, power=8.0, step=0.1)
    windows = [PhaseWindow("decode", 100.0, 105.9, tokens=100)]
    m, tags = energy_metrics(samples, windows, EnergySettings())
    assert m["decode_oc3_events"] == 12 and m["decode_energy_j"] > 0 and "throttling.status" in tags
    assert [f.code for f in findings(samples, windows)] == ["throttling"]
    # Without a power signal the throttling evidence still counts.
    no_power = [{k: v for k, v in s.items() if k != "power_w"} for s in samples]
    m, tags = energy_metrics(no_power, windows, EnergySettings())
    assert m["decode_oc3_events"] == 12 and tags["energy.status"].startswith("not measured")
