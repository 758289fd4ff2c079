"""The sysfs/hwmon reader (jbench/device/telemetry/hwmon.py) run for real through the local connection
against the layouts of tests/data/sysfs/layouts.yaml: kept-open files re-read, sensor settings as tags,
throttling signals in the stream, failed reads absent (never 0)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from jbench.device.local import LocalConnection
from jbench.device.telemetry import sources
from jbench.device.telemetry.hwmon import HWMON_DEFAULT_INTERVAL_MS, SysfsSampler, parse_reader_line, sensor_tags
from tests.sysfs_layouts import build

HWMON1 = "bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon1"


def _run_until(sampler: SysfsSampler, done, timeout_s: float = 30) -> list[dict]:
    """Run the sampler until done(samples) holds (the timeout only guards a hang; it is not what is tested)."""
    sampler.start()
    deadline = time.monotonic() + timeout_s
    try:
        while not done(sampler.samples) and time.monotonic() < deadline and sampler.problem is None:
            time.sleep(0.02)
    finally:
        samples = sampler.stop()
    assert done(samples), sampler.problem
    return samples


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-loop", "python-loop"])
def test_reader_rereads_open_files_and_streams_throttling_signals(tmp_path, compiled):
    # Both loops: the C one compiled on the device (cc is on this machine, as on JetPack) and the Python one
    # the reader falls back to; same files, same line format, same samples.
    build(tmp_path, "orin_nano_jp6")
    sampler = SysfsSampler(LocalConnection(), 10, sysfs_root=str(tmp_path), compiled=compiled)
    first = _run_until(sampler, lambda s: len(s) >= 3)
    loop_tag = sampler.telemetry_tags()["telemetry.sampler_loop"]
    assert loop_tag.startswith("compiled C (") if compiled else loop_tag.startswith("python (")
    # Change the files the reader holds open: later samples must show the new values.
    (tmp_path / HWMON1 / "curr1_input").write_text("3000\n")
    (tmp_path / "class/hwmon/hwmon3/oc3_event_cnt").write_text("1250\n")
    sampler = SysfsSampler(LocalConnection(), 10, sysfs_root=str(tmp_path), compiled=compiled)
    sampler.start()
    try:
        assert sampler.wait_for_samples(2, timeout_s=30), sampler.problem
        (tmp_path / HWMON1 / "curr1_input").write_text("2000\n")
        (tmp_path / "class/hwmon/hwmon3/oc3_event_cnt").write_text("1300\n")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(s.get("oc3_event_cnt") == 1300 and
                                                      any(x["power_w"] == pytest.approx(10.0) for x in sampler.samples)
                                                      for s in sampler.samples):
            time.sleep(0.02)
    finally:
        samples = sampler.stop()
    assert first[0]["power_w"] == pytest.approx(12.0)
    # A read that met the file mid-rewrite (empty) is an absent rail, so power_w None there: never 0.
    assert {round(s["power_w"], 3) for s in samples if s["power_w"] is not None} >= {15.0, 10.0}
    assert all(s["power_w"] != 0 for s in samples)
    assert [s["oc3_event_cnt"] for s in samples if "oc3_event_cnt" in s][-1] == 1300
    slow = next(s for s in first if "oc1_event_cnt" in s)
    assert slow["oc1_event_cnt"] == 0 and slow["temp_tj-thermal_c"] == pytest.approx(52.25)
    assert slow["temp_max_c"] == pytest.approx(52.25)  # cv0-thermal's -256 C (offline) is not a temperature
    assert slow["gpu_freq_mhz"] == pytest.approx(1020.0) and slow["cpu_freq_mhz"] == pytest.approx(1728.0)
    # Counters, zones and clocks come every 100 ms, not with every 10 ms sample.
    assert sum("oc3_event_cnt" in s for s in samples) < len(samples)
    ts = [s["t"] for s in samples]
    assert ts == sorted(ts) and abs(ts[0] - time.time()) < 3600  # the device's epoch clock


def test_sensor_settings_become_tags(tmp_path):
    build(tmp_path, "orin_nano_jp6")
    sampler = SysfsSampler(LocalConnection(), 10, sysfs_root=str(tmp_path))
    _run_until(sampler, lambda s: len(s) >= 2)
    tags = sampler.telemetry_tags()
    assert tags["telemetry.sample_interval_ms"] == "10"
    assert tags["telemetry.sensor_update_interval_ms"] == "ina3221 1-0040: 35"
    assert tags["telemetry.sensor_averaging"] == "ina3221 1-0040: 512 samples"
    assert tags["telemetry.sensor_shunt_uohm"] == "VDD_IN 5000, VDD_CPU_GPU_CV 5000, VDD_SOC 5000"
    assert "converts every 35 ms" in tags["telemetry.sensor_note"] and "repeat" in tags["telemetry.sensor_note"]
    assert tags["telemetry.throttle_signals"] == "soctherm_oc counters, 4 thermal zones, GPU devfreq, 2 cpufreq"
    assert tags["telemetry.power_rails"] == "VDD_IN"


def test_ina238_without_update_interval_says_not_exposed(tmp_path):
    build(tmp_path, "thor_jp7")
    sampler = SysfsSampler(LocalConnection(), 10, sysfs_root=str(tmp_path))
    samples = _run_until(sampler, lambda s: len(s) >= 2)
    tags = sampler.telemetry_tags()
    assert tags["telemetry.sensor_update_interval_ms"] == "ina3221 2-0040: 5; ina238 2-0044: not exposed"
    assert "telemetry.sensor_note" not in tags  # 5 ms conversions are faster than 10 ms sampling
    assert tags["telemetry.throttle_signals"] == "none found"
    assert samples[0]["rail_VIN_w"] == pytest.approx(24.0)


def test_ina238_bus_volts_times_amps_and_its_label(tmp_path):
    d = tmp_path / "bus/i2c/drivers/ina238/2-0044/hwmon/hwmon5"
    d.mkdir(parents=True)
    (d / "in1_input").write_text("48000\n")
    (d / "curr1_input").write_text("250\n")
    (d / "label").write_text("VIN_CARRIER\n")
    samples = _run_until(SysfsSampler(LocalConnection(), 10, sysfs_root=str(tmp_path)), lambda s: len(s) >= 1)
    assert samples[0]["rail_VIN_CARRIER_w"] == pytest.approx(12.0)
    assert samples[0]["power_w"] is None  # an unknown rail name is no input rail: no total, never a guess


def test_disabled_nc_shunt_and_sum_channels_are_never_rails(tmp_path):
    build(tmp_path, "orin_nano_jp6")
    (tmp_path / HWMON1 / "in3_enable").write_text("0\n")
    samples = _run_until(SysfsSampler(LocalConnection(), 10, sysfs_root=str(tmp_path)), lambda s: len(s) >= 1)
    assert {k for k in samples[0] if k.startswith("rail_")} == {"rail_VDD_IN_w", "rail_VDD_CPU_GPU_CV_w"}


def test_a_failed_read_is_absent_never_zero():
    meta = {"rails": [["VDD_IN", 1e-6, 2], ["VDD_SOC", 1e-6, 2]], "slow": [["oc3_event_cnt", 1], ["temp_tj_c", 1e-3]]}
    t, rails, slow = parse_reader_line("1700000000.5 5000 2400 - 300 | - 52000", meta)
    assert t == 1700000000.5 and rails == {"VDD_IN": pytest.approx(12.0)} and slow == {"temp_tj_c": 52.0}
    assert parse_reader_line("1700000000.5 5000 2400", meta) is None  # a short line is no sample
    assert parse_reader_line("garbage", meta) is None


def test_sensor_note_only_when_sampling_outruns_the_sensor():
    meta = {"chips": [{"driver": "ina3221", "device": "1-0040", "update_interval": "2"}], "slow": []}
    assert "telemetry.sensor_note" not in sensor_tags(meta, 10)
    assert "converts every 2 ms" in sensor_tags(meta, 1)["telemetry.sensor_note"]


def test_sysfs_source_samples_at_100_hz_by_default(tmp_path):
    device = {"paths": {"sysfs_root": str(tmp_path)}}
    sampler = sources.make_sampler("sysfs", LocalConnection(), device, None, 100)
    assert sampler.interval_ms == HWMON_DEFAULT_INTERVAL_MS == 10
    assert sampler.argv[-3:] == [str(tmp_path), "10", "100"]
    faster = sources.make_sampler("sysfs", LocalConnection(), device, None, 100, hwmon_interval_ms=5)
    assert faster.interval_ms == 5
    # A source without the keyword is called as before.
    assert sources.make_sampler("none", LocalConnection(), device, None, 100, hwmon_interval_ms=5).problem


def test_no_rails_says_why(tmp_path: Path):
    sampler = SysfsSampler(LocalConnection(), 10, sysfs_root=str(tmp_path)).start()
    deadline = time.monotonic() + 30
    while sampler.problem is None and time.monotonic() < deadline:
        time.sleep(0.02)
    sampler.stop()
    assert sampler.samples == [] and "no INA3221/INA238 hwmon channels" in sampler.problem
