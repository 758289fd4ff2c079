"""Where a class sweep's controller time goes with many devices: the sweep of bench/farm_scale.py's utilisation
scenario run in this process, every worker thread under its own cProfile, the profiles summed (the figures quoted
in docs/PERFORMANCE.md, "The device farm at scale"). Times are per-thread wall time, so waiting for the sweep's
lock shows as time in the lock's callers.

    .venv/bin/python bench/farm_profile.py --devices 64 --trials-per-device 2 --trial-s 15
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import farm_scale as F  # noqa: E402  (puts the repository on sys.path)

from jbench.sweeps.plan import plan  # noqa: E402
from jbench.sweeps.sweep import run_sweep  # noqa: E402
from jbench.tracking.writer import Tracker  # noqa: E402


def writes_alone(n: int) -> None:
    """A trial's tracker writes (run with ~45 tags and 25 params, metrics, status tags, 3 artifacts, end) in one
    thread, n times: what the same writes cost with no other thread competing."""
    import statistics

    tracker = Tracker(None, Path(tempfile.mkdtemp(prefix="farm-profile-writes-")))
    exp = tracker.experiment_id("x")
    parent = tracker.start_run(exp, "sweep", tags={"jbench.kind": "sweep"})
    steps: dict[str, list[float]] = {k: [] for k in ("start", "metrics", "status_tags", "artifacts", "end")}
    for i in range(n):
        t0 = time.perf_counter()
        rid = tracker.start_run(exp, f"t{i}", parent_run_id=parent, params={f"p.{j}": j for j in range(25)},
                                tags={f"tag.{j}": f"value {j}" * 3 for j in range(45)})
        t1 = time.perf_counter()
        tracker.log(rid, metrics={f"m{j}": float(j) for j in range(30)}, tags={f"r{j}": "x" for j in range(15)})
        t2 = time.perf_counter()
        tracker.log(rid, tags={"jbench.status": "FINISHED"})
        t3 = time.perf_counter()
        tracker.log_texts(rid, {"config.yaml": "a: 1\n" * 100, "trial.log": "line\n" * 20, "raw/stdout.txt": "x\n"})
        t4 = time.perf_counter()
        tracker.end_run(rid, "FINISHED")
        t5 = time.perf_counter()
        for key, a, b in (("start", t0, t1), ("metrics", t1, t2), ("status_tags", t2, t3), ("artifacts", t3, t4),
                          ("end", t4, t5)):
            steps[key].append(b - a)
    shutil.rmtree(Path(tracker.uri.removeprefix("sqlite:///")).parent, ignore_errors=True)
    for key, values in steps.items():
        print(f"{key:12s} median {1000 * statistics.median(values):6.1f} ms")
    print(f"a trial's writes alone: {1000 * sum(statistics.median(v) for v in steps.values()):.0f} ms (median sum)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--trials-per-device", type=int, default=2)
    ap.add_argument("--trial-s", type=float, default=15.0)
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--writes-alone", type=int, default=0, metavar="N",
                    help="instead: time a trial's tracker writes N times in one thread")
    args = ap.parse_args()
    if args.writes_alone:
        writes_alone(args.writes_alone)
        return 0
    work = Path(tempfile.mkdtemp(prefix="farm-profile-"))
    n, per = args.devices, args.trials_per_device
    emus = F.start_devices(n, work / "devices")
    profiles: list[cProfile.Profile] = []
    worker = Sweep._worker

    def profiled(self, *a, **k):
        p = cProfile.Profile()
        profiles.append(p)
        p.enable()
        try:
            return worker(self, *a, **k)
        finally:
            p.disable()

    Sweep._worker = profiled
    try:
        conf = F.write_conf(work / "conf", emus, args.trial_s, "P")
        p = plan([f"device=@{F.CLASS}", "backend=sleepy", *F.NO_TELEMETRY, F.n_gen_values(1, n * per),
                  f"tracking.results_dir={work / 'r'}"], [conf])
        if p.problems:
            raise SystemExit("\n".join(p.problems))
        t0 = time.time()
        result = run_sweep(p, lambda: Tracker(None, work / "r"))
        print(f"sweep: {time.time() - t0:.1f} s wall, {len(result.outcomes)} trials, "
              f"{sum(o.status.value == 'FINISHED' for o in result.outcomes)} FINISHED")
    finally:
        F.stop_devices(emus)
        Sweep._worker = worker
        shutil.rmtree(work, ignore_errors=True)
    out = io.StringIO()
    stats = pstats.Stats(profiles[0], stream=out)
    for q in profiles[1:]:
        stats.add(q)
    stats.sort_stats("cumulative").print_stats(args.top)
    print(f"worker threads, summed ({len(profiles)}):\n{out.getvalue()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
