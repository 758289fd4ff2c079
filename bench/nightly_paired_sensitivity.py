"""How sensitive the nightly's same-night control is, from real nights (issue 26 part 3).

Reads a store written by bench/nightly_paired_device.sh (nights of `jbench nightly` on one unit whose reference is a
copy of the build under test, so every paired ratio is noise) and, per configuration and rate:
- the night-to-night CV of the absolute series (the build under test's night mean) beside that of the paired ratio;
- false alarms: each night judged as the nightly judges it (jbench.analysis.paired.trial_ratio, the trial as the
  unit, the trial-to-trial spread pooled with up to 7 earlier nights) against the per-repetition Welch test
  (night_ratio) the control used before;
- detection: the build under test's repetitions of every night from night s on scaled by (1 - step), the nights
  judged again; a step is found within three nights when one of nights s, s+1, s+2 calls it a regression; the rate
  over every start night s with two nights after it; and the smallest step found at >= 90 %.
The injected step uses the measured repetitions themselves, so the noise is the GPU's, not a model of it.

    .venv/bin/python bench/nightly_paired_sensitivity.py STORE.db [--out bench/results-nightly-paired-h100.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jbench.analysis.paired import night_ratio, trial_ratio  # noqa: E402

ALPHA, MIN_EFFECT, EARLIER = 0.01, 0.01, 7
DIRECTION = +1  # tokens per second: higher is better
STEPS = [0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05]


def load(db: str, metric: str) -> dict[str, list[dict]]:
    """{config hash: [night: {"id", "T": [trial reps], "R": [trial reps]}] in night order}."""
    con = sqlite3.connect(db)
    tags: dict[str, dict[str, str]] = defaultdict(dict)
    for run, key, value in con.execute("select run_uuid, key, value from tags where key in "
                                       "('jbench.config_hash', 'jbench.sweep_id', 'jbench.kind')"):
        tags[run][key] = value
    status = dict(con.execute("select run_uuid, status from runs"))
    start = dict(con.execute("select run_uuid, start_time from runs"))
    reps: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for run, step, value in con.execute("select run_uuid, step, value from metrics where key = ?", (f"{metric}_rep",)):
        reps[run].append((step, value))
    nights: dict[str, dict[str, dict]] = defaultdict(dict)
    order: dict[str, int] = {}
    for run, t in tags.items():
        h, night = t.get("jbench.config_hash"), t.get("jbench.sweep_id")
        if not h or not night or t.get("jbench.kind", "trial") != "trial" or status.get(run) != "FINISHED":
            continue
        if run not in reps:
            continue
        base, role = (h[:-len("-reference")], "R") if h.endswith("-reference") else (h, "T")
        entry = nights[base].setdefault(night, {"id": night, "T": [], "R": []})
        entry[role].append([v for _, v in sorted(reps[run])])
        order[night] = min(order.get(night, 1 << 62), start[run])
    return {h: sorted(n.values(), key=lambda e: order[e["id"]]) for h, n in nights.items()}


def _log_means(trials: list[list[float]]) -> list[float]:
    return [statistics.fmean(math.log(v) for v in t) for t in trials if t]


def judge(nights: list[dict], i: int, step_from: int | None, step: float) -> tuple[str, str]:
    """(trial-level verdict, per-repetition verdict) of night i, the test build's rates scaled from night
    `step_from` on."""
    def test(n: int) -> list[list[float]]:
        scale = (1 - step) if step_from is not None and n >= step_from else 1.0
        return [[v * scale for v in t] for t in nights[n]["T"]]

    earlier = []
    for n in range(max(0, i - EARLIER), i):
        earlier += [g for g in (_log_means(test(n)), _log_means(nights[n]["R"])) if len(g) >= 2]
    tr = trial_ratio(test(i), nights[i]["R"], DIRECTION, earlier=earlier, alpha=ALPHA, min_effect=MIN_EFFECT)
    rep = night_ratio([v for t in test(i) for v in t], [v for t in nights[i]["R"] for v in t], DIRECTION,
                      alpha=ALPHA, min_effect=MIN_EFFECT)
    return tr.verdict, rep.verdict


def analyse(nights: list[dict]) -> dict:
    n = len(nights)
    t_means = [math.exp(statistics.fmean(_log_means(e["T"]))) for e in nights]
    ratios = [math.exp(statistics.fmean(_log_means(e["T"])) - statistics.fmean(_log_means(e["R"]))) for e in nights]
    judged = range(1, n)  # night 0 has no earlier night to pool from
    alarms = [judge(nights, i, None, 0.0) for i in judged]
    out = {"nights": n, "trials_per_build": statistics.median(len(e["T"]) for e in nights),
           "repetitions_per_trial": statistics.median(len(t) for e in nights for t in e["T"]),
           "cv_absolute_pct": 100 * statistics.stdev(t_means) / statistics.fmean(t_means),
           "cv_paired_ratio_pct": 100 * statistics.stdev(ratios) / statistics.fmean(ratios),
           "false_alarms_trial_level": sum(a != "no change" for a, _ in alarms),
           "false_alarms_per_repetition": sum(b != "no change" for _, b in alarms),
           "nights_judged": len(alarms), "detection": {}}
    starts = [s for s in range(1, n - 2)]
    for step in STEPS:
        found = first = 0
        for s in starts:
            verdicts = [judge(nights, i, s, step)[0] for i in (s, s + 1, s + 2)]
            found += any(v == "regression" for v in verdicts)
            first += verdicts[0] == "regression"
        out["detection"][f"{step:.3f}"] = {"within_three_nights": found / len(starts) if starts else math.nan,
                                            "first_night": first / len(starts) if starts else math.nan,
                                            "histories": len(starts)}
    at90 = [s for s in STEPS if out["detection"][f"{s:.3f}"]["within_three_nights"] >= 0.9]
    out["smallest_step_found_at_90pct"] = min(at90) if at90 else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", help="the nightly store's mlflow.db")
    ap.add_argument("--metric", default="decode_tps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {"store": args.store, "metric": args.metric, "alpha": ALPHA, "min_effect": MIN_EFFECT,
              "earlier_nights_pooled": EARLIER, "configurations": {}}
    for h, nights in sorted(load(args.store, args.metric).items()):
        if len(nights) < 4:
            continue
        r = result["configurations"][h] = analyse(nights)
        d2 = r["detection"]["0.020"]
        print(f"{h}: {r['nights']} nights, {r['trials_per_build']:g} trials x {r['repetitions_per_trial']:g} reps; "
              f"CV absolute {r['cv_absolute_pct']:.2f} %, paired ratio {r['cv_paired_ratio_pct']:.2f} %; "
              f"false alarms {r['false_alarms_trial_level']}/{r['nights_judged']} (per-repetition test "
              f"{r['false_alarms_per_repetition']}); 2 % step found within 3 nights {100 * d2['within_three_nights']:.0f} % "
              f"(first night {100 * d2['first_night']:.0f} %, {d2['histories']} histories); smallest step at 90 %: "
              f"{r['smallest_step_found_at_90pct']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
