"""Memory bandwidth of a device for the roofline: a measured figure, a saved calibration, or the datasheet.

Bandwidth for a device, in order: device.bandwidth_gbs (a figure the user measured), a saved
`jbench calibrate` result, the profile's datasheet figure. The figure's source is always recorded.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from jbench import paths
from jbench.device.connection import Connection

# Constant program; the size comes in as an argument. Copies a buffer several times with numpy and
# reports the best rate counting bytes read and written.
_BANDWIDTH = r"""
import sys, time
import numpy as np
n = int(sys.argv[1]) * (1 << 20) // 8
a = np.ones(n); b = np.empty_like(a)
best = 0.0
for _ in range(7):
    t = time.perf_counter(); np.copyto(b, a); dt = time.perf_counter() - t
    best = max(best, 2 * a.nbytes / dt)
print("%.3f" % (best / 1e9))
"""


def measure_bandwidth(conn: Connection, size_mb: int = 512) -> float:
    res = conn.run(["python3", "-c", _BANDWIDTH, str(int(size_mb))], timeout=300)
    if res.returncode != 0:
        raise ValueError(f"bandwidth measurement failed on '{conn.name}' (needs python3 with numpy): "
                         f"{res.stderr.strip()[-300:]}")
    return float(res.stdout.strip().splitlines()[-1])


def _calibration_path(device_name: str) -> Path:
    return paths.cache_dir() / "calibration" / f"{device_name}.json"


def save_calibration(device_name: str, gbs: float) -> Path:
    path = _calibration_path(device_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"bandwidth_gbs": gbs, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                "method": "numpy copy on the device CPU"}))
    return path


def device_bandwidth(device: dict, profile: Optional[dict]) -> tuple[Optional[float], str]:
    """(GB/s, where the figure comes from) or (None, why there is none)."""
    if device.get("bandwidth_gbs"):
        return float(device["bandwidth_gbs"]), "device.bandwidth_gbs"
    cal = _calibration_path(device.get("name", "local"))
    if cal.exists():
        return float(json.loads(cal.read_text())["bandwidth_gbs"]), f"jbench calibrate ({cal})"
    if profile and profile.get("memory_bandwidth_gbs"):
        return float(profile["memory_bandwidth_gbs"]), f"datasheet ({profile['name']})"
    return None, "no device bandwidth: set device.profile or device.bandwidth_gbs, or run `jbench calibrate DEVICE`"
