"""Planning speed and resume-lookup speed.

- Plan and validate a 10,000-trial grid (backend.n_gen x backend.depth x model.quant) with
  jbench's planner, including per-trial validation (quant names, model files, memory fit).
- Look up FINISHED trials for resume in an MLflow store holding 5,000+ trial runs (the store that
  bench/report_regress.py builds and caches; built here too when missing).

    .venv/bin/python bench/plan_resume.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jbench.sweeps.plan import plan  # noqa: E402
from jbench.tracking.writer import Tracker  # noqa
from jbench.tracking.reader import finished_trials  # noqa: E402

STORE = Path("/tmp/jbench-bench-10k")


def main() -> None:
    overrides = ["backend.n_gen=range(1,51)", "backend.depth=range(0,4000,20)", "model.quant=Q4_0"]
    times = []
    for _ in range(3):
        t = time.perf_counter()
        p = plan(overrides)
        times.append(time.perf_counter() - t)
    assert len(p.trials) == 10_000, len(p.trials)
    if not (STORE / "mlflow.db").exists():
        subprocess.run([sys.executable, str(ROOT / "bench" / "report_regress.py"), "--rounds", "1"], check=True)
    tracker = Tracker(None, STORE)
    lookups = []
    for _ in range(3):
        t = time.perf_counter()
        found = finished_trials(tracker, "nightly")
        lookups.append(time.perf_counter() - t)
    figures = {
        "plan_10000_trials_s": [round(x, 3) for x in times],
        "plan_10000_trials_s_median": round(statistics.median(times), 3),
        "plan_problems": len(p.problems),
        "resume_lookup_runs": len(found),
        "resume_lookup_s": [round(x, 3) for x in lookups],
        "resume_lookup_s_median": round(statistics.median(lookups), 3),
    }
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
