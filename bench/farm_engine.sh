#!/bin/sh
# bench/farm_scale.py's engine: a fixed sleep (the device-side work), stamped on the device's own clock.
# Usage: farm_engine.sh SECONDS PROMPT_TOKENS GEN_TOKENS CONTROLLER
# Appends "start end controller lease_pid lease_sweep" to $HOME/farm-bench-busy.log (the device's home):
# the busy interval, which controller's sweep ran it, and whose on-device lease was on the device meanwhile.
set -eu
seconds=$1 prompt=$2 gen=$3 controller=$4
t0=$(date +%s.%N)
sleep "$seconds"
t1=$(date +%s.%N)
lease=$(cat "$HOME"/.cache/jbench/lease-*.json 2>/dev/null | tr -d ' \n' || true)
pid=$(printf '%s' "$lease" | sed -n 's/.*"pid":\([0-9]*\).*/\1/p')
sweep=$(printf '%s' "$lease" | sed -n 's/.*"sweep_id":"\([^"]*\)".*/\1/p')
echo "$t0 $t1 $controller ${pid:--} ${sweep:--}" >> "$HOME/farm-bench-busy.log"
ms=$(awk "BEGIN { printf \"%d\", $seconds * 500 }")
echo "[engine] Prefill: $prompt tokens in $ms ms"
echo "[engine] Decode: $gen tokens in $ms ms"
