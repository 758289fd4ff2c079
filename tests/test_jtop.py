"""The jtop sampler against the real jetson-stats service running inside real_paths emulated Jetsons."""

from __future__ import annotations

import time

import pytest

from jbench.device.connect import connect
from jbench.device.telemetry.jtop import JtopSampler

pytestmark = pytest.mark.ssh


def _sampler(emu, **profile):
    conn = connect(emu.device_config())
    sampler = JtopSampler(conn, 200)
    sampler.rail_profile = profile or None
    return conn, sampler.start()


def _collect(sampler, n, timeout=60.0):
    assert sampler.wait_for_samples(n, timeout), sampler.problem
    return list(sampler.samples)


def test_orin_nano_super_power_follows_load_and_extra_fields(emulated_jetson_factory):
    emu = emulated_jetson_factory("orin_nano_super", jtop=True)
    conn, sampler = _sampler(emu)
    try:
        idle = _collect(sampler, 5)
        conn.run(["emu-gpu-load", "6"], timeout=30)
        busy = [s for s in sampler.samples[len(idle):]]
    finally:
        sampler.stop()
    s = idle[-1]
    assert sampler.power_field == "board input VDD_IN"
    assert sampler.telemetry_tags()["telemetry.power_rails"] == "VDD_IN"
    assert s["power_w"] == s["rail_VDD_IN_w"] and s["power_w"] > 1.0
    assert s["jtop_nvpmodel"] == "25W" and s["jtop_jetson_clocks"] is False
    assert s["fan_speed_pct"] is not None and s["fan_rpm"] is not None
    assert s["gpu_governor"] == "nvhost_podgov" and s["gpu_3d_scaling"] is True
    assert s["gpu_freq_mhz"] is not None and s["emc_freq_mhz"] is not None and s["temp_max_c"] is not None
    assert busy and max(b["power_w"] for b in busy) > max(i["power_w"] for i in idle) + 2.0
    assert max(b["gpu_load_pct"] for b in busy) > 50


def test_agx_orin_sums_module_rails(emulated_jetson_factory):
    emu = emulated_jetson_factory("agx_orin", jtop=True)
    conn, sampler = _sampler(emu)
    try:
        s = _collect(sampler, 3)[-1]
    finally:
        sampler.stop()
    assert sampler.power_field.startswith("module rails sum (AGX Orin): VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0")
    names = ("VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0", "VDDQ_VDD2_1V8AO")
    assert s["power_w"] == pytest.approx(sum(s[f"rail_{n}_w"] for n in names))
    assert "rail_NC_w" not in s


def test_without_service_the_sampler_has_a_problem_not_zeros(emulated_jetson_factory):
    emu = emulated_jetson_factory("orin_nano_super", real_paths=True)  # files, no jtop installed or running
    conn, sampler = _sampler(emu)
    deadline = time.monotonic() + 30
    while sampler.problem is None and time.monotonic() < deadline:
        time.sleep(0.1)
    sampler.stop()
    assert sampler.samples == []
    assert "jetson-stats is not installed" in sampler.problem
