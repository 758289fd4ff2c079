"""jbench's own overhead: a whole `jbench sweep +experiment=quant_ladder` process against the same
six llama-bench commands run bare, back to back. Each side a fresh process (or six), in
alternating pairs; wall time and CPU time (user + system of every process, from
getrusage(RUSAGE_CHILDREN)) per side, per-pair ratios with 95 % t intervals.

The jbench side is what a user runs: interpreter start, imports, compose and plan, preflight,
six trials recorded in MLflow (SQLite), summary; with sweep.rerun=true so every round measures
again. The bare side runs exactly the llama-bench argument lists jbench runs (from the plan, via
the backend's own command builder), nothing else. The MLflow store is created by an unmeasured
first jbench run (reported on its own); the page cache and the model-facts cache are warm.

The ratio depends on the workload (jbench's cost is nearly fixed per sweep and trial, llama-bench's
grows with -p/-n/-r), so the absolute overhead (jbench - bare, seconds per sweep) is reported too.

    .venv/bin/python bench/overhead.py [--pairs 6] [--n-prompt 128] [--n-gen 64] [--reps 3] [--threads N]
                                       [--json bench/results-overhead.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _procstat import (  # noqa: E402
    alternate, describe, exit_cleanly_on_sigterm, fmt, jbench_env, jbench_exe, load_average, machine, paired, raw,
    run_many, run_once,
)


def bare_commands(overrides: list[str]) -> list[list[str]]:
    """The llama-bench argument lists jbench runs for these overrides, in trial order."""
    from jbench.backends.llamacpp.backend import LlamaCppBackend
    from jbench.models.store import resolve_model_file
    from jbench.sweeps.plan import plan

    p = plan(overrides)
    if p.problems:
        raise SystemExit("plan problems: " + "; ".join(p.problems))
    return [LlamaCppBackend(t.config["backend"]).command(t, resolve_model_file(t.config["model"])[0]) for t in p.trials]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, help="backend.threads (llama-bench -t); default: llama-bench's own")
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results-overhead.json")
    args = ap.parse_args()
    exit_cleanly_on_sigterm()
    overrides = ["+experiment=quant_ladder", "sweep.rerun=true", f"backend.n_prompt={args.n_prompt}",
                 f"backend.n_gen={args.n_gen}", f"backend.repetitions={args.reps}"]
    if args.threads:
        overrides.append(f"backend.threads={args.threads}")
    commands = bare_commands(overrides)
    jb = jbench_exe()
    with tempfile.TemporaryDirectory(prefix="jbench-overhead-") as t:
        tmp = Path(t)
        env = jbench_env(JBENCH_RESULTS_DIR=str(tmp / "results"))
        sweep_argv = jb + ["sweep", *overrides]
        t0 = time.perf_counter()
        first = subprocess.run(sweep_argv, env=env, cwd=tmp, capture_output=True, text=True)
        first_s = time.perf_counter() - t0
        if first.returncode != 0:
            raise SystemExit(f"the first sweep failed:\n{first.stdout[-3000:]}\n{first.stderr[-3000:]}")
        print(f"first jbench sweep (creates the MLflow store, unmeasured): {first_s:.1f} s", flush=True)

        def jbench_side():
            return run_once(sweep_argv, env=env, cwd=tmp)

        def bare_side():
            return run_many(commands)

        def show(i, x, y):
            print(f"  pair {i + 1}: jbench {x.wall_s:.2f} s / {x.cpu_s:.2f} CPU-s, bare {y.wall_s:.2f} s / "
                  f"{y.cpu_s:.2f} CPU-s, ratio wall {x.wall_s / y.wall_s:.3f} CPU {x.cpu_s / y.cpu_s:.3f}", flush=True)

        load0 = load_average()
        sj, sb = alternate(jbench_side, bare_side, args.pairs, show)
    wall = paired([s.wall_s for s in sj], [s.wall_s for s in sb])
    cpu = paired([s.cpu_s for s in sj], [s.cpu_s for s in sb])
    figures = {
        "command": "jbench " + " ".join(["sweep", *overrides]),
        "baseline": f"the same {len(commands)} llama-bench commands, bare, back to back",
        "machine": machine(),
        "load_average": {"start": load0, "end": load_average()},
        "params": {"pairs": args.pairs, "n_prompt": args.n_prompt, "n_gen": args.n_gen, "reps": args.reps,
                   "threads": args.threads},
        "trials_per_sweep": len(commands),
        "first_sweep_s": round(first_s, 2),
        "jbench_wall_s": describe([s.wall_s for s in sj]),
        "bare_wall_s": describe([s.wall_s for s in sb]),
        "jbench_cpu_s": describe([s.cpu_s for s in sj]),
        "bare_cpu_s": describe([s.cpu_s for s in sb]),
        "ratio_wall": wall["ratio"],
        "ratio_cpu": cpu["ratio"],
        "overhead_wall_s": wall["difference"],
        "overhead_cpu_s": cpu["difference"],
        "pairs": raw(sj, sb, ("jbench", "bare")),
    }
    figures["targets"] = {"ratio_wall_at_most_1.05": figures["ratio_wall"]["median"] <= 1.05,
                          "ratio_cpu_at_most_1.05": figures["ratio_cpu"]["median"] <= 1.05}
    print(f"wall  ratio {fmt(figures['ratio_wall'], unit='x')}\n      overhead {fmt(figures['overhead_wall_s'])}\n"
          f"CPU   ratio {fmt(figures['ratio_cpu'], unit='x')}\n      overhead {fmt(figures['overhead_cpu_s'], unit='CPU-s')}")
    print(json.dumps(figures["targets"]))
    args.json.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
