"""Cost of telemetry: (c) CPU used by the sampler processes jbench runs on the device at 10 Hz,
and (b) tok/s with and without sampling, in alternating pairs.

On this machine the device is local: the tegrastats sampler runs its stamping pipeline around
the test fixture tests/fixtures/fake_tegrastats (a real Orin Nano line every interval), and the
sysfs reader reads a fake INA3221 hwmon tree. jbench's own cost is the stamping shell (bash) and
the sysfs reader (python3); the fake tegrastats is NVIDIA's tool on a real device and not counted.

    .venv/bin/python bench/telemetry_overhead.py [--seconds 20] [--pairs 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jbench.backends.llamacpp.backend import parse_output  # noqa: E402
from jbench.device.local import LocalConnection  # noqa: E402
from jbench.device.telemetry.samplers import SYSFS_READER, TegrastatsSampler, stamped  # noqa: E402
from jbench.models.store import load_manifest  # noqa: E402
from jbench.models.provision import active_build  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def group_pids(pgid: int, comm: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat.rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and name == comm:
                    out.append(int(d.name))
            except (OSError, ValueError):
                pass
    return out


def sampler_cpu(argv: list[str], comm: str, seconds: float, env=None) -> dict:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    time.sleep(1.0)
    pids = group_pids(proc.pid, comm)
    before = {p: cpu_seconds(p) for p in pids}
    t0 = time.monotonic()
    time.sleep(seconds)
    used = sum(cpu_seconds(p) - before[p] for p in pids if Path(f"/proc/{p}").exists())
    wall = time.monotonic() - t0
    os.killpg(proc.pid, 15)
    proc.wait()
    return {"processes": len(pids), "cpu_s": round(used, 3), "wall_s": round(wall, 2),
            "percent_of_one_core": round(100 * used / wall, 3)}


def decode_tps(bin_dir: str, model: str) -> float:
    out = subprocess.run([f"{bin_dir}/llama-bench", "-m", model, "-p", "0", "-n", "64", "-r", "3", "-o", "jsonl"],
                         capture_output=True, text=True, check=True).stdout
    d = parse_output(out)[0]["decode"]
    return statistics.fmean(d.samples_tps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    fake = ROOT / "tests" / "fixtures" / "fake_tegrastats"
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}")
    figures: dict = {"interval_ms": 100}
    figures["tegrastats_stamper"] = sampler_cpu(stamped(["tegrastats", "--interval", "100"]), "bash", args.seconds, env)
    with tempfile.TemporaryDirectory() as root:
        hw = Path(root, "bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon3")
        hw.mkdir(parents=True)
        for k, label in enumerate(["VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"], 1):
            (hw / f"in{k}_label").write_text(label)
            (hw / f"in{k}_input").write_text("5000")
            (hw / f"curr{k}_input").write_text("1000")
        figures["sysfs_reader"] = sampler_cpu(["python3", "-c", SYSFS_READER, root, "100"], "python3", args.seconds)
    build = active_build()
    model = load_manifest("gemma3_270m")["files"]["Q4_0"]["path"]
    os.environ["PATH"] = env["PATH"]
    with_t, without = [], []
    for i in range(args.pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        for sampling in order:
            sampler = TegrastatsSampler(LocalConnection(), 100, sudo=False).start() if sampling else None
            tps = decode_tps(build["bin_dir"], model)
            if sampler:
                sampler.stop()
                with_t.append(tps)
            else:
                without.append(tps)
        print(f"pair {i + 1}: with {with_t[-1]:.2f} tok/s, without {without[-1]:.2f} tok/s", flush=True)
    figures["decode_tps_with_sampling"] = [round(x, 3) for x in with_t]
    figures["decode_tps_without_sampling"] = [round(x, 3) for x in without]
    figures["difference_pct_of_medians"] = round(100 * (statistics.median(with_t) / statistics.median(without) - 1), 2)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
