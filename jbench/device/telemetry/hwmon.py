"""The sysfs source: INA3221 / INA238 power monitors (hwmon; iio on JetPack <= 4) read on the device at
>= 100 Hz, plus the throttling evidence (soctherm over-current counters, thermal zones, GPU/CPU clocks).

`HWMON_READER` is a small constant Python program run on the device (`python3 -c`). It finds the chips
once, keeps every attribute open and re-reads it with `os.pread(fd, n, 0)`: sysfs regenerates an
attribute's text on a read at offset 0, so there is no open/close per sample. Each line is stamped with
the device's clock (`time.time()`, the clock of the phase markers) and lines are written in batches.

Output, one line each:
- `@@meta <json>`: what was found, once: rails (name, scale to W, files per reading), the slow columns,
  and per chip its `update_interval` (ms), averaging `samples` and shunt resistors (µΩ), as the driver
  exposes them (absent when it does not).
- `<t> <raw> <raw> ... [| <raw> ...]`: the raw attribute texts of the rails; every `slow_ms` also the
  slow columns after `|`. `-` is a failed read. The controller does the arithmetic.
- `NO_RAILS <reason>`: nothing to read; the reader exits.

Files (Linux Documentation/hwmon/ina3221.rst, ina238.rst; NVIDIA's Tegra234 over-current event driver;
jetson-stats `jtop/core/{power,temperature,gpu}.py`; tests/data/jetson-formats/sysfs-paths.md):
- INA3221 hwmon: `bus/i2c/drivers/ina3221/*/hwmon/hwmon*/in[123]_label`, `in[123]_input` (bus mV),
  `curr[123]_input` (mA); labels containing `NC` (unconnected), disabled channels (`in<k>_enable` 0), the
  shunt-voltage channels in4-6 and the sum channel in7 are never rails. `samples`, `update_interval`,
  `shunt[123]_resistor`.
- INA238 hwmon: `bus/i2c/drivers/ina238/*/hwmon/hwmon*/power1_input` (µW; else `in1_input` mV x
  `curr1_input` mA). The driver has no channel label: the rail is the hwmon `label` attribute when the
  device tree gives one, else `VIN` (the Thor carrier's input monitor).
- INA3221 iio (JetPack <= 4): `bus/i2c/drivers/ina3221x/*/iio:device*/rail_name_<k>`, `in_power<k>_input`
  (mW), else `in_voltage<k>_input` x `in_current<k>_input`.
- `class/hwmon/hwmon*/name` == `soctherm_oc`: `oc1_event_cnt`, `oc2_event_cnt`, `oc3_event_cnt`
  (cumulative since boot; OC1 under-voltage, OC2 average and OC3 instantaneous over-current).
- `devices/virtual/thermal/thermal_zone*/{type,temp}` (m°C); `class/devfreq/*/cur_freq` (Hz) of the GPU
  (`device/of_node/name` gv11b/gp10b/ga10b/gb10b/gpu, or Thor's `gpu-gpc-*`);
  `devices/system/cpu/cpu*/cpufreq/scaling_cur_freq` (kHz).
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

from jbench.core.schema import ProfileConfig
from jbench.device.connection import Connection
from jbench.device.telemetry.rails import power_fields
from jbench.device.telemetry.samplers import StreamSampler, split_stamp
from jbench.device import ondevice

__all__ = ["HWMON_DEFAULT_INTERVAL_MS", "HWMON_READER", "HWMON_SLOW_MS", "SYSFS_READER", "SysfsSampler",
           "parse_reader_line", "sensor_tags"]

# 100 Hz: fast enough to see a decode step's power, and well under 1 % of a core (docs/PERFORMANCE.md).
HWMON_DEFAULT_INTERVAL_MS = 10
# Counters, zones and clocks change slowly (thermal zones poll at ~1 s); 10 Hz is plenty for per-phase deltas.
HWMON_SLOW_MS = 100

HWMON_READER = r"""
import glob, json, os, sys, time
root = sys.argv[1]
interval = float(sys.argv[2]) / 1000.0
slow_every = float(sys.argv[3]) / 1000.0 if len(sys.argv) > 3 else 0.1
J = os.path.join
def text(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, ValueError):
        return None
def opened(path):
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None
rails, fast_fds, fast_paths, chips = [], [], [], []
def add_rail(name, scale, paths):
    fds = [opened(p) for p in paths]
    if None in fds:
        return False
    rails.append([name, scale, len(fds)])
    fast_fds.extend(fds)
    fast_paths.extend(paths)
    return True
def chip(kind, d, dev):
    info = {"driver": kind, "device": dev, "rails": []}
    for key in ("update_interval", "samples"):
        v = text(J(d, key))
        if v is not None:
            info[key] = v
    chips.append(info)
    return info
for d in sorted(glob.glob(J(root, "bus/i2c/drivers/ina3221/*/hwmon/hwmon*"))):
    info = chip("ina3221", d, d.split(os.sep)[-3])
    for k in (1, 2, 3):
        name = text(J(d, "in%d_label" % k))
        if not name or "NC" in name or text(J(d, "in%d_enable" % k)) == "0":
            continue
        if add_rail(name, 1e-6, [J(d, "in%d_input" % k), J(d, "curr%d_input" % k)]):
            info["rails"].append(name)
            r = text(J(d, "shunt%d_resistor" % k))
            if r is not None:
                info.setdefault("shunt_uohm", {})[name] = r
for d in sorted(glob.glob(J(root, "bus/i2c/drivers/ina238/*/hwmon/hwmon*"))):
    info = chip("ina238", d, d.split(os.sep)[-3])
    name = text(J(d, "label")) or "VIN"
    info["label_from"] = "label" if text(J(d, "label")) else "default VIN"
    ok = add_rail(name, 1e-6, [J(d, "power1_input")]) if os.path.exists(J(d, "power1_input")) else False
    if not ok:
        ok = add_rail(name, 1e-6, [J(d, "in1_input"), J(d, "curr1_input")])
    if ok:
        info["rails"].append(name)
for d in sorted(glob.glob(J(root, "bus/i2c/drivers/ina3221x/*/iio:device*"))):
    info = chip("ina3221x-iio", d, d.split(os.sep)[-2])
    for lab in sorted(glob.glob(J(d, "rail_name_*"))):
        k = lab.rsplit("_", 1)[1]
        name = text(lab)
        if not k.isdigit() or not name or "NC" in name:
            continue
        p = J(d, "in_power%s_input" % k)
        ok = add_rail(name, 1e-3, [p]) if os.path.exists(p) else False
        ok = ok or add_rail(name, 1e-6, [J(d, "in_voltage%s_input" % k), J(d, "in_current%s_input" % k)])
        if ok:
            info["rails"].append(name)
if not rails:
    print("NO_RAILS no INA3221/INA238 hwmon channels (nor INA3221 iio rail_name_* files) under " + root, flush=True)
    sys.exit(3)
slow, slow_fds, slow_paths = [], [], []
def add_slow(key, scale, path):
    fd = opened(path)
    if fd is not None:
        slow.append([key, scale])
        slow_fds.append(fd)
        slow_paths.append(path)
for h in sorted(glob.glob(J(root, "class/hwmon/hwmon*"))):
    if text(J(h, "name")) == "soctherm_oc":
        for k in (1, 2, 3):
            add_slow("oc%d_event_cnt" % k, 1, J(h, "oc%d_event_cnt" % k))
seen = set()
for z in sorted(glob.glob(J(root, "devices/virtual/thermal/thermal_zone*")), key=lambda p: (len(p), p)):
    kind = (text(J(z, "type")) or os.path.basename(z)).replace(" ", "_")
    key = "temp_%s_c" % kind
    if key in seen:
        key = "temp_%s_%s_c" % (kind, os.path.basename(z))
    seen.add(key)
    add_slow(key, 1e-3, J(z, "temp"))
for f in sorted(glob.glob(J(root, "class/devfreq/*"))):
    node = text(J(f, "device/of_node/name"))
    if node in ("gv11b", "gp10b", "ga10b", "gb10b", "gpu") or os.path.basename(f).startswith("gpu-gpc"):
        add_slow("gpu_freq_mhz", 1e-6, J(f, "cur_freq"))
        break
for c in sorted(glob.glob(J(root, "devices/system/cpu/cpu[0-9]*/cpufreq/scaling_cur_freq")), key=lambda p: (len(p), p)):
    add_slow("%s_freq_mhz" % c.split(os.sep)[-3], 1e-3, c)
meta = {"rails": rails, "slow": slow, "chips": chips, "interval_ms": interval * 1000, "slow_ms": slow_every * 1000}
# The compiled loop (jbench/device/probes/hwmon_loop.c), when the controller built one: it reads the same files
# in the same line format without an interpreter. Without it, or if it cannot start, the loop below runs.
loop = sys.argv[4] if len(sys.argv) > 4 and os.access(sys.argv[4], os.X_OK) else None
meta["loop"] = "c" if loop else "python"
os.write(1, ("@@meta %s\n" % json.dumps(meta)).encode())
if loop:
    try:
        os.execv(loop, [loop, sys.argv[2], str(slow_every * 1000), str(len(fast_paths)), *fast_paths,
                        str(len(slow_paths)), *slow_paths])
    except OSError as e:
        meta["loop"], meta["loop_error"] = "python", str(e)
        os.write(1, ("@@meta %s\n" % json.dumps(meta)).encode())
pread = os.pread
def one(fd):
    try:
        return pread(fd, 32, 0).strip() or b"-"
    except OSError:
        return b"-"
def raw(fds):
    # The common case in one comprehension; a failed or empty read falls back to one file at a time.
    try:
        vals = [pread(fd, 32, 0) for fd in fds]
    except OSError:
        return [one(fd) for fd in fds]
    return [v.strip() or b"-" for v in vals]
buf, last_flush, next_t, next_slow = [], 0.0, time.monotonic(), 0.0
while True:
    now = time.monotonic()
    parts = [b"%.6f" % time.time()]
    parts += raw(fast_fds)
    if slow_fds and now >= next_slow:
        next_slow = now + slow_every
        parts.append(b"|")
        parts += raw(slow_fds)
    buf.append(b" ".join(parts))
    # Batch writes: one syscall per ~100 ms, and the first lines at once so the start is seen quickly.
    if len(buf) >= 16 or now - last_flush >= 0.1 or last_flush == 0.0:
        try:
            os.write(1, b"\n".join(buf) + b"\n")
        except OSError:
            sys.exit(0)  # the controller closed the stream
        buf, last_flush = [], now
    next_t += interval
    delay = next_t - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    elif delay < -interval:
        next_t = time.monotonic()  # fell behind (a suspended process): skip, never burst
"""
# The reader's earlier name, kept for callers that import it.
SYSFS_READER = HWMON_READER


def _num(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def parse_reader_line(line: str, meta: dict[str, Any]) -> Optional[tuple[float, dict[str, float], dict[str, float]]]:
    """(device time, {rail: W}, {slow column: value}) from one reader line, None when it is not a sample.
    A rail whose read failed is absent from the rails (never 0)."""
    t, payload = split_stamp(line)
    if t is None:
        return None
    fast_text, _, slow_text = payload.partition("|")
    fields = fast_text.split()
    rails: dict[str, float] = {}
    i = 0
    for name, scale, n in meta["rails"]:
        chunk = fields[i:i + n]
        i += n
        values = [_num(x) for x in chunk]
        if len(values) == n and None not in values:
            rails[name] = math.prod(values) * scale  # type: ignore[arg-type]
    if i != len(fields):
        return None
    slow: dict[str, float] = {}
    if slow_text:
        columns = slow_text.split()
        if len(columns) != len(meta["slow"]):
            return None
        for (key, scale), x in zip(meta["slow"], columns):
            v = _num(x)
            if v is not None:
                slow[key] = v * scale
    return t, rails, slow


def _slow_fields(slow: dict[str, float]) -> dict[str, float]:
    """A sample's throttling fields: counters, per-zone temperatures and their maximum, GPU clock, fastest CPU."""
    out: dict[str, float] = dict(slow)
    # jtop's offline marker is -256 C; a zone that reads that is not a temperature.
    temps = [v for k, v in slow.items() if k.startswith("temp_") and v > -100]
    if temps:
        out["temp_max_c"] = max(temps)
    cpus = [v for k, v in slow.items() if k.startswith("cpu") and k.endswith("_freq_mhz")]
    if cpus:
        out["cpu_freq_mhz"] = max(cpus)
    return out


def sensor_tags(meta: dict[str, Any], interval_ms: float) -> dict[str, str]:
    """telemetry.* tags that say what one sample means: each chip's conversion time and averaging as the
    driver reports them, shunt resistors, the slow signals found, and a note when samples repeat."""
    def per_chip(key: str, unit: str) -> str:
        return "; ".join(f"{c['driver']} {c['device']}: {c[key] + unit if key in c else 'not exposed'}"
                         for c in meta.get("chips", []))

    tags = {
        "telemetry.sample_interval_ms": f"{interval_ms:g}",
        "telemetry.sensor_update_interval_ms": per_chip("update_interval", ""),
        "telemetry.sensor_averaging": per_chip("samples", " samples"),
    }
    shunts = {name: r for c in meta.get("chips", []) for name, r in (c.get("shunt_uohm") or {}).items()}
    if shunts:
        tags["telemetry.sensor_shunt_uohm"] = ", ".join(f"{k} {v}" for k, v in shunts.items())
    slow_keys = [k for k, _ in meta.get("slow", [])]
    found = []
    if any(k.startswith("oc") for k in slow_keys):
        found.append("soctherm_oc counters")
    zones = sum(k.startswith("temp_") for k in slow_keys)
    if zones:
        found.append(f"{zones} thermal zones")
    if "gpu_freq_mhz" in slow_keys:
        found.append("GPU devfreq")
    cpus = sum(k.startswith("cpu") for k in slow_keys)
    if cpus:
        found.append(f"{cpus} cpufreq")
    tags["telemetry.throttle_signals"] = ", ".join(found) if found else "none found"
    slower = []
    for c in meta.get("chips", []):
        conv = _num(c.get("update_interval", ""))
        if conv is not None and conv > interval_ms:
            slower.append(f"{c['driver']} {c['device']} converts every {conv:g} ms")
    if slower:
        tags["telemetry.sensor_note"] = (f"sampling every {interval_ms:g} ms but " + ", ".join(slower)
                                         + ": consecutive samples repeat a reading")
    return tags


class SysfsSampler(StreamSampler):
    """Rails from INA3221/INA238 hwmon (iio on JetPack <= 4) at `interval_ms` (default 10 ms), with soctherm
    over-current counters, thermal zones and clocks every HWMON_SLOW_MS. Board and GPU/CPU power by the
    rules of telemetry/rails.py. The Python reader finds the files; the 100 Hz loop itself is a small C program
    compiled on the device (`compiled`, the default), else the reader's own Python loop."""

    source = "sysfs"

    def __init__(self, conn: Connection, interval_ms: int = HWMON_DEFAULT_INTERVAL_MS, *,
                 profile: Optional[ProfileConfig] = None, sysfs_root: str = "/sys", slow_ms: int = HWMON_SLOW_MS,
                 compiled: bool = True):
        super().__init__(conn, ["python3", "-c", HWMON_READER, sysfs_root, str(int(interval_ms)), str(int(slow_ms))])
        self.profile = profile  # the module profile: its rails decide the input power (rails.input_power)
        self.interval_ms = int(interval_ms)
        self.meta: Optional[dict[str, Any]] = None
        self.compiled = compiled
        self.loop_note = ""

    def _compiled_loop(self) -> Optional[str]:
        """The sampling loop compiled on the device (probes/hwmon_loop.c), or None with the reason in loop_note:
        the Python loop then samples, at a higher CPU cost."""

        try:
            cc = ondevice.c_compiler(self.conn)
            if cc is None:
                self.loop_note = "no C compiler (cc, gcc, clang) on the device"
                return None
            binary, flags = ondevice.build(self.conn, cc, ["--version"], "hwmon_loop.c", [["-O2"]], "hwmon_loop")
        except ondevice.BuildError as exc:
            self.loop_note = str(exc).splitlines()[-1][:300]
            return None
        self.loop_note = f"{cc} {' '.join(flags)}"
        return binary

    def _run(self) -> None:
        loop = self._compiled_loop() if self.compiled else None
        if not self.compiled:
            self.loop_note = "the compiled loop was not asked for"
        self._stream = self.conn.stream_lines(self.argv + ([loop] if loop else []))
        for line in self._stream:
            if self._stop.is_set():
                break
            if line.startswith("NO_RAILS "):
                self.problem = line[len("NO_RAILS "):].strip()
                return
            if line.startswith("@@meta "):
                try:
                    self.meta = json.loads(line[len("@@meta "):])
                except json.JSONDecodeError:
                    self.problem = f"sysfs reader sent an unreadable header: {line[:200]!r}"
                    return
                continue
            parsed = parse_reader_line(line, self.meta) if self.meta is not None else None
            if parsed is None:
                if line.strip():
                    self.skipped_lines += 1
                    self.last_skipped = line.strip()[:300]
                continue
            t, rails, slow = parsed
            power, total = power_fields(rails, self.profile)
            self._note_power(total)
            self.samples.append({"t": t, **power, **{f"rail_{k}_w": v for k, v in rails.items()},
                                 **_slow_fields(slow)})
        if not self.samples and not self._stop.is_set():
            self.problem = self.problem or f"sysfs reader produced no samples (last output: {self.last_skipped!r})"

    def telemetry_tags(self) -> dict[str, str]:
        tags = super().telemetry_tags()
        if self.meta is not None:
            tags.update(sensor_tags(self.meta, self.interval_ms))
            loop = self.meta.get("loop", "python")
            why = self.meta.get("loop_error") or self.loop_note
            tags["telemetry.sampler_loop"] = ("compiled C" if loop == "c" else "python") + (f" ({why})" if why else "")
        return tags
