"""Memory bandwidth of a device for the roofline ceiling: what decode's compute path can read.

Decode streams the weights once per token, so its ceiling is the *read* bandwidth that its compute path
achieves: all CPU cores reading with vector loads for a CPU build, a GPU kernel reading with 16-byte loads
for a GPU build (a Jetson's integrated GPU or a discrete NVIDIA GPU). Both probes ship with jbench as source
(`jbench/device/probes/`) and are compiled on the device with its own compiler (cc; nvcc from the PATH or
/usr/local/cuda/bin), the binary cached on the device under a name keyed by the source hash and the
compiler's version. A CPU device without a C compiler falls back to numpy reductions in threads.

A calibration is kept per device, probe and power state (nvpmodel mode and jetson_clocks on a Jetson, the
CPU frequency governor elsewhere) in `<cache>/calibration/<device>/`, with its method, every run, median,
min, max and spread. The bandwidth a trial uses, in order: device.bandwidth_gbs (a figure the user measured),
the calibration matching the trial's probe and power state, a calibration measured then and there
(device.auto_calibrate), the profile's datasheet figure. The source is always recorded.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, runtime_checkable

from jbench.core import paths
from jbench.core.schema import DeviceConfig, DeviceSection, ProfileConfig, ProfileSection, typed
from jbench.core.trial import backend_config
from jbench.device import ondevice
from jbench.device.connection import Connection
from jbench.device.power import PowerStateError, PowerStrategy

CPU, GPU = "cpu", "gpu"
DEFAULT_SIZE_MB = {CPU: 512, GPU: 1024}
DEFAULT_RUNS = 7
# A probe buffer must dwarf the last cache level, or the probe measures the cache.
MIN_BUFFER_OVER_L2 = 8
# Runs spread wider than this ((max - min) / median) mean the device was not idle.
NOISY_SPREAD = 0.10


class CalibrationError(Exception):
    """A bandwidth probe could not be built or run; the message names the fix."""


@dataclass
class Calibration:
    """One calibration: every run's read rate (GB/s) and how it was measured."""

    device: str
    probe: str  # cpu | gpu
    power_state: str
    method: str
    runs: list[float]
    size_mb: int
    threads: Optional[int] = None  # cpu probe
    copy_runs: list[float] = field(default_factory=list)  # gpu probe: device-to-device copy, read + written
    details: dict[str, Any] = field(default_factory=dict)
    measured_at: str = ""

    @property
    def median(self) -> float:
        return float(statistics.median(self.runs))

    @property
    def min(self) -> float:
        return float(min(self.runs))

    @property
    def max(self) -> float:
        return float(max(self.runs))

    @property
    def spread(self) -> float:
        """(max - min) / median over the runs."""
        return (self.max - self.min) / self.median

    @property
    def ceiling_gbs(self) -> float:
        """The figure a ceiling uses: the best run. Interference (other processes, a clock dip) only lowers a
        read rate, so the fastest run is the closest to what the memory delivers (STREAM's convention); the
        median and spread say how steady the runs were."""
        return self.max

    @property
    def copy_median(self) -> Optional[float]:
        return float(statistics.median(self.copy_runs)) if self.copy_runs else None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update({"bandwidth_gbs": self.ceiling_gbs, "median_gbs": self.median, "min_gbs": self.min, "max_gbs": self.max, "spread": self.spread,
                  "copy_gbs": self.copy_median})
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Calibration":
        names = {f for f in Calibration.__dataclass_fields__}
        return Calibration(**{k: v for k, v in d.items() if k in names})

    def summary(self) -> str:
        text = (f"{self.ceiling_gbs:.1f} GB/s read (best of {len(self.runs)} runs; median {self.median:.1f}, "
                f"min {self.min:.1f}, spread {self.spread:.1%})")
        if self.copy_runs:
            text += f"; device-to-device copy {self.copy_median:.1f} GB/s (read + written)"
        return text


@dataclass(frozen=True)
class Bandwidth:
    """The bandwidth a ceiling uses: GB/s (None: none known), where it comes from, and the calibration."""

    gbs: Optional[float]
    source: str
    calibration: Optional[Calibration] = None

    def tags(self) -> dict[str, str]:
        tags = {"roofline.bandwidth_source": self.source}
        cal = self.calibration
        if cal is not None:
            tags.update({"roofline.bandwidth_probe": cal.probe, "roofline.bandwidth_method": cal.method,
                         "roofline.bandwidth_power_state": cal.power_state,
                         "roofline.bandwidth_runs": str(len(cal.runs)),
                         "roofline.bandwidth_median_gbs": f"{cal.median:.3f}",
                         "roofline.bandwidth_spread": f"{cal.spread:.4f}",
                         "roofline.bandwidth_measured_at": cal.measured_at})
        return tags


# ---------------------------------------------------------------------------------------------------------
# Which probe and which power state


@runtime_checkable
class OffloadsLayers(Protocol):
    """A backend config that says how many layers go to the GPU (llama.cpp's; 0 keeps them on the CPU)."""

    n_gpu_layers: int


@runtime_checkable
class SetsThreads(Protocol):
    """A backend config with a CPU thread count (None: the tool's own default, all cores)."""

    threads: Optional[int]


def compute_path(backend: Any, reported_backends: Optional[str]) -> str:
    """GPU when the backend ran on a GPU (its own report names CUDA and it offloads layers), else CPU.
    backend: the trial's backend CONFIG object."""
    if backend.name == "trtllm":
        return GPU
    gpu_build = bool(reported_backends) and bool(re.search(r"cuda|gpu", reported_backends, re.I))
    # A config without a layer count keeps whatever its tool does: the tool's own report decides.
    offloads = not isinstance(backend, OffloadsLayers) or backend.n_gpu_layers != 0
    return GPU if gpu_build and offloads else CPU


def power_state(conn: Connection, device: DeviceConfig, profile: Optional[ProfileConfig]) -> str:
    """The clocks state a calibration holds for: nvpmodel mode and jetson_clocks on a Jetson (a device with a
    profile), the CPU frequency governor elsewhere ('governor=none' where the kernel exposes none)."""
    if profile:

        try:
            snap = PowerStrategy(conn, device, profile=profile).current()
        except PowerStateError as exc:
            return f"nvpmodel=unknown ({str(exc)[:80]})"
        return f"nvpmodel={snap.mode},jetson_clocks={'on' if snap.clocks_locked else 'off'}"
    res = conn.run(["cat", "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"], timeout=30)
    governor = res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else "none"
    return f"governor={governor}"


# ---------------------------------------------------------------------------------------------------------
# The probes


probe_source = ondevice.probe_source


def _probe_dir(conn: Connection) -> str:
    return ondevice.probe_dir(conn)


def _first_tool(conn: Connection, names: list[str], extra_paths: tuple[str, ...] = ()) -> Optional[str]:
    return ondevice.first_tool(conn, names, extra_paths)


def _build(conn: Connection, compiler: str, version_argv: list[str], source_name: str, flag_sets: list[list[str]],
           stem: str) -> tuple[str, list[str]]:
    """Compile a probe on the device once per (source, compiler version); (binary path, flags used)."""
    try:
        return ondevice.build(conn, compiler, version_argv, source_name, flag_sets, stem)
    except ondevice.BuildError as exc:
        raise CalibrationError(str(exc)) from None


def _run_json(conn: Connection, argv: list[str], what: str) -> dict[str, Any]:
    res = conn.run(argv, timeout=900)
    if res.returncode != 0:
        raise CalibrationError(f"the {what} probe failed on '{conn.name}': {res.stderr.strip()[-400:]}")
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise CalibrationError(f"the {what} probe on '{conn.name}' printed no result: {res.stdout[-300:]!r}") from None


# numpy fallback (no C compiler on the device): each thread sums its slice; numpy reductions release the
# GIL, so the threads read in parallel. Constant program; size, threads and runs come in as arguments.
_NUMPY_READ = r"""
import json, os, sys, threading, time
import numpy as np
size, threads, runs = (int(a) for a in sys.argv[1:4])
threads = threads or os.cpu_count()
buf = np.ones(size * (1 << 20) // 8, dtype=np.int64)
parts = np.array_split(buf, threads)
def read(part, out, i):
    out[i] = int(part.sum())
rates = []
for r in range(runs + 1):
    out = [0] * threads
    ts = [threading.Thread(target=read, args=(p, out, i)) for i, p in enumerate(parts)]
    t = time.perf_counter()
    for th in ts: th.start()
    for th in ts: th.join()
    dt = time.perf_counter() - t
    if r: rates.append(buf.nbytes / dt / 1e9)
print(json.dumps({"probe": "numpy-read", "threads": threads, "buffer_bytes": buf.nbytes, "read_gbs": rates}))
"""


def last_level_cache_mb(conn: Connection) -> Optional[float]:
    """The CPU's largest cache (sysfs, cpu0), in MiB; None where the kernel does not say."""
    res = conn.run(["sh", "-c", 'cat /sys/devices/system/cpu/cpu0/cache/index*/size 2>/dev/null'], timeout=30)
    sizes = []
    for token in res.stdout.split():
        m = re.fullmatch(r"(\d+)([KMG]?)", token.strip())
        if m:
            sizes.append(int(m.group(1)) / {"": 2**20, "K": 2**10, "M": 1, "G": 1 / 2**10}[m.group(2)])
    return max(sizes) if sizes else None


def measure_cpu(conn: Connection, *, size_mb: Optional[int] = None, threads: Optional[int] = None,
                runs: int = DEFAULT_RUNS) -> tuple[list[float], str, int, dict[str, Any]]:
    """(GB/s of each run, method, threads, details) of a multi-threaded read on the device's CPU."""
    llc = last_level_cache_mb(conn)
    if size_mb is None:
        size_mb = max(DEFAULT_SIZE_MB[CPU], int(MIN_BUFFER_OVER_L2 * llc) if llc else 0)
    elif llc and size_mb < MIN_BUFFER_OVER_L2 * llc:
        raise CalibrationError(f"the probe buffer ({size_mb} MB) is under {MIN_BUFFER_OVER_L2}x the CPU's last-level "
                               f"cache ({llc:g} MB): pass --size-mb {int(MIN_BUFFER_OVER_L2 * llc)} or more")
    cc = _first_tool(conn, ["cc", "gcc", "clang"])
    args = [str(int(size_mb)), str(int(threads or 0)), str(int(runs))]
    if cc:
        flags = ["-O2", "-pthread"]
        binary, flags = _build(conn, cc, ["--version"], "cpu_read.c", [flags], "cpu_read")
        out = _run_json(conn, [binary, *args], "CPU read")
        method = f"C read probe, {out['threads']} threads, 16-byte vector loads ({Path(cc).name} {' '.join(flags)})"
    else:
        res = conn.run(["python3", "-c", _NUMPY_READ, *args], timeout=900)
        if res.returncode != 0:
            raise CalibrationError(f"'{conn.name}' has no C compiler and the numpy fallback failed (needs python3 "
                                   f"with numpy; or install gcc): {res.stderr.strip()[-300:]}")
        out = json.loads(res.stdout.strip().splitlines()[-1])
        method = f"numpy sum in {out['threads']} threads (no C compiler on the device)"
    return ([float(x) for x in out["read_gbs"]], method, int(out["threads"]),
            {"buffer_bytes": out["buffer_bytes"], "last_level_cache_mb": llc})


def measure_gpu(conn: Connection, *, size_mb: int = DEFAULT_SIZE_MB[GPU], runs: int = DEFAULT_RUNS
                ) -> tuple[list[float], list[float], str, dict[str, Any]]:
    """(read GB/s per run, device-to-device copy GB/s per run, method, details) of the GPU read kernel."""
    nvcc = _first_tool(conn, ["nvcc"], ("/usr/local/cuda/bin/nvcc",))
    if nvcc is None:
        raise CalibrationError(f"no nvcc on '{conn.name}' (PATH or /usr/local/cuda/bin/nvcc): install the CUDA "
                               "toolkit (JetPack ships it) to measure the GPU's read bandwidth")
    # -arch=native builds for the GPU present; older nvcc lack it, then nvcc's default target (PTX, JIT).
    binary, flags = _build(conn, nvcc, ["--version"], "gpu_read.cu", [["-O3", "-arch=native"], ["-O3"]],
                           "gpu_read")
    out = _run_json(conn, [binary, str(int(size_mb)), str(int(runs))], "GPU read")
    if out["buffer_bytes"] < MIN_BUFFER_OVER_L2 * out["l2_bytes"]:
        raise CalibrationError(f"the probe buffer ({size_mb} MB) is under {MIN_BUFFER_OVER_L2}x the GPU's L2 "
                               f"({out['l2_bytes'] / 2**20:.0f} MB): pass a larger --size-mb")
    method = (f"CUDA read kernel, 16-byte loads, {out['blocks']}x{out['threads']} threads on {out['gpu']} "
              f"(nvcc {' '.join(flags)})")
    details = {k: out[k] for k in ("gpu", "sm_count", "l2_bytes", "buffer_bytes", "cuda_runtime", "cuda_driver")}
    return [float(x) for x in out["read_gbs"]], [float(x) for x in out["copy_gbs"]], method, details


def calibrate(conn: Connection, device: DeviceConfig, profile: Optional[ProfileConfig], *, probe: str = CPU,
              size_mb: Optional[int] = None, threads: Optional[int] = None, runs: int = DEFAULT_RUNS) -> Calibration:
    """Measure the device's read bandwidth with one probe, in its current power state."""
    if runs < 3:
        raise CalibrationError(f"--runs {runs}: at least 3 runs are needed for a spread")
    state = power_state(conn, device, profile)
    copy: list[float] = []
    if probe == GPU:
        size_mb = int(size_mb or DEFAULT_SIZE_MB[GPU])
        rates, copy, method, details = measure_gpu(conn, size_mb=size_mb, runs=runs)
        used_threads = None
    else:
        rates, method, used_threads, details = measure_cpu(conn, size_mb=size_mb, threads=threads, runs=runs)
        size_mb = details["buffer_bytes"] >> 20
    if not rates or min(rates) <= 0:
        raise CalibrationError(f"the {probe} probe on '{conn.name}' reported no positive rate: {rates}")
    return Calibration(device=device.name, probe=probe, power_state=state, method=method,
                       runs=rates, size_mb=size_mb, threads=used_threads, copy_runs=copy, details=details,
                       measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


# ---------------------------------------------------------------------------------------------------------
# The calibration cache


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:120]


def _probe_key(probe: str, threads: Optional[int]) -> str:
    return f"{probe}-t{threads}" if probe == CPU and threads else probe


def calibration_dir(device_name: str) -> Path:
    return paths.cache_dir() / "calibration" / _slug(device_name)


def calibration_path(device_name: str, probe: str, state: str, threads: Optional[int] = None) -> Path:
    return calibration_dir(device_name) / f"{_probe_key(probe, threads)}--{_slug(state)}.json"


def save_calibration(cal: Calibration, *, threads_key: Optional[int] = None) -> Path:
    """Store under the probe, the power state and (CPU) the thread count a trial asks for (None: all cores)."""
    path = calibration_path(cal.device, cal.probe, cal.power_state, threads_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cal.as_dict(), indent=2))
    tmp.replace(path)
    return path


def load_calibration(device_name: str, probe: str, state: str, threads: Optional[int] = None) -> Optional[Calibration]:
    path = calibration_path(device_name, probe, state, threads)
    if not path.is_file():
        return None
    try:
        return Calibration.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError):
        return None  # a damaged or foreign file is no calibration; the next one overwrites it


def latest_calibration(device_name: str) -> Optional[Calibration]:
    """The most recent calibration of a device, whatever its probe and state (offline `jbench roofline`)."""
    d = calibration_dir(device_name)
    files = sorted(d.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True) if d.is_dir() else []
    for f in files:
        try:
            return Calibration.from_dict(json.loads(f.read_text()))
        except (ValueError, TypeError, KeyError):
            continue
    return None


# ---------------------------------------------------------------------------------------------------------
# The bandwidth a ceiling uses

NO_BANDWIDTH = ("no device bandwidth: run `jbench calibrate DEVICE`, set device.bandwidth_gbs, or give the device "
                "a profile (datasheet figure)")


def _fallback(profile: Optional[ProfileConfig], why: str) -> Bandwidth:
    if profile and profile.memory_bandwidth_gbs:
        return Bandwidth(float(profile.memory_bandwidth_gbs),
                         f"datasheet ({profile.name}; {why}): an upper bound, not a measurement")
    return Bandwidth(None, f"{NO_BANDWIDTH} ({why})")


def device_bandwidth(device: DeviceConfig, profile: Optional[ProfileConfig]) -> Bandwidth:
    """Without a connection (offline tools): the user's figure, the latest calibration, the datasheet."""
    if device.bandwidth_gbs:
        return Bandwidth(float(device.bandwidth_gbs), "device.bandwidth_gbs")
    cal = latest_calibration(device.name)
    if cal is not None:
        return Bandwidth(cal.ceiling_gbs, f"jbench calibrate ({cal.probe} probe, {cal.power_state}, {cal.measured_at})", cal)
    return _fallback(profile, "no calibration")


def trial_bandwidth(conn: Connection, device: DeviceSection, profile: ProfileSection, backend: Any,
                    reported_backends: Optional[str], *, auto_calibrate: bool = True) -> Bandwidth:
    """The read bandwidth of the trial's compute path in the device's current power state. backend: the trial's
    backend CONFIG object, or its plain section (as the run layer passes every section)."""
    device = typed(DeviceConfig, device, where="device")
    profile = typed(ProfileConfig, profile, where="profile") if profile else None
    backend = backend_config(backend)
    if device.bandwidth_gbs:
        return Bandwidth(float(device.bandwidth_gbs), "device.bandwidth_gbs")
    probe = compute_path(backend, reported_backends)
    threads = backend.threads if probe == CPU and isinstance(backend, SetsThreads) else None
    name = device.name
    state = power_state(conn, device, profile)
    cal = load_calibration(name, probe, state, threads)
    if cal is not None:
        return Bandwidth(cal.ceiling_gbs, "jbench calibrate", cal)
    if not auto_calibrate:
        return _fallback(profile, f"no {probe} calibration for {state}; device.auto_calibrate is off")
    try:
        cal = calibrate(conn, device, profile, probe=probe, threads=threads)
    except CalibrationError as exc:
        return _fallback(profile, f"auto-calibration failed: {exc}")
    save_calibration(cal, threads_key=threads)
    return Bandwidth(cal.ceiling_gbs, "measured during the sweep (auto-calibration)", cal)
