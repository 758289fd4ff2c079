"""CPU cost of the sysfs/hwmon reader (jbench/device/telemetry/hwmon.py HWMON_READER) at 100 Hz.

Builds a hwmon-like tree (the Orin Nano JP6 layout of tests/data/sysfs/layouts.yaml: one INA3221 with three
rails, soctherm_oc, four thermal zones, GPU devfreq, two cpufreq), runs the reader exactly as the sysfs source
does (`python3 -c HWMON_READER ROOT 10 100`), drains its output as the controller would, and reads the
reader's utime+stime from /proc/<pid>/stat after a warm-up and again after --seconds: % of one core and
CPU time per sample and per attribute read. Start-up (interpreter, discovery) is excluded. Each run alternates
with the compiled loop (jbench/device/probes/hwmon_loop.c, which the sysfs source runs when the device has a C
compiler) and with an empty Python loop waking at the same interval: the timer wake-ups' own cost.

    .venv/bin/python bench/hwmon_reader_cost.py [--seconds 30] [--interval-ms 10] [--runs 3] [--json OUT]

What it does not measure: on a Jetson each read of an INA3221 attribute is an I2C transaction in the
kernel; here the files are plain files (tmpfs/disk), so this is the reader's own Python + VFS cost.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jbench.device import ondevice  # noqa: E402
from jbench.device.local import LocalConnection  # noqa: E402
from jbench.device.telemetry.hwmon import HWMON_READER  # noqa: E402
from tests.sysfs_layouts import build  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    # Fields 14 and 15 of /proc/<pid>/stat (utime, stime) in clock ticks; the name field may hold spaces.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def one_run(root: Path, seconds: float, interval_ms: int, slow_ms: int, loop: str | None = None) -> dict:
    # With `loop`, the reader execs the compiled loop after discovery (same pid), as the sysfs source runs it.
    proc = subprocess.Popen([sys.executable, "-c", HWMON_READER, str(root), str(interval_ms), str(slow_ms),
                             *([loop] if loop else [])], stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    header: dict = {}

    def drain() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("@@meta "):
                header.update(json.loads(line[7:]))
            else:
                lines.append(line)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        time.sleep(2.0)  # warm-up: interpreter start and discovery are not the steady cost
        n0, c0, t0 = len(lines), cpu_seconds(proc.pid), time.monotonic()
        time.sleep(seconds)
        n1, c1, t1 = len(lines), cpu_seconds(proc.pid), time.monotonic()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    samples = n1 - n0
    fast_reads = sum(n for _, _, n in header["rails"])
    slow_reads = len(header["slow"])
    reads = samples * fast_reads + samples * slow_reads * interval_ms / slow_ms
    cpu = c1 - c0
    return {"wall_s": t1 - t0, "cpu_s": cpu, "samples": samples, "rate_hz": samples / (t1 - t0),
            "pct_of_one_core": 100.0 * cpu / (t1 - t0), "us_per_sample": 1e6 * cpu / samples if samples else None,
            "reads_per_s": reads / (t1 - t0), "us_per_read": 1e6 * cpu / reads if reads else None,
            "fast_files": fast_reads, "slow_files": slow_reads}


# The same interpreter waking at the same interval and doing nothing else: the floor any 100 Hz sampler pays for
# its timer wake-ups (on a VM each one is a costly exit to the hypervisor; on bare metal it is far cheaper).
_IDLE_LOOP = r"""
import sys, time
interval = float(sys.argv[1]) / 1000.0
next_t = time.monotonic()
while True:
    next_t += interval
    d = next_t - time.monotonic()
    if d > 0:
        time.sleep(d)
"""


def idle_loop_cost(seconds: float, interval_ms: int) -> dict:
    proc = subprocess.Popen([sys.executable, "-c", _IDLE_LOOP, str(interval_ms)])
    try:
        time.sleep(2.0)
        c0, t0 = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(seconds)
        c1, t1 = cpu_seconds(proc.pid), time.monotonic()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return {"wall_s": t1 - t0, "cpu_s": c1 - c0, "pct_of_one_core": 100.0 * (c1 - c0) / (t1 - t0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--interval-ms", type=int, default=10)
    ap.add_argument("--slow-ms", type=int, default=100)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), "orin_nano_jp6")
        loop, flags = ondevice.build(LocalConnection(), ondevice.c_compiler(LocalConnection()) or "cc", ["--version"],
                                     "hwmon_loop.c", [["-O2"]], "hwmon_loop")
        runs, compiled, idle = [], [], []
        for _ in range(args.runs):  # alternating, so a change in the machine's load falls on all three
            runs.append(one_run(Path(tmp), args.seconds, args.interval_ms, args.slow_ms))
            compiled.append(one_run(Path(tmp), args.seconds, args.interval_ms, args.slow_ms, loop))
            idle.append(idle_loop_cost(args.seconds, args.interval_ms))
    out = {"idle_loop_runs": idle, "compiled_loop_runs": compiled, "compiled_flags": flags, "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.platform()}",
           "python": platform.python_version(), "tick_hz": TICK, "interval_ms": args.interval_ms,
           "slow_ms": args.slow_ms, "seconds": args.seconds, "runs": runs}
    for r in runs:
        print(f"{r['rate_hz']:.1f} Hz  {r['pct_of_one_core']:.2f} % of one core  {r['us_per_sample']:.0f} us/sample  "
              f"{r['us_per_read']:.1f} us/read ({r['cpu_s']:.2f} s CPU in {r['wall_s']:.1f} s)")
    for r in compiled:
        print(f"compiled loop: {r['rate_hz']:.1f} Hz  {r['pct_of_one_core']:.2f} % of one core  "
              f"{r['us_per_sample']:.0f} us/sample")
    for r in idle:
        print(f"an empty loop waking every {args.interval_ms} ms: {r['pct_of_one_core']:.2f} % of one core")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
