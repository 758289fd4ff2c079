#!/bin/bash
# Lean energy passes on the workplace's GPU host (issue 26 part 2): what a telemetry sweep costs over the bare speed
# passes, before and after, and whether decode tokens/J stayed the same. The quant ladder (Q4_0, Q8_0, F16 of a
# Gemma-3-270M-shaped model with random weights), telemetry.source=nvml, quality off, in alternating rounds of:
#   bare    the speed pass's own llama-bench command (3 repetitions + 1 settle), one whole process per quant
#   lean    jbench built from the tree under test (defaults: energy from the speed pass where the sensor resolves it,
#           passes sized to the sensor, adaptive idle and cooldown, NVML power and counter every 10 ms)
#   before  jbench as it was before (fixed 3 s idle, 5 s energy windows sized 25 % over, 2 s cooldown, 100 ms NVML)
# First it probes the NVML sensor itself: how often the instantaneous power field and the total-energy counter
# change when read as fast as possible, idle and under load. Results: $OUT (the run tool's output folder).
# Run from the repository root there (the `run` tool, carry [".whl", "$GPU_DIR"]), with
#   .whl/*.whl                     py3.12 wheels of jbench's dependencies (no jbench wheel)
#   $GPU_DIR/jbench-*.whl          jbench from the tree under test (pip wheel --no-deps -w $GPU_DIR .)
#   $GPU_DIR/before/jbench-*.whl   jbench from the tree before the change
#   $GPU_DIR/llama.cpp.tar.xz, $GPU_DIR/gemma3_270m_F16_header.gguf.xz   as for bench/settle_device.sh
# usage: bash bench/lean_energy_device.sh [BUDGET_S]
set -u
export PYTHONUNBUFFERED=1
BUDGET=${1:-560}
source bench/gpu26_setup.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt

# The sensor: read NVML as fast as it answers, 2 s idle, then during a decode run; intervals between changed values.
PYTHONPATH=$W/site python3 - $B/llama-bench $W/ladder/Q4_0.gguf > $OUT/nvml-probe.json <<'PY'
import json, statistics, subprocess, sys, threading, time
import pynvml
pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
FI = pynvml.NVML_FI_DEV_POWER_INSTANT
def read(seconds):
    rows, end = [], time.time() + seconds
    while time.time() < end:
        t = time.time()
        inst = pynvml.nvmlDeviceGetFieldValues(h, [FI])[0].value.uiVal / 1000.0
        rows.append((t, inst, pynvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0))
    return rows
def summary(rows):
    out = {"reads": len(rows), "read_interval_ms": 1000 * statistics.median(b[0] - a[0] for a, b in zip(rows, rows[1:]))}
    for i, name in ((1, "power_instant"), (2, "energy_counter")):
        ch = [b[0] for a, b in zip(rows, rows[1:]) if b[i] != a[i]]
        gaps = [1000 * (b - a) for a, b in zip(ch, ch[1:])]
        out[name] = {"changes": len(ch), "median_ms": statistics.median(gaps) if gaps else None,
                     "p10_ms": statistics.quantiles(gaps, n=10)[0] if len(gaps) > 10 else None,
                     "p90_ms": statistics.quantiles(gaps, n=10)[-1] if len(gaps) > 10 else None}
    return out
res = {"idle": summary(read(2.0))}
p = subprocess.Popen([sys.argv[1], "-m", sys.argv[2], "-p", "0", "-n", "256", "-r", "20", "-ngl", "99"],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(1.0)
res["decode"] = summary(read(2.0))
p.wait()
print(json.dumps(res, indent=1))
PY
cat $OUT/nvml-probe.json

export JBENCH_CACHE_DIR=$W/cache
COMMON=(+experiment=quant_ladder backend.binary_dir=$B model.source=files "model.path_template='$W/ladder/{quant}.gguf'"
        model.quant=Q4_0,Q8_0,F16 telemetry.source=nvml quality.enabled=false sweep.rerun=true)
ms() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }
: > $OUT/walls.txt
for round in 1 2 3 4; do
  for variant in bare before lean; do
    # A round of the three starts only if it should end within the budget (before ~80 s, lean ~30 s, bare ~4 s).
    [ $(( $(date +%s) - T0 + 120 )) -gt $BUDGET ] && { echo "out of time before round $round $variant"; break 2; }
    s=$(date +%s%N)
    case $variant in
      bare) for q in Q4_0 Q8_0 F16; do
              q0=$(date +%s%N)
              $B/llama-bench -m $W/ladder/$q.gguf -p 128 -n 64 -d 0 -r 4 -ngl 99 -ctk f16 -ctv f16 -o jsonl > /dev/null 2>&1
              echo "$round bare-$q $(ms $q0)" >> $OUT/walls.txt
            done ;;
      lean) JBENCH_RESULTS_DIR=$W/results-lean PYTHONPATH=$W/site jbench sweep "${COMMON[@]}" -o csv \
              > $W/sweep-lean-$round.csv 2> $W/sweep-lean-$round.err ;;
      before) JBENCH_RESULTS_DIR=$W/results-before PYTHONPATH=$W/site-old $W/site-old/bin/jbench sweep "${COMMON[@]}" \
              -o csv > $W/sweep-before-$round.csv 2> $W/sweep-before-$round.err ;;
    esac
    echo "$round $variant $(ms $s)" | tee -a $OUT/walls.txt
  done
done
for v in lean before; do
  JBENCH_RESULTS_DIR=$W/results-$v PYTHONPATH=$W/site jbench export --out $OUT/runs-$v.csv > /dev/null 2>&1
done
PYTHONPATH=$W/site python3 - $OUT <<'PY'
import sys, pandas as pd
out = sys.argv[1]
for v in ("lean", "before"):
    df = pd.read_csv(f"{out}/runs-{v}.csv")
    cols = ["params.model.quant", "metrics.measure_wall_s", "metrics.trial_wall_s", "metrics.idle_window_s",
            "metrics.cooldown_window_s", "metrics.power_sensor_period_ms", "metrics.prefill_window_s",
            "metrics.prefill_energy_edge_error_pct", "metrics.prefill_tokens_per_joule", "metrics.decode_window_s",
            "metrics.decode_energy_edge_error_pct", "metrics.decode_tokens_per_joule", "metrics.decode_energy_deviation_pct"]
    print(f"== {v}"); print(df[[c for c in cols if c in df]].to_string())
    for c in ("tags.energy.prefill.window", "tags.energy.decode.window", "tags.telemetry.idle_wait",
              "tags.telemetry.cooldown_wait", "tags.energy.status"):
        if c in df: print(c, "|", " || ".join(map(str, df[c].tolist()))[:1500])
PY
cp $W/sweep-*.err $OUT/ 2>/dev/null
echo "all at $(( $(date +%s) - T0 )) s"
