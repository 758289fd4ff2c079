"""How fast jbench notices a tracking server that does not answer.

1. At start: `jbench run` with MLFLOW_TRACKING_URI pointing at a port nothing listens on, whole process until
   it exits 2 (the /health check before any device is touched).
2. Mid-sweep: a real `mlflow server` is SIGKILLed right after the first trial of a three-trial sweep is FINISHED
   on it; the time from the kill to the sweep's spool line on stdout.

    .venv/bin/python bench/tracking_outage.py [--reps 3]    (needs `jbench setup`; writes bench/results-tracking-outage.json)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

JBENCH = str(Path(sys.executable).with_name("jbench"))
TRIAL = ["backend.n_prompt=64", "backend.n_gen=64", "backend.repetitions=4", "device.lease_wait_s=600"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def at_start(tmp: Path) -> float:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}", "JBENCH_RESULTS_DIR": str(tmp)}
    t0 = time.monotonic()
    res = subprocess.run([JBENCH, "run", *TRIAL], env=env, capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    return time.monotonic() - t0


def finished(db: Path) -> int:
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        n = con.execute("SELECT COUNT(*) FROM runs JOIN tags ON tags.run_uuid = runs.run_uuid WHERE "
                        "tags.key = 'jbench.kind' AND tags.value = 'trial' AND runs.status = 'FINISHED'").fetchone()[0]
        con.close()
        return n
    except sqlite3.Error:
        return 0


def mid_sweep(tmp: Path) -> float:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--backend-store-uri", f"sqlite:///{tmp}/server.db", "--artifacts-destination",
                               str(tmp / "art"), "--workers", "1"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            break
        except OSError:
            time.sleep(0.3)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}", "JBENCH_RESULTS_DIR": str(tmp / "r"),
           "COLUMNS": "300"}
    sweep = subprocess.Popen([JBENCH, "sweep", "model.quant=Q4_0,Q8_0,Q4_K_M", *TRIAL], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    while finished(tmp / "server.db") < 1:
        time.sleep(0.05)
    os.killpg(server.pid, signal.SIGKILL)
    killed = time.monotonic()
    server.wait()
    for line in sweep.stdout:
        if "spool" in line:
            noticed = time.monotonic() - killed
            break
    else:
        raise AssertionError("no spool line")
    sweep.communicate()
    assert sweep.returncode == 0
    return noticed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    out: dict = {"at_start_s": [], "mid_sweep_s": []}
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            out["at_start_s"].append(at_start(Path(tmp)))
        with tempfile.TemporaryDirectory() as tmp:
            out["mid_sweep_s"].append(mid_sweep(Path(tmp)))
    for key in ("at_start_s", "mid_sweep_s"):
        v = out[key]
        print(f"{key}: median {statistics.median(v):.2f} s, range {min(v):.2f}-{max(v):.2f} s ({len(v)} reps)")
    Path(__file__).with_name("results-tracking-outage.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
