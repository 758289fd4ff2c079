"""Findings from crafted telemetry, counter-vs-integration energy, and the sysfs reader on a fake tree."""

from __future__ import annotations

import time

import pytest

from jbench.core.schema import ProfileConfig

from jbench.analysis.telemetry import EnergySettings, PhaseWindow, counter_energy, energy_metrics, findings
from jbench.core.schema import ProfileConfig
from jbench.device.local import LocalConnection
from jbench.device.telemetry.samplers import SysfsSampler, split_stamp, tegrastats_sample

from .conftest import DATA


def _series(n=50, dt=0.1, **signals):
    out = []
    for i in range(n):
        s = {"t": 1000.0 + i * dt}
        for key, value in signals.items():
            s[key] = value(i) if callable(value) else value
        out.append(s)
    return out


DECODE = PhaseWindow("decode", 1000.0, 1004.9, tokens=100)


def _codes(samples, **kw):
    return {f.code for f in findings(samples, [DECODE], **kw)}


def test_cpu_fallback():
    assert "cpu_fallback" in _codes(_series(gpu_load_pct=0.0, cpu_load_pct=95.0))
    assert "cpu_fallback" not in _codes(_series(gpu_load_pct=90.0, cpu_load_pct=95.0))


def test_gpu_clock_zero_and_unlocked_clocks():
    assert "gpu_clock_zero" in _codes(_series(gpu_freq_mhz=0.0, gpu_load_pct=0.0))
    varying = _series(gpu_load_pct=99.0, gpu_freq_mhz=lambda i: 306.0 if i % 2 else 624.0)
    assert "clocks_not_locked" in _codes(varying)
    assert "clocks_not_locked" not in _codes(_series(gpu_load_pct=99.0, gpu_freq_mhz=624.0))


def test_emc_underused_while_gpu_busy():
    assert "emc_underused" in _codes(_series(gpu_load_pct=95.0, emc_load_pct=30.0, gpu_freq_mhz=624.0))
    assert "emc_underused" not in _codes(_series(gpu_load_pct=95.0, emc_load_pct=80.0, gpu_freq_mhz=624.0))


def test_thermal_throttling_by_limit_and_by_falling_clock():
    hot = _series(temp_max_c=101.0, gpu_load_pct=99.0, gpu_freq_mhz=624.0)
    assert "thermal_throttling" in _codes(hot, profile=ProfileConfig(throttle_temp_c=99.0))
    falling = _series(gpu_load_pct=99.0, gpu_freq_mhz=lambda i: 1300.0 if i < 25 else 900.0, temp_max_c=70.0)
    found = findings(falling, [DECODE])
    assert any(f.code == "thermal_throttling" and f.evidence["gpu_freq_last_mhz"] == 900.0 for f in found)


def test_swap_and_mode_mismatch():
    assert "swap_used" in _codes(_series(swap_used_mb=lambda i: 100 + i))
    assert "power_mode_mismatch" in _codes(_series(), requested_mode="MAXN", actual_mode="15W")
    assert _codes(_series(gpu_load_pct=95.0, gpu_freq_mhz=624.0, emc_load_pct=70.0, cpu_load_pct=20.0)) == set()


def test_energy_metrics_against_a_hardware_counter():
    # 100 W constant with a counter that agrees: deviation 0; idle at 40 W gives above-idle figures.
    samples = _series(n=200, dt=0.05, power_w=100.0, energy_j=lambda i: 5000.0 + 100.0 * 0.05 * i)
    idle = PhaseWindow("idle", 1000.0, 1002.0)
    decode = PhaseWindow("decode", 1003.0, 1009.0, tokens=600)
    for s in samples:
        if s["t"] <= 1002.0:
            s["power_w"] = 40.0
    m, tags = energy_metrics(samples, [idle, decode], EnergySettings(min_window_s=5))
    assert tags["energy.status"] == "ok"
    assert m["decode_energy_j"] == pytest.approx(600.0)
    assert m["decode_energy_counter_j"] == pytest.approx(600.0)
    assert abs(m["decode_energy_deviation_pct"]) < 1e-9
    assert m["idle_power_w"] == pytest.approx(40.0)
    assert m["decode_tokens_per_joule"] == pytest.approx(1.0)
    assert m["decode_tokens_per_joule_above_idle"] == pytest.approx(600 / (600 - 40 * 6))
    assert counter_energy(samples, 999.0, 1001.0) is None  # outside the counter's samples


def test_no_power_signal_is_a_reason_not_a_zero():
    m, tags = energy_metrics(_series(gpu_load_pct=50.0), [DECODE], EnergySettings())
    assert m == {} and tags["energy.status"] == "not measured: the telemetry has no total-power signal"


def test_tegrastats_sample_uses_the_profile_rails():
    line = next(l for l in (DATA / "jetson-formats" / "tegrastats-agx-orin.txt").read_text().splitlines()
                if l and not l.startswith("#") and "VDD_GPU_SOC" in l)
    s = tegrastats_sample(5.0, line, ProfileConfig(power_rails=["VDD_GPU_SOC"], gpu_rail="VDD_GPU_SOC",
                                                   cpu_rail="VDD_CPU_CV"))
    assert s["power_w"] == pytest.approx(s["rail_VDD_GPU_SOC_w"]) and s["gpu_power_w"] == s["rail_VDD_GPU_SOC_w"]
    assert split_stamp("1795242869.151979 RAM 1/2MB") == (1795242869.151979, "RAM 1/2MB")
    assert split_stamp("garbage") == (None, "garbage")


def test_sysfs_sampler_reads_ina3221_hwmon(tmp_path):
    hw = tmp_path / "bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon3"
    hw.mkdir(parents=True)
    for k, (label, mv, ma) in enumerate([("VDD_IN", 5000, 2400), ("VDD_CPU_GPU_CV", 5000, 600), ("NC", 0, 0)], 1):
        (hw / f"in{k}_label").write_text(label + "\n")
        (hw / f"in{k}_input").write_text(f"{mv}\n")
        (hw / f"curr{k}_input").write_text(f"{ma}\n")
    sampler = SysfsSampler(LocalConnection(), 20, profile=ProfileConfig(gpu_rail="VDD_CPU_GPU_CV"),
                           sysfs_root=str(tmp_path)).start()
    assert sampler.wait_for_samples(5, timeout_s=20), sampler.problem
    samples = sampler.stop()
    # The combined CPU+GPU+CV rail is reported once, never as GPU (or CPU) energy.
    assert samples[0]["power_w"] == pytest.approx(12.0) and samples[0]["cpu_gpu_cv_power_w"] == pytest.approx(3.0)
    assert "gpu_power_w" not in samples[0] and "cpu_power_w" not in samples[0]
    assert sampler.power_field == "board input VDD_IN"
    assert "rail_NC_w" not in samples[0]
    assert all(b["t"] > a["t"] for a, b in zip(samples, samples[1:]))


def test_sysfs_sampler_without_rails_says_why(tmp_path):
    sampler = SysfsSampler(LocalConnection(), 20, sysfs_root=str(tmp_path)).start()
    deadline = time.monotonic() + 20
    while sampler.problem is None and time.monotonic() < deadline:
        time.sleep(0.05)
    sampler.stop()
    assert sampler.samples == [] and "no INA3221/INA238 hwmon channels" in sampler.problem


def test_no_above_idle_figure_from_a_difference_the_window_cannot_resolve():
    # A draw that equals idle to within float round-off (9.81 W in both windows, integrated over different
    # spans) leaves an "above idle" of a few 1e-14 J: 400 tokens over it were published as 2.8e16 tok/J.
    samples = _series(n=400, dt=0.1, power_w=9.81)
    idle = PhaseWindow("idle", 1000.0, 1001.0)
    decode = PhaseWindow("decode", 1001.0, 1012.3, tokens=400)
    m, tags = energy_metrics(samples, [idle, decode], EnergySettings())
    assert tags["energy.status"] == "ok" and m["decode_avg_power_w"] == pytest.approx(9.81)
    assert m["decode_tokens_per_joule"] == pytest.approx(400 / (9.81 * 11.3))
    assert "decode_energy_above_idle_j" not in m and "decode_tokens_per_joule_above_idle" not in m
