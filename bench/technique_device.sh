#!/bin/bash
# Issue 27 techniques on the workplace's GPU host (one H100, CUDA build of llama.cpp 0c1e57098, NVML energy):
# CUDA graphs on/off (backend.env GGML_CUDA_DISABLE_GRAPHS) in the bench scenario on the Gemma-3-270M-shaped ladder
# (launch-bound) and the 2B-shaped model (bandwidth-bound), and in the serving scenario; speculative decoding
# (+experiment=speculative) on the 270M ladder and with the 2B-shaped F16 target drafted by its own Q4_0, by the
# 270M Q4_0 (same tokenizer metadata: gen_big.py copies it) and by ngram-simple. All models have RANDOM weights.
# Each comparison is `jbench compare` on the stored trials (change with its 95 % interval).
#
#   bash bench/technique_device.sh          # on the device: set-up, then the techniques (detached; see
#                                           # bench/search_grid_device.sh for start/wait and what lands in $OUT)
# Sourced by bench/search_grid_device.sh's driver, which calls `techniques` after the set-up (W, B set).

tech_sweep() {  # name, overrides...: one sweep, its summary csv and log in $T, its sweep id (the newest) in $T/$name.sid
  local name=$1; shift
  echo "== $name: jbench sweep $*" | tee -a $T/commands.txt
  local s=$(date +%s)
  timeout 900 jbench sweep "$@" -o csv > $T/$name.csv 2> >(tee $T/$name.err >&2)
  local rc=$?
  echo "== $name rc=$rc wall $(( $(date +%s) - s )) s" | tee -a $T/commands.txt
  sleep 1
  python3 - $JBENCH_RESULTS_DIR > $T/$name.sid <<'PY'
import sys
from mlflow.tracking import MlflowClient
c = MlflowClient(f"sqlite:///{sys.argv[1]}/mlflow.db")
ids = [e.experiment_id for e in c.search_experiments()]
runs = c.search_runs(ids, filter_string="tags.`jbench.kind` = 'sweep'", order_by=["attributes.start_time DESC"], max_results=1)
print(runs[0].data.tags["jbench.sweep_id"] if runs else "")
PY
  echo "== $name sweep id $(cat $T/$name.sid)"
  cat $T/$name.csv
}

tech_runs() {  # sweep id -> "run_id draft spec_type env" per trial, in start order
  python3 - $JBENCH_RESULTS_DIR "$1" <<'PY'
import sys
from mlflow.tracking import MlflowClient
store, sid = sys.argv[1], sys.argv[2]
c = MlflowClient(f"sqlite:///{store}/mlflow.db")
ids = [e.experiment_id for e in c.search_experiments()]
runs = c.search_runs(ids, filter_string=f"tags.`jbench.sweep_id` = '{sid}'", max_results=1000)
for r in sorted(runs, key=lambda r: r.info.start_time):
    if r.data.tags.get("jbench.kind") != "trial":
        continue
    p = r.data.params
    env = ",".join(f"{k[len('backend.env.'):]}" for k in p if k.startswith("backend.env.")) or "graphs-on"
    print(r.info.run_id, p.get("backend.draft", "none").replace("/root/jb26/ladder/", "270m-"),
          p.get("backend.spec_type", "none"), env, p.get("model.quant"), r.info.status)
PY
}

tech_compare() {  # out-name, jbench compare args...
  local name=${1//\//_}; shift
  echo "== compare $name: jbench compare $*" | tee -a $T/commands.txt
  jbench compare "$@" -o md 2>&1 | tee $T/compare-$name.md
}

techniques() {
  T=$W/out-tech; mkdir -p $T
  export JBENCH_RESULTS_DIR=$W/results-tech JBENCH_CACHE_DIR=$W/cache
  nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $T/gpu.txt
  date -u +%FT%TZ > $T/start.txt
  local C270=(backend.binary_dir=$B model.source=files "model.path_template='$W/ladder/{quant}.gguf'"
              telemetry.source=nvml quality.enabled=false)
  local CBIG=(backend.binary_dir=$B model.source=files "model.path_template='$W/big/{quant}.gguf'"
              telemetry.source=nvml quality.enabled=false)
  local ENV='backend.env={},{GGML_CUDA_DISABLE_GRAPHS:1}' sid

  # 1. CUDA graphs, bench scenario (llama-bench), 10 repetitions a phase.
  tech_sweep graphs-270m +experiment=quant_ladder "${C270[@]}" model.quant=Q4_0,F16 "$ENV" backend.repetitions=10
  sid=$(cat $T/graphs-270m.sid)
  tech_compare graphs-270m 'backend.env={}' 'backend.env.GGML_CUDA_DISABLE_GRAPHS=1' --along backend.env --sweep $sid
  tech_sweep graphs-2b +experiment=quant_ladder "${CBIG[@]}" model.quant=Q4_0 "$ENV" backend.repetitions=10
  sid=$(cat $T/graphs-2b.sid)
  tech_compare graphs-2b 'backend.env={}' 'backend.env.GGML_CUDA_DISABLE_GRAPHS=1' --along backend.env --sweep $sid

  # 2. Speculative decoding, latency scenario: F16 target; no draft, its own Q4_0, ngram-simple.
  tech_sweep spec-270m +experiment=speculative "${C270[@]}" backend.latency_requests=16
  tech_runs $(cat $T/spec-270m.sid) | tee $T/spec-270m.runs
  # the 2B F16 target: no draft, its own Q4_0, the 270M Q4_0 (same vocabulary), ngram-simple
  tech_sweep spec-2b +experiment=speculative "${CBIG[@]}" 'sweep.grid={}' \
    "backend.draft=null,Q4_0,$W/ladder/Q4_0.gguf,null" 'backend.spec_type=null,null,null,ngram-simple' \
    'sweep.link=[[backend.draft,backend.spec_type]]' backend.latency_requests=16
  tech_runs $(cat $T/spec-2b.sid) | tee $T/spec-2b.runs
  local f a b
  for f in spec-270m spec-2b; do
    a=$(awk '$2=="none" && $3=="none" {print $1; exit}' $T/$f.runs)
    while read -r b draft spec rest; do
      [ "$b" = "$a" ] && continue
      if [ "$draft" != none ]; then tech_compare $f-draft-${draft} $a $b --along backend.draft
      else tech_compare $f-$spec $a $b --along backend.spec_type; fi
    done < $T/$f.runs
  done

  # 3. CUDA graphs in the serving scenario (llama-server, 8 slots, 1 and 8 in flight).
  tech_sweep serving-graphs +experiment=serving "${C270[@]}" model.quant=Q4_0 "$ENV" serving.slots=8 \
    'serving.levels=[1,8]' serving.requests_per_level=64 serving.input.kind=fixed serving.input.mean=128 \
    serving.output.mean=64

  jbench export --out $T/runs-tech.csv > /dev/null 2>&1
  date -u +%FT%TZ > $T/end.txt
}

# Run directly: the driver with this part only.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$(dirname "$0")/search_grid_device.sh" start tech
fi
