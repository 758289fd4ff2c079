"""The serving load generator's own ceiling and cost (jbench/backends/serving/loadgen.py).

The stand-in OpenAI server (tests/fixtures/stub_openai_server.py) runs in a process of its own, so this process's
CPU time (run_level's client_cpu_s) is the generator's and its send function's alone. It answers at once
(zero per-token delay, 8 tokens a request, slots enough for every request: never the queue).

1. The ceiling: requests/s sustained closed loop at 1, 4, 16 in flight (completions / the level's window), and
   open loop (constant arrivals) at increasing offered rates until the dispatch lag p99 exceeds 10 ms or the
   achieved rate (completions between the first and last one) falls under 95 % of the offered rate.
2. The overhead per request at a rate well under the ceiling (a quarter of the highest open-loop rate that held):
   client CPU ms per request, dispatch lag p50 / p99.

Each figure is measured REPS times: median and min..max. The send function is the stub's minimal client
(http.client, a fresh connection per request, the stream parsed line by line), as cheap as a real client gets.

    PYTHONPATH=. .venv/bin/python bench/loadgen_overhead.py [--reps 3] [--json bench/results-loadgen-overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jbench.backends.serving import RequestSpec, arrival_offsets, run_level, with_arrivals  # noqa: E402
from tests.fixtures.stub_openai_server import StubClient, stats  # noqa: E402

TOKENS = 8
LAG_LIMIT_MS = 10.0
ACHIEVED_MIN = 0.95


def start_stub() -> tuple[subprocess.Popen, tuple[str, int]]:
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fixtures" / "stub_openai_server.py"),
                             "--slots", "1024", "--token-delay", "0"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        proc.kill()
        raise SystemExit(f"the stub server did not start: {line!r}")
    return proc, ("127.0.0.1", int(line.split()[1]))


def specs(n: int) -> list[RequestSpec]:
    return [RequestSpec(index=i, input_tokens=16, output_tokens=TOKENS) for i in range(n)]


def achieved_rate(run) -> float:
    done = sorted(s.finished_s for s in run.sent if s.ok)
    return (len(done) - 1) / (done[-1] - done[0]) if len(done) > 1 and done[-1] > done[0] else float("nan")


def closed(client: StubClient, concurrency: int, n: int) -> dict:
    run = run_level(client.send, specs(n), concurrency=concurrency, timeout_s=120)
    failed = sum(not s.ok for s in run.sent)
    return {"rps": n / (run.end_perf - run.start_perf), "failed": failed, **run.overhead}


def open_loop(client: StubClient, rate: float, seconds: float) -> dict:
    n = max(50, int(rate * seconds))
    run = run_level(client.send, with_arrivals(specs(n), arrival_offsets(n, rate, "constant", seed=0)),
                    timeout_s=120, max_in_flight=256)
    failed = sum(not s.ok for s in run.sent)
    return {"offered": rate, "achieved": achieved_rate(run), "failed": failed, **run.overhead}


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def repeat(reps: int, fn: Callable[[], dict], keys: tuple[str, ...]) -> dict:
    runs = [fn() for _ in range(reps)]
    out = {k: summary([r[k] for r in runs]) for k in keys}
    out["failed"] = sum(r["failed"] for r in runs)
    return out


def fmt(s: dict, digits: int = 0) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}..{s['max']:.{digits}f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--closed-requests", type=int, default=400)
    ap.add_argument("--seconds", type=float, default=2.0, help="length of each open-loop level")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    proc, address = start_stub()
    client = StubClient(address)
    result: dict = {"machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
                               f"Python {platform.python_version()}; the stub server shares the cores",
                    "tokens_per_request": TOKENS, "reps": args.reps}
    try:
        run_level(client.send, specs(50), concurrency=4)  # warm-up: imports, first connections
        result["closed"] = {}
        for c in (1, 4, 16):
            r = repeat(args.reps, lambda: closed(client, c, args.closed_requests),
                       ("rps", "client_cpu_per_request_ms", "dispatch_lag_ms_p50", "dispatch_lag_ms_p99"))
            result["closed"][c] = r
            print(f"closed {c:>2} in flight: {fmt(r['rps'])} req/s, CPU {fmt(r['client_cpu_per_request_ms'], 2)} "
                  f"ms/request, failed {r['failed']}", flush=True)

        result["open"] = []
        held = None
        rate = 50.0
        while rate <= 20000:
            r = repeat(args.reps, lambda: open_loop(client, rate, args.seconds),
                       ("achieved", "dispatch_lag_ms_p50", "dispatch_lag_ms_p99", "client_cpu_per_request_ms",
                        "max_in_flight"))
            r["offered"] = rate
            ok = r["dispatch_lag_ms_p99"]["median"] <= LAG_LIMIT_MS and \
                r["achieved"]["median"] >= ACHIEVED_MIN * rate and r["failed"] == 0
            r["held"] = ok
            result["open"].append(r)
            print(f"open {rate:>6.0f}/s: achieved {fmt(r['achieved'])}, lag p50 {fmt(r['dispatch_lag_ms_p50'], 2)} "
                  f"p99 {fmt(r['dispatch_lag_ms_p99'], 2)} ms, CPU {fmt(r['client_cpu_per_request_ms'], 2)} ms/req, "
                  f"in flight {fmt(r['max_in_flight'])}, {'held' if ok else 'NOT held'}", flush=True)
            if not ok:
                break
            held = rate
            rate *= 1.5 if rate >= 200 else 2
        result["open_ceiling_rps"] = held

        if held:
            low = max(10.0, round(held / 4))
            r = repeat(max(args.reps, 5), lambda: open_loop(client, low, max(args.seconds, 3.0)),
                       ("achieved", "dispatch_lag_ms_p50", "dispatch_lag_ms_p99", "client_cpu_per_request_ms"))
            r["offered"] = low
            result["overhead_at"] = r
            print(f"overhead at {low:.0f}/s: CPU {fmt(r['client_cpu_per_request_ms'], 3)} ms/request, lag p50 "
                  f"{fmt(r['dispatch_lag_ms_p50'], 3)} p99 {fmt(r['dispatch_lag_ms_p99'], 3)} ms", flush=True)
        result["stub_stats"] = {k: v for k, v in stats(address).items() if k != "peaks"}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
