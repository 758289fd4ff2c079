"""Re-running a finished sweep: `jbench sweep +experiment=quant_ladder` when all six trials are
already FINISHED in the results store, so it runs nothing. Each run a fresh process, in
alternating pairs with `jbench --help`; the OS page cache and the model-facts cache warm.

The store: --results-dir DIR when it already holds the finished sweep (reused as is), else a
temporary dir in which the sweep is first run for real once (minutes: six llama-bench trials;
its wall time is reported). Before timing, one re-run checks that every trial is skipped as
already FINISHED. --profile adds one re-run under cProfile and reports where its time goes.

Target (issue 10): a re-run of a finished 6-trial sweep < 2 s.

    .venv/bin/python bench/resume.py [--results-dir /tmp/jb-resume] [--pairs 10] [--profile]
                                     [--json bench/results-resume.json]
"""

from __future__ import annotations

import argparse
import json
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _procstat import (  # noqa: E402
    alternate, describe, exit_cleanly_on_sigterm, fmt, jbench_env, jbench_exe, load_average, machine, paired, raw,
    run_once,
)

SWEEP = ["sweep", "+experiment=quant_ladder"]

# (label, how cProfile names the function): where a resume's time goes.
PROFILE_POINTS = [
    ("whole process (profiled)", "builtins.exec"),
    ("plan the sweep (compose, validate; includes importing the backends)", "plan.py:", "(plan)"),
    ("import jbench.sweeps.sweep", "sweep.py:1(<module>)"),
    ("import mlflow (only when the sqlite3 fast path cannot answer)", "mlflow/__init__.py:1(<module>)"),
    ("Sweep.run (preflight, resume lookup, skip)", "sweep.py:", "(run)"),
    ("Sweep.preflight (connect, fingerprint, backend checks, build id, model digest)", "sweep.py:", "(preflight)"),
    ("resume lookup via sqlite3 (resume_index)", "resume_index.py:", "(finished_trials_sqlite)"),
    ("finished_trials through MLflow (fallback)", "reader.py:", "(finished_trials)"),
]


def profile_once(env: dict, cwd: Path) -> dict:
    prof = cwd / "resume.prof"
    subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "jbench.cli", *SWEEP], env=env, cwd=cwd,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    stats = pstats.Stats(str(prof)).stats  # {(file, line, func): (cc, nc, tt, ct, callers)}
    out = {}
    for label, *needles in PROFILE_POINTS:
        best = 0.0
        for (file, line, func), (_cc, _nc, _tt, ct, _callers) in stats.items():
            name = f"{file}:{line}({func})"
            if needles == ["builtins.exec"]:
                if func == "<built-in method builtins.exec>":
                    best = max(best, ct)
                continue
            if all(n in name for n in needles):
                best = max(best, ct)
        out[label] = round(best, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results-dir", type=Path, help="a results dir that already holds the finished sweep")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="also profile one re-run (cProfile)")
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results-resume.json")
    args = ap.parse_args()
    exit_cleanly_on_sigterm()

    jb = jbench_exe()
    with tempfile.TemporaryDirectory(prefix="jbench-resume-") as t:
        tmp = Path(t)
        results = (args.results_dir or tmp / "results").resolve()
        env = jbench_env(JBENCH_RESULTS_DIR=str(results))
        figures: dict = {"command": "JBENCH_RESULTS_DIR=... jbench " + " ".join(SWEEP) + "  (all trials FINISHED)",
                         "baseline": "jbench --help", "machine": machine(), "results_dir": str(results)}
        if not (results / "mlflow.db").exists():
            print(f"running the sweep once for real into {results} (six llama-bench trials) ...", flush=True)
            t0 = time.perf_counter()
            first = subprocess.run(jb + SWEEP, env=env, cwd=tmp, capture_output=True, text=True)
            figures["first_sweep_s"] = round(time.perf_counter() - t0, 2)
            if first.returncode != 0:
                raise SystemExit(f"the first sweep failed:\n{first.stdout[-3000:]}\n{first.stderr[-3000:]}")
            print(f"  first sweep: {figures['first_sweep_s']} s", flush=True)
        check = subprocess.run(jb + SWEEP, env=env, cwd=tmp, capture_output=True, text=True)
        skipped = check.stdout.count("already FINISHED") + check.stderr.count("already FINISHED")
        if check.returncode != 0 or skipped < 6:
            raise SystemExit(f"the re-run did not skip all six trials (exit {check.returncode}, {skipped} skipped):\n"
                             f"{check.stdout[-3000:]}\n{check.stderr[-3000:]}")
        figures["trials_skipped_per_rerun"] = skipped

        def resume():
            return run_once(jb + SWEEP, env=env, cwd=tmp)

        def helpc():
            return run_once(jb + ["--help"], env=env, cwd=tmp)

        def show(i, x, y):
            print(f"  pair {i + 1}: re-run {x.wall_s:.3f} s ({x.cpu_s:.2f} CPU-s), --help {y.wall_s:.3f} s", flush=True)

        helpc()
        load0 = load_average()
        sa, sb = alternate(resume, helpc, args.pairs, show)
        figures.update({
            "resume_wall_s": describe([s.wall_s for s in sa]),
            "resume_cpu_s": describe([s.cpu_s for s in sa]),
            "help_wall_s": describe([s.wall_s for s in sb]),
            "resume_over_help_wall": paired([s.wall_s for s in sa], [s.wall_s for s in sb])["ratio"],
            "load_average": {"start": load0, "end": load_average()},
            "pairs": raw(sa, sb, ("resume", "help")),
        })
        print(f"re-run: {fmt(figures['resume_wall_s'])}\n        CPU {fmt(figures['resume_cpu_s'], unit='CPU-s')}\n"
              f"--help: {fmt(figures['help_wall_s'])}")
        if args.profile:
            figures["profile_cumulative_s"] = profile_once(env, tmp)
            for k, v in figures["profile_cumulative_s"].items():
                print(f"  {v:7.3f} s  {k}")
    figures["targets"] = {"resume_under_2s": figures["resume_wall_s"]["median"] < 2.0}
    print(json.dumps(figures["targets"]))
    args.json.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
