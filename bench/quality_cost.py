"""What quality and memory cost a user, and how good the memory prediction is (issue 25).

Whole `jbench sweep +experiment=quant_ladder` processes on the embedded default, in rounds of three variants whose
order rotates each round:

- `off`:  quality.enabled=false (the speed, energy and memory passes alone);
- `cold`: quality on, an empty quality cache on the device (a fresh HOME): the first sweep a user runs, which
          computes the reference logits;
- `warm`: quality on, the reference logits already cached (every later sweep with the same corpus and context).

Each variant writes to its own fresh results store, so no trial is resumed or its quality reused from an earlier
process. From the stores: per-trial quality stage time and reference logits size, and the memory pass's peak RSS
against the planner's prediction. Then `jbench sweep +experiment=context_sweep` once (KV cache 0 to 8192 cells) for
the memory prediction over context.

    .venv/bin/python bench/quality_cost.py [--rounds 3] [--out bench/results-quality.json]
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

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
JBENCH = str(Path(sys.executable).with_name("jbench"))
VARIANTS = {"off": ["quality.enabled=false"], "cold": [], "warm": []}


def _sweep(args: list[str], results: Path, home: Path | None) -> float:
    env = dict(os.environ, JBENCH_RESULTS_DIR=str(results), COLUMNS="200")
    if home is not None:
        # The device's quality cache is ~/.cache/jbench/quality; the build and the models stay where they are.
        env.setdefault("JBENCH_CACHE_DIR", str(Path.home() / ".cache" / "jbench"))
        env["HOME"] = str(home)
    started = time.perf_counter()
    res = subprocess.run([JBENCH, "sweep", *args], env=env, capture_output=True, text=True, cwd=results.parent)
    wall = time.perf_counter() - started
    if res.returncode != 0:
        sys.exit(f"jbench sweep {' '.join(args)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return wall


def _trials(results: Path, experiment: str) -> list:
    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    return sorted((r for r in runs if r.data.tags.get("jbench.kind") == "trial"),
                  key=lambda r: int(r.data.tags["jbench.trial_index"]))


def _spread(values: list[float]) -> dict:
    return {"min": round(min(values), 2), "median": round(statistics.median(values), 2), "max": round(max(values), 2),
            "n": len(values)}


def _memory_rows(trials: list, label: str) -> list[dict]:
    rows = []
    for t in trials:
        m = t.data.metrics
        rows.append({"trial": t.data.params.get(label), "peak_rss_mib": round(m.get("memory_peak_rss_mib", float("nan")), 1),
                     "predicted_mib": round(m.get("memory_predicted_mib", float("nan")), 1),
                     "error_pct": round(m.get("memory_prediction_error_pct", float("nan")), 1),
                     "prediction": t.data.tags.get("memory.prediction", "")})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results-quality.json"))
    a = ap.parse_args()
    walls: dict[str, list[float]] = {v: [] for v in VARIANTS}
    per_trial: dict[str, list[dict]] = {"cold": [], "warm": []}
    memory: list[dict] = []
    names = list(VARIANTS)
    with tempfile.TemporaryDirectory(prefix="jbench-quality-bench-") as tmp:
        work = Path(tmp)
        for r in range(a.rounds):
            order = names[r % 3:] + names[:r % 3]
            for variant in order:
                results = work / f"{variant}-{r}" / "results"
                results.mkdir(parents=True)
                home = None
                if variant == "cold":
                    home = work / f"home-{r}"
                    home.mkdir()
                wall = _sweep(["+experiment=quant_ladder", *VARIANTS[variant]], results, home)
                walls[variant].append(wall)
                trials = _trials(results, "quant_ladder")
                print(f"round {r + 1} {variant}: {wall:.1f} s, {len(trials)} trials", flush=True)
                if variant in per_trial:
                    for t in trials:
                        m, tags = t.data.metrics, t.data.tags
                        per_trial[variant].append({
                            "quant": t.data.params["model.quant"], "quality_wall_s": round(m["quality_wall_s"], 2),
                            "reference_cache": tags.get("quality.reference_cache", ""),
                            "logits_mib": round(m.get("quality_reference_logits_mib", float("nan")), 1),
                            "kld_mean": m.get("quality_kld_mean"), "same_top_pct": m.get("quality_same_top_pct")})
                if variant == "off" and not memory:
                    memory = _memory_rows(trials, "model.quant")
        ctx_results = work / "context" / "results"
        ctx_results.mkdir(parents=True)
        ctx_wall = _sweep(["+experiment=context_sweep", "backend.n_gen=16", "backend.repetitions=2"], ctx_results, None)
        context_memory = _memory_rows(_trials(ctx_results, "context_sweep"), "backend.depth")
    errors = [row["error_pct"] for row in memory + context_memory if row["error_pct"] == row["error_pct"]]
    figures = {
        "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.platform()}",
        "command": "jbench sweep +experiment=quant_ladder (6 quants, quality context 512, 1 chunk), variants "
                   "rotated each round",
        "rounds": a.rounds,
        "wall_s": {v: _spread(w) for v, w in walls.items()},
        "quality_added_s": {
            "cold": _spread([c - o for c, o in zip(walls["cold"], walls["off"])]),
            "warm": _spread([w - o for w, o in zip(walls["warm"], walls["off"])]),
        },
        "quality_stage_s_per_trial": {v: _spread([row["quality_wall_s"] for row in rows]) for v, rows in per_trial.items()},
        "reference_pass_trial_s": _spread([row["quality_wall_s"] for row in per_trial["cold"]
                                           if row["reference_cache"].startswith("computed")]),
        "reference_logits_mib": sorted({row["logits_mib"] for row in per_trial["cold"]}),
        "quality_per_quant_first_round": per_trial["warm"][:6],
        "memory_quant_ladder": memory,
        "memory_context_sweep": context_memory,
        "context_sweep_wall_s": round(ctx_wall, 1),
        "memory_prediction_error_pct": _spread(errors) if errors else None,
    }
    Path(a.out).write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
