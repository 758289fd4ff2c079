"""Shared by the whole-process benchmarks (dry_run.py, resume.py, overhead.py): run commands as a
user does, each in a fresh process, in alternating pairs, and summarise with t intervals.

Wall time is perf_counter around the child's whole life (interpreter start, imports, work, exit).
CPU time is user + system of the child and every descendant it waited for, from
resource.getrusage(RUSAGE_CHILDREN) before and after (this process runs one child at a time).
"""

from __future__ import annotations

import math
import os
import platform
import resource
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Sample:
    wall_s: float
    cpu_s: float
    cpu_pressure: Optional[float] = None  # /proc/pressure/cpu "some" avg10 (%) when the run started


def cpu_pressure_avg10() -> Optional[float]:
    """The share of the last 10 s in which some task waited for a CPU (%), None where unknown."""
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0].split()
        return float(dict(kv.split("=") for kv in some[1:])["avg10"])
    except (OSError, IndexError, KeyError, ValueError):
        return None


def exit_cleanly_on_sigterm() -> None:
    """SIGTERM (a killed benchmark) unwinds like an exception, so temporary directories are removed."""
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_once(argv: Sequence[str], env: Optional[dict] = None, cwd: Optional[Path] = None,
             check: bool = True) -> Sample:
    """One fresh process; output discarded. Raises on a non-zero exit when check."""
    pressure = cpu_pressure_avg10()
    cpu0 = _children_cpu()
    t0 = time.perf_counter()
    proc = subprocess.run(list(argv), env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    cpu = _children_cpu() - cpu0
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return Sample(wall, cpu, pressure)


def run_many(commands: Sequence[Sequence[str]], env: Optional[dict] = None) -> Sample:
    """Commands back to back, as one sample (the bare llama-bench side of overhead.py)."""
    total = Sample(0.0, 0.0, cpu_pressure_avg10())
    for argv in commands:
        s = run_once(argv, env=env)
        total.wall_s += s.wall_s
        total.cpu_s += s.cpu_s
    return total


def alternate(a: Callable[[], Sample], b: Callable[[], Sample], pairs: int,
              on_pair: Optional[Callable[[int, Sample, Sample], None]] = None) -> tuple[list[Sample], list[Sample]]:
    """`pairs` (a, b) pairs; a runs first in even pairs, b first in odd ones, so slow drift of the
    machine (page cache, other jobs) does not favour one side."""
    sa, sb = [], []
    for i in range(pairs):
        if i % 2 == 0:
            x = a()
            y = b()
        else:
            y = b()
            x = a()
        sa.append(x)
        sb.append(y)
        if on_pair:
            on_pair(i, x, y)
    return sa, sb


def t_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): Student t interval of the mean."""
    from scipy import stats

    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return mean, math.nan, math.nan
    sem = statistics.stdev(values) / math.sqrt(n)
    if sem == 0:
        return mean, mean, mean
    low, high = stats.t.interval(confidence, n - 1, loc=mean, scale=sem)
    return mean, float(low), float(high)


def describe(values: Sequence[float]) -> dict:
    """median, spread (min, max, IQR) and the mean's 95 % t interval, rounded for the JSON files."""
    vals = sorted(values)
    mean, low, high = t_interval(vals)
    q = statistics.quantiles(vals, n=4) if len(vals) >= 2 else [vals[0]] * 3
    return {"n": len(vals), "median": round(statistics.median(vals), 4), "min": round(vals[0], 4),
            "max": round(vals[-1], 4), "iqr": [round(q[0], 4), round(q[2], 4)], "mean": round(mean, 4),
            "ci95": [round(low, 4), round(high, 4)]}


def raw(a: Sequence[Sample], b: Sequence[Sample], names: tuple[str, str]) -> list[dict]:
    """Every pair as measured, with the CPU pressure when each side started (for reading noisy runs)."""
    out = []
    for x, y in zip(a, b):
        out.append({f"{names[0]}_wall_s": round(x.wall_s, 4), f"{names[0]}_cpu_s": round(x.cpu_s, 4),
                    f"{names[1]}_wall_s": round(y.wall_s, 4), f"{names[1]}_cpu_s": round(y.cpu_s, 4),
                    "cpu_pressure_avg10_pct": [x.cpu_pressure, y.cpu_pressure]})
    return out


def paired(a: Sequence[float], b: Sequence[float]) -> dict:
    """Per-pair ratio a/b and difference a-b, each with its median and 95 % t interval."""
    ratios = [x / y for x, y in zip(a, b)]
    diffs = [x - y for x, y in zip(a, b)]
    return {"ratio": describe(ratios), "difference": describe(diffs)}


def load_average() -> dict:
    """The 1/5/15-minute load averages and the share of the last 60 s in which some task waited
    for a CPU (/proc/pressure/cpu): how much other work shared the machine."""
    out: dict = {"loadavg": [round(x, 2) for x in os.getloadavg()]}
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0].split()
        out["cpu_pressure_some_avg60_pct"] = float(dict(kv.split("=") for kv in some[1:])["avg60"])
    except (OSError, IndexError, KeyError, ValueError):
        pass
    return out


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"host": platform.node(), "cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(),
            "jbench_src": _source_commit(jbench_src()), "load_average_at_start": load_average()}


def _source_commit(src: Path) -> str:
    """Which jbench was measured: the source tree's git commit (a path would name one machine's layout)."""
    import subprocess

    res = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"commit {res.stdout.strip()}" if res.returncode == 0 and res.stdout.strip() else src.name


def jbench_exe() -> list[str]:
    """The `jbench` console script next to this interpreter (the user's command)."""
    import sys

    exe = Path(sys.executable).with_name("jbench")
    if not exe.exists():
        raise SystemExit(f"no jbench console script next to {sys.executable}: install jbench in this venv")
    return [str(exe)]


def jbench_src() -> Path:
    """The jbench source tree the measured commands run: this checkout, or $JBENCH_BENCH_SRC (another
    checkout, e.g. `git archive <base> | tar -x -C DIR`, to measure a baseline with the same script)."""
    return Path(os.environ.get("JBENCH_BENCH_SRC") or ROOT).resolve()


def jbench_env(**extra: str) -> dict:
    """The environment of a user's jbench run. The source tree of jbench_src() wins over an installed copy."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(jbench_src()) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("COLUMNS", "120")
    env.update(extra)
    return env


def fmt(d: dict, unit: str = "s", digits: int = 3) -> str:
    return (f"median {d['median']:.{digits}f} {unit} (range {d['min']:.{digits}f}-{d['max']:.{digits}f}; "
            f"mean {d['mean']:.{digits}f}, 95% CI {d['ci95'][0]:.{digits}f}-{d['ci95'][1]:.{digits}f}; n={d['n']})")
