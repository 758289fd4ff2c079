#!/bin/bash
# Second verification: a ~2B-parameter Gemma-3-shaped model (random weights), where decode on the H100 is
# bandwidth-bound. Idempotent like run.sh.
set -u
export PYTHONUNBUFFERED=1
G=$(cd "$(dirname "$0")" && pwd); W=${WORK_DIR:-$G/work}; B=$W/build/bin
OUT=${OUT:-$W/out}; mkdir -p "$OUT"  # where the figures land
bash $G/run.sh build-only-270m-f16 || exit 1
export PYTHONPATH=$W/site PATH=$W/site/bin:$PATH
mkdir -p $W/big
[ -f $W/big/F16.gguf ] || { python3 $G/gen_big.py $W/ladder/F16.gguf $W/big/F16.tmp && mv $W/big/F16.tmp $W/big/F16.gguf; }
for q in Q4_0 Q4_K_M Q8_0; do
  [ -f $W/big/$q.gguf ] || { $B/llama-quantize $W/big/F16.gguf $W/big/$q.tmp $q 8 > $W/qb-$q.log 2>&1 && mv $W/big/$q.tmp $W/big/$q.gguf; } &
done; wait
ls -la $W/big
export JBENCH_RESULTS_DIR=$W/results-big JBENCH_CACHE_DIR=$W/cache
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv | tee $OUT/gpu.txt
jbench calibrate local --probe gpu --runs 7 2>&1 | tee $OUT/calibrate.txt
jbench sweep +experiment=quant_ladder backend.binary_dir=$B model.source=files "model.path_template='$W/big/{quant}.gguf'" 'model.quant=Q4_0,Q4_K_M,Q8_0,F16' -o csv > $OUT/sweep_big.csv 2> $OUT/sweep_big.err; echo "sweep rc=$?"
cat $OUT/sweep_big.csv | cut -d, -f2,4,14,16 ; tail -3 $OUT/sweep_big.err
