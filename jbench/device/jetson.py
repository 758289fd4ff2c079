"""Jetson facts: parsers for nvpmodel, jetson_clocks and L4T release output, and the Jetson
fingerprint. Pure parsing functions first (tested on tests/data/jetson-formats), then the reads
through a Connection.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from jbench.core.schema import DevicePaths, typed
from jbench.device.connection import Connection
from jbench.device.fingerprint import parse_sections


class JetsonError(Exception):
    pass


# --------------------------------------------------------------------------------------------
# nvpmodel


def parse_nvpmodel_query(text: str) -> tuple[str, Optional[int]]:
    """`nvpmodel -q`: 'NV Power Mode: NAME' then the id on the next line (warnings may precede)."""
    lines = [l.strip() for l in text.splitlines()]
    for i, line in enumerate(lines):
        m = re.match(r"NV Power Mode(?:\[\d+\])?:\s*(\S+)", line)
        if m:
            mode_id = None
            if i + 1 < len(lines) and lines[i + 1].isdigit():
                mode_id = int(lines[i + 1])
            return m.group(1), mode_id
    raise JetsonError(f"no 'NV Power Mode:' line in nvpmodel output: {text.strip()[:200]!r}")


def parse_nvpmodel_conf(text: str) -> tuple[dict[str, int], Optional[int]]:
    """Mode name -> id from an nvpmodel.conf (`< POWER_MODEL ID=n NAME=x >`), and the default id."""
    modes: dict[str, int] = {}
    for m in re.finditer(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=(\S+?)\s*>", text):
        modes[m.group(2)] = int(m.group(1))
    default = re.search(r"<\s*PM_CONFIG\s+DEFAULT=(\d+)\s*>", text)
    return modes, int(default.group(1)) if default else None


def mentions_reboot(text: str) -> bool:
    return bool(re.search(r"reboot", text, re.I))


# --------------------------------------------------------------------------------------------
# jetson_clocks --show


@dataclass
class ClockRange:
    min_hz: int
    max_hz: int
    current_hz: Optional[int] = None
    freq_override: Optional[int] = None  # EMC FreqOverride=1 while jetson_clocks holds the clock

    @property
    def pinned(self) -> bool:
        return self.min_hz == self.max_hz


@dataclass
class ClocksShow:
    gpu: Optional[ClockRange] = None
    emc: Optional[ClockRange] = None
    cpus: dict[str, ClockRange] = field(default_factory=dict)  # online CPUs only
    # Per online CPU, the IdleStates flags as printed: 1 = state enabled, 0 = disabled by jetson_clocks.
    idle_states: dict[str, dict[str, int]] = field(default_factory=dict)
    fan_pwm: Optional[int] = None
    power_mode: Optional[str] = None

    @property
    def gpu_locked(self) -> bool:
        return bool(self.gpu and self.gpu.pinned)

    @property
    def emc_locked(self) -> Optional[bool]:
        """FreqOverride=1 while jetson_clocks holds the EMC rate (Thor keeps min < max then); releases that
        print no FreqOverride (R39) show the lock as min == max."""
        if self.emc is None:
            return None
        if self.emc.freq_override is not None:
            return self.emc.freq_override == 1
        return self.emc.pinned

    @property
    def cpu_locked(self) -> Optional[bool]:
        if not self.cpus:
            return None
        return all(r.pinned for r in self.cpus.values())

    @property
    def cpuidle_disabled(self) -> Optional[bool]:
        """True when jetson_clocks disabled every idle state (all flags 0); None when not printed."""
        flags = [v for states in self.idle_states.values() for v in states.values()]
        if not flags:
            return None
        return not any(flags)

    @property
    def locked(self) -> bool:
        """The whole jetson_clocks lock as --show can tell it: GPU and EMC held (CPU too where printed)."""
        if not self.gpu_locked:
            return False
        return self.emc_locked is not False and self.cpu_locked is not False


def _range(line: str) -> Optional[ClockRange]:
    mn = re.search(r"MinFreq=(\d+)", line)
    mx = re.search(r"MaxFreq=(\d+)", line)
    cur = re.search(r"CurrentFreq=(\d+)", line)
    override = re.search(r"FreqOverride=(\d+)", line)
    if not (mn and mx):
        return None
    return ClockRange(int(mn.group(1)), int(mx.group(1)), int(cur.group(1)) if cur else None,
                      int(override.group(1)) if override else None)


def parse_clocks_show(text: str) -> ClocksShow:
    show = ClocksShow()
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("GPU ") or (line.startswith("gpu-gpc-") and show.gpu is None):
            show.gpu = _range(line)  # Thor names its GPU clocks gpu-gpc-0 / gpu-nvd-0
        elif line.startswith("EMC "):
            show.emc = _range(line)
        elif re.match(r"cpu\d+:", line):
            r = _range(line)
            if r and "Online=0" not in line:  # R35/R36 keep a line for an offline core
                cpu = line.split(":")[0]
                show.cpus[cpu] = r
                idle = line.partition("IdleStates:")[2]
                flags = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", idle)}
                if flags:
                    show.idle_states[cpu] = flags
        elif line.startswith("FAN") and show.fan_pwm is None:
            m = re.search(r"pwm\d+=(\d+)", line)
            if m:
                show.fan_pwm = int(m.group(1))
        elif line.startswith("NV Power Mode:"):
            show.power_mode = line.split(":", 1)[1].strip()
    if show.gpu is None and show.emc is None:
        raise JetsonError(f"no GPU/EMC lines in jetson_clocks --show output: {text.strip()[:200]!r}")
    return show


# --------------------------------------------------------------------------------------------
# L4T release and JetPack


def parse_tegra_release(text: str) -> Optional[str]:
    """'# R36 (release), REVISION: 4.3, ...' -> '36.4.3'."""
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text)
    return f"{m.group(1)}.{m.group(2)}" if m else None


# L4T release -> JetPack, from NVIDIA's JetPack archive release notes. A release not listed is
# reported as unknown rather than guessed.
_L4T_TO_JETPACK = {
    "32.7.1": "4.6.1", "32.7.2": "4.6.2", "32.7.3": "4.6.3", "32.7.4": "4.6.4", "32.7.5": "4.6.5", "32.7.6": "4.6.6",
    "35.1.0": "5.0.2", "35.2.1": "5.1", "35.3.1": "5.1.1", "35.4.1": "5.1.2", "35.5.0": "5.1.3", "35.6.0": "5.1.4",
    "36.2.0": "6.0 DP", "36.3.0": "6.0", "36.4.0": "6.1", "36.4.3": "6.2", "36.4.4": "6.2.1",
    "38.2.0": "7.0", "38.4.0": "7.1", "39.2.0": "7.2", "39.2.1": "7.2.1",
}


def jetpack_for_l4t(l4t: Optional[str]) -> Optional[str]:
    if not l4t:
        return None
    if l4t in _L4T_TO_JETPACK:
        return _L4T_TO_JETPACK[l4t]
    if l4t + ".0" in _L4T_TO_JETPACK:
        return _L4T_TO_JETPACK[l4t + ".0"]
    return None


# --------------------------------------------------------------------------------------------
# Reads through a connection


# One round trip; the paths are passed as positional arguments ($1..$3), never pasted into the script.
# The serial ($3) is the device tree's serial-number node, read as jetson-stats does
# (jtop/core/jetson_variables.py get_jetson_variables, rbonghi/jetson_stats @01f201f) and NVIDIA's jetson-zoo
# script (`tr -d '\0' < /sys/firmware/devicetree/base/serial-number`); a NUL-terminated string.
_PROBE = r"""
echo '@@model'; tr -d '\0' < "$1" 2>/dev/null; echo
echo '@@release'; cat "$2" 2>/dev/null
echo '@@serial'; tr -d '\0' < "$3" 2>/dev/null; echo
echo '@@jetpack'; dpkg-query -W -f='${Version}' nvidia-jetpack 2>/dev/null; echo
echo '@@cuda'; (cat /usr/local/cuda/version.json 2>/dev/null | grep -m1 -A1 '"cuda"' | grep version) || (nvcc --version 2>/dev/null | grep release)
echo '@@tensorrt'; dpkg-query -W -f='${Version}' tensorrt 2>/dev/null || dpkg-query -W -f='${Version}' libnvinfer10 2>/dev/null || dpkg-query -W -f='${Version}' libnvinfer8 2>/dev/null; echo
echo '@@meminfo'; grep -E '^(MemTotal|MemAvailable|CmaTotal|CmaFree|SwapTotal|SwapFree):' /proc/meminfo 2>/dev/null
echo '@@nvpmodel'; nvpmodel -q 2>/dev/null
"""


def jetson_fingerprint(conn: Connection, section: Union[DevicePaths, Mapping[str, Any]]) -> dict[str, str]:
    """jetson.* tags read on the device (`section`: device.paths); a fact the device does not show is left out."""
    paths = typed(DevicePaths, section, where="device.paths")
    res = conn.run(["sh", "-c", _PROBE, "sh", paths.device_tree_model, paths.tegra_release, paths.serial_number],
                   timeout=30)
    s = parse_sections(res.stdout)
    tags: dict[str, str] = {}
    if s.get("model"):
        tags["jetson.module"] = s["model"]
    if s.get("serial"):  # tells units of one class apart in results
        tags["jetson.serial"] = s["serial"]
    l4t = parse_tegra_release(s.get("release", ""))
    if l4t:
        tags["jetson.l4t"] = l4t
    jetpack = s.get("jetpack", "").split("+")[0].split("-")[0] or jetpack_for_l4t(l4t)
    if jetpack:
        tags["jetson.jetpack"] = jetpack
    m = re.search(r'"version"\s*:\s*"([\d.]+)"', s.get("cuda", "")) or re.search(r"release ([\d.]+)", s.get("cuda", ""))
    if m:
        tags["jetson.cuda"] = m.group(1)
    if s.get("tensorrt"):
        tags["jetson.tensorrt"] = s["tensorrt"]
    mem = dict(re.findall(r"(\w+):\s+(\d+) kB", s.get("meminfo", "")))
    for key, tag in (("MemTotal", "ram_mib"), ("CmaTotal", "cma_mib"), ("SwapTotal", "swap_mib")):
        if key in mem:
            tags[f"jetson.{tag}"] = str(int(mem[key]) // 1024)
    if s.get("nvpmodel"):
        try:
            name, mode_id = parse_nvpmodel_query(s["nvpmodel"])
            tags["jetson.power_mode"] = name if mode_id is None else f"{name} ({mode_id})"
        except JetsonError:
            pass
    return tags
