"""Pre-flight audits of a device: `jbench devices check` (can jbench drive it?) and `jbench doctor`
(is it ready for LLM work?). Every item is pass / warn / fail with the fix a user applies."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace
from typing import Optional

from jbench.core.schema import DeviceConfig, ModelConfig, ProfileConfig
from jbench.device.connection import Connection, DeviceError
from jbench.device.fingerprint import parse_sections
from jbench.device.jetson import (JetsonError, jetson_fingerprint, parse_clocks_show, parse_nvpmodel_conf,
                                  parse_nvpmodel_query)
from jbench.device.power import SUDOERS_HINT


@dataclass
class Check:
    item: str
    status: str  # pass | warn | fail | info
    detail: str
    fix: str = ""


def check_device(conn: Connection, device: DeviceConfig, binary_dir: Optional[str] = None) -> list[Check]:
    """Reachability, sudo rights and tools: what jbench needs to drive the device."""
    checks = []
    started = time.monotonic()
    res = conn.run(["true"], timeout=30)
    rtt = (time.monotonic() - started) * 1000
    checks.append(Check("reachable", "pass" if res.ok else "fail", f"command round trip {rtt:.0f} ms"))
    jetson = bool(device.profile)
    tools = ["nvpmodel", "jetson_clocks", "tegrastats"] if jetson else []
    if tools:
        probe = conn.run(["sh", "-c", 'for t in "$@"; do printf "%s=" "$t"; command -v "$t" || echo; done', "sh", *tools], timeout=30)
        found = dict(line.split("=", 1) for line in probe.stdout.splitlines() if "=" in line)
        for tool in tools:
            path = found.get(tool, "").strip()
            checks.append(Check(f"tool {tool}", "pass" if path else "fail", path or "not found",
                                "" if path else f"install the L4T tools ({tool} ships with JetPack)"))
        sudo = conn.run(["nvpmodel", "-q"], sudo=True, timeout=30)
        if sudo.ok:
            checks.append(Check("sudo rights", "pass", "sudo nvpmodel -q works"))
        else:
            checks.append(Check("sudo rights", "fail", (sudo.stderr or sudo.stdout).strip()[:200],
                                SUDOERS_HINT.format(user=device.user or "USER")))
    if binary_dir:
        bench = binary_dir.rstrip("/") + "/llama-bench"
        ok = conn.exists(bench)
        checks.append(Check("llama-bench", "pass" if ok else "fail", bench,
                            "" if ok else "build llama.cpp on the device and set backend.binary_dir"))
    return checks


_DOCTOR_PROBE = r"""
echo '@@meminfo'; cat /proc/meminfo 2>/dev/null
echo '@@swaps'; cat /proc/swaps 2>/dev/null
echo '@@df'; df -Pk "$HOME" 2>/dev/null | tail -n 1
echo '@@thermal'; for z in /sys/devices/virtual/thermal/thermal_zone*; do [ -r "$z/temp" ] && echo "$(cat "$z/type" 2>/dev/null) $(cat "$z/temp" 2>/dev/null)"; done
echo '@@gui'; for p in Xorg Xwayland gnome-shell gdm3 lightdm; do pgrep -x "$p" >/dev/null 2>&1 && echo "$p"; done
echo '@@gpufreq'; for f in cur_freq min_freq max_freq; do printf '%s=' "$f"; cat "$1/$f" 2>/dev/null || echo; done
echo '@@nvpmodel'; nvpmodel -q 2>&1
echo '@@modes'; cat "$2" 2>/dev/null
echo '@@governor'; cat /sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_governor 2>/dev/null
"""


def doctor(conn: Connection, device: DeviceConfig, profile: Optional[ProfileConfig]) -> list[Check]:
    """The audit an engineer runs before LLM work on a Jetson (or any Linux device)."""
    checks: list[Check] = []
    gpu_devfreq = (profile.gpu_devfreq if profile else None) or "/nonexistent"
    res = conn.run(["sh", "-c", _DOCTOR_PROBE, "sh", gpu_devfreq, device.paths.nvpmodel_conf], timeout=60)
    s = parse_sections(res.stdout)

    if profile:
        fp = jetson_fingerprint(conn, device.paths)
        checks += _versions(fp, profile)
    mem = {k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+) kB", s.get("meminfo", ""), re.M)}
    if "MemTotal" in mem:
        total, avail = mem["MemTotal"] / 1048576, mem.get("MemAvailable", 0) / 1048576
        status = "pass" if avail >= 0.5 * total else "warn"
        checks.append(Check("RAM", status, f"{avail:.1f} GiB available of {total:.1f} GiB",
                            "" if status == "pass" else "stop other workloads: the model and KV cache share this memory with the GPU"))
    if mem.get("CmaTotal"):
        checks.append(Check("CMA", "info", f"{mem['CmaTotal'] // 1024} MiB reserved, {mem.get('CmaFree', 0) // 1024} MiB free"))
    zram = [l.split()[0] for l in s.get("swaps", "").splitlines()[1:] if "zram" in l]
    swap_total = mem.get("SwapTotal", 0) // 1024
    if zram:
        checks.append(Check("swap/zram", "warn", f"zram swap active ({', '.join(zram)}), {swap_total} MiB swap in all",
                            "compressed swap makes numbers unstable when memory runs short: sudo systemctl disable --now nvzramconfig"))
    else:
        checks.append(Check("swap/zram", "pass", f"{swap_total} MiB swap, no zram"))
    df = s.get("df", "").split()
    if len(df) >= 4 and df[3].isdigit():
        free_gb = int(df[3]) / 1048576
        status = "pass" if free_gb >= 10 else ("warn" if free_gb >= 2 else "fail")
        checks.append(Check("free disk", status, f"{free_gb:.1f} GiB free in the home filesystem",
                            "" if status == "pass" else "free space for models and engines (a 7B Q4 GGUF is ~4 GB)"))
    temps = []
    for line in s.get("thermal", "").splitlines():
        parts = line.split()
        if len(parts) == 2 and re.fullmatch(r"-?\d+", parts[1]) and int(parts[1]) > -100000:
            temps.append((parts[0], int(parts[1]) / 1000))
    if temps:
        name, hottest = max(temps, key=lambda t: t[1])
        limit = profile.throttle_temp_c if profile else None
        status = "pass" if hottest < 70 else ("warn" if limit is None or hottest < limit else "fail")
        checks.append(Check("temperatures", status, f"hottest {name} {hottest:.1f} C at idle",
                            "" if status == "pass" else "improve cooling or let the device cool before benchmarking"))
    else:
        checks.append(Check("temperatures", "info", "no thermal zones readable"))
    gui = s.get("gui", "").split()
    checks.append(Check("desktop GUI", "warn" if gui else "pass", ", ".join(gui) + " running" if gui else "none running",
                        "the desktop takes ~500 MB of shared memory: sudo systemctl set-default multi-user.target && sudo reboot" if gui else ""))
    if profile:
        checks += _power(conn, s)
    else:  # a Jetson's clocks are nvpmodel's and jetson_clocks' (checked above); elsewhere the governor sets them
        checks.append(governor_check(s.get("governor", "")))
    return checks


GOVERNOR_FIX = ("sudo cpupower frequency-set -g performance (or write performance to "
                "/sys/devices/system/cpu/cpu*/cpufreq/scaling_governor)")


def governor_check(text: str) -> Check:
    """The CPU frequency governors (one line per CPU, as sysfs gives them): `performance` holds the clock, any other
    ramps it with the load, so a short benchmark measures part of the ramp."""
    governors = [line.strip() for line in text.splitlines() if line.strip()]
    if not governors:
        return Check("CPU governor", "info", "none exposed (a virtual machine or a fixed clock): the host or "
                                             "firmware sets the CPU clock")
    counts = {g: governors.count(g) for g in dict.fromkeys(governors)}
    detail = ", ".join(f"{g} on {n} CPU(s)" for g, n in counts.items())
    if set(counts) == {"performance"}:
        return Check("CPU governor", "pass", detail)
    return Check("CPU governor", "warn", f"{detail}: the clock follows the load, so runs vary", GOVERNOR_FIX)


def build_check(binary_dir: Optional[str]) -> Check:
    """The llama.cpp build a trial on this machine runs: `backend.binary_dir`, else the one `jbench setup` made."""
    import os

    from jbench.models.provision import active_build

    if binary_dir:
        bench = os.path.join(binary_dir, "llama-bench")
        if os.path.isfile(bench):
            return Check("llama.cpp build", "pass", f"{bench} (backend.binary_dir)")
        return Check("llama.cpp build", "fail", f"{bench} not found (backend.binary_dir)", "fix backend.binary_dir")
    build = active_build()
    if build is None:
        return Check("llama.cpp build", "fail", "no build of `jbench setup` found",
                     "run `jbench setup` (or set backend.binary_dir to your own build)")
    return Check("llama.cpp build", "pass",
                 f"llama.cpp {build.get('build_commit', '?')} ({build.get('flavor', '?')}) in {build['bin_dir']}")


def model_check(model: ModelConfig) -> Check:
    """The model's files on this machine: a bundled model's whole quant ladder (`jbench setup` makes it), else the
    file of the configured quant."""
    import os

    from jbench.models.store import ModelError, resolve_model_file

    quants = list(dict.fromkeys([model.quant, *([model.source_quant] if model.source_quant else []), *model.ladder]))
    if model.source != "bundled":
        quants = [model.quant]  # the user's own files: the configured quant is what a plain run needs
    found, missing = [], []
    for quant in quants:
        try:
            path, _ = resolve_model_file(replace(model, quant=quant))
        except ModelError:
            missing.append(quant)
            continue
        (found if os.path.isfile(os.path.expanduser(path)) else missing).append(quant)
    what = "quant ladder" if model.source == "bundled" else "model file"
    if missing:
        fix = "run `jbench setup`" if model.source == "bundled" else "fix model.files / model.path_template"
        return Check(f"model {what}", "fail", f"{model.name}: {', '.join(missing)} missing"
                     + (f" ({', '.join(found)} installed)" if found else ""), fix)
    return Check(f"model {what}", "pass", f"{model.name}: {', '.join(found)}")


def _versions(fp: dict, profile: ProfileConfig) -> list[Check]:
    out = []
    module = fp.get("jetson.module")
    matched = module and any(m.lower() in module.lower() for m in profile.model_match)
    out.append(Check("module", "pass" if matched else "warn", module or "unknown (no device-tree model)",
                     "" if matched else f"the device does not look like a {profile.module}: check device.profile"))
    l4t, jp = fp.get("jetson.l4t"), fp.get("jetson.jetpack")
    if not l4t:
        out.append(Check("L4T / JetPack", "fail", "no /etc/nv_tegra_release", "install JetPack (L4T) on the device"))
    else:
        major = int(l4t.split(".")[0])
        note = {32: "JetPack 4: CUDA 10.2; current llama.cpp CUDA builds and TensorRT-LLM need newer releases",
                35: "JetPack 5: CUDA 11.4; TensorRT-LLM's Jetson branch (v0.12.0-jetson) needs JetPack 6.1",
                36: "JetPack 6: CUDA 12; llama.cpp CUDA builds and TensorRT-LLM v0.12.0-jetson (6.1+) supported",
                38: "JetPack 7: CUDA 13", 39: "JetPack 7: CUDA 13"}.get(major, "")
        out.append(Check("L4T / JetPack", "warn" if major <= 32 else "pass", f"L4T {l4t}, JetPack {jp or 'unknown'}. {note}".strip(),
                         "upgrade JetPack for current CUDA" if major <= 32 else ""))
    out.append(Check("CUDA", "pass" if fp.get("jetson.cuda") else "warn", fp.get("jetson.cuda") or "not found",
                     "" if fp.get("jetson.cuda") else "install the CUDA toolkit (sudo apt install nvidia-jetpack)"))
    out.append(Check("TensorRT", "pass" if fp.get("jetson.tensorrt") else "info", fp.get("jetson.tensorrt") or "not installed",
                     "" if fp.get("jetson.tensorrt") else "needed only for the TensorRT-LLM backend"))
    return out


def _power(conn: Connection, s: dict) -> list[Check]:
    out = []
    try:
        mode, mode_id = parse_nvpmodel_query(s.get("nvpmodel", ""))
        modes, _ = parse_nvpmodel_conf(s.get("modes", ""))
        maxn = [m for m in modes if m.startswith("MAXN")]
        status = "pass" if (not maxn or mode in maxn) else "warn"
        out.append(Check("power mode", status, f"{mode} ({mode_id}); modes: {', '.join(modes) or 'unknown'}",
                         "" if status == "pass" else f"for peak numbers: sudo nvpmodel -m {modes[maxn[0]]} ({maxn[0]}), or set power.mode"))
    except JetsonError as exc:
        out.append(Check("power mode", "fail", str(exc), "is nvpmodel installed?"))
    show = conn.run(["jetson_clocks", "--show"], sudo=True, timeout=30)
    try:
        clocks = parse_clocks_show(show.stdout)
        gpu = clocks.gpu
        detail = f"GPU {gpu.min_hz // 1_000_000}-{gpu.max_hz // 1_000_000} MHz (now {(gpu.current_hz or 0) // 1_000_000})" if gpu else ""
        out.append(Check("jetson_clocks", "pass" if clocks.locked else "warn",
                         ("locked; " if clocks.locked else "not locked (DVFS may park clocks); ") + detail,
                         "" if clocks.locked else "sudo jetson_clocks, or set power.jetson_clocks=true"))
        if gpu and gpu.current_hz == 0:
            out.append(Check("GPU clock", "fail", "GPU at 0 MHz", "the GPU is parked: apply a power mode and jetson_clocks"))
    except JetsonError:
        out.append(Check("jetson_clocks", "fail", (show.stderr or show.stdout).strip()[:200],
                         "jetson_clocks needs root: " + SUDOERS_HINT.format(user="USER")))
    freqs = dict(l.split("=", 1) for l in s.get("gpufreq", "").splitlines() if "=" in l)
    if freqs.get("cur_freq", "").strip().isdigit():
        out.append(Check("GPU devfreq", "info",
                         f"cur {int(freqs['cur_freq']) // 1_000_000} MHz, min {int(freqs.get('min_freq') or 0) // 1_000_000}, "
                         f"max {int(freqs.get('max_freq') or 0) // 1_000_000}"))
    return out


def worst(checks: list[Check]) -> str:
    order = {"fail": 3, "warn": 2, "pass": 1, "info": 0}
    return max((c.status for c in checks), key=lambda s: order[s], default="pass")


__all__ = ["Check", "check_device", "doctor", "build_check", "governor_check", "model_check", "worst", "DeviceError"]
