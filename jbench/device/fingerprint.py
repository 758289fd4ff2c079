"""What a device is, read from the device itself and recorded as tags on every run."""

from __future__ import annotations

import re

from jbench.device.connection import Connection

# One round trip: a constant script (no config value is pasted into it) printing marked sections.
_PROBE = r"""
echo '@@hostname'; hostname 2>/dev/null
echo '@@kernel'; uname -srm 2>/dev/null
echo '@@os'; cat /etc/os-release 2>/dev/null
echo '@@cpuinfo'; grep -m1 -E '^(model name|Hardware|Model)' /proc/cpuinfo 2>/dev/null
echo '@@lscpu'; LC_ALL=C lscpu 2>/dev/null | grep -m1 '^Model name'
echo '@@ncpu'; nproc 2>/dev/null
echo '@@meminfo'; grep -m1 MemTotal /proc/meminfo 2>/dev/null
echo '@@gpu'; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
echo '@@dtmodel'; tr -d '\0' < /proc/device-tree/model 2>/dev/null; echo
"""


def parse_sections(text: str) -> dict[str, str]:
    """Output of a probe script that prints `@@name` headers -> {name: section text}."""
    out: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("@@"):
            current = line[2:].strip()
            out[current] = ""
        elif current:
            out[current] += line + "\n"
    return {k: v.strip() for k, v in out.items()}


def parse_host_fingerprint(text: str) -> dict[str, str]:
    """Turn the probe's output into host.* tags; absent facts are left out, never invented."""
    s = parse_sections(text)
    tags: dict[str, str] = {}
    if s.get("hostname"):
        tags["host.hostname"] = s["hostname"]
    if s.get("kernel"):
        tags["host.kernel"] = s["kernel"]
    m = re.search(r'^PRETTY_NAME="?([^"\n]+)"?', s.get("os", ""), re.M)
    if m:
        tags["host.os"] = m.group(1)
    cpu = ""
    m = re.search(r"Model name:\s*(.+)", s.get("lscpu", ""))
    if m:
        cpu = m.group(1).strip()
    if not cpu:
        m = re.search(r":\s*(.+)", s.get("cpuinfo", ""))
        cpu = m.group(1).strip() if m else ""
    if cpu:
        tags["host.cpu"] = cpu
    if s.get("ncpu", "").isdigit():
        tags["host.cpu_count"] = s["ncpu"]
    m = re.search(r"MemTotal:\s*(\d+)\s*kB", s.get("meminfo", ""))
    if m:
        tags["host.ram_mib"] = str(int(m.group(1)) // 1024)
    gpus = [g.strip() for g in s.get("gpu", "").splitlines() if g.strip()]
    if gpus:
        tags["host.gpu"] = "; ".join(gpus)
    if s.get("dtmodel"):
        tags["host.model"] = s["dtmodel"]
    return tags


def host_fingerprint(conn: Connection) -> dict[str, str]:
    result = conn.run(["sh", "-c", _PROBE], timeout=30)
    return parse_host_fingerprint(result.stdout)
