"""Telemetry samplers: run on the device, stream timestamped samples to the controller.

Every sample is a flat dict with `t` = seconds since the epoch **on the device's clock** (the
phase markers of a trial come from the same clock, so there is no cross-machine skew) plus the
signals the source has: `power_w` (total board input), `gpu_power_w`, `cpu_power_w` (or, for a rail
that feeds both, `cpu_gpu_cv_power_w` alone; rules in rails.py), `gpu_load_pct`, `gpu_freq_mhz`,
`emc_load_pct`, `emc_freq_mhz`, `temp_max_c`, `ram_used_mb`, `swap_used_mb`, `cpu_load_pct`, and for
NVML `energy_j` (the GPU's own energy counter).

Sources (telemetry.source): tegrastats, sysfs (INA3221/INA238 hwmon or iio, hwmon.py), jtop (the user's own jetson-stats
install through its service), nvml (discrete NVIDIA GPUs on the local device), none; auto picks the
first that works and records which. A sampler that cannot start says why in `problem`; it never
produces zeros in place of a missing signal.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from abc import ABC, abstractmethod
from typing import Optional

from jbench.core.schema import ProfileConfig
from jbench.device.connection import Connection

from jbench.device.telemetry.rails import InputPower, power_fields
from jbench.device.telemetry.tegrastats import parse_line

log = logging.getLogger("jbench.telemetry")

# Prefix each line with the device's clock: bash's $EPOCHREALTIME costs no process per line (bash >= 5);
# older shells fall back to `date +%s.%N`. The command comes in as "$@", never pasted into the script.
_STAMP = (
    'set -o pipefail; "$@" | while IFS= read -r line; do t=$EPOCHREALTIME; [ -n "$t" ] || t=$(date +%s.%N); '
    'printf "%s %s\\n" "$t" "$line"; done'
)


def stamped(argv: list[str], *, start_marker: bool = False) -> list[str]:
    """argv wrapped so that every output line starts with the device's epoch time (stderr is left
    as is). start_marker first prints `<time> @@start`, the moment the command starts."""
    script = _STAMP
    if start_marker:
        script = 't=$EPOCHREALTIME; [ -n "$t" ] || t=$(date +%s.%N); printf "%s @@start\\n" "$t"; ' + script
    return ["bash", "-c", script, "bash", *[str(a) for a in argv]]


def split_stamp(line: str) -> tuple[Optional[float], str]:
    head, _, rest = line.partition(" ")
    try:
        return float(head.replace(",", ".")), rest
    except ValueError:
        return None, line


class Sampler(ABC):
    source: str = "none"

    def __init__(self) -> None:
        self.samples: list[dict] = []
        self.skipped_lines = 0
        self.last_skipped = ""
        self.problem: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    @abstractmethod
    def _run(self) -> None:
        """Append samples until self._stop is set (runs in a thread)."""

    def start(self) -> "Sampler":
        self._thread = threading.Thread(target=self._guarded, name=f"sampler-{self.source}", daemon=True)
        self._thread.start()
        return self

    def _guarded(self) -> None:
        try:
            self._run()
        except Exception as exc:  # a sampler failure must not kill the trial; it is reported instead
            self.problem = self.problem or f"{self.source} sampler stopped: {exc}"
            log.warning("%s", self.problem)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        return self.samples

    def _close(self) -> None:
        pass

    def wait_for_samples(self, n: int, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while len(self.samples) < n and time.monotonic() < end and self.problem is None:
            if self._thread is not None and not self._thread.is_alive():
                break
            time.sleep(0.05)
        return len(self.samples) >= n

    def wait_past(self, t: float, timeout_s: float) -> bool:
        """Wait until a sample newer than device time t has arrived (so a window ending at t is covered)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            latest = self.latest_time()
            if latest is not None and latest >= t:
                return True
            if self.problem is not None or (self._thread is not None and not self._thread.is_alive()):
                return False
            time.sleep(0.02)
        return False

    def latest_time(self) -> Optional[float]:
        return self.samples[-1]["t"] if self.samples else None

    def telemetry_tags(self) -> dict[str, str]:
        """telemetry.* tags that explain this sampler's numbers: the input-power rule and its rails
        (`telemetry.power_rule`, `telemetry.power_rails`), and what a source adds (sensor settings)."""
        rules = getattr(self, "_power_rules", ())
        if not rules:
            return {}
        return {"telemetry.power_rule": "; ".join(label for label, _ in rules),
                "telemetry.power_rails": "; ".join(dict.fromkeys(rails for _, rails in rules))}


class NoSampler(Sampler):
    source = "none"

    def __init__(self, reason: str):
        super().__init__()
        self.problem = reason

    def _run(self) -> None:
        return


# --------------------------------------------------------------------------------------------
# tegrastats


def tegrastats_sample(t: float, line: str, profile: Optional[ProfileConfig] = None) -> Optional[dict]:
    """One tegrastats line as a sample; `profile`: the module profile whose rails the rail rules read."""
    parsed = _tegrastats_sample(t, line, profile)
    return None if parsed is None else parsed[0]


def _tegrastats_sample(t: float, line: str, profile: Optional[ProfileConfig]) -> Optional[tuple[dict, InputPower]]:
    s = parse_line(line)
    if s is None:
        return None
    rails_w = {name: rail.current_mw / 1000.0 for name, rail in s.rails.items()}
    power, total = power_fields(rails_w, profile)
    sample: dict = {"t": t, **power}
    sample["gpu_load_pct"] = s.gpu_load_pct
    sample["gpu_freq_mhz"] = s.gpu_freqs_mhz[0] if s.gpu_freqs_mhz else None
    sample["emc_load_pct"] = s.emc_load_pct
    sample["emc_freq_mhz"] = s.emc_freq_mhz
    temps = [v for v in s.temps_c.values() if v is not None]
    sample["temp_max_c"] = max(temps) if temps else None
    sample["ram_used_mb"] = s.ram_used_mb
    sample["swap_used_mb"] = s.swap_used_mb
    loads = [c.load_pct for c in s.cpus if c.online and c.load_pct is not None]
    sample["cpu_load_pct"] = statistics.fmean(loads) if loads else None
    for name, watts in rails_w.items():
        sample[f"rail_{name}_w"] = watts
    return sample, total


class StreamSampler(Sampler):
    """A command on the device whose stamped output lines become samples."""

    def __init__(self, conn: Connection, argv: list[str], *, sudo: bool = False):
        super().__init__()
        self.conn = conn
        self.argv = argv
        self.sudo = sudo
        self._stream = None

    def _parse(self, t: float, payload: str) -> Optional[dict]:
        raise NotImplementedError

    def _run(self) -> None:
        # sudo applies to the tool inside the stamping pipe, not to bash.
        argv = self.argv
        if self.sudo:
            argv = self.conn.sudo_argv(argv)
        self._stream = self.conn.stream_lines(stamped(argv))
        for line in self._stream:
            if self._stop.is_set():
                break
            t, payload = split_stamp(line)
            sample = self._parse(t, payload) if t is not None else None
            if sample is None:
                if payload.strip():
                    self.skipped_lines += 1
                    self.last_skipped = payload.strip()[:300]
                continue
            self.samples.append(sample)
        if not self.samples and not self._stop.is_set():
            self.problem = self.problem or f"{self.source} produced no samples (last output: {self.last_skipped!r})"

    def _close(self) -> None:
        if self._stream is not None:
            self._stream.close()

    _power_rules: tuple[tuple[str, str], ...] = ()  # (rule label, "+"-joined rails), in order of first use
    power_field: Optional[str] = None

    def _device_json(self, fail_prefix: str):
        """(device time, object) per line of a reader program on the device that stamps its own lines
        (`<epoch> <json>`; no bash wrapper); a line starting with fail_prefix is the reader's reason for
        giving up: it becomes `problem` and ends the stream. Other lines are counted as skipped."""
        self._stream = self.conn.stream_lines(self.argv)
        for line in self._stream:
            if self._stop.is_set():
                return
            if line.startswith(fail_prefix):
                self.problem = line[len(fail_prefix):].strip()
                return
            t, payload = split_stamp(line)
            try:
                data = json.loads(payload)
            except json.JSONDecodeError:
                data = None
            if t is None or not isinstance(data, dict):
                self.skipped_lines += 1
                self.last_skipped = line.strip()[:300]
                continue
            yield t, data

    def _note_power(self, total: InputPower) -> None:
        """Which input-power rule and rails gave `power_w` (tags telemetry.power_rule / power_rails; the
        older tag telemetry.power_field is the rule too)."""
        if total.value is not None:
            entry = (total.label, "+".join(total.rails))
        else:  # say that there was no total, and which rule came up short
            entry = (f"no input power ({total.label} incomplete)" if total.rails else "no input power", "none")
        if entry not in self._power_rules:
            self._power_rules = (*self._power_rules, entry)
            self.power_field = "; ".join(label for label, _ in self._power_rules)


class TegrastatsSampler(StreamSampler):
    source = "tegrastats"

    def __init__(self, conn: Connection, interval_ms: int = 100, *, profile: Optional[ProfileConfig] = None,
                 sudo: bool = True):
        super().__init__(conn, ["tegrastats", "--interval", str(int(interval_ms))], sudo=sudo)
        self.profile = profile  # the module profile: its rails decide the input power (rails.input_power)

    def _parse(self, t, payload):
        parsed = _tegrastats_sample(t, payload, self.profile)
        if parsed is None:
            return None
        self._note_power(parsed[1])
        return parsed[0]


# --------------------------------------------------------------------------------------------
# sysfs INA3221 / INA238 hwmon: jbench/device/telemetry/hwmon.py (SysfsSampler, HWMON_READER), re-exported here.


# --------------------------------------------------------------------------------------------
# NVML (discrete NVIDIA GPUs, local device)


class NvmlSampler(Sampler):
    """Power, the GPU's total-energy counter, clocks, utilisation, temperature and memory.

    Power is the instantaneous field (NVML_FI_DEV_POWER_INSTANT) where the GPU has it: on Hopper,
    nvmlDeviceGetPowerUsage is a ~1 s trailing average, which integrates low over short windows.
    """

    source = "nvml"

    def __init__(self, interval_ms: int = 50, gpu_index: int = 0, power_interval_ms: Optional[int] = None):
        super().__init__()
        self.interval = interval_ms / 1000.0
        # Power and the energy counter are cheap reads that size the shortest window energy can be taken over
        # (jbench.analysis.sensor), so they are read this often; clocks, load, temperature and memory every interval.
        self.power_interval = min(self.interval, (power_interval_ms or interval_ms) / 1000.0)
        self.gpu_index = gpu_index
        self.power_field: Optional[str] = None

    @staticmethod
    def available() -> Optional[str]:
        """None when NVML sees a GPU, else the reason."""
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                if pynvml.nvmlDeviceGetCount() < 1:
                    return "NVML sees no GPU"
            finally:
                pynvml.nvmlShutdown()
        except Exception as exc:  # library missing, no driver, Tegra (NVML unsupported)
            return f"NVML not available: {exc}"
        return None

    def _run(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(self.gpu_index)
            instant = getattr(pynvml, "NVML_FI_DEV_POWER_INSTANT", None)

            def power_instant() -> Optional[float]:
                if instant is None:
                    return None
                v = pynvml.nvmlDeviceGetFieldValues(h, [instant])[0]
                if v.nvmlReturn != pynvml.NVML_SUCCESS:
                    return None
                return float(v.value.uiVal) / 1000.0

            self.power_field = "power_instant" if power_instant() is not None else "power_usage_average"
            next_full = 0.0
            while not self._stop.is_set():
                t = time.time()
                sample: dict = {"t": t}
                try:
                    inst = power_instant()
                    if inst is not None:
                        sample["power_w"] = inst
                    sample["energy_j"] = pynvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0
                    if t < next_full and inst is not None:
                        self.samples.append(sample)
                        self._stop.wait(max(0.0, self.power_interval - (time.time() - t)))
                        continue
                    next_full = t + self.interval - self.power_interval / 2
                    avg = pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0
                    sample["power_w"] = inst if inst is not None else avg
                    sample["power_avg_w"] = avg
                    sample["gpu_freq_mhz"] = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
                    sample["mem_freq_mhz"] = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)
                    util = pynvml.nvmlDeviceGetUtilizationRates(h)
                    sample["gpu_load_pct"], sample["mem_load_pct"] = float(util.gpu), float(util.memory)
                    sample["temp_max_c"] = float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))
                    sample["gpu_mem_used_mb"] = pynvml.nvmlDeviceGetMemoryInfo(h).used / 1048576
                except pynvml.NVMLError as exc:
                    self.problem = f"NVML read failed: {exc}"
                    return
                self.samples.append(sample)
                self._stop.wait(max(0.0, self.power_interval - (time.time() - t)))
        finally:
            pynvml.nvmlShutdown()


# The sysfs and jtop samplers live in hwmon.py and jtop.py, which build on StreamSampler from this module,
# so they are re-exported lazily (an import here would be circular).
_MOVED = {"SysfsSampler": "hwmon", "SYSFS_READER": "hwmon", "HWMON_READER": "hwmon",
          "JtopSampler": "jtop", "JTOP_READER": "jtop"}


def __getattr__(name: str):
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(f"jbench.device.telemetry.{_MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
