"""Sensitivity of nightly regression detection: jbench's history detector vs today's two-sweep test.

1. Noise (`measure`): per configuration, from a real store of several nights of the same sweep (e.g.
   `jbench sweep +experiment=quant_ladder sweep.rerun=true` run N times into one results dir):
     night CV   = sample std / mean of the configuration's nightly means (what the history detector sees),
     within CV  = mean of the runs' per-repetition CV (`<phase>_tps_cv`: what the two-sweep test sees),
   for decode_tps, prefill_tps and decode_tokens_per_joule where the store has it (tokens/J: one energy window
   per run, so no within-run CV and `reps` 1; nights whose runs withheld it are counted in `nights_withheld`).
2. Simulation (`tune`: the detector's settings on a grid; `table`: the default settings at measured and grid CVs): a configuration's nightly history of `--nights` nights; each night
   level_k = 1 x (1 + step_k) x (1 + e_k), e_k ~ N(0, night_extra), and `--reps` repetitions
   level_k x (1 + N(0, within CV)); night_extra is set so that the nightly mean's CV equals the measured night CV
   (night_extra^2 = night CV^2 - within CV^2 / reps, at least 0). The history detector sees the nightly means;
   the two-sweep test (jbench.analysis.regress.check_metric, baseline = the night before: `--baseline last`)
   sees the repetitions of tonight and last night.
     detection within 3 nights: a step of -S starts at night `--step-at`; detected when the verdict on one of
       the step's first three nights (the step night included) is "regression" (history: with its change
       starting within one night of the step);
     false alarms per configuration-night: on histories without a step, the share of (history, night) verdicts
       that are regression or improvement, over every night that has a verdict.
   Binomial 95 % intervals: Wilson.
3. `render`: the markdown table of docs/PERFORMANCE.md from `table` outputs; `speed`: history() over 10k runs.

The exact commands behind the published figures are in docs/PERFORMANCE.md ("Regression detection over history").
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jbench.analysis.history import DEFAULT_SETTINGS, REGRESSION, IMPROVEMENT, DetectorSettings, judge  # noqa: E402
from jbench.analysis.regress import check_metric  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "regress-sensitivity"


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return math.nan, math.nan
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


# --------------------------------------------------------------------------------------------
# 1. Noise measured in a real store


def measure(store: str, experiment: str, *, source: str | None = None, others: bool = True) -> dict:
    """source: what the noise was measured on, shown beside each configuration in the table (e.g. "H100 CUDA")."""
    from jbench.tracking.reader import runs_frame

    df = runs_frame(f"sqlite:///{Path(store).resolve()}/mlflow.db", [experiment])
    df = df[df["status"] == "FINISHED"]
    out = {"store": str(store), "experiment": experiment, "sweeps": int(df["tags.jbench.sweep_id"].nunique()),
           "configurations": {}, "too_few_nights": []}
    if source:
        out["source"] = source
    for h, g in df.groupby("tags.jbench.config_hash"):
        label = str(g["tags.jbench.trial_label"].iloc[-1]) if "tags.jbench.trial_label" in g else str(h)
        entry = {"config_hash": h, "nights": int(g["tags.jbench.sweep_id"].nunique())}
        for metric, within in (("decode_tps", "decode_tps_cv"), ("prefill_tps", "prefill_tps_cv"),
                               ("decode_tokens_per_joule", None)):
            col = f"metrics.{metric}"
            if col not in g or g[col].isna().all():
                continue
            nightly = g.groupby("tags.jbench.sweep_id")[col].mean().dropna()
            if len(nightly) < 3:
                continue
            e = {"night_cv": float(nightly.std(ddof=1) / nightly.mean()), "nights": int(len(nightly)),
                 "mean": float(nightly.mean())}
            if within and f"metrics.{within}" in g:
                e["within_cv"] = float(g[f"metrics.{within}"].mean())
            if metric == "decode_tokens_per_joule":
                # One energy window (the energy pass) per run: one tokens/J value a night, no repetitions, so the
                # two-sweep test has no samples to test it with. Runs whose energy pass ran at another speed than
                # the speed pass publish NaN (energy.speed_tolerance): those nights are counted, not filled in.
                e["reps"] = 1
                e["nights_withheld"] = int(g.groupby("tags.jbench.sweep_id")[col].apply(lambda v: v.isna().all()).sum())
            else:
                reps = g.get(f"metrics.{metric.split('_')[0]}_repetitions")
                if reps is not None and reps.notna().any():
                    e["reps"] = int(reps.dropna().iloc[0])
            entry[metric] = e
        if len(entry) > 2:
            out["configurations"][label] = entry
        else:  # a configuration of one or two sweeps (e.g. a first, larger night) has no night-to-night CV
            out["too_few_nights"].append({"label": label, "nights": entry["nights"]})
    out["other_sources"] = other_sources() if others else {}
    return out


def other_sources() -> dict:
    """Run-to-run CVs of decode tok/s already measured by other benches of this repository (runs minutes apart,
    not nights: a lower bound on nightly noise on those machines)."""
    here = Path(__file__).resolve().parent
    out = {}
    for f in sorted((here / "results" / "sampler-perturbation").glob("*.json")):
        d = json.loads(f.read_text())
        vals = np.array(d.get("decode_tps_without") or [], dtype=float)
        if vals.size >= 3:
            out[f"sampler-perturbation/{f.name} ({d.get('workload', '')})"] = {
                "metric": "decode_tps", "runs": int(vals.size), "cv": float(vals.std(ddof=1) / vals.mean())}
    nvml = here / "results-nvml-energy-h200.json"
    if nvml.exists():
        runs = json.loads(nvml.read_text())["runs"]
        for phase in ("decode", "prefill"):
            vals = np.array([r["tok_s"][phase] for r in runs], dtype=float)
            out[f"results-nvml-energy-h200.json (H200 CUDA, {phase})"] = {
                "metric": f"{phase}_tps", "runs": int(vals.size), "cv": float(vals.std(ddof=1) / vals.mean())}
    return out


# --------------------------------------------------------------------------------------------
# 2. Simulation


def _history(rng, nights: int, reps: int, night_cv: float, within_cv: float, step: float, step_at: int):
    extra = math.sqrt(max(0.0, night_cv ** 2 - within_cv ** 2 / reps))
    level = 1.0 + extra * rng.standard_normal(nights)
    if step:
        level[step_at:] *= 1.0 + step
    samples = level[:, None] * (1.0 + within_cv * rng.standard_normal((nights, reps)))
    return samples.mean(axis=1), samples


def run_cell(settings: DetectorSettings, *, night_cv: float, within_cv: float, step: float, histories: int,
             nights: int, reps: int, step_at: int, seed: int, pairwise: bool = True) -> dict:
    """Detection (step != 0) or false alarms (step == 0) for both detectors."""
    rng = np.random.default_rng(seed)
    hist_hits = pair_hits = 0
    hist_fa = pair_fa = hist_n = pair_n = 0
    for _ in range(histories):
        means, samples = _history(rng, nights, reps, night_cv, within_cv, step, step_at)
        if step:
            found = False
            for k in range(step_at + 1, step_at + 4):  # verdicts on the step's nights 1, 2, 3
                verdict, changes, _ = judge(means[:k], settings)
                if verdict == REGRESSION and abs(changes[-1].index - step_at) <= 1:
                    found = True
                    break
            hist_hits += found
            if pairwise:
                pair_hits += any(check_metric(samples[k - 1], samples[k], "x").verdict == REGRESSION
                                 for k in range(step_at, step_at + 3))
        else:
            for k in range(settings.min_nights, nights + 1):
                verdict, _, _ = judge(means[:k], settings)
                hist_n += 1
                hist_fa += verdict in (REGRESSION, IMPROVEMENT)
            if pairwise:
                for k in range(1, nights):
                    v = check_metric(samples[k - 1], samples[k], "x").verdict
                    pair_n += 1
                    pair_fa += v in (REGRESSION, IMPROVEMENT)
    if step:
        out = {"history": {"k": hist_hits, "n": histories}}
        if pairwise:
            out["pairwise"] = {"k": pair_hits, "n": histories}
    else:
        out = {"history": {"k": hist_fa, "n": hist_n}}
        if pairwise:
            out["pairwise"] = {"k": pair_fa, "n": pair_n}
    for v in out.values():
        v["rate"] = v["k"] / v["n"] if v["n"] else math.nan
        v["ci95"] = wilson(v["k"], v["n"])
    return out


def speed(rounds: int) -> dict:
    """Seconds of `history(df)` (series, detection, verdicts) over 96 configurations x 104 nightly sweeps of one
    unit, decode and prefill (9,984 trial runs, as bench/report_regress.py's store), built in memory."""
    import pandas as pd

    from jbench.analysis.history import history

    rng = np.random.default_rng(0)
    t0 = pd.Timestamp("2026-01-01T02:00:00Z")
    rows = [{"run_id": f"{n}-{h}", "status": "FINISHED", "start_time": t0 + pd.Timedelta(days=n, minutes=h),
             "tags.jbench.kind": "trial", "tags.jbench.sweep_id": f"s{n:03d}", "tags.jbench.config_hash": f"h{h}",
             "tags.device.name": "orin", "metrics.decode_tps": 40 * (1 + 0.005 * rng.standard_normal()),
             "metrics.prefill_tps": 800 * (1 + 0.005 * rng.standard_normal())} for n in range(104) for h in range(96)]
    df = pd.DataFrame(rows)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        rep = history(df)
        times.append(time.perf_counter() - t)
    return {"runs": len(df), "series": len(rep.results), "seconds": [round(x, 2) for x in times],
            "counts": rep.counts()}


def render(files: list[str]) -> str:
    def rate(v: dict, digits: int = 1) -> str:
        lo, hi = v["ci95"]
        return f"{v['rate'] * 100:.{digits}f} % ({lo * 100:.{digits}f}–{hi * 100:.{digits}f})"

    lines = ["| noise source | metric | night CV | step | found within 3 nights: history | two-sweep | "
             "false alarms / configuration-night: history | two-sweep |", "|---|---|---:|---:|---|---|---|---|"]
    cells = [c for f in files for c in json.loads(Path(f).read_text())["cells"]]
    cells.sort(key=lambda c: (c["source"] != "CV grid", c["night_cv"]))
    for c in cells:
        fa = c["false_alarms"]
        for key in sorted(k for k in c if k.startswith("detect_")):
            step = key.split("_")[1].replace("pct", " %")
            lines.append(f"| {c['source']} | {c['metric']} | {c['night_cv'] * 100:.2f} % | −{step} | "
                         f"{rate(c[key]['history'])} | {rate(c[key]['pairwise'])} | {rate(fa['history'], 2)} | "
                         f"{rate(fa['pairwise'], 2)} |")
    return "\n".join(lines)


def _pct(v: dict) -> str:
    lo, hi = v["ci95"]
    return f"{v['rate'] * 100:.1f} % ({lo * 100:.1f}–{hi * 100:.1f})"


def _grid() -> list[DetectorSettings]:
    out = []
    for penalty in (1.0, 2.0):
        for min_size in (1, 2):
            for alpha in (0.01, 0.001, 0.0001):
                out.append(replace(DEFAULT_SETTINGS, penalty=penalty, min_size=min_size, alpha=alpha))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--store", required=True)
    m.add_argument("--experiment", default="quant_ladder")
    m.add_argument("--out", default=str(OUT / "noise.json"))
    m.add_argument("--source", help="what the noise was measured on, shown in the table (e.g. 'H100 CUDA')")
    m.add_argument("--no-other-sources", action="store_true",
                   help="leave out the run-to-run CVs of other benches (other_sources)")
    rd = sub.add_parser("render", help="the markdown table of docs/PERFORMANCE.md from table JSON files")
    rd.add_argument("files", nargs="+")
    sp = sub.add_parser("speed", help="history() over a synthetic run table of 96 configurations x 104 nights")
    sp.add_argument("--rounds", type=int, default=3)
    for name in ("tune", "table"):
        s = sub.add_parser(name)
        s.add_argument("--night-cv", type=float, nargs="*", help="CV levels (default: from --noise)")
        s.add_argument("--within-cv", type=float, default=None)
        s.add_argument("--noise", default=str(OUT / "noise.json"))
        s.add_argument("--histories", type=int, default=500)
        s.add_argument("--nights", type=int, default=30)
        s.add_argument("--step-at", type=int, default=20)
        s.add_argument("--reps", type=int, default=10)
        s.add_argument("--seed", type=int, default=15)
        s.add_argument("--out", default=str(OUT / f"{name}.json"))
    a = ap.parse_args()
    if a.cmd == "measure":
        res = measure(a.store, a.experiment, source=a.source, others=not a.no_other_sources)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2))
        print(json.dumps(res, indent=2))
        return
    if a.cmd == "render":
        print(render(a.files))
        return
    if a.cmd == "speed":
        print(json.dumps(speed(a.rounds), indent=2))
        return
    t0 = time.time()
    common = dict(histories=a.histories, nights=a.nights, reps=a.reps, step_at=a.step_at)
    # Paths inside the checkout are recorded relative to it: the results are read from a clone anywhere.
    root = OUT.parents[2]
    args = {k: (str(Path(v).resolve().relative_to(root)) if isinstance(v, str) and Path(v).resolve().is_relative_to(root)
                else v) for k, v in vars(a).items()}
    results: dict = {"machine": platform.node(), "args": args, "cells": []}
    if a.cmd == "tune":
        cv = (a.night_cv or [0.01])[0]
        within = a.within_cv if a.within_cv is not None else cv
        for st in _grid():
            fa = run_cell(st, night_cv=cv, within_cv=within, step=0.0, seed=a.seed, pairwise=False, **common)
            det = run_cell(st, night_cv=cv, within_cv=within, step=-0.02, seed=a.seed + 1, pairwise=False, **common)
            cell = {"settings": asdict(st), "night_cv": cv, "false_alarms": fa["history"],
                    "detect_2pct": det["history"]}
            results["cells"].append(cell)
            print(f"pen {st.penalty:g} min_size {st.min_size} alpha {st.alpha:g} floor {st.min_effect:g}: "
                  f"FA {_pct(fa['history'])}  2 % step {_pct(det['history'])}", flush=True)
    else:
        noise = json.loads(Path(a.noise).read_text()) if Path(a.noise).exists() else {"configurations": {}}
        levels = []  # (source, metric, night cv, within cv, repetitions a night)
        where = noise.get("source", "measured")
        for label, e in noise["configurations"].items():
            for metric in ("decode_tps", "decode_tokens_per_joule"):
                if metric in e:
                    # tokens/J: one value a night (reps 1 in the noise file): the nightly value is that value,
                    # and the two-sweep test sees 1 vs 1 samples (insufficient data, as `jbench regress` answers).
                    reps = e[metric]["reps"] if metric == "decode_tokens_per_joule" else a.reps
                    levels.append((f"{label} ({where})", metric, e[metric]["night_cv"],
                                   e[metric].get("within_cv", e[metric]["night_cv"]), reps))
        for source, e in noise.get("other_sources", {}).items():
            if e["metric"] == "decode_tps":
                levels.append((f"{source} (runs minutes apart)", "decode_tps", e["cv"], e["cv"], a.reps))
        for cv in a.night_cv or []:
            levels.append(("CV grid", "any", cv, a.within_cv if a.within_cv is not None else cv, a.reps))
        for source, metric, cv, within, reps in levels:
            steps = {"decode_tps": (-0.02, -0.05), "decode_tokens_per_joule": (-0.03,), "any": (-0.02, -0.03, -0.05)}
            cell_common = {**common, "reps": reps}
            cell = {"source": source, "metric": metric, "night_cv": cv, "within_cv": within, "reps": reps,
                    "false_alarms": run_cell(DEFAULT_SETTINGS, night_cv=cv, within_cv=within, step=0.0,
                                             seed=a.seed, **cell_common)}
            for st in steps[metric]:
                cell[f"detect_{abs(st) * 100:g}pct"] = run_cell(DEFAULT_SETTINGS, night_cv=cv, within_cv=within,
                                                                step=st, seed=a.seed + 1, **cell_common)
            results["cells"].append(cell)
            print(f"{source} {metric} night CV {cv * 100:.2f} % within {within * 100:.2f} %: "
                  + "; ".join(f"{k}: history {_pct(v['history'])} pairwise {_pct(v['pairwise'])}"
                              for k, v in cell.items() if isinstance(v, dict)), flush=True)
        results["settings"] = asdict(DEFAULT_SETTINGS)
    results["elapsed_s"] = round(time.time() - t0, 1)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=2, default=str))
    print(f"{results['elapsed_s']} s -> {a.out}")


if __name__ == "__main__":
    main()
