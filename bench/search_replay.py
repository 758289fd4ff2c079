"""`sweep --search` replayed on a complete measured grid (docs/PERFORMANCE.md, "The search against a replayed grid").

    PYTHONPATH=. .venv/bin/python bench/search_replay.py --results-dir /path/to/store [--seeds 100] \
        [--maximize decode_tps] [--require 'memory_peak_rss_mib<=400' --require 'prefill_tps>=300'] [--json out.json]

The store holds one full sweep of a grid (every configuration measured once, with its repetitions). It becomes an
oracle with its measured noise: a replayed run of a configuration is `repetitions` draws from a normal with that
configuration's own mean and repetition spread of each rate (noise differs from point to point, as measured); a
figure measured once without repetitions (the memory pass's peak RSS) is replayed as measured. The truth is each
configuration's measured mean.

Per seed, three ways to the answer, each judged by the truth:
  * `search`: jbench.sweeps.search.Search (TPE with constraints, adaptive repetitions), budget: 25 % of the grid's
    runs (--budget);
  * `random`: as many runs as the search used, on distinct configurations drawn at random, one run each;
  * `grid`: every configuration once (100 % of the runs).
Each then names its best: the best measured mean among the configurations it judged to meet the constraints
(P >= 0.9, as the advisor). Success: that configuration truly meets the constraints and its true mean is the true
constrained best's or not significantly worse than it (difference within 1.96 standard errors of two
`repetitions`-sample means at the two configurations' measured spreads).

Calibration: at the end of each search, every configuration it measured states P(constraint met) for each
constraint; over all seeds, binned by the stated probability, the share that truly meets it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass

from jbench.analysis.advice import Goal, MEETS, parse_constraint
from jbench.core.results import Status
from jbench.core.trial import Trial
from jbench.sweeps.search import Measured, Search, SearchSettings, verdict


@dataclass
class Config:
    trial: Trial
    mean: dict[str, float]  # metric -> measured mean (the truth)
    sd: dict[str, float]  # metric -> repetition spread (0: replayed as measured)


@dataclass
class Outcome:
    trial: Trial
    status: Status
    metrics: dict
    earlier_run_id: str | None = None


def load(results_dir: str, metrics: list[str], repetitions: int) -> tuple[list[Config], dict[str, list]]:
    from jbench.tracking.common import resolve_uri
    from jbench.tracking.reader import repetition_samples, runs_frame

    uri = resolve_uri(None, results_dir)
    df = runs_frame(uri)
    df = df[(df["status"] == "FINISHED") & (df["tags.jbench.kind"] == "trial")]
    point_keys = sorted({k for k in df.columns if k.startswith("params.")} - {"params.sweep.overrides"})
    varying = [k for k in point_keys if df[k].nunique(dropna=False) > 1 and not k.startswith("params.sweep.")]
    configs: list[Config] = []
    for i, (h, rows) in enumerate(df.groupby("tags.jbench.config_hash", sort=False), 1):
        row = rows.iloc[-1]
        point = {k[len("params."):]: str(row[k]) for k in varying}
        mean, sd = {}, {}
        for m in metrics:
            reps = [v for s in repetition_samples(uri, list(rows["run_id"]), f"{m}_rep").values() for v in s]
            if len(reps) >= 2:
                mean[m], sd[m] = statistics.fmean(reps), statistics.stdev(reps)
            elif f"metrics.{m}" in rows.columns and not math.isnan(float(row[f"metrics.{m}"])):
                mean[m], sd[m] = float(row[f"metrics.{m}"]), 0.0
        configs.append(Config(Trial(i, {}, {}, point, str(h)), mean, sd))
    dims = {k[len("params."):]: sorted({str(c.trial.point[k[len("params."):]]) for c in configs}) for k in varying}
    return configs, dims


def replay_run(c: Config, rng: random.Random, repetitions: int) -> dict[str, float]:
    out = {}
    for m, mu in c.mean.items():
        sd = c.sd.get(m, 0.0)
        if sd > 0:
            draws = [rng.gauss(mu, sd) for _ in range(repetitions)]
            out[m] = statistics.fmean(draws)
            out[f"{m}_std"] = statistics.stdev(draws)
            out[f"{m.split('_', 1)[0]}_repetitions"] = float(repetitions)
        else:
            out[m] = mu
    return out


def truly_meets(goal: Goal, c: Config) -> bool:
    return all(con.metric in c.mean and (c.mean[con.metric] - con.bound) * con.sense >= 0 for con in goal.constraints)


def success(goal: Goal, found: Config | None, best: Config, repetitions: int) -> bool:
    if found is None or not truly_meets(goal, found):
        return False
    o = goal.objective
    diff = (best.mean[o] - found.mean[o]) * goal.direction
    se = math.sqrt((best.sd.get(o, 0) ** 2 + found.sd.get(o, 0) ** 2) / repetitions)
    return diff <= 1.96 * se + 1e-12


def pick(goal: Goal, measured: dict[str, Measured], by_hash: dict[str, Config]) -> Config | None:
    """The advisor's answer over what was measured (a figure measured once without a spread: judged on its value, as
    `jbench advise` does)."""
    best, value = None, None
    for h, m in measured.items():
        if not m.runs or verdict(goal, m, lambda metric: None)[0] != MEETS:
            continue
        v = m.estimate(goal.objective).mean
        if value is None or (v - value) * goal.direction > 0:
            best, value = by_hash[h], v
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results-dir", required=True)
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--maximize", default="decode_tps")
    ap.add_argument("--require", action="append", default=[])
    ap.add_argument("--budget", type=float, default=0.25, help="share of the grid's runs the search may use")
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--max-runs", type=int, default=2, help="the search's runs of one configuration at most")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    goal = Goal(args.maximize, 1, tuple(parse_constraint(r) for r in args.require))
    metrics = sorted({goal.objective, *(c.metric for c in goal.constraints)})
    configs, dims = load(args.results_dir, metrics, args.repetitions)
    configs = [c for c in configs if all(m in c.mean for m in metrics)]
    by_hash = {c.trial.config_hash: c for c in configs}
    trials = [c.trial for c in configs]
    feasible = [c for c in configs if truly_meets(goal, c)]
    if not feasible:
        print("no configuration of the grid truly meets the constraints: choose other bounds", file=sys.stderr)
        return 2
    best = max(feasible, key=lambda c: c.mean[goal.objective] * goal.direction)
    budget = max(1, math.floor(args.budget * len(configs)))
    print(f"grid: {len(configs)} configurations over {', '.join(dims)}; {len(feasible)} truly meet "
          f"{', '.join(map(str, goal.constraints))}; true best {best.trial.point} "
          f"{goal.objective} {best.mean[goal.objective]:.2f}; search budget {budget} runs", flush=True)
    wins = {"search": 0, "random": 0, "grid": 0}
    used: list[int] = []
    calib: dict[int, list[bool]] = {}
    for seed in range(args.seeds):
        rng = random.Random(seed)
        search = Search(goal, SearchSettings(seed=seed, budget_trials=budget, max_runs=args.max_runs), dims=dims)
        for t in search.order(trials):
            search.observe(Outcome(t, Status.FINISHED, replay_run(by_hash[t.config_hash], rng, args.repetitions)))
        used.append(search.runs)
        wins["search"] += success(goal, pick(goal, search.measured, by_hash), best, args.repetitions)
        for h, m in search.measured.items():
            for con in goal.constraints:
                e = m.estimate(con.metric, search.cv(con.metric))
                p_up = e.prob_at_least(con.bound)
                if not math.isfinite(p_up):
                    continue
                p = p_up if con.sense > 0 else 1 - p_up
                truth = (by_hash[h].mean[con.metric] - con.bound) * con.sense >= 0
                calib.setdefault(min(int(p * 10), 9), []).append(truth)
        # Random search with the same number of runs, one run per configuration.
        rmeasured: dict[str, Measured] = {}
        for c in rng.sample(configs, min(search.runs, len(configs))):
            rmeasured[c.trial.config_hash] = Measured(c.trial, [replay_run(c, rng, args.repetitions)])
        wins["random"] += success(goal, pick(goal, rmeasured, by_hash), best, args.repetitions)
        gmeasured = {c.trial.config_hash: Measured(c.trial, [replay_run(c, rng, args.repetitions)]) for c in configs}
        wins["grid"] += success(goal, pick(goal, gmeasured, by_hash), best, args.repetitions)
    n = args.seeds
    mean_used = statistics.fmean(used)
    print(f"search: true best (or not significantly worse) in {wins['search']}/{n} seeds, runs used mean "
          f"{mean_used:.1f} (max {max(used)}) = {100 * mean_used / len(configs):.1f} % of the grid's runs")
    print(f"random search, same runs: {wins['random']}/{n}; full grid (100 % of runs): {wins['grid']}/{n}")
    print("calibration: stated P(met) bin -> observed share meeting it (count)")
    rows = []
    for b in sorted(calib):
        hits = calib[b]
        rows.append({"bin": f"{b / 10:.1f}-{(b + 1) / 10:.1f}", "observed": sum(hits) / len(hits), "n": len(hits)})
        print(f"  {rows[-1]['bin']}: {rows[-1]['observed']:.3f} ({len(hits)})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"grid": len(configs), "max_runs": args.max_runs, "dims": dims, "goal": {"maximize": goal.objective,
                       "constraints": [str(c) for c in goal.constraints]}, "seeds": n, "budget_runs": budget,
                       "wins": wins, "runs_used": used, "calibration": rows,
                       "true_best": {"point": best.trial.point, "mean": best.mean}}, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
