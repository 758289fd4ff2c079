#!/bin/bash
# Settled speed on the workplace's GPU host (issue 26 part 1): the quant ladder (Q4_0, Q8_0, F16 of a
# Gemma-3-270M-shaped model with random weights) with NVML energy, settled (backend.settle_repetitions=1, the default)
# and as before (settle_repetitions=0), alternating while the time budget lasts; then per trial prefill CV, cold
# repetitions, prefill tokens/J and why it was withheld. Results: docs/PERFORMANCE.md, bench/results/settle-h100/.
# Run from the repository root there (the `run` tool, carry [".whl", "$GPU_DIR"]), with
#   .whl/*.whl                py3.12 wheels of jbench's dependencies (no jbench wheel)
#   $GPU_DIR/jbench-*.whl     jbench built from the tree under test (pip wheel --no-deps -w $GPU_DIR .)
#   $GPU_DIR/llama.cpp.tar.xz the vendored llama.cpp of llama-cpp-python 0.3.36 (tools/ui, server, cli and the other
#                             GPU backends left out to fit the carry limit)
#   $GPU_DIR/gemma3_270m_F16_header.gguf.xz  the bundled model's F16 header (metadata + tensor table)
# usage: bash bench/settle_device.sh      (OUT: where the figures land; the run tool sets it)
set -u
export PYTHONUNBUFFERED=1
source bench/gpu26_setup.sh || exit 1
export PYTHONPATH=$W/site
export JBENCH_CACHE_DIR=$W/cache
COMMON=(+experiment=quant_ladder backend.binary_dir=$B model.source=files "model.path_template='$W/ladder/{quant}.gguf'"
        model.quant=Q4_0,Q8_0,F16 telemetry.source=nvml quality.enabled=false)
for q in Q4_0 Q8_0 F16; do s=$(date +%s%N); $B/llama-bench -m $W/ladder/$q.gguf -p 128 -n 64 -r 3 -ngl 99 -o jsonl > /dev/null 2>&1; echo "bare $q $(( ($(date +%s%N) - s) / 1000000 )) ms"; done
for round in 1 2; do
  for settle in 1 0; do
    [ $(( $(date +%s) - T0 )) -gt 480 ] && { echo "out of time before round $round settle $settle"; break 2; }
    R=$W/results-s$settle; export JBENCH_RESULTS_DIR=$R
    s=$(date +%s%N)
    jbench sweep "${COMMON[@]}" backend.settle_repetitions=$settle sweep.rerun=true -o csv > $W/sweep-s$settle-$round.csv 2> $W/sweep-s$settle-$round.err
    echo "round $round settle=$settle rc=$? wall $(( ($(date +%s%N) - s) / 1000000 )) ms"
  done
done
for settle in 1 0; do
  export JBENCH_RESULTS_DIR=$W/results-s$settle
  jbench export --out $OUT/runs-s$settle.csv > /dev/null 2>&1
  python3 - $OUT/runs-s$settle.csv $settle <<'PY'
import sys, pandas as pd
df = pd.read_csv(sys.argv[1])
df = df[df.get("tags.jbench.kind", "trial") == "trial"] if "tags.jbench.kind" in df else df
cols = ["params.model.quant", "metrics.prefill_tps", "metrics.prefill_tps_cv", "metrics.prefill_cold_repetitions",
        "metrics.prefill_cold_tps", "metrics.prefill_tokens_per_joule", "metrics.prefill_energy_speed_difference_pct",
        "metrics.decode_tps", "metrics.decode_tps_cv", "metrics.decode_cold_repetitions", "metrics.decode_tokens_per_joule",
        "metrics.trial_wall_s", "tags.jbench.noisy"]
print(f"== settle_repetitions={sys.argv[2]}")
print(df[[c for c in cols if c in df]].to_string())
for c in ("tags.energy.prefill.status", "tags.prefill.settle"):
    if c in df: print(c, "|", " || ".join(map(str, df[c].tolist())))
PY
done
cp $W/sweep-*.csv $W/sweep-*.err $OUT/ 2>/dev/null
echo "all at $(( $(date +%s) - T0 )) s"
