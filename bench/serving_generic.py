"""The openai backend (llama-server declared as any OpenAI-compatible server, conf/backend/llama_server.yaml) against the
llama.cpp backend's own serving scenario, on the same real llama-server (docs/PERFORMANCE.md, "Serving: the generic
backend against the llama.cpp backend").

    PYTHONPATH=. .venv/bin/python bench/serving_generic.py [--pairs 4] [--levels 1,2] [--json out.json]

Alternating pairs (llamacpp, openai) of the same trial: the embedded default's llama-server (`jbench setup`'s build)
and the bundled Q4_0 model, one thread, 2 slots, 16-token prompts, 16 output tokens, 8 requests per level. Per
level and backend: the per-request TPOT p50 and the output tok/s of each run; then the two backends' difference with
a Welch interval over the runs, and the same-backend run-to-run spread (the noise the difference is judged by).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

from jbench.analysis.stats import welch_interval
from jbench.backends.base import backend_class
from jbench.device.local import LocalConnection
from jbench.models.provision import active_build
from jbench.sweeps.plan import plan


def tpot_p50_ms(level) -> float:
    return 1000 * statistics.median((o.e2e_s - o.ttft_s) / (o.output_tokens - 1) for o in level.outcomes if o.ok)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--levels", default="1,2")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    build = active_build()
    if not build:
        print("no llama.cpp build: run `jbench setup` first", file=sys.stderr)
        return 2
    common = ["+experiment=serving", "model.quant=Q4_0", "serving.slots=2", f"serving.levels=[{args.levels}]",
              "serving.requests_per_level=8", "serving.input.kind=fixed", "serving.input.mean=16",
              "serving.output.mean=16"]
    plans = {"llamacpp": plan([*common, "backend.threads=1"], use_grid=False),
             "openai": plan([*common, "backend=llama_server", f"backend.vars.server={build['bin_dir']}/llama-server",
                             "+backend.env.LLAMA_ARG_THREADS=1"], use_grid=False)}
    for p in plans.values():
        if p.problems:
            print("\n".join(p.problems), file=sys.stderr)
            return 2
    log = logging.getLogger("bench.serving_generic")
    runs: dict[str, list[dict]] = {"llamacpp": [], "openai": []}
    with LocalConnection() as conn:
        for i in range(args.pairs):
            for name, p in plans.items():
                trial = p.trials[0]
                t0 = time.monotonic()
                result = backend_class(trial.cfg.backend.name)(trial.cfg.backend).run(trial, conn, log)
                levels = result.serving_levels
                row = {"tpot_p50_ms": [tpot_p50_ms(lv) for lv in levels],
                       "output_tps": [sum(o.output_tokens for o in lv.outcomes if o.ok) / lv.wall_s for lv in levels],
                       "failed": sum(1 for lv in levels for o in lv.outcomes if not o.ok),
                       "wall_s": time.monotonic() - t0}
                runs[name].append(row)
                print(f"pair {i + 1} {name:8s} TPOT p50 {['%.2f' % v for v in row['tpot_p50_ms']]} ms, output "
                      f"{['%.1f' % v for v in row['output_tps']]} tok/s, {row['failed']} failed", flush=True)
    summary = []
    for li, load in enumerate(args.levels.split(",")):
        for metric in ("tpot_p50_ms", "output_tps"):
            a = [r[metric][li] for r in runs["llamacpp"]]
            b = [r[metric][li] for r in runs["openai"]]
            ci = welch_interval(a, b, 0.95)
            ref = statistics.fmean(a)
            entry = {"load": float(load), "metric": metric, "llamacpp_mean": ref, "llamacpp_sd": statistics.stdev(a),
                     "openai_mean": statistics.fmean(b), "openai_sd": statistics.stdev(b),
                     "diff_pct": 100 * ci.diff / ref, "ci_low_pct": 100 * ci.low / ref,
                     "ci_high_pct": 100 * ci.high / ref}
            summary.append(entry)
            print(f"load {load}: {metric}: llamacpp {entry['llamacpp_mean']:.2f} ± {entry['llamacpp_sd']:.2f}, openai "
                  f"{entry['openai_mean']:.2f} ± {entry['openai_sd']:.2f}; openai - llamacpp {entry['diff_pct']:+.1f} % "
                  f"(95 % CI {entry['ci_low_pct']:+.1f} … {entry['ci_high_pct']:+.1f} %)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"runs": runs, "summary": summary, "pairs": args.pairs}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
