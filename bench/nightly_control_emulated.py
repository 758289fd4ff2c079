"""The nightly's same-night control on real llama.cpp builds: a slower build fails its first night; a slower
environment is not blamed on the build.

Four nights of `jbench nightly cpu_host` (`jbench.sweeps.nightly.run_nightly`, what the command runs; its exit code
is the command's) on this machine as a one-unit class, the embedded default model (Gemma 3 270M Q4_0), one small
configuration (32 prompt + 16 generated tokens, one thread, six rounds: T R R T T R R T T R R T, so that load that
comes and goes within a night falls on both builds), telemetry, thermal gate, quality and the re-measuring
confirmation off. Both builds are real: the cached `jbench setup` build and the SIMD-less build
of the same commit from its sources (tests/nosimd_build.py: x86-64's baseline SSE2 only, about 5x slower).

  1. the cached build, `--promote-reference`: no control yet (no accepted reference); it becomes the reference.
  2. the same build under test beside the reference: the pair holds (exit 0). Its repetitions come from night 1's
     within-night spread (the noise budget, farm.target_interval_pct).
  3. an environment change: the same build again, while one busy-looping process is pinned to each core of the
     machine for the whole night (background load that the fingerprint does not see). Both builds slow down; the
     absolute gate (against night 2) alarms; the control reports an environment change (the reference moved against
     its night 2, the pair holds), not the build's regression.
  4. the SIMD-less build under test: it fails on its first night on the paired ratio (exit 1).

Per night: the exit code, the control's verdicts (paired ratio test/reference with its (1 - alpha) interval, p, the
reference's shift against its previous control night), the repetitions per build the budget chose and why, the
absolute report's alarms and how the control settled them, the load average around the night.

    PYTHONPATH=. .venv/bin/python bench/nightly_control_emulated.py [--out bench/results-nightly-control.json]
        [--work DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.local_class import local_class_conf  # noqa: E402

CLASS = "cpu_host"
EXPERIMENT = "control_bench"
COMMON = ["telemetry.source=none", "thermal.start_below_c=null", "quality.enabled=false"]


def _conf(work: Path, rounds: int) -> Path:
    # One thread: a share of one core, so that a busy process beside it slows it by a clear amount.
    return local_class_conf(work / "conf", CLASS, EXPERIMENT, "one small configuration, the control's figures",
                            rounds=rounds, backend={"n_prompt": 32, "n_gen": 16, "repetitions": 6, "threads": 1})


def _build_dir(work: Path, name: str, bin_dir: str) -> str:
    d = work / "builds" / name  # one directory per build: the reference is never replaced in place
    d.mkdir(parents=True)
    (d / "llama-bench").symlink_to(Path(bin_dir) / "llama-bench")
    return str(d)


def _hogs() -> list[subprocess.Popen]:
    """One busy-looping process pinned to each core this process may use: the environment change."""
    procs = []
    for cpu in sorted(os.sched_getaffinity(0)):
        procs.append(subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", "while True: pass"]))
    return procs


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=10)


def _num(x: float) -> Any:
    return float(f"{x:.6g}") if isinstance(x, float) and math.isfinite(x) else None  # p-values stay, however small


def _verdicts(result: Any) -> list[dict]:
    out = []
    for v in result.control_verdicts:
        p, s = v.paired, v.shift
        out.append({
            "unit": v.unit, "metric": v.metric, "verdict": v.verdict, "reason": v.reason,
            "paired_ratio": _num(p.ratio), "ratio_low": _num(p.low), "ratio_high": _num(p.high),
            "p_value": _num(p.p_value), "repetitions_test": p.n_test, "repetitions_reference": p.n_reference,
            "within_night_spread": _num(p.cv), "paired_verdict": p.verdict,
            "reference_shift": None if s is None else {
                "previous_sweep": s.previous_sweep, "ratio": _num(s.ratio), "low": _num(s.low), "high": _num(s.high),
                "p_value": _num(s.p_value), "moved": s.moved, "reason": s.reason},
            "text": v.describe()})
    return out


def _absolute(result: Any) -> dict:
    report = result.regress
    if report is None:
        return {"mode": result.mode, "alarms": [], "no_verdict_reason": result.no_verdict_reason}
    alarms = []
    for r in report.alarms():
        alarms.append({"what": getattr(r, "label", "") or getattr(getattr(r, "series", None), "label", ""),
                       "confirmed": r.confirmed, "confirmation": r.confirmation})
    return {"mode": result.mode, "exit_code_alone": int(report.exit_code), "alarms": alarms,
            "no_verdict_reason": result.no_verdict_reason}


class _Load:
    """The machine's 1-minute load average every 5 s while a night runs (other processes share this machine)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(5)

    def __enter__(self) -> "_Load":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def night(n: int, what: str, build: str, conf: Path, results: Path, *, promote: bool = False,
          hog: bool = False) -> dict:
    from jbench.sweeps.nightly import run_nightly

    procs = _hogs() if hog else []
    started = time.perf_counter()
    try:
        with _Load() as load:
            result = run_nightly(CLASS, experiment=EXPERIMENT, config_dirs=[conf], results_dir=results,
                                 overrides=[*COMMON, f"backend.binary_dir={build}"], confirm=False,
                                 promote_reference=promote)
    finally:
        _stop(procs)
    wall = time.perf_counter() - started
    row = {
        "night": n, "what": what, "build_under_test": build, "cpu_hogs": len(procs),
        "exit_code": int(result.exit_code), "verdict": result.verdict, "sweep_id": result.sweep_id,
        "control": result.control.tag if result.control else None,
        "reference": result.control.reference.binary_dir if result.control and result.control.reference else None,
        "repetitions": {h: {"per_build": b.repetitions, "from_spread": b.chosen, "reason": b.reason,
                            "half_width": _num(b.half_width)} for h, b in result.budgets.items()},
        "control_verdicts": _verdicts(result), "absolute": _absolute(result),
        "promoted": result.promoted.describe() if result.promoted else None,
        "failed_trials": len(result.failed), "notes": result.notes,
        "wall_s": round(wall, 1),
        "loadavg_1m": {"mean": round(sum(load.samples) / len(load.samples), 2), "max": round(max(load.samples), 2),
                       "samples": len(load.samples)}}
    decode = next((v for v in row["control_verdicts"] if v["metric"] == "decode_tps"), None)
    print(f"night {n} ({what}): exit {row['exit_code']} ({row['verdict']}), {wall:.0f} s"
          + (f"; decode: {decode['text']}" if decode else ""), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results-nightly-control.json"))
    ap.add_argument("--work", default=None, help="working directory (default: a temporary one, removed after)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (its MLflow store)")
    ap.add_argument("--rounds", type=int, default=6, help="sweep.rounds of the configuration (even: T R R T ...)")
    args = ap.parse_args()

    from jbench.models.provision import active_build
    from tests.nosimd_build import ensure_nosimd_build

    build = active_build()
    if build is None:
        sys.exit("no llama.cpp build: run `jbench setup` first")
    nosimd = str(ensure_nosimd_build(build["build_commit"]))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="jbench-control-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        conf, results = _conf(work, args.rounds), work / "results"
        good, slow = _build_dir(work, "b-good", build["bin_dir"]), _build_dir(work, "b-nosimd", nosimd)
        nights = [
            night(1, "the cached build, promoted to the reference", good, conf, results, promote=True),
            night(2, "the cached build beside the reference (no change)", good, conf, results),
            night(3, "environment change: a busy process pinned to each core, same build", good, conf, results,
                  hog=True),
            night(4, "the SIMD-less build under test (a slower build)", slow, conf, results),
        ]
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    out = {
        "what": "the nightly's same-night control on real llama.cpp builds (bench/nightly_control_emulated.py)",
        "machine": {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "platform": platform.platform(),
                    "python": platform.python_version()},
        "llama_cpp_commit": build["build_commit"], "model": "gemma3_270m Q4_0 (the embedded default)",
        "configuration": {"n_prompt": 32, "n_gen": 16, "threads": 1, "rounds": args.rounds, "configured_repetitions": 6,
                          "target_interval_pct": 1.0, "alpha": 0.01, "min_effect": 0.01},
        "nights": nights, "total_wall_s": round(time.perf_counter() - started, 1)}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out} ({out['total_wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
