"""Thermal gate: before a trial, wait (bounded) until the device's hottest sensor is cool enough."""

from __future__ import annotations

import logging
import time
from typing import Optional

from jbench.core.schema import ThermalConfig
from jbench.device.connection import Connection

# Constant script: the thermal zones (milli-degrees C, prefixed "zone"), then a discrete NVIDIA GPU's own
# temperature (degrees C, prefixed "gpu") where nvidia-smi exists: a GPU host often exposes no thermal zone
# (a container, a server board) while NVML reports the GPU's temperature, and the GPU is what a trial heats.
# Offline sensors (-256 C and the like) are ignored.
_READ = ('for z in /sys/devices/virtual/thermal/thermal_zone*/temp; do [ -r "$z" ] && printf "zone %s\\n" "$(cat "$z")"; '
         'done 2>/dev/null; if command -v nvidia-smi >/dev/null 2>&1; then '
         'nvidia-smi --query-gpu=temperature.gpu --format=csv,noheader,nounits 2>/dev/null | sed "s/^/gpu /"; fi')


def parse_temperatures(text: str) -> dict[str, list[float]]:
    """Readings in degrees C by source ("zone", "gpu") from the output of the constant script above."""
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2 or parts[0] not in ("zone", "gpu"):
            continue
        try:
            value = float(parts[1]) / (1000.0 if parts[0] == "zone" else 1.0)
        except ValueError:
            continue  # "[N/A]" from a GPU without a sensor
        if -40.0 < value < 150.0:
            found.setdefault(parts[0], []).append(value)
    return found


def hottest_c(conn: Connection) -> Optional[float]:
    """The hottest reading of the device's thermal zones and its NVIDIA GPUs, or None without any sensor."""
    res = conn.run(["sh", "-c", _READ], timeout=30)
    temps = [t for values in parse_temperatures(res.stdout).values() for t in values]
    return max(temps) if temps else None


def thermal_gate(conn: Connection, cfg: ThermalConfig, log: logging.Logger, *, read=hottest_c, sleep=time.sleep,
                 clock=time.monotonic) -> dict[str, str]:
    """Wait until the hottest sensor is under thermal.start_below_c (bounded by thermal.timeout_s);
    on timeout go on and say so. Returns tags recording what happened."""
    limit = cfg.start_below_c
    tags: dict[str, str] = {}
    if cfg.cooldown_s:
        sleep(float(cfg.cooldown_s))
    temp = read(conn)
    if temp is None:
        return {"thermal.gate": "no temperature sensors: not gated"}
    tags["thermal.start_temp_c"] = f"{temp:.1f}"
    if limit is None:
        tags["thermal.gate"] = "off"
        return tags
    start = clock()
    waited = False
    while temp >= limit:
        if clock() - start >= float(cfg.timeout_s):
            log.warning("thermal gate: still %.1f C after %.0f s (limit %.1f C); going on", temp, clock() - start, limit)
            tags.update({"thermal.gate": "timeout", "thermal.start_temp_c": f"{temp:.1f}"})
            return tags
        waited = True
        sleep(float(cfg.poll_s))
        temp = read(conn)
        if temp is None:
            break
    tags["thermal.gate"] = f"waited {clock() - start:.0f} s" if waited else "cool"
    if temp is not None:
        tags["thermal.start_temp_c"] = f"{temp:.1f}"
    return tags
