"""Device control over SSH: command round trip on one persistent connection, and the cost of a
trial's power step when the device is already in the requested state.

Runs against an emulated Jetson (a real OpenSSH sshd on loopback with the fake L4T tools from
tests/emulated_jetson), so it measures jbench's SSH and control path, not a Jetson's tools.

    .venv/bin/python bench/ssh_control.py [--n 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jbench.device.connect import connect  # noqa: E402
from jbench.device.power import PowerStrategy  # noqa: E402
from tests.emulated_jetson import EmulatedJetson  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with EmulatedJetson.start("orin_nano_super") as emu:
        cfg = emu.device_config(name="bench")
        cfg["paths"]["boot_id"] = str(emu.boot_id_path)
        started = time.perf_counter()
        conn = connect(cfg)
        connect_s = time.perf_counter() - started
        rtt = []
        for _ in range(args.n):
            t = time.perf_counter()
            conn.run(["true"], timeout=30)
            rtt.append(time.perf_counter() - t)
        power = PowerStrategy(conn, cfg)
        power.apply("MAXN_SUPER", True)  # bring it into the state once
        steady = []
        for _ in range(max(20, args.n // 10)):
            t = time.perf_counter()
            changes = power.apply("MAXN_SUPER", True)
            steady.append(time.perf_counter() - t)
            assert changes == []
        conn.close()
    figures = {
        "connect_s": round(connect_s, 4),
        "rtt_ms_median": round(1000 * statistics.median(rtt), 2),
        "rtt_ms_p95": round(1000 * pct(rtt, 0.95), 2),
        "power_step_already_in_state_s_median": round(statistics.median(steady), 4),
        "power_step_already_in_state_s_p95": round(pct(steady, 0.95), 4),
        "n_rtt": len(rtt), "n_power": len(steady),
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
