#!/bin/bash
# The farm's utilisation scenario on a bigger controller machine (the workplace's GPU host: 16 cores), so that 64
# emulated devices and the controller do not share 2 cores. Run from the repository root with the py3.12 wheels
# of jbench and its dependencies in .whl/ (pip wheel --no-deps -w .whl . for jbench itself):
#   bash bench/farm_scale_device.sh [farm_scale.py options]
# Results: $OUT (or bench/results/farm-scale/gpu-host/).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/farm-scale/gpu-host}; mkdir -p "$OUT"
# A host without OpenSSH (the GPU host has none, and nothing can be downloaded there): Debian 12's binaries, carried
# in .gpu/openssh-bookworm.tar.gz (sshd, ssh, ssh-keygen and the libraries the host lacks), made as in docs/PERFORMANCE.md.
if [ ! -x /usr/sbin/sshd ] && [ -f .gpu/openssh-bookworm.tar.gz ]; then
  tar xzf .gpu/openssh-bookworm.tar.gz -C /tmp
  cp /tmp/osh/sbin/sshd /usr/sbin/ && cp /tmp/osh/bin/ssh /tmp/osh/bin/ssh-keygen /usr/bin/
  for l in /tmp/osh/lib/*; do [ -e /usr/lib/x86_64-linux-gnu/$(basename $l) ] || cp $l /usr/lib/x86_64-linux-gnu/; done
  ldconfig
  getent passwd sshd >/dev/null || useradd -r -d /run/sshd -s /usr/sbin/nologin sshd
  mkdir -p /run/sshd && chmod 755 /run/sshd
fi
[ -x /usr/sbin/sshd ] && command -v ssh-keygen >/dev/null || { echo "no OpenSSH server/client here"; exit 3; }
/usr/sbin/sshd -V 2>&1 | head -1
# Into the host's own Python environment (its numpy, pandas, scipy, matplotlib...; the machine is thrown away after).
PY=$(command -v python3); V=$(dirname "$PY")
if [ ! -x $V/jbench ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile $(ls .whl/*.whl | grep -v -e cp311-cp311) || exit 1
fi
$PY -c "import jbench.cli, mlflow, paramiko, hydra, pandas, scipy, rich; print('python ok', mlflow.__version__)" || exit 1
# farm_scale.py puts the checkout first on the sweeps' PYTHONPATH; outside an editable install the checkout's jbench/
# has no conf/ (pyproject maps conf/ to jbench.conf), so give it one in this throw-away copy.
[ -e jbench/conf ] || ln -s ../conf jbench/conf
(nproc; uptime; python3 --version; id) | tee "$OUT/host.txt"
$PY bench/farm_scale.py --out "$OUT" "$@"
