"""jbench's own overhead: the quant ladder through jbench vs the same llama-bench commands bare.

In one process, alternating: a jbench round plans the ladder, preflights the device, runs every
trial and records it in MLflow (SQLite); a bare round runs exactly the llama-bench argument
lists jbench ran, back to back, and nothing else. The ratio of wall times is jbench's cost.
The very first jbench round creates the MLflow store and is reported on its own.

    .venv/bin/python bench/overhead.py [--rounds 3] [--n-prompt 128] [--n-gen 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jbench.backends.llamacpp.backend import LlamaCppBackend  # noqa: E402
from jbench.models.store import resolve_model_file  # noqa: E402
from jbench.sweeps.plan import plan  # noqa: E402
from jbench.sweeps.sweep import Sweep  # noqa: E402
from jbench.tracking.writer import Tracker  # noqa: E402


def jbench_round(overrides: list[str], results: Path) -> tuple[float, list[list[str]]]:
    started = time.perf_counter()
    p = plan(overrides)
    if p.problems:
        raise SystemExit("plan problems: " + "; ".join(p.problems))
    outcome = Sweep(p, lambda: Tracker(None, results)).run()
    wall = time.perf_counter() - started
    if outcome.failed:
        raise SystemExit(f"trials failed: {[o.error for o in outcome.failed]}")
    commands = [LlamaCppBackend(t.config["backend"]).command(t, resolve_model_file(t.config["model"])[0])
                for t in p.trials]
    return wall, commands


def bare_round(commands: list[list[str]]) -> float:
    started = time.perf_counter()
    for argv in commands:
        subprocess.run(argv, check=True, capture_output=True, stdin=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    # sweep.rerun: every round measures again (otherwise resume would skip the finished trials).
    overrides = ["+experiment=quant_ladder", "sweep.rerun=true", f"backend.n_prompt={args.n_prompt}",
                 f"backend.n_gen={args.n_gen}", f"backend.repetitions={args.reps}"]
    with tempfile.TemporaryDirectory(prefix="jbench-bench-") as tmp:
        results = Path(tmp)
        first_wall, commands = jbench_round(overrides, results)  # creates the store
        print(f"first jbench round (creates the MLflow store): {first_wall:.2f} s", flush=True)
        jb, bare = [], []
        for i in range(args.rounds):
            # Alternate which goes first so slow drift does not favour one side.
            if i % 2 == 0:
                bare.append(bare_round(commands))
                jb.append(jbench_round(overrides, results)[0])
            else:
                jb.append(jbench_round(overrides, results)[0])
                bare.append(bare_round(commands))
            print(f"round {i + 1}: jbench {jb[-1]:.2f} s, bare {bare[-1]:.2f} s, ratio {jb[-1] / bare[-1]:.4f}", flush=True)
    figures = {
        "machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
        "trials_per_round": len(commands),
        "params": vars(args) | {"json": None},
        "first_round_s": round(first_wall, 3),
        "jbench_s": [round(x, 3) for x in jb],
        "bare_s": [round(x, 3) for x in bare],
        "ratio_median": round(statistics.median(jb) / statistics.median(bare), 4),
        "ratio_total": round(sum(jb) / sum(bare), 4),
        "overhead_s_per_trial_median": round((statistics.median(jb) - statistics.median(bare)) / len(commands), 3),
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
