#!/bin/bash
# Issue 28 on the workplace's GPU host: a complete measured grid of 108 configurations (the 2B Gemma-3-shaped model,
# random weights, bandwidth-bound on an H100: 6 quants x flash attention on/off x K-cache f16/q8_0/q4_0 x n_ubatch
# 32/64/128 at a 128-token prompt) with NVML energy, for bench/search_replay.py. Also the driver of
# bench/technique_device.sh (issue 27 techniques), so both share one machine's build.
#
# The work runs detached (setsid) on the device machine, so it outlives the 10-minute limit of one `run` call: each
# call starts it if it is not running, then follows its log for WAIT_S seconds and packs what exists into $OUT.
# Run from the repository root there (the `run` tool, carry [".whl", ".gpu26"]; inputs as for bench/gpu26_setup.sh):
#   bash bench/search_grid_device.sh start "grid tech"   # parts in order: grid (this file), tech (technique_device.sh)
#   bash bench/search_grid_device.sh wait                # the next calls, while the machine is warm
# Results in $OUT: driver.log, grid-mlflow.db.xz (a consistent copy of the grid's store, artifacts left out),
# grid-out.tar.xz (sweep summary, export, GPU line), tech.tar.xz (technique figures and their store).
# Resume on a fresh machine: put the store at .gpu26/resume/grid-mlflow.db.xz; the sweep skips FINISHED trials.
set -u
export PYTHONUNBUFFERED=1
W=/root/jb26; mkdir -p $W
WAIT_S=${WAIT_S:-555}

pack() {  # what exists now, into the call's $OUT (8 files at most)
  local out=$1
  cp $W/driver.log $out/ 2>/dev/null
  if [ -f $W/results-grid/mlflow.db ]; then
    python3 -c "import sqlite3,sys; s=sqlite3.connect(sys.argv[1]); d=sqlite3.connect(sys.argv[2]); s.backup(d); d.close()" \
      $W/results-grid/mlflow.db $W/grid-copy.db && xz -T0 -6 -c $W/grid-copy.db > $out/grid-mlflow.db.xz
  fi
  [ -d $W/out-grid ] && tar -C $W -cJf $out/grid-out.tar.xz out-grid
  if [ -d $W/out-tech ]; then
    local extra=""; [ -f $W/results-tech/mlflow.db ] && extra="results-tech"
    tar -C $W -cJf $out/tech.tar.xz out-tech $extra
  fi
  ls -la $out
}

follow() {  # print the driver log from where the last call stopped, until done or WAIT_S
  local deadline=$(( $(date +%s) + WAIT_S )) off last_gpu=0
  while :; do
    off=$(cat $W/log.offset 2>/dev/null || echo 0)
    if [ -f $W/driver.log ]; then
      tail -c +$(( off + 1 )) $W/driver.log; stat -c %s $W/driver.log > $W/log.offset
    fi
    if [ $(( $(date +%s) - last_gpu )) -ge 60 ]; then
      last_gpu=$(date +%s)
      echo "[poll $(date -u +%T)] $(nvidia-smi --query-gpu=temperature.gpu,power.draw,utilization.gpu,memory.used --format=csv,noheader 2>&1)"
    fi
    [ -f $W/driver.done ] && { echo "[poll] driver done: $(cat $W/driver.done)"; break; }
    [ $(date +%s) -ge $deadline ] && { echo "[poll] call ends; driver still running"; break; }
    sleep 5
  done
}

grid() {
  local G=$W/out-grid; mkdir -p $G
  export JBENCH_RESULTS_DIR=$W/results-grid JBENCH_CACHE_DIR=$W/cache
  if [ ! -f $W/results-grid/mlflow.db ] && [ -f $ROOT/.gpu26/resume/grid-mlflow.db.xz ]; then
    mkdir -p $W/results-grid && xz -dc $ROOT/.gpu26/resume/grid-mlflow.db.xz > $W/results-grid/mlflow.db
    echo "grid: resuming from the carried store"
  fi
  nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee -a $G/gpu.txt
  local ARGS=(experiment.name=search_grid_h100 backend.binary_dir=$B model.source=files
    "model.path_template='$W/big/{quant}.gguf'" model.quant=Q4_0,Q4_K_M,Q5_K_M,Q6_K,Q8_0,F16
    backend.flash_attn=on,off backend.cache_type_k=f16,q8_0,q4_0 backend.n_ubatch=32,64,128
    backend.n_prompt=128 backend.n_gen=32 backend.repetitions=3 telemetry.source=nvml quality.enabled=false
    telemetry.idle_s=0.5 telemetry.cooldown_s=0 energy.max_edge_error=0.05)
  echo "grid: jbench sweep ${ARGS[*]} -o csv" | tee -a $G/command.txt
  echo "grid: start $(date -u +%FT%TZ)" | tee -a $G/command.txt
  local s=$(date +%s)
  jbench sweep "${ARGS[@]}" -o csv > $G/sweep-$(date +%s).csv 2> >(tee -a $G/sweep.err >&2)
  local rc=$?
  echo "grid: end $(date -u +%FT%TZ) rc=$rc wall $(( $(date +%s) - s )) s" | tee -a $G/command.txt
  jbench export --out $G/runs-grid.csv > /dev/null 2>&1
}

body() {  # the detached work: set-up, then each part in order
  cd $ROOT
  unset OUT
  SERVER=1 source bench/gpu26_setup.sh || { echo "set-up failed" ; echo "setup-failed" > $W/driver.done; exit 1; }
  export PYTHONPATH=$W/site JBENCH_CACHE_DIR=$W/cache
  python3 -c "import pandas, optuna; print('pandas', pandas.__version__, 'optuna', optuna.__version__)"
  mkdir -p $W/big
  if [ ! -f $W/big/F16.gguf ]; then
    python3 $W/gen_big.py $W/ladder/F16.gguf $W/big/F16.tmp > /dev/null && mv $W/big/F16.tmp $W/big/F16.gguf
  fi
  for q in Q4_0 Q4_K_M Q5_K_M Q6_K Q8_0; do
    [ -f $W/big/$q.gguf ] || { $B/llama-quantize $W/big/F16.gguf $W/big/$q.tmp $q 3 > $W/qb-$q.log 2>&1 \
                               && mv $W/big/$q.tmp $W/big/$q.gguf; } &
  done; wait
  ls -la $W/big; echo "2B models at $(( $(date +%s) - T0 )) s"
  for part in $PARTS; do
    echo "=== part $part at $(( $(date +%s) - T0 )) s"
    case $part in
      grid) grid ;;
      tech) source $W/technique_device.sh; techniques ;;
    esac
  done
  echo "=== all done at $(( $(date +%s) - T0 )) s"
  echo "ok" > $W/driver.done
}

case "${1:-wait}" in
  start)
    if [ -f $W/driver.started ] && [ ! -f $W/driver.done ]; then
      echo "driver already running (started $(cat $W/driver.started))"
    else
      rm -f $W/driver.done $W/log.offset
      cp bench/search_grid_device.sh bench/technique_device.sh bench/gpu_roofline/gen_big.py $W/
      date -u +%FT%TZ > $W/driver.started
      ROOT=$PWD PARTS="${2:-grid tech}" setsid bash $W/search_grid_device.sh body > $W/driver.log 2>&1 < /dev/null &
      sleep 2
    fi
    follow; pack "${OUT:-$W/out-call}" ;;
  wait) follow; pack "${OUT:-$W/out-call}" ;;
  body) body ;;
esac
