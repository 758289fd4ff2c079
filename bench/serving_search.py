"""The SLO-capacity search against a full grid for the same answer, on a real llama-server (docs/PERFORMANCE.md,
"Serving: the SLO-capacity search").

    PYTHONPATH=. .venv/bin/python bench/serving_search.py [--max-load 8] [--slots 2] [--requests 8] [-- OVERRIDES...]

Three `jbench sweep +experiment=serving` processes, as a user runs them, into a throw-away store:
1. calibration: one level at concurrency 1 gives a request's end-to-end time e1 on this machine;
2. the full grid: every concurrency 1..max_load with the SLO "TTFT <= e1 / 2" (a request that waits for a slot
   misses it, one that gets a slot at once meets it), so the capacity should be the slot count;
3. the search (serving.search=slo) with the same SLO, from 1 to max_load.
It prints the levels each ran, the capacity each found with its interval, and (with --json) writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def sweep(store: Path, overrides: list[str]) -> tuple[dict, dict, list[float], float]:
    env = dict(os.environ, JBENCH_RESULTS_DIR=str(store))
    exe = shutil.which("jbench") or str(Path(sys.executable).with_name("jbench"))
    t0 = time.monotonic()
    res = subprocess.run([exe, "sweep", "+experiment=serving", "sweep.rerun=true", *overrides],
                         capture_output=True, text=True, env=env)
    wall = time.monotonic() - t0
    if res.returncode != 0:
        raise SystemExit(f"jbench sweep failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{store}/mlflow.db")
    exp = client.get_experiment_by_name("serving")
    runs = [r for r in client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
            if r.data.tags.get("jbench.kind") == "trial"]
    run = runs[0]
    loads = [m.value for m in client.get_metric_history(run.info.run_id, "serving_level_load")]
    return run.data.metrics, run.data.tags, loads, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-load", type=int, default=8)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    common = [f"serving.slots={a.slots}", f"serving.requests_per_level={a.requests}", "serving.slo.tpot_ms=null",
              "serving.slo.e2e_ms=null", *a.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp)
        m, _, _, _ = sweep(store, [*common, "serving.levels=[1]", "serving.slo.ttft_ms=null"])
        e1 = m["serving_e2e_ms_p50"]
        target = round(e1 / 2, 1)
        slo = [f"serving.slo.ttft_ms={target}"]
        grid_levels = ",".join(str(i) for i in range(1, a.max_load + 1))
        g_m, g_t, g_loads, g_wall = sweep(store, [*common, *slo, f"serving.levels=[{grid_levels}]",
                                                  f"serving.max_load={a.max_load}"])
        s_m, s_t, s_loads, s_wall = sweep(store, [*common, *slo, "serving.search=slo", "serving.levels=[1]",
                                                  f"serving.max_load={a.max_load}"])
    out = {"slots": a.slots, "requests_per_level": a.requests, "e2e_ms_at_1": e1, "slo_ttft_ms": target,
           "grid": {"levels": g_loads, "capacity": g_m.get("serving_slo_capacity"),
                    "low": g_m.get("serving_slo_capacity_low"), "high": g_m.get("serving_slo_capacity_high"),
                    "reason": g_t.get("serving.slo_capacity"), "wall_s": g_wall},
           "search": {"levels": s_loads, "capacity": s_m.get("serving_slo_capacity"),
                      "low": s_m.get("serving_slo_capacity_low"), "high": s_m.get("serving_slo_capacity_high"),
                      "reason": s_t.get("serving.slo_capacity"), "wall_s": s_wall}}
    for name in ("grid", "search"):
        r = out[name]
        print(f"{name:6s} levels {len(r['levels']):2d} {r['levels']}  capacity {r['capacity']} "
              f"[{r['low']}, {r['high']}]  {r['wall_s']:.0f} s")
    print(f"SLO: TTFT <= {target} ms (half of one request's e2e at concurrency 1, {e1:.1f} ms); slots {a.slots}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
