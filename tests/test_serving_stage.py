"""The serving scenario's record from its levels and their energy windows (jbench.runner.serving.serving_result):
per-level stepped series, the knee and the SLO capacity with their intervals, tokens per joule at the capacity."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest

from jbench.analysis.energy import WindowEnergy
from jbench.analysis.serving import Level, RequestOutcome
from jbench.core import metrics
from jbench.core.results import LoadWindow
from jbench.core.schema import ServingConfig, SloConfig
from jbench.runner.serving import serving_result

SLOTS, SERVICE_S, N_OUT = 4, 0.5, 20


def _level(load: int, n: int = 16) -> tuple[Level, LoadWindow]:
    """A closed loop at `load` in flight against SLOTS slots of SERVICE_S each: beyond the slots a request waits
    for one, so its TTFT holds a queue wait; throughput grows with the load up to the slots, then stays flat."""
    outcomes, t = [], 0.0
    waves = math.ceil(n / load)
    for i in range(n):
        wave = i // load
        queue = (i % load) // SLOTS * SERVICE_S  # requests beyond the slots wait for a full service
        sent = wave * (SERVICE_S * math.ceil(load / SLOTS))
        ttft = 0.05 + queue
        e2e = ttft + SERVICE_S
        gaps = tuple([SERVICE_S / (N_OUT - 1)] * (N_OUT - 1))
        outcomes.append(RequestOutcome(i, sent, ttft, e2e, N_OUT, 64, gaps))
        t = max(t, sent + e2e)
    level = Level(float(load), tuple(outcomes), wall_s=t)
    window = LoadWindow(f"level{load}", 1000.0, 1000.0 + t, output_tokens=n * N_OUT, total_tokens=n * (N_OUT + 64))
    return level, window


def _energy(window: LoadWindow, watts: float) -> WindowEnergy:
    d = window.end - window.start
    return WindowEnergy(watts * d, watts, d, int(d * 10), 1.0, "ok")


def test_levels_become_stepped_series_and_the_answers_come_with_intervals():
    cfg = ServingConfig(levels=[1.0, 2.0, 4.0, 8.0, 16.0], slo=SloConfig(ttft_ms=400.0, attainment=0.9))
    pairs = [_level(c) for c in (1, 2, 4, 8, 16)]
    levels, windows = [p[0] for p in pairs], [p[1] for p in pairs]
    # Power rises with the load until the slots are busy.
    energy = {w.name: _energy(w, 5.0 + 2.0 * min(c, SLOTS)) for w, c in zip(windows, (1, 2, 4, 8, 16))}
    out = serving_result(cfg, levels, windows, energy)
    for name in list(out.metrics) + list(out.stepped):
        assert metrics.is_declared(name), name
    assert out.stepped["serving_level_load"] == [1.0, 2.0, 4.0, 8.0, 16.0]
    tps = out.stepped["serving_output_tps"]
    assert tps[0] < tps[1] < tps[2] and tps[3] == pytest.approx(tps[2], rel=0.2)
    tpj = out.stepped["serving_output_tokens_per_joule"]
    assert tpj[0] == pytest.approx(windows[0].output_tokens / energy["level1"].energy_j)
    assert out.stepped["serving_joules_per_output_token"][2] == pytest.approx(1 / tpj[2])
    # At 8 and 16 in flight half and more of the requests wait a whole service: TTFT over 400 ms.
    assert out.stepped["serving_slo_attainment"][:3] == [1.0, 1.0, 1.0]
    assert out.stepped["serving_slo_attainment"][3] < 0.9
    assert out.metrics["serving_slo_capacity"] == 4.0
    assert out.metrics["serving_slo_capacity_low"] <= 4.0 <= out.metrics["serving_slo_capacity_high"]
    assert out.metrics["serving_capacity_output_tokens_per_joule"] == pytest.approx(tpj[2])
    assert out.metrics["serving_knee_load"] == 4.0 and "serving.knee_load" in out.tags
    rows = list(csv.DictReader(io.StringIO(out.artifacts["serving/levels.csv"])))
    assert [float(r["load"]) for r in rows] == [1.0, 2.0, 4.0, 8.0, 16.0]
    summary = json.loads(out.artifacts["serving/summary.json"])
    assert summary["slo_capacity"]["value"] == 4.0 and len(summary["levels"]) == 5


def test_no_energy_is_said_never_guessed_and_an_unmet_slo_is_a_finding():
    cfg = ServingConfig(levels=[1.0, 2.0], slo=SloConfig(ttft_ms=1.0))  # 1 ms: nothing meets it
    pairs = [_level(1), _level(2)]
    out = serving_result(cfg, [p[0] for p in pairs], [p[1] for p in pairs], {}, "the telemetry has no power")
    assert "serving_output_tokens_per_joule" not in out.stepped and "serving_avg_power_w" not in out.stepped
    assert out.tags["serving.energy"] == "not measured: the telemetry has no power"
    assert "serving_slo_capacity" not in out.metrics
    assert [f.code for f in out.findings] == ["serving_slo_not_met"]
    # Two loads: no knee, and the reason says why.
    assert "serving_knee_load" not in out.metrics and out.tags["serving.knee_load"]


def test_a_window_without_energy_keeps_its_reason_and_the_others_their_figures():
    cfg = ServingConfig(levels=[1.0, 2.0])
    pairs = [_level(1), _level(2)]
    windows = [p[1] for p in pairs]
    bad = WindowEnergy(math.nan, math.nan, 1.0, 2, 0.2, "too few samples in window (2 < 5)")
    out = serving_result(cfg, [p[0] for p in pairs], windows, {"level1": bad, "level2": _energy(windows[1], 9.0)})
    tpj = out.stepped["serving_output_tokens_per_joule"]
    assert math.isnan(tpj[0]) and tpj[1] > 0
    assert out.tags["energy.level1.status"] == "too few samples in window (2 < 5)"
    stopped = Level(4.0, pairs[1][0].outcomes, pairs[1][0].wall_s, stopped_early="TTFT grew from 50 ms to 900 ms")
    out = serving_result(cfg, [pairs[0][0], stopped], windows, {})
    assert any(f.code == "serving_oversaturated" and "900 ms" in f.message for f in out.findings)
