"""Lean energy passes measured (issue 26, part 2): real `jbench sweep` processes against an emulated Jetson (a real
sshd on loopback with its files at their real paths, tests/emulated_jetson) running the embedded default's real
llama-bench CPU build and model ladder (~/.cache/jbench), under each emulated sensor:
telemetry.source=sysfs (the 100 Hz INA3221 hwmon reader) and telemetry.source=tegrastats (100 ms).

    nice -n 5 .venv/bin/python bench/lean_energy.py                    # 3 rounds per sensor (~12 min on 2 cores)
    nice -n 5 .venv/bin/python bench/lean_energy.py --rounds 1 --sensors sysfs   # a quick look

Per sensor, alternating rounds of three variants (lean and before-like take turns going first; bare sits between):
- bare:   each trial's speed-pass llama-bench command (read from the lean run's trial.log, "running: ..."), run as
          a whole process over the same kind of SSH connection jbench uses (paramiko, an argument list), timed
          around the remote command on an open connection.
- lean:   the new defaults (telemetry.adaptive=true, energy from the speed pass when the sensor resolves it).
- before: `telemetry.adaptive=false energy.min_window_s=5 telemetry.hwmon_interval_ms=100`: the old fixed idle and
          cooldown waits and 5-s energy windows. "before-like": the old code also sized passes 25 % over and
          retried any speed mismatch, which this code no longer does.
Each sweep writes to a fresh store (otherwise resume would skip every trial already FINISHED).

Figures (bench/results-lean-energy.json and the table printed at the end), per sensor:
- sweep_wall_s: the `jbench sweep` process's whole life (interpreter, imports, store, every stage);
- measure_wall_s per trial (the Measure stage: idle + speed pass + energy passes + cooldown);
- bare_s per trial; the idle window the trial's idle wait actually used (telemetry.idle_wait);
- ratio = lean measure_wall_s / (bare + that idle window), the issue's target being <= 1.5;
- {phase}_tokens_per_joule, {phase}_energy_edge_error_pct, energy.{phase}.window;
- decode tokens/J lean vs before (%), the target being within 1 %, and decode power lean vs before (%).

The emulated sensors: power follows whether a llama-bench process runs (the emulator polls the device's processes
every 250 ms: ~17.2 W busy, ~4.85 W idle on the Orin Nano Super), not the phase or the work llama-bench actually gets
done, so prefill and decode draw the same and the edges inside a pass barely step. tokens/J therefore move with
llama-bench's speed on this shared CPU alone, and decode power is the figure that compares the two sensors' energy
at equal speed.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _procstat import cpu_pressure_avg10, exit_cleanly_on_sigterm, jbench_env, jbench_exe, machine  # noqa: E402

from tests.emulated_jetson import EmulatedJetson  # noqa: E402

OUT = ROOT / "bench" / "results-lean-energy.json"
MODULE = "orin_nano_super"
EXPERIMENT = "quant_ladder"
# The shipped quant ladder with two of its quants and, by default, half its n_prompt/n_gen (64/32, 3 repetitions:
# its 128/64 took ~3 min a round on the shared 2-core VM); no quality pass (llama-perplexity is not the subject).
# thermal.start_below_c=null: the emulated temperatures are not what is measured; auto_calibrate is off in the
# device entry: a bandwidth probe of this host would only lengthen every sweep alike.
COMMON = ["+experiment=quant_ladder", "quality.enabled=false", "thermal.start_below_c=null"]
VARIANTS = {
    "lean": [],
    "before": ["telemetry.adaptive=false", "energy.min_window_s=5", "telemetry.hwmon_interval_ms=100"],
}
METRICS = ("measure_wall_s", "power_sensor_period_ms", "prefill_tokens_per_joule", "decode_tokens_per_joule",
           "prefill_energy_edge_error_pct", "decode_energy_edge_error_pct", "prefill_window_s", "decode_window_s",
           "idle_window_s", "prefill_tps", "decode_tps", "decode_energy_speed_difference_pct",
           "prefill_energy_speed_difference_pct", "decode_avg_power_w", "prefill_avg_power_w", "idle_avg_power_w",
           "decode_energy_window_tps")
TAGS = ("energy.prefill.window", "energy.decode.window", "telemetry.idle_wait", "telemetry.cooldown_wait",
        "energy.status", "telemetry.samples", "telemetry.power_rails")
IDLE_SETTLED = re.compile(r"settled after ([0-9.]+) s \(a ([0-9.]+) s window\)")
IDLE_UNSETTLED = re.compile(r"telemetry\.idle_s=([0-9.]+) s")
# backend.run's log line after each llama-bench pass (the memory pass's line starts "memory pass:")
PASS_EXITED = re.compile(r"(?<!memory pass: )llama-bench exited -?\d+ after ([0-9.]+) s")


def write_conf(conf: Path, emu: EmulatedJetson) -> Path:
    (conf / "device").mkdir(parents=True, exist_ok=True)
    cfg = emu.device_config(name="emu")
    cfg["paths"]["boot_id"] = str(emu.boot_id_path)
    cfg.update(connect_timeout_s=30.0, auto_calibrate=False)
    (conf / "device" / "emu.yaml").write_text(yaml.safe_dump({"defaults": ["device_schema", "_self_"], **cfg}))
    return conf


def sweep_argv(conf: Path, bin_dir: str, sensor: str, args, variant: str) -> list[str]:
    return [*jbench_exe(), "sweep", "--config-dir", str(conf), "device=emu", *COMMON,
            f"model.quant={args.quants}", f"backend.binary_dir={bin_dir}", f"backend.n_prompt={args.n_prompt}",
            f"backend.n_gen={args.n_gen}", f"backend.repetitions={args.repetitions}",
            f"telemetry.source={sensor}", *VARIANTS[variant]]


def idle_window(wait: Optional[str]) -> tuple[Optional[float], Optional[float]]:
    """(the idle window used, the wait before it) from the telemetry.idle_wait tag; a fixed wait has no tag."""
    if not wait:
        return None, None
    m = IDLE_SETTLED.search(wait)
    if m:
        return float(m.group(2)), float(m.group(1))
    m = IDLE_UNSETTLED.search(wait)
    if m:
        return float(m.group(1)), None
    return None, None


def trial_records(results: Path, work: Path) -> list[dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        return []
    runs = [r for r in client.search_runs([exp.experiment_id], max_results=1000)
            if r.data.tags.get("jbench.kind") == "trial"]
    out = []
    for r in sorted(runs, key=lambda r: int(r.data.tags["jbench.trial_index"])):
        m, t = r.data.metrics, r.data.tags
        rec = {"quant": r.data.params.get("model.quant"), "status": r.info.status,
               "trial_run_s": round((r.info.end_time - r.info.start_time) / 1000, 3) if r.info.end_time else None}
        rec.update({k: m.get(k) for k in METRICS})
        rec.update({k: t.get(k) for k in TAGS})
        rec["idle_window_used_s"], rec["idle_waited_s"] = idle_window(t.get("telemetry.idle_wait"))
        log = Path(client.download_artifacts(r.info.run_id, "trial.log", str(work / r.info.run_id)))
        lines = log.read_text(errors="replace").splitlines()
        running = [ln.split("running: ", 1)[1] for ln in lines if "running: " in ln]
        rec["speed_pass_argv"] = shlex.split(running[0]) if running else None
        rec["energy_passes"] = len(running) - 1
        passes = [float(m.group(1)) for ln in lines if (m := PASS_EXITED.search(ln))]
        # The speed pass as it ran inside this trial (same minute, same load): the Measure stage's own overhead
        # beside it is what lean energy adds, whatever the shared machine's load did to llama-bench's speed.
        rec["speed_pass_in_trial_s"] = passes[0] if passes else None
        rec["energy_passes_s"] = passes[1:]
        if rec["measure_wall_s"] is not None and passes:
            rec["measure_overhead_s"] = round(rec["measure_wall_s"] - passes[0], 3)
        out.append(rec)
    return out


def run_sweep(argv: list[str], results: Path, log_path: Path) -> dict:
    pressure = cpu_pressure_avg10()
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(argv, env=jbench_env(JBENCH_RESULTS_DIR=str(results), COLUMNS="200"),
                              stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"the sweep exited {proc.returncode}:\n{tail}")
    return {"sweep_wall_s": round(wall, 3), "cpu_pressure_avg10_pct": pressure}


def run_bare(conn, argvs: dict[str, list[str]]) -> dict:
    """Each trial's speed-pass command as a whole remote process, one after another on an open connection."""
    pressure = cpu_pressure_avg10()
    per = {}
    for quant, argv in argvs.items():
        t0 = time.perf_counter()
        res = conn.run(argv, timeout=600)
        per[quant] = round(time.perf_counter() - t0, 3)
        if res.returncode != 0:
            raise SystemExit(f"bare llama-bench exited {res.returncode}: {res.stderr[-2000:]}")
    return {"bare_s": per, "bare_total_s": round(sum(per.values()), 3), "cpu_pressure_avg10_pct": pressure}


def med(values: list) -> Optional[float]:
    vals = [v for v in values if v is not None and v == v]
    return round(statistics.median(vals), 4) if vals else None


def summarise(sensor: str, rounds: list[dict], quants: list[str]) -> dict:
    out: dict = {"sensor": sensor, "rounds": len(rounds)}
    for variant in ("lean", "before"):
        out[f"{variant}_sweep_wall_s"] = med([r[variant]["sweep_wall_s"] for r in rounds])
    out["bare_total_s"] = med([r["bare"]["bare_total_s"] for r in rounds])
    per_quant = {}
    for q in quants:
        def trial(r: dict, variant: str) -> dict:
            return next(t for t in r[variant]["trials"] if t["quant"] == q)

        lean = [trial(r, "lean") for r in rounds]
        before = [trial(r, "before") for r in rounds]
        bare = [r["bare"]["bare_s"][q] for r in rounds]
        ratios, ratios_waited = [], []
        for t, b in zip(lean, bare):
            if t["measure_wall_s"] is not None and t["idle_window_used_s"] is not None:
                ratios.append(t["measure_wall_s"] / (b + t["idle_window_used_s"]))
            if t["measure_wall_s"] is not None and t["idle_waited_s"] is not None:
                ratios_waited.append(t["measure_wall_s"] / (b + t["idle_waited_s"]))
        ratios_in_trial = [t["measure_wall_s"] / (t["speed_pass_in_trial_s"] + t["idle_window_used_s"]) for t in lean
                           if t.get("speed_pass_in_trial_s") and t["idle_window_used_s"] is not None]
        tpj = {v: med([t["decode_tokens_per_joule"] for t in ts]) for v, ts in (("lean", lean), ("before", before))}
        power = {v: med([t["decode_avg_power_w"] for t in ts]) for v, ts in (("lean", lean), ("before", before))}
        overhead = med([t.get("measure_overhead_s") for t in lean])
        idle_w = med([t["idle_window_used_s"] for t in lean])
        per_quant[q] = {
            "bare_s": med(bare),
            "lean_measure_wall_s": med([t["measure_wall_s"] for t in lean]),
            "before_measure_wall_s": med([t["measure_wall_s"] for t in before]),
            "lean_idle_window_s": med([t["idle_window_used_s"] for t in lean]),
            "lean_idle_waited_s": med([t["idle_waited_s"] for t in lean]),
            "ratio_lean_measure_to_bare_plus_idle_window": med(ratios),
            "ratio_per_round": [round(x, 3) for x in ratios],
            "ratio_lean_measure_to_bare_plus_idle_waited": med(ratios_waited),
            "speed_pass_in_trial_s": {"lean": med([t.get("speed_pass_in_trial_s") for t in lean]),
                                      "before": med([t.get("speed_pass_in_trial_s") for t in before])},
            "ratio_lean_measure_to_in_trial_speed_pass_plus_idle_window": med(ratios_in_trial),
            "lean_measure_overhead_s": overhead,
            "before_measure_overhead_s": med([t.get("measure_overhead_s") for t in before]),
            # (S + O) / (S + I) <= 1.5  <=>  S >= 2 O - 3 I: the shortest speed pass that meets the target
            "break_even_speed_pass_s": (round(max(0.0, 2 * overhead - 3 * idle_w), 3)
                                        if overhead is not None and idle_w is not None else None),
            "decode_avg_power_w": power,
            "decode_avg_power_lean_vs_before_pct": (round(100 * (power["lean"] / power["before"] - 1), 3)
                                                    if power["lean"] and power["before"] else None),
            "decode_tps_speed_pass": {"lean": med([t["decode_tps"] for t in lean]),
                                      "before": med([t["decode_tps"] for t in before])},
            "ratio_before_measure_to_bare_plus_3s_idle": med(
                [t["measure_wall_s"] / (b + 3.0) for t, b in zip(before, bare) if t["measure_wall_s"] is not None]),
            "lean_energy_passes": [t["energy_passes"] for t in lean],
            "before_energy_passes": [t["energy_passes"] for t in before],
            "power_sensor_period_ms": {"lean": med([t["power_sensor_period_ms"] for t in lean]),
                                       "before": med([t["power_sensor_period_ms"] for t in before])},
            "decode_tokens_per_joule": tpj,
            "decode_tokens_per_joule_lean_vs_before_pct": (round(100 * (tpj["lean"] / tpj["before"] - 1), 3)
                                                           if tpj["lean"] and tpj["before"] else None),
            "decode_tokens_per_joule_per_round_pct": [
                round(100 * (a["decode_tokens_per_joule"] / b["decode_tokens_per_joule"] - 1), 3)
                for a, b in zip(lean, before) if a["decode_tokens_per_joule"] and b["decode_tokens_per_joule"]],
            "prefill_tokens_per_joule": {"lean": med([t["prefill_tokens_per_joule"] for t in lean]),
                                         "before": med([t["prefill_tokens_per_joule"] for t in before])},
            "decode_edge_error_pct": {"lean": med([t["decode_energy_edge_error_pct"] for t in lean]),
                                      "before": med([t["decode_energy_edge_error_pct"] for t in before])},
            "prefill_edge_error_pct": {"lean": med([t["prefill_energy_edge_error_pct"] for t in lean]),
                                       "before": med([t["prefill_energy_edge_error_pct"] for t in before])},
            "lean_windows": {"prefill": sorted({t["energy.prefill.window"] or "" for t in lean}),
                             "decode": sorted({t["energy.decode.window"] or "" for t in lean})},
        }
    out["per_quant"] = per_quant
    # Where the rest of a sweep's wall time goes: outside its trials (interpreter, imports, plan, preflight, store,
    # summary) and inside a trial outside Measure (other stages, the sampler's start, the memory pass, the record).
    for variant in ("lean", "before"):
        out[f"{variant}_outside_trials_s"] = med([r[variant]["sweep_wall_s"] - sum(t["trial_run_s"] or 0 for t in
                                                                                    r[variant]["trials"])
                                                  for r in rounds])
        out[f"{variant}_trial_outside_measure_s"] = med([t["trial_run_s"] - t["measure_wall_s"] for r in rounds
                                                        for t in r[variant]["trials"]
                                                        if t["trial_run_s"] and t["measure_wall_s"]])
    # The whole sweep against the work it must do: the bare passes plus each trial's idle window.
    idle = sum(per_quant[q]["lean_idle_window_s"] or 0 for q in quants)
    if out["lean_sweep_wall_s"] and out["bare_total_s"]:
        out["ratio_lean_sweep_to_bare_plus_idle_windows"] = round(out["lean_sweep_wall_s"] /
                                                                 (out["bare_total_s"] + idle), 3)
        out["ratio_before_sweep_to_bare_plus_idle_windows"] = round(out["before_sweep_wall_s"] /
                                                                   (out["bare_total_s"] + idle), 3)
    return out


def _f(v: Optional[float], spec: str) -> str:
    return format(v, spec) if v is not None else "n/a"


def table(summaries: list[dict], quants: list[str]) -> str:
    cols = [("sensor", 10), ("quant", 5), ("bare s", 7), ("in-trial s", 10), ("lean Meas s", 11),
            ("before Meas s", 13), ("overh s", 7), ("idle s", 6), ("ratio", 5), ("ratio in-t", 10),
            ("dec tok/J l", 11), ("before", 7), ("diff %", 7), ("dec W diff %", 12), ("edge % l/b", 11),
            ("passes l/b", 10)]
    head = " ".join(f"{n:>{w}}" for n, w in cols)
    lines = [head, "-" * len(head)]
    for s in summaries:
        for q in quants:
            p = s["per_quant"][q]
            tpj, edge = p["decode_tokens_per_joule"], p["decode_edge_error_pct"]
            cells = [s["sensor"], q, _f(p["bare_s"], ".2f"), _f(p["speed_pass_in_trial_s"]["lean"], ".2f"),
                     _f(p["lean_measure_wall_s"], ".2f"), _f(p["before_measure_wall_s"], ".2f"),
                     _f(p["lean_measure_overhead_s"], ".2f"), _f(p["lean_idle_window_s"], ".2f"),
                     _f(p["ratio_lean_measure_to_bare_plus_idle_window"], ".2f"),
                     _f(p["ratio_lean_measure_to_in_trial_speed_pass_plus_idle_window"], ".2f"),
                     _f(tpj["lean"], ".3f"), _f(tpj["before"], ".3f"),
                     _f(p["decode_tokens_per_joule_lean_vs_before_pct"], "+.2f"),
                     _f(p["decode_avg_power_lean_vs_before_pct"], "+.2f"),
                     f"{_f(edge['lean'], '.3f')}/{_f(edge['before'], '.3f')}",
                     f"{statistics.median(p['lean_energy_passes']):g}/{statistics.median(p['before_energy_passes']):g}"]
            lines.append(" ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, cols)))
        lines.append(f"{s['sensor']:>10} sweep process: lean {_f(s['lean_sweep_wall_s'], '.1f')} s, before "
                     f"{_f(s['before_sweep_wall_s'], '.1f')} s, bare passes {_f(s['bare_total_s'], '.1f')} s; "
                     f"sweep / (bare + idle windows): lean {s.get('ratio_lean_sweep_to_bare_plus_idle_windows')}, "
                     f"before {s.get('ratio_before_sweep_to_bare_plus_idle_windows')}; outside trials "
                     f"{_f(s.get('lean_outside_trials_s'), '.1f')} s, per trial outside Measure "
                     f"{_f(s.get('lean_trial_outside_measure_s'), '.1f')} s (lean)")
    lines += ["bare: the speed pass's llama-bench alone over SSH; in-trial: the same pass inside the lean trial; "
              "overh: lean Measure - in-trial pass; ratio: lean Measure / (bare + idle window), ratio in-t: "
              "/ (in-trial + idle window); target <= 1.5",
              "diff %: decode tok/J lean vs before as measured (medians over rounds; a withheld figure left out); "
              "dec W diff %: decode power lean vs before (tok/J at equal speed); passes: energy passes per trial"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sensors", default="sysfs,tegrastats")
    ap.add_argument("--quants", default="Q4_0,Q8_0")
    ap.add_argument("--n-prompt", type=int, default=64)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--summarise-only", action="store_true",
                    help="recompute the summaries and the table from the rounds already in --out (no sweeps)")
    args = ap.parse_args()
    if args.summarise_only:
        report = json.loads(args.out.read_text())
        quants = report["workload"]["quants"]
        summaries = []
        for sensor, data in report["sensors"].items():
            data["summary"] = summarise(sensor, data["rounds"], quants)
            summaries.append(data["summary"])
        text = table(summaries, quants)
        report["table"] = text.splitlines()
        args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(text)
        return
    exit_cleanly_on_sigterm()
    from jbench.device.connect import connect
    from jbench.models.provision import active_build

    build = active_build()
    if build is None:
        raise SystemExit("no llama.cpp build: run `jbench setup` first")
    quants = args.quants.split(",")
    started = time.time()
    report: dict = {"benchmark": "lean energy passes on an emulated Jetson (bench/lean_energy.py)",
                    "machine": machine(), "module": MODULE,
                    "build": {k: build.get(k) for k in ("llama_cpp_python", "build_commit", "flavor", "machine")},
                    "workload": {"quants": quants, "n_prompt": args.n_prompt, "n_gen": args.n_gen,
                                 "repetitions": args.repetitions, "overrides": COMMON},
                    "variants": {k: v for k, v in VARIANTS.items()}, "sensors": {}}
    summaries = []
    with tempfile.TemporaryDirectory(prefix="lean-energy-") as tmp:
        work = Path(tmp)
        (work / "emu").mkdir()
        # real_paths: the sysfs source reads the INA3221 hwmon files at /sys (root only, a mount namespace)
        emu = EmulatedJetson.start(MODULE, base_dir=work / "emu", real_paths=True, start_timeout_s=60)
        try:
            conf = write_conf(work / "conf", emu)
            for sensor in args.sensors.split(","):
                rounds = []
                argvs: dict[str, list[str]] = {}
                for i in range(args.rounds):
                    order = ["lean", "bare", "before"] if i % 2 == 0 else ["before", "bare", "lean"]
                    if not argvs:
                        order = ["lean", "bare", "before"]  # bare needs the lean run's logged command
                    rnd: dict = {"order": order}
                    for variant in order:
                        tag = f"{sensor}-{i}-{variant}"
                        print(f"[{time.time() - started:6.0f} s] {tag}", flush=True)
                        if variant == "bare":
                            with connect(emu.device_config(name="emu")) as conn:
                                rnd["bare"] = run_bare(conn, argvs)
                            continue
                        results = work / "results" / tag
                        rnd[variant] = run_sweep(sweep_argv(conf, build["bin_dir"], sensor, args, variant),
                                                 results, work / f"{tag}.log")
                        rnd[variant]["trials"] = trial_records(results, work / "artifacts" / tag)
                        if variant == "lean" and not argvs:
                            argvs = {t["quant"]: t["speed_pass_argv"] for t in rnd[variant]["trials"]}
                    rounds.append(rnd)
                summary = summarise(sensor, rounds, quants)
                summaries.append(summary)
                report["sensors"][sensor] = {"summary": summary, "rounds": rounds,
                                             "speed_pass_argv": {q: shlex.join(a) for q, a in argvs.items()}}
        finally:
            emu.stop()
    report["elapsed_s"] = round(time.time() - started, 1)
    report["machine"]["load_average_at_end"] = machine()["load_average_at_start"]
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")  # first: a table bug loses nothing
    text = table(summaries, quants)
    report["table"] = text.splitlines()
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(text)
    print(f"written {args.out} in {report['elapsed_s']} s")


if __name__ == "__main__":
    main()
