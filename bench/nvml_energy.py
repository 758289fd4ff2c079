"""NVML energy check on a discrete NVIDIA GPU: jbench's integrated power vs the GPU's energy counter.

Runs real llama.cpp CUDA decode and prefill passes through jbench's own measurement path
(jbench.runner.measure: NVML sampler, device-clock phase windows, trapezoid integration) for
several window lengths, and for each window compares three energies:
  - integrated instantaneous power (NVML_FI_DEV_POWER_INSTANT; what jbench logs),
  - integrated nvmlDeviceGetPowerUsage (a ~1 s trailing average on Hopper),
  - the GPU's total-energy counter (nvmlDeviceGetTotalEnergyConsumption), the reference.

    python3 bench/nvml_energy.py --bin-dir BUILD/bin --model MODEL.gguf [--json OUT]

Needs nvidia-ml-py; no MLflow or Hydra (the trial is built by hand).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jbench.analysis.energy import window_energy  # noqa: E402
from jbench.analysis.telemetry import counter_energy  # noqa: E402
from jbench.backends.llamacpp.backend import LlamaCppBackend  # noqa: E402
from jbench.runner.context import TrialContext  # noqa: E402
from jbench.runner.session import DeviceSession  # noqa: E402
from jbench.runner.measure import measure  # noqa: E402
from jbench.core.trial import Trial


def make_trial(bin_dir: str, model: str, n_prompt: int, n_gen: int, reps: int, min_window_s: float) -> Trial:
    # The llama.cpp backend's config keys (jbench.backends.llamacpp.backend.LlamaCppConfig).
    backend = {"name": "llamacpp", "depth": 0, "warmup": True, "threads": None, "n_batch": None, "n_ubatch": None,
               "cache_type_k": "f16", "cache_type_v": "f16", "flash_attn": "auto", "extra_args": [], "timeout_s": 1800.0}
    backend.update(binary_dir=bin_dir, n_prompt=n_prompt, n_gen=n_gen, repetitions=reps, n_gpu_layers=99)
    config = {
        "device": {"name": "local", "kind": "local"},
        "backend": backend,
        "model": {"name": "bench", "quant": "Q4_K_M", "source": "files", "files": {"Q4_K_M": model}},
        "telemetry": {"source": "nvml", "interval_ms": 20, "idle_s": 2.0, "cooldown_s": 1.0, "energy_pass": True},
        "energy": {"min_window_s": min_window_s, "min_samples": 5, "min_coverage": 0.9},
        "power": {},
    }
    return Trial(1, config, {}, {}, "bench")


def compare_windows(samples: list[dict], windows: list[dict]) -> list[dict]:
    out = []
    inst = [(s["t"], s["power_w"]) for s in samples if s.get("power_w") is not None]
    avg = [(s["t"], s["power_avg_w"]) for s in samples if s.get("power_avg_w") is not None]
    for w in windows:
        if w["phase"] not in ("prefill", "decode"):
            continue
        e_inst = window_energy([t for t, _ in inst], [p for _, p in inst], w["start"], w["end"])
        e_avg = window_energy([t for t, _ in avg], [p for _, p in avg], w["start"], w["end"])
        counter = counter_energy(samples, w["start"], w["end"])
        row = {"phase": w["phase"], "window_s": round(w["end"] - w["start"], 3), "samples": e_inst.n_samples,
               "energy_counter_j": counter, "energy_instant_j": e_inst.energy_j, "energy_average_j": e_avg.energy_j}
        for key in ("instant", "average"):
            e = row[f"energy_{key}_j"]
            row[f"deviation_{key}_pct"] = (100.0 * (e - counter) / counter
                                           if counter and not math.isnan(e) else None)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    log = logging.getLogger("bench")
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    results = {"gpu": gpu, "machine": platform.node(), "runs": []}
    # Window lengths from sub-second to ~10 s: a speed pass and energy passes of growing length.
    for min_window in (0.5, 2.0, 8.0):
        trial = make_trial(args.bin_dir, args.model, n_prompt=512, n_gen=256, reps=3, min_window_s=min_window)
        backend = LlamaCppBackend(trial.config["backend"])
        session = DeviceSession(trial.config["device"], owner="bench-nvml-energy")
        assert session.connect() == [], "this machine as the device"
        ctx = TrialContext(trial, trial.cfg, session, backend, log)
        measure(ctx)
        measured = ctx.record
        import csv
        import io

        rows = list(csv.DictReader(io.StringIO(measured.artifacts["telemetry/samples.csv"])))
        samples = [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in rows]
        windows = json.loads(measured.artifacts["telemetry/windows.json"])
        cmp = compare_windows(samples, windows)
        speed = {p: round(sum(r.samples_tps) / len(r.samples_tps), 1) for p, r in ctx.backend_result.phases.items()}
        entry = {"min_window_s": min_window, "tok_s": speed, "power_field": measured.tags.get("telemetry.power_field"),
                 "energy_status": measured.tags.get("energy.status"), "windows": cmp,
                 "jbench_metrics": {k: v for k, v in measured.metrics.items() if "energy" in k or "power" in k}}
        results["runs"].append(entry)
        print(json.dumps(entry, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
