#!/bin/bash
# The same-night control on the workplace's GPU host (issue 26 part 3): back-to-back `jbench nightly` nights of a
# one-unit class (this machine, device_class h100) whose reference build is a copy of the build under test, so every
# night's paired ratio test/reference measures only noise. The nightly matrix as shipped (+experiment=nightly:
# 10 repetitions, 2 rounds, T R R T) on the Q4_0, Q8_0 and F16 ladder at depth 0, speed only (telemetry.source=none,
# quality off). ROUNDS (default 2, as shipped) sets sweep.rounds: each round runs every configuration with both builds,
# alternating their order (T R R T ...). The store goes to $OUT/nightly-store.tar.gz for
# bench/nightly_paired_sensitivity.py.
# Run from the repository root there (the `run` tool, carry [".whl", "$GPU_DIR"]); see bench/gpu26_setup.sh.
# usage: bash bench/nightly_paired_device.sh [BUDGET_S] [NIGHTS]
set -u
export PYTHONUNBUFFERED=1
BUDGET=${1:-560}; NIGHTS=${2:-20}
source bench/gpu26_setup.sh || exit 1
C=$W/nightly-conf; REF=$W/reference/bin
mkdir -p $C/device $W/state
cat > $C/device/gpu0.yaml <<YAML
defaults:
  - device_schema
  - _self_
name: gpu0
kind: local
device_class: h100
paths:
  state_dir: $W/state
YAML
# The reference: a copy kept beside the build, never replaced in place (the nightly checks its commit).
[ -x $REF/llama-bench ] || { mkdir -p $W/reference && cp -a $B $REF; }
export JBENCH_RESULTS_DIR=$W/results-nightly${ROUNDS:+-r$ROUNDS} JBENCH_CACHE_DIR=$W/cache PYTHONPATH=$W/site
ARGS=(--config-dir $C backend.binary_dir=$B farm.reference=$REF model.source=files
      "model.path_template='$W/ladder/{quant}.gguf'" model.quant=Q4_0,Q8_0,F16 backend.depth=0
      telemetry.source=none quality.enabled=false sweep.rounds=${ROUNDS:-2})
last=60
for night in $(seq 1 $NIGHTS); do
  [ $(( $(date +%s) - T0 + last + 20 )) -gt $BUDGET ] && { echo "out of time before night $night"; break; }
  s=$(date +%s)
  jbench nightly h100 "${ARGS[@]}" --markdown $W/night-$night.md > $W/night-$night.log 2>&1
  rc=$?; last=$(( $(date +%s) - s ))
  echo "night $night rc=$rc wall ${last} s"
  grep -m3 "control: gpu0" $W/night-$night.log | cut -c1-220
done
nvidia-smi --query-gpu=temperature.gpu,clocks.sm --format=csv,noheader
tar -czf $OUT/nightly-store.tar.gz -C $JBENCH_RESULTS_DIR mlflow.db 2>/dev/null || ls $JBENCH_RESULTS_DIR
cp $W/night-1.log $OUT/ 2>/dev/null
echo "all at $(( $(date +%s) - T0 )) s"
