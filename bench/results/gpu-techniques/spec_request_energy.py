"""Energy per output token of the speculative (latency-scenario) trials, integrated BY HAND from each trial's own NVML
samples (artifacts telemetry/samples.csv), because jbench records no request/decode energy window for the latency
scenario (only idle and a "cooldown" window that spans the whole server run). Not a jbench metric.

Span: from the trial log's "warmup: ..." line (the warm-up request answered; the measured requests start) to its
"llama-server stopped" line (after the last request; includes the server's stop). Power: the instantaneous NVML power
field, trapezoids, linear interpolation at the two edges (100-ms sensor); the NVML energy counter over the same span
is printed beside it as a cross-check. Draft counters: Σ draft_n and Σ draft_n_accepted of the measured requests'
server timings (raw/stdout.txt), the same sums jbench's draft_acceptance pools.

    python3 spec_request_energy.py RESULTS_DIR/artifacts/speculative
"""
import csv
import datetime as dt
import json
import os
import sys


def stamp(line: str) -> float:  # the trial log's local time; the GPU host runs in UTC
    return dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=dt.timezone.utc).timestamp()


def interp(series, t):
    for (ta, va), (tb, vb) in zip(series, series[1:]):
        if ta <= t <= tb:
            return va + (vb - va) * (t - ta) / (tb - ta)
    raise ValueError(f"{t} outside the samples")


root = sys.argv[1]
for rid in sorted(os.listdir(root)):
    a = os.path.join(root, rid, "artifacts")
    if not os.path.exists(os.path.join(a, "telemetry", "samples.csv")):
        continue
    cfg = open(os.path.join(a, "trial.log")).read().splitlines()
    t0 = next(stamp(l) for l in cfg if " warmup: " in l)
    t1 = next(stamp(l) for l in cfg if "llama-server stopped" in l)
    rows = list(csv.DictReader(open(os.path.join(a, "telemetry", "samples.csv"))))
    power = [(float(r["t"]), float(r["power_w"])) for r in rows if r["power_w"]]
    counter = [(float(r["t"]), float(r["energy_j"])) for r in rows if r["energy_j"]]
    pts = [(t0, interp(power, t0))] + [(t, p) for t, p in power if t0 < t < t1] + [(t1, interp(power, t1))]
    energy = sum((tb - ta) * (pa + pb) / 2 for (ta, pa), (tb, pb) in zip(pts, pts[1:]))
    energy_counter = interp(counter, t1) - interp(counter, t0)
    reqs = [json.loads(l) for l in open(os.path.join(a, "raw", "stdout.txt")) if l.strip()]
    measured = [r for r in reqs if r.get("kind") != "warmup"]
    out = sum(r["output_tokens"] for r in measured)
    drafted = sum(r["server_timings"].get("draft_n", 0) for r in measured)
    accepted = sum(r["server_timings"].get("draft_n_accepted", 0) for r in measured)
    head = next(l for l in cfg if " INFO trial " in l).split("INFO ", 1)[1]
    print(json.dumps({"run_id": rid, "trial": head, "requests": len(measured), "output_tokens": out,
                      "span_s": round(t1 - t0, 3), "energy_j": round(energy, 1),
                      "energy_counter_j": round(energy_counter, 1), "avg_power_w": round(energy / (t1 - t0), 1),
                      "j_per_output_token": round(energy / out, 4), "output_tokens_per_j": round(out / energy, 3),
                      "draft_n": drafted, "draft_n_accepted": accepted}))
