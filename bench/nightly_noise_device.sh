#!/bin/bash
# Nightly noise on the workplace's GPU host (issue 15): back-to-back `jbench sweep +experiment=$EXPERIMENT
# sweep.rerun=true` ("nights") into one results dir, then per configuration the night-to-night and within-run CVs
# (bench/regress_sensitivity.py measure). Run from the repository root there, with:
#   .whl/*.whl              py3.12 wheels of jbench's dependencies (a jbench wheel there is ignored)
#   $NOISE_DIR/jbench-*.whl jbench built from the tree under test (pip wheel --no-deps -w $NOISE_DIR .);
#                           also regress_sensitivity.py when the tree sent is not the one under test
#   $GPU_DIR/               llama.cpp.tar.xz and gemma3_270m_F16_header.gguf.xz, as for bench/gpu_roofline/run.sh
# usage: bash bench/nightly_noise_device.sh gpu|cpu [BUDGET_S] [NIGHTS] [jbench sweep overrides...]
#   gpu: the CUDA build, telemetry from NVML (tokens/J per run from the GPU's power readings; TELEMETRY=none: none).
#   cpu: a CPU build (no CUDA; -march=native) in $WORK_DIR/cpu, jbench and llama-bench pinned to cores 8-15,
#        backend.threads=8, no power sensor (telemetry.source=none).
# EXPERIMENT (default quant_ladder): the experiment each night sweeps. ALT (space-separated overrides): a second
#   variant of it, run right after the first every night into its own store (results-MODE-alt), so both see the
#   same machine and the same hour; e.g. ALT='backend.n_gen=512'.
# Idempotent: the build, the ladder and the store stay in $WORK_DIR (default /root/jb), so a later call on a warm
# machine adds nights to the same store. A night starts only if it should end within BUDGET_S seconds of this call.
set -u
export PYTHONUNBUFFERED=1
MODE=${1:?usage: nightly_noise_device.sh gpu|cpu [BUDGET_S] [NIGHTS]}
EXPERIMENT=${EXPERIMENT:-quant_ladder}; ALT=${ALT:-}; TELEMETRY=${TELEMETRY:-nvml}
BUDGET=${2:-540}; NIGHTS=${3:-14}; shift $(( $# < 3 ? $# : 3 ))
T0=$(date +%s)
ROOT=$PWD; W=${WORK_DIR:-/root/jb}; NOISE_DIR=${NOISE_DIR:-$ROOT/.gpu/noise}; GPU_DIR=${GPU_DIR:-$ROOT/.gpu}
OUT=${OUT:-$W/out}; mkdir -p "$OUT" "$W"
LOG=$OUT/log-$MODE.txt

# cpu: its own work dir whose build/ is a CPU build made first, so run.sh below finds a build and makes no CUDA one.
if [ "$MODE" = cpu ]; then
  W=$W/cpu; mkdir -p $W
  if [ ! -x $W/build/bin/llama-bench ]; then
    rm -rf $W/src $W/build; mkdir -p $W/src && tar -xJf $GPU_DIR/llama.cpp.tar.xz -C $W/src
    cmake -S $W/src/llama.cpp -B $W/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_COMMIT=0c1e57098 > $W/cmake.log 2>&1 \
      && cmake --build $W/build -j 16 --target llama-bench llama-quantize > $W/build.log 2>&1 || { tail -40 $W/build.log; exit 1; }
    echo "llama.cpp CPU build done at $(( $(date +%s) - T0 )) s" | tee -a $LOG
  fi
fi
# The dependencies' wheels with this tree's jbench instead of any older one in .whl/ (two versions stop pip).
if [ ! -d $W/site/jbench ]; then
  mkdir -p $W/wheels && rm -f $W/wheels/*.whl
  for f in .whl/*.whl; do case $(basename $f) in jbench-*) ;; *) ln -sf $ROOT/$f $W/wheels/ ;; esac; done
  ln -sf $NOISE_DIR/jbench-*.whl $W/wheels/
fi
# The CUDA build (unless a build is there) and the quant ladder (random weights in the bundled model's shapes) as the roofline check made them.
G=$W/g; mkdir -p $G
cp bench/gpu_roofline/run.sh bench/gpu_roofline/fill_model.py $G/
ln -sf $GPU_DIR/llama.cpp.tar.xz $GPU_DIR/gemma3_270m_F16_header.gguf.xz $G/
WORK_DIR=$W WHEELS=$W/wheels OUT=$W/roofline-out bash $G/run.sh > $W/setup.txt 2>&1 || { tail -30 $W/setup.txt; exit 1; }
grep -h 'build:' $W/setup.txt | tee -a $LOG; echo "set up at $(( $(date +%s) - T0 )) s" | tee -a $LOG
export PYTHONPATH=$W/site PATH=$W/site/bin:$PATH
python3 -c "import jbench, pynvml, ruptures; print('jbench from', jbench.__file__)" || exit 1

B=$W/build/bin
if [ "$MODE" = cpu ]; then
  # Cores 8-15 for the benchmark and its controller (llama-bench inherits the mask), 8 threads.
  PIN="taskset -c 8-15"; EXTRA=(telemetry.source=none backend.threads=8)
else
  PIN=""; EXTRA=(telemetry.source=$TELEMETRY)
fi
export JBENCH_CACHE_DIR=$W/cache
echo "experiment $EXPERIMENT; sweep overrides: ${EXTRA[*]} $*${ALT:+; alt: $ALT}" | tee -a $LOG
{ date -u; nproc; uname -r; python3 --version; nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,clocks.max.mem,persistence_mode --format=csv
  $B/llama-bench --version 2>&1 | tail -2; lscpu | grep -E 'Model name|^CPU\(s\)|Thread|NUMA node\(s\)'; } > $OUT/host-$MODE.txt 2>&1
cat $OUT/host-$MODE.txt

# One night of a variant: TAG names its store and its nights' folder.
night() {  # TAG N [overrides...]
  local tag=$1 n=$2; shift 2
  JBENCH_RESULTS_DIR=$W/results-$tag $PIN jbench sweep +experiment=$EXPERIMENT sweep.rerun=true backend.binary_dir=$B \
    model.source=files "model.path_template='$W/ladder/{quant}.gguf'" "${EXTRA[@]}" "$@" -o csv > $W/nights-$tag/$n.csv 2> $W/nights-$tag/$n.err
  local rc=$?
  [ $rc = 0 ] || { tail -20 $W/nights-$tag/$n.err; mv $W/nights-$tag/$n.csv $W/nights-$tag/$n.failed; }
  return $rc
}
TAGS=($MODE); [ -n "$ALT" ] && TAGS+=($MODE-alt)
for t in "${TAGS[@]}"; do mkdir -p $W/nights-$t; done
n=$(ls $W/nights-$MODE | grep -c '\.csv$'); longest=0
while [ $n -lt $NIGHTS ]; do
  now=$(date +%s)
  if [ $(( now - T0 + longest + 15 )) -gt $BUDGET ]; then echo "budget: stop before night $((n + 1))" | tee -a $LOG; break; fi
  n=$((n + 1))
  night $MODE $n "$@" || break
  [ -z "$ALT" ] || night $MODE-alt $n "$@" $ALT || break
  took=$(( $(date +%s) - now )); [ $took -gt $longest ] && longest=$took
  echo "night $n ($MODE${ALT:+ and alt}): $took s, $(( $(date +%s) - T0 )) s into this call" | tee -a $LOG
done
cut -d, -f1-6 $W/nights-$MODE/$n.csv 2>/dev/null | head -8
# What comes back: the runs as a table, the noise figures, and the store itself (MLflow SQLite) to measure again here.
RS=bench/regress_sensitivity.py; [ -f $NOISE_DIR/regress_sensitivity.py ] && RS=$NOISE_DIR/regress_sensitivity.py
for t in "${TAGS[@]}"; do
  JBENCH_RESULTS_DIR=$W/results-$t jbench export --out $OUT/runs-$t.csv 2>&1 | tail -1
  python3 $RS measure --store $W/results-$t --experiment $EXPERIMENT --no-other-sources --out $OUT/noise-$t.json > /dev/null && python3 - "$OUT/noise-$t.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[1], "sweeps", d["sweeps"])
for label, e in d["configurations"].items():
    print(label, {m: {k: round(v, 5) if isinstance(v, float) else v for k, v in e[m].items()}
                  for m in ("decode_tps", "prefill_tps", "decode_tokens_per_joule") if m in e})
PY
  tar -C $W/results-$t -czf $OUT/store-$t.tar.gz mlflow.db
  cat $W/nights-$t/*.err | grep -iE 'warn|error|not measured|withheld' | sort | uniq -c | sort -rn | head -15
done
ls -la $OUT
