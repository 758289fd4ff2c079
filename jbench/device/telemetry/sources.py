"""Telemetry sources by name (telemetry.source): each is a factory registered in the `jbench.samplers`
entry-point group, `(conn, device, profile, interval_ms) -> Sampler`, where `device` is the trial's
DeviceConfig and `profile` its ProfileConfig (None: no module profile). A user's package adds a source the
same way (see jbench.registry); `auto` picks among the built-ins.

`interval_ms` is telemetry.interval_ms (tegrastats, jtop, nvml). The sysfs/hwmon reader has its own,
shorter interval (telemetry.hwmon_interval_ms, default 10 ms = 100 Hz): a factory that takes the keyword
`hwmon_interval_ms` gets it."""

from __future__ import annotations

import inspect
from typing import Optional

from jbench.core import registry
from jbench.core.schema import DeviceConfig, DeviceSection, ProfileConfig, ProfileSection, typed
from jbench.device.connection import Connection
from jbench.device.telemetry.hwmon import HWMON_DEFAULT_INTERVAL_MS, SysfsSampler
from jbench.device.telemetry.samplers import (
    JtopSampler,
    NoSampler,
    NvmlSampler,
    Sampler,
    TegrastatsSampler,
)


def no_telemetry(conn: Connection, device: DeviceConfig, profile: Optional[ProfileConfig], interval_ms: int) -> Sampler:
    return NoSampler("telemetry.source=none")


def tegrastats(conn: Connection, device: DeviceConfig, profile: Optional[ProfileConfig], interval_ms: int) -> Sampler:
    return TegrastatsSampler(conn, interval_ms, profile=profile)


def sysfs(conn: Connection, device: DeviceConfig, profile: Optional[ProfileConfig], interval_ms: int, *,
          hwmon_interval_ms: Optional[int] = None) -> Sampler:
    """The hwmon reader at hwmon_interval_ms (default 10 ms), not telemetry.interval_ms: its compiled loop costs
    little at 100 Hz (docs/PERFORMANCE.md), and tegrastats' 100 ms default is too coarse for a decode step's power."""
    return SysfsSampler(conn, int(hwmon_interval_ms or HWMON_DEFAULT_INTERVAL_MS), profile=profile,
                        sysfs_root=device.paths.sysfs_root)


def jtop(conn: Connection, device: DeviceConfig, profile: Optional[ProfileConfig], interval_ms: int) -> Sampler:
    sampler = JtopSampler(conn, interval_ms)
    sampler.rail_profile = profile  # the module profile's rails decide the input power (rails.input_power)
    return sampler


def nvml(conn: Connection, device: DeviceConfig, profile: Optional[ProfileConfig], interval_ms: int, *,
         hwmon_interval_ms: Optional[int] = None) -> Sampler:
    """NVML on the controller; power and the energy counter every hwmon_interval_ms (the fast power interval)."""
    if not conn.is_local:
        return NoSampler("telemetry.source=nvml samples the controller's own GPUs: use it with device=local")
    reason = NvmlSampler.available()
    return NoSampler(reason) if reason else NvmlSampler(interval_ms, power_interval_ms=hwmon_interval_ms)


def auto(conn: Connection, device: DeviceConfig, profile: Optional[ProfileConfig], interval_ms: int, *,
         hwmon_interval_ms: Optional[int] = None) -> Sampler:
    """NVML on a local machine without a Jetson profile; on a Jetson tegrastats, else the sysfs reader."""
    if conn.is_local and not profile:
        reason = NvmlSampler.available()
        if reason is None:
            return NvmlSampler(interval_ms, power_interval_ms=hwmon_interval_ms)
        return NoSampler(f"no power sensor on this machine: {reason}; no Jetson profile (device.profile)")
    probe = conn.run(["sh", "-c", "command -v tegrastats; command -v python3"], timeout=30)
    if "tegrastats" in probe.stdout:
        return tegrastats(conn, device, profile, interval_ms)
    if "python3" in probe.stdout:
        return sysfs(conn, device, profile, interval_ms, hwmon_interval_ms=hwmon_interval_ms)
    return NoSampler(f"no telemetry source on '{conn.name}': tegrastats and python3 not found")


def make_sampler(source: str, conn: Connection, device: DeviceSection, profile: ProfileSection, interval_ms: int, *,
                 hwmon_interval_ms: Optional[int] = None) -> Sampler:
    """The sampler for telemetry.source (a registered name); hwmon_interval_ms reaches the factories that take it.
    The factory gets the device and profile as schema objects (the run layer may pass plain sections)."""
    device = typed(DeviceConfig, device, where="device")
    profile = typed(ProfileConfig, profile, where="profile") if profile else None
    try:
        factory = registry.load(registry.SAMPLERS, source)
    except KeyError:
        raise ValueError(f"unknown telemetry.source '{source}'. Valid: "
                         f"{', '.join(sorted(registry.targets(registry.SAMPLERS)))}") from None
    if hwmon_interval_ms is not None and "hwmon_interval_ms" in inspect.signature(factory).parameters:
        return factory(conn, device, profile, interval_ms, hwmon_interval_ms=hwmon_interval_ms)
    return factory(conn, device, profile, interval_ms)
