"""Does sampling slow the benchmark? Paired, alternating llama-bench decode runs with and without the
telemetry sampler running, and a confidence interval on the difference.

The sampler is jbench's sysfs source exactly as a trial starts it (`SysfsSampler` through a local
connection: the hwmon reader at 100 Hz plus the controller thread that parses its lines) against the Orin Nano
JP6 hwmon layout of tests/data/sysfs/layouts.yaml. The workload is the real llama-bench of `jbench setup` on the
bundled model (decode only: `-p 0 -n N -r R`), with its default thread count, so the sampler competes with
every decode thread, as on a device whose cores are all busy decoding.

Pairs run in alternating order (with/without, then without/with, ...) so a drift of the machine's speed
falls on both arms. Per pair: d = tok/s with / tok/s without - 1. Reported: the mean of d with its 95 % t
interval over the pairs, the median, and the share of pairs in which sampling was slower. The target
(issue 13) is |slowdown| <= 0.5 %: "met" only when the whole interval lies above -0.5 %.

    .venv/bin/python bench/sampler_perturbation.py [--pairs 20] [--n-gen 64] [--reps 3] [--json OUT]
        [--bin-dir DIR --model FILE]   (another llama.cpp build and GGUF, e.g. on a machine without `jbench setup`)

Run it on a quiet machine; it says how many CPUs it had and their load before it started.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jbench.analysis.stats import describe, mean_interval  # noqa: E402
from jbench.backends.llamacpp.bench import parse_output  # noqa: E402
from jbench.device.local import LocalConnection  # noqa: E402
from jbench.device.telemetry.hwmon import SysfsSampler  # noqa: E402
from jbench.models.provision import active_build  # noqa: E402
from jbench.models.store import load_manifest  # noqa: E402
from tests.sysfs_layouts import build  # noqa: E402

TARGET_PCT = 0.5


def decode_tps(bin_dir: str, model: str, n_gen: int, reps: int, threads: int = 0) -> float:
    """Mean decode tok/s of one llama-bench run (its own per-repetition timings)."""
    argv = [f"{bin_dir}/llama-bench", "-m", model, "-p", "0", "-n", str(n_gen), "-r", str(reps), "-o", "jsonl"]
    out = subprocess.run(argv + (["-t", str(threads)] if threads else []), capture_output=True, text=True,
                         check=True).stdout
    return statistics.fmean(parse_output(out)[0]["decode"].samples_tps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--interval-ms", type=int, default=10)
    ap.add_argument("--quant", default="Q4_0")
    ap.add_argument("--threads", type=int, default=0,
                    help="llama-bench -t (default: its own, all cores; fewer leaves cores free, as GPU decode does)")
    ap.add_argument("--bin-dir", help="llama.cpp's bin directory (default: the build of `jbench setup`)")
    ap.add_argument("--model", help="a GGUF file (default: the bundled model at --quant)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    bin_dir = args.bin_dir or active_build()["bin_dir"]
    model = args.model or load_manifest("gemma3_270m")["files"][args.quant]["path"]
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_before": os.getloadavg()}
    print(f"machine: {machine}", flush=True)
    with tempfile.TemporaryDirectory() as root:
        build(Path(root), "orin_nano_jp6")
        decode_tps(bin_dir, model, args.n_gen, 1, args.threads)  # warm the page cache and the CPU before the first pair
        with_s: list[float] = []
        without: list[float] = []
        samples_per_s: list[float] = []
        for i in range(args.pairs):
            for sampling in ((True, False) if i % 2 == 0 else (False, True)):
                if not sampling:
                    without.append(decode_tps(bin_dir, model, args.n_gen, args.reps, args.threads))
                    continue
                sampler = SysfsSampler(LocalConnection(), args.interval_ms, sysfs_root=root).start()
                if not sampler.wait_for_samples(5, timeout_s=10):
                    raise SystemExit(f"the sampler gave no samples: {sampler.problem}")
                t0, n0 = time.monotonic(), len(sampler.samples)
                with_s.append(decode_tps(bin_dir, model, args.n_gen, args.reps, args.threads))
                samples_per_s.append((len(sampler.samples) - n0) / (time.monotonic() - t0))
                sampler.stop()
            d = 100 * (with_s[-1] / without[-1] - 1)
            print(f"pair {i + 1:2d}: with {with_s[-1]:7.2f}  without {without[-1]:7.2f} tok/s  d {d:+6.2f} %", flush=True)
    diffs = [100 * (w / wo - 1) for w, wo in zip(with_s, without)]
    st = describe(diffs)
    lo, hi = mean_interval(st.n, st.mean, st.std)
    verdict = "met" if lo >= -TARGET_PCT else ("not met" if hi < -TARGET_PCT else "not shown (interval too wide)")
    figures = {
        "machine": machine, "command": " ".join(sys.argv), "sampler": f"sysfs hwmon reader at {args.interval_ms} ms",
        "workload": f"llama-bench -p 0 -n {args.n_gen} -r {args.reps}{f' -t {args.threads}' if args.threads else ''} "
                    f"({Path(model).name})",
        "cv_pct_with": round(100 * statistics.stdev(with_s) / statistics.fmean(with_s), 2),
        "cv_pct_without": round(100 * statistics.stdev(without) / statistics.fmean(without), 2),
        "sampler_samples_per_s_median": round(statistics.median(samples_per_s), 1),
        "decode_tps_with": [round(x, 3) for x in with_s], "decode_tps_without": [round(x, 3) for x in without],
        "difference_pct": [round(x, 3) for x in diffs],
        "mean_difference_pct": round(st.mean, 3), "ci95_pct": [round(lo, 3), round(hi, 3)],
        "median_difference_pct": round(statistics.median(diffs), 3),
        "pairs_slower_with_sampling": sum(d < 0 for d in diffs), "pairs": len(diffs),
        "target_pct": TARGET_PCT, "verdict": verdict,
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
