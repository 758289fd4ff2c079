"""`jbench report` and `jbench regress` over an MLflow store with 10,000 runs: the read and analysis paths.

Creates (once) a SQLite MLflow store shaped like a long nightly history: experiment "nightly", one
device, 96 configurations (6 quants x 4 depths x 2 KV types x 2 power modes) per sweep, 104 sweeps,
each a parent run and 96 trial runs (10,088 runs), every trial with the params, tags and metrics a
real trial has (~60 params, ~30 tags, summary metrics, energy and roofline metrics, and 5-repetition
series decode_tps_rep / prefill_tps_rep). The newest sweep carries a true 6 % decode regression on
the Q8_0 configurations. The store is written through MlflowClient (create_run, log_batch,
set_terminated) on /dev/shm (where SQLite commits are cheap), then cached at --store (default
/tmp/jbench-bench-10k/mlflow.db), so reruns skip creation.

Then it times, --rounds times in this process (the first round also pays module imports and cold
caches):
  * runs_frame (all trial runs of the experiment; default method: SQL read) + build_report (no
    repetition samples: error bars from the runs' *_std)
  * runs_frame + regress --baseline last (repetition samples read in bulk for the runs under test only)
and, once, runs_frame through MlflowClient.search_runs (method="search") for reference, and
repetition_samples for every trial run. Prints the figures.

    .venv/bin/python bench/report_regress.py [--store PATH] [--rounds 3] [--rebuild]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlflow.entities import Metric, Param, RunTag  # noqa: E402  (the bench writes the store itself)
from mlflow.tracking import MlflowClient  # noqa: E402

from jbench.analysis.regress import regress  # noqa: E402
from jbench.reporting.report import bits_per_weight, build_report  # noqa: E402
from jbench.tracking.reader import repetition_samples, runs_frame  # noqa: E402

QUANTS = ["Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16"]
DEPTHS = [0, 1024, 4096, 16384]
KV = ["f16", "q8_0"]
MODES = ["MAXN", "15W"]
N_SWEEPS = 104
REPS = 5
EXPERIMENT = "nightly"


def _config_params(quant: str, depth: int, kv: str, mode: str) -> dict[str, str]:
    p = {
        "backend.binary_dir": "/opt/llama.cpp/build/bin", "backend.cache_type_k": kv, "backend.cache_type_v": kv,
        "backend.depth": str(depth), "backend.extra_args": "[]", "backend.flash_attn": "on", "backend.n_batch": "null",
        "backend.n_gen": "128", "backend.n_gpu_layers": "99", "backend.n_prompt": "512", "backend.n_ubatch": "null",
        "backend.name": "llamacpp", "backend.repetitions": str(REPS), "backend.threads": "null",
        "backend.timeout_s": "1800.0", "backend.warmup": "True", "choice.backend": "llamacpp",
        "choice.device": "orin_nx", "choice.experiment": EXPERIMENT, "choice.model": "qwen3_4b",
        "choice.tracking": "local", "device.accept_new_host_key": "False", "device.connect_timeout_s": "10.0",
        "device.host": "orin-nx-01.lab", "device.jump": "null", "device.keepalive_s": "15.0",
        "device.key": "~/.ssh/id_ed25519", "device.kind": "ssh", "device.known_hosts": "null",
        "device.name": "orin-nx-01", "device.paths.device_tree_model": "/proc/device-tree/model",
        "device.paths.nvpmodel_conf": "/etc/nvpmodel.conf", "device.paths.state_dir": "~/.cache/jbench",
        "device.paths.tegra_release": "/etc/nv_tegra_release", "device.port": "22", "device.profile": "orin_nx_16gb",
        "device.sudo_password_env": "null", "device.tags": "{}", "device.user": "bench",
        "experiment.description": "nightly regression grid", "experiment.name": EXPERIMENT, "model.display_name": "Qwen3 4B",
        "model.files": "{}", "model.ladder": "[]", "model.name": "qwen3_4b", "model.package": "null",
        "model.package_version": "null", "model.path_template": "/models/qwen3-4b-{quant}.gguf", "model.quant": quant,
        "model.sha256": "null", "model.source": "path", "model.source_quant": "null", "power.allow_reboot": "False",
        "power.fan": "null", "power.jetson_clocks": "True", "power.mode": mode, "power.reboot_timeout_s": "300.0",
        "tracking.experiment_name": "null", "tracking.results_dir": "/srv/jbench/results", "tracking.uri": "null",
    }
    return p


def build_store(db: Path) -> None:
    rng = random.Random(7)
    work = Path(tempfile.mkdtemp(prefix="jbench-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    exp = client.create_experiment(EXPERIMENT, artifact_location=(work / "artifacts").as_uri())
    configs = [(q, d, k, m) for q in QUANTS for d in DEPTHS for k in KV for m in MODES]
    t_start = 1_700_000_000_000
    made = 0
    started = time.perf_counter()
    for s in range(N_SWEEPS):
        sweep_id = f"2024{s // 28 + 1:02d}{s % 28 + 1:02d}-020000-{s:06x}"
        t0 = t_start + s * 86_400_000
        build = "b4500a1" if s < N_SWEEPS // 2 else "b4610c7"
        common = {"jbench.sweep_id": sweep_id, "jbench.version": "0.1.0", "jbench.git_sha": f"{s:040x}"}
        parent = client.create_run(exp, start_time=t0, run_name=f"sweep {sweep_id}",
                                   tags={"mlflow.runName": f"sweep {sweep_id}"}).info.run_id
        client.log_batch(parent, params=[Param("sweep.overrides", "+experiment=nightly"),
                                         Param("sweep.n_trials", str(len(configs)))],
                         tags=[RunTag(k, v) for k, v in {**common, "jbench.kind": "sweep",
                                                         "jbench.experiment": EXPERIMENT}.items()])
        made += 1
        drift = rng.gauss(0, 0.004)  # night-to-night drift of the whole device
        for i, (q, d, k, m) in enumerate(configs):
            start = t0 + 1000 + i * 30_000
            label = f"model.quant={q} backend.depth={d} backend.cache_type_k={k} power.mode={m}"
            h = hashlib.sha256(f"{q}|{d}|{k}|{m}".encode()).hexdigest()[:16]
            bpw = bits_per_weight(q)
            ceiling = 102e9 / (4.0e9 * bpw / 8 + d * 36 * 2 * 1024 * (2 if k == "f16" else 1.0625))
            mean = ceiling * (0.55 if m == "MAXN" else 0.4) * (1 + drift)
            if s == N_SWEEPS - 1 and q == "Q8_0":
                mean *= 0.94  # the regression the gate must catch
            decode = [mean * (1 + rng.gauss(0, 0.01)) for _ in range(REPS)]
            prefill = [mean * 12 * (1 + rng.gauss(0, 0.02)) for _ in range(REPS)]
            power = (14.5 if m == "MAXN" else 9.8) * (1 + rng.gauss(0, 0.01))
            dm = statistics.fmean(decode)
            metrics = {
                "decode_tps": dm, "decode_tps_std": statistics.stdev(decode), "decode_tps_median": statistics.median(decode),
                "prefill_tps": statistics.fmean(prefill), "prefill_tps_std": statistics.stdev(prefill),
                "prefill_tps_median": statistics.median(prefill), "decode_tokens": 128, "prefill_tokens": 512,
                "decode_repetitions": REPS, "prefill_repetitions": REPS, "decode_ms_mean": 128e3 / dm,
                "prefill_ms_mean": 512e3 / statistics.fmean(prefill), "trial_wall_s": 25 + rng.random(),
                "decode_avg_power_w": power, "decode_energy_j": power * 128 / dm, "decode_tokens_per_joule": dm / power,
                "roofline_decode_tps": ceiling, "roofline_fraction": dm / ceiling,
            }
            now_ms = start + 20_000
            mlist = [Metric(key, float(v), now_ms, 0) for key, v in metrics.items()]
            mlist += [Metric("decode_tps_rep", v, now_ms, j) for j, v in enumerate(decode)]
            mlist += [Metric("prefill_tps_rep", v, now_ms, j) for j, v in enumerate(prefill)]
            tags = {
                **common, "jbench.kind": "trial", "jbench.config_hash": h, "jbench.trial_index": str(i + 1),
                "jbench.trial_label": label, "jbench.status": "FINISHED", "device.name": "orin-nx-01",
                "backend.name": "llamacpp", "model.name": "qwen3_4b", "model.quant": q,
                "model.sha256": hashlib.sha256(q.encode()).hexdigest(), "model.file": f"/models/qwen3-4b-{q}.gguf",
                "backend.build_commit": build, "backend.build_number": "4500", "backend.backends": "CUDA",
                "backend.gpu_info": "Orin (nvgpu)", "backend.cpu_info": "ARMv8 Processor rev 1 (v8l)",
                "backend.flash_attn": "on", "host.cpu": "ARMv8 Processor rev 1 (v8l)", "host.cpu_count": "8",
                "host.hostname": "orin-nx-01", "host.kernel": "Linux 5.15.148-tegra aarch64",
                "host.os": "Ubuntu 22.04.5 LTS", "host.ram_mib": "15656", "jetson.jetpack": "6.2",
                "jetson.l4t": "36.4.3", "jetson.model": "NVIDIA Jetson Orin NX Engine Reference Carrier",
                "power.mode_actual": m, "roofline.regime": "memory-bound, below roofline",
            }
            run = client.create_run(exp, start_time=start, run_name=f"{i + 1:03d} {label}",
                                    tags={"mlflow.parentRunId": parent, "mlflow.runName": f"{i + 1:03d} {label}"})
            rid = run.info.run_id
            client.log_batch(rid, metrics=mlist, params=[Param(a, b) for a, b in _config_params(q, d, k, m).items()],
                             tags=[RunTag(a, str(b)) for a, b in tags.items()])
            client.set_terminated(rid, "FINISHED", end_time=start + 25_000)
            made += 1
        client.set_terminated(parent, "FINISHED", end_time=t0 + 1000 + len(configs) * 30_000)
        el = time.perf_counter() - started
        print(f"\rcreating store: {made} runs, {el:.0f} s", end="", flush=True)
    print()
    db.parent.mkdir(parents=True, exist_ok=True)
    tmp = db.with_suffix(".db.partial")
    shutil.copyfile(work / "mlflow.db", tmp)
    os.replace(tmp, db)
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, default=Path("/tmp/jbench-bench-10k/mlflow.db"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--no-search", action="store_true", help="skip the (slow) search_runs reference read")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    if args.rebuild or not args.store.exists():
        t = time.perf_counter()
        build_store(args.store)
        print(f"store created in {time.perf_counter() - t:.0f} s: {args.store}")
    uri = f"sqlite:///{args.store.resolve()}"
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    n_runs = len(client.search_runs([exp.experiment_id], max_results=50000, filter_string=""))
    print(f"store: {uri}: {n_runs} runs in experiment '{EXPERIMENT}'")

    figures: dict = {"runs_in_store": n_runs, "rounds": []}
    with tempfile.TemporaryDirectory(prefix="jbench-report-") as out:
        for r in range(args.rounds):
            t0 = time.perf_counter()
            df = runs_frame(uri, [EXPERIMENT])
            t1 = time.perf_counter()
            files = build_report(df, out_dir=out)
            t2 = time.perf_counter()
            df2 = runs_frame(uri, [EXPERIMENT])
            t3 = time.perf_counter()
            rep = regress(df2, lambda ids, m: repetition_samples(uri, ids, m), baseline="last")
            t4 = time.perf_counter()
            row = {"runs_frame_s": t1 - t0, "build_report_s": t2 - t1, "report_total_s": t2 - t0,
                   "runs_frame_2_s": t3 - t2, "regress_s": t4 - t3, "regress_total_s": t4 - t2,
                   "trial_rows": len(df), "columns": df.shape[1], "pngs": len(files.pngs),
                   "configurations": len(rep.results), "regressions": rep.counts().get("regression", 0),
                   "exit_code": rep.exit_code}
            figures["rounds"].append(row)
            print(f"round {r + 1}: runs_frame {row['runs_frame_s']:.2f} s ({len(df)} trial rows x {df.shape[1]} cols) "
                  f"+ build_report {row['build_report_s']:.2f} s = report {row['report_total_s']:.2f} s | "
                  f"runs_frame {row['runs_frame_2_s']:.2f} s + regress {row['regress_s']:.2f} s = "
                  f"regress {row['regress_total_s']:.2f} s ({row['configurations']} configurations, "
                  f"{row['regressions']} regressions, exit {row['exit_code']})", flush=True)
        if not args.no_search:
            t = time.perf_counter()
            slow = runs_frame(uri, [EXPERIMENT], method="search")
            figures["runs_frame_search_runs_s"] = time.perf_counter() - t
            print(f"runs_frame through MlflowClient.search_runs (method='search', 5000-run pages): "
                  f"{figures['runs_frame_search_runs_s']:.2f} s ({len(slow)} rows; same frame: "
                  f"{slow.equals(df)})", flush=True)
        counts = rep.counts()
        flagged = sorted({r.label.split()[0] for r in rep.results if r.status == "regression"})
        print(f"regress statuses: {counts}; regressions flagged in: {flagged} "
              f"(planted: 6 % drop on all 16 Q8_0 configurations of the newest sweep)")
        figures["regress_counts"] = counts
        t = time.perf_counter()
        all_samples = repetition_samples(uri, df["run_id"], "decode_tps_rep")
        figures["repetition_samples_all_trials_s"] = time.perf_counter() - t
        print(f"repetition_samples for all {len(all_samples)} trial runs: {figures['repetition_samples_all_trials_s']:.2f} s")
    figures["machine"] = f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs"
    figures["python"] = platform.python_version()
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
