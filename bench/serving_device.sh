#!/bin/bash
# The serving scenario on the workplace's GPU host (issue 27): capacity per joule with NVML energy per level, the SLO
# search against a full grid, and the load generator against llama.cpp's own llama-batched-bench for the same slots.
# Run from the repository root there (the `run` tool, carry [".whl", ".gpu26"]); inputs as for bench/gpu26_setup.sh
# (SERVER=1 builds llama-server and llama-batched-bench too). Results: $OUT.
# usage: bash bench/serving_device.sh ladder|search
set -u
export PYTHONUNBUFFERED=1
SERVER=1 source bench/gpu26_setup.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
COMMON=(backend.binary_dir=$B model.source=files "model.path_template='$W/ladder/{quant}.gguf'" model.quant=Q4_0
        telemetry.source=nvml quality.enabled=false sweep.rerun=true)
case "${1:-ladder}" in
  ladder)
    # 8 slots; 1..32 in flight (beyond 8 the server queues); 128 requests of 128 in / 64 out per level.
    JBENCH_RESULTS_DIR=$W/results-ladder PYTHONPATH=$W/site jbench sweep +experiment=serving "${COMMON[@]}" \
      serving.slots=8 "serving.levels=[1,2,4,8,16,32]" serving.requests_per_level=128 serving.input.kind=fixed \
      serving.input.mean=128 serving.output.mean=64 serving.slo.ttft_ms=100 serving.slo.tpot_ms=20 \
      2>&1 | tee $OUT/ladder.txt
    (cd $W && PYTHONPATH=$W/site python3 - $W/results-ladder $OUT <<'PY'
import json, sys
from mlflow.tracking import MlflowClient
store, out = sys.argv[1], sys.argv[2]
c = MlflowClient(f"sqlite:///{store}/mlflow.db")
exp = c.get_experiment_by_name("serving")
[run] = [r for r in c.search_runs([exp.experiment_id]) if r.data.tags.get("jbench.kind") == "trial"]
c.download_artifacts(run.info.run_id, "serving", out)
json.dump({"metrics": run.data.metrics, "tags": {k: v for k, v in run.data.tags.items()
           if k.startswith(("serving", "energy", "telemetry"))}}, open(f"{out}/ladder-run.json", "w"), indent=2)
PY
    )
    # llama.cpp's own batched decode for the same shape: S_TG at 1..8 parallel sequences of 128 + 64 tokens.
    $B/llama-batched-bench -m $W/ladder/Q4_0.gguf -c 8192 -b 2048 -ub 512 -ngl 99 -npp 128 -ntg 64 -npl 1,2,4,8 \
      > $OUT/batched-bench.txt 2>&1; tail -12 $OUT/batched-bench.txt
    ;;
  search)
    PYTHONPATH=$W/site:$ROOT python3 bench/serving_search.py --max-load 16 --slots 4 --requests 48 \
      --json $OUT/search.json -- "${COMMON[@]}" serving.input.kind=fixed serving.input.mean=128 \
      serving.output.mean=64 2>&1 | tee $OUT/search.txt
    ;;
esac
echo "done at $(( $(date +%s) - T0 )) s"
