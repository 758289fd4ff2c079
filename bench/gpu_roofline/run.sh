#!/bin/bash
# GPU roofline verification on the device machine. Idempotent: each step is skipped when its output is already in WORK_DIR.
# usage: bash run.sh [sweep]   (next to it: llama.cpp.tar.xz, gemma3_270m_F16_header.gguf.xz, wheels/; see docs/PERFORMANCE.md)
set -u
export PYTHONUNBUFFERED=1
G=$(cd "$(dirname "$0")" && pwd); W=${WORK_DIR:-$G/work}; B=$W/build/bin; WHEELS=${WHEELS:-$G/wheels}
OUT=${OUT:-$W/out}; mkdir -p "$OUT"  # where the figures land
mkdir -p $W/ladder
if [ ! -d $W/site/jbench ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $W/site $WHEELS/*.whl || exit 1
fi
export PYTHONPATH=$W/site PATH=$W/site/bin:$PATH
if [ ! -x $B/llama-bench ]; then
  rm -rf $W/src $W/build; mkdir -p $W/src && tar -xJf $G/llama.cpp.tar.xz -C $W/src
  cmake -S $W/src/llama.cpp -B $W/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_COMMIT=0c1e57098 > $W/cmake.log 2>&1 || { tail -40 $W/cmake.log; exit 1; }
  s=$(date +%s)
  cmake --build $W/build -j 16 --target llama-bench llama-quantize > $W/build.log 2>&1 || { tail -40 $W/build.log; exit 1; }
  echo "llama.cpp CUDA build: $(( $(date +%s) - s )) s"
fi
if [ ! -f $W/ladder/F16.gguf ]; then
  xz -dc $G/gemma3_270m_F16_header.gguf.xz > $W/hdr.gguf
  python3 $G/fill_model.py $W/hdr.gguf $W/ladder/F16.gguf.tmp 542833344 && mv $W/ladder/F16.gguf.tmp $W/ladder/F16.gguf
fi
[ "${1:-}" = build-only-270m-f16 ] && exit 0
for q in Q4_0 Q4_K_M Q5_K_M Q6_K Q8_0; do
  [ -f $W/ladder/$q.gguf ] || { $B/llama-quantize $W/ladder/F16.gguf $W/ladder/$q.tmp $q > $W/q-$q.log 2>&1 && mv $W/ladder/$q.tmp $W/ladder/$q.gguf; } &
done; wait
ls -la $W/ladder
[ "${1:-}" = sweep ] || exit 0
export JBENCH_RESULTS_DIR=$W/results JBENCH_CACHE_DIR=$W/cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem --format=csv | tee $OUT/gpu.txt
jbench calibrate local --probe both --runs 7 2>&1 | tee $OUT/calibrate.txt
cp $W/cache/calibration/local/*.json $OUT/ 2>/dev/null
jbench sweep +experiment=quant_ladder backend.binary_dir=$B model.source=files "model.path_template='$W/ladder/{quant}.gguf'" -o csv > $OUT/sweep.csv 2> $OUT/sweep.err; echo "sweep rc=$?"
cat $OUT/sweep.csv; tail -5 $OUT/sweep.err
jbench export --out $OUT/runs.csv 2>&1 | tail -2
python3 - <<'PY'
import pandas as pd, os
df = pd.read_csv(os.environ["OUT"] + "/runs.csv")
cols = [c for c in df.columns if "roofline" in c or c in ("params.model.quant", "metrics.decode_tps", "status", "tags.finding.ceiling_below_measured")]
print(df[cols].T.to_string())
PY
