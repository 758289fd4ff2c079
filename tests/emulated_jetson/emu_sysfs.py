"""The files of an emulated Jetson at their real paths (option `real_paths=True`): a per-device tree under
`<base>/root/` that emu_ns.py mounts over /sys, /run, /etc, /usr/bin and /usr/local in the mount namespace of the
device's sshd (so every command of its sessions sees it), rewritten by the supervisor while the device runs.

Standard library only, no relative imports (the supervisor imports it as a top-level module).

Sources (facts only; paths relative to tests/data/jetson-formats/ where they are in the corpus):
- INA3221 hwmon attributes: Linux Documentation/hwmon/ina3221.rst (torvalds/linux @942e6f8): in[123]_label,
  in[123]_input (mV), curr[123]_input (mA), curr[123]_crit / curr[123]_max (mA), shunt[123]_resistor (uOhm),
  samples, update_interval (ms); no power attribute (power is computed host-side). sysfs-paths.md section 3.
- INA238 hwmon attributes: Linux Documentation/hwmon/ina238.rst (torvalds/linux @248fd3b): in1_input bus voltage
  (mV), curr1_input (mA), power1_input (uW), power1_max. update_interval is not in that document: emulator assumption.
- Orin Nano INA3221: realpath /sys/devices/platform/bus@0/c240000.i2c/i2c-1/1-0040/hwmon/hwmon1, in1=VDD_IN,
  in2=VDD_CPU_GPU_CV, in3=VDD_SOC (public file, repository not resolved, reference id 56705657586; sysfs-paths.md
  cites ARK-Electronics/ark_jetson_kernel docs/power.md for the labels). AGX Orin: two chips 1-0040 and 1-0041
  (reference id 71371832646) with the rails and NC channels of tegrastats-agx-orin.txt. Thor: INA3221 rails of
  tegrastats-thor.txt plus VIN on an INA238 (jetson-stats 7.2.2 jtop/core/power.py: "Thor uses both an INA3221 for
  module rails and an INA238 for carrier-board system input power"); Thor's bus and addresses: emulator assumption.
- soctherm_oc hwmon: NVIDIA's Tegra234 overcurrent event driver registers hwmon "soctherm_oc" with oc[123]_throt_en
  and oc[123]_event_cnt ("%u\\n"), cumulative, reset at boot (reference id 28238037071; path /sys/class/hwmon/hwmonN,
  N often 3). oc3 (instantaneous over-current) climbs under load on uncapped MAXN / MAXN_SUPER (reference ids
  63169062940, 69391290997); one report counts oc3_event_cnt=27390 in 3605 s of uptime, 7.6/s averaged over idle
  and load (reference id 70567317268). emulator assumption: 50 events/s while a workload runs in a MAXN* mode (so
  thousands per minute of load, as users describe for the Orin Nano Super), none otherwise; Thor has no such
  hwmon here (the driver is Tegra234's).
- Thermal zones /sys/devices/virtual/thermal/thermal_zone*/{type,temp} (m°C) and hwmon/devfreq/EMC/cpufreq layout
  as jetson-stats reads them: jtop-api.md sections 3-5 (jtop/core/temperature.py, gpu.py, memory.py, cpu.py, fan.py);
  zone names are the tegrastats names of each module's capture with jtop's `-thermal` / `-therm` type suffix.
- GPU devfreq at the profile's `gpu_devfreq` path; its `device` is the GPU platform device whose `of_node/name` jtop
  matches (`gpu`, `ga10b`), with railgate_enable, tpc_pg_mask, enable_3d_scaling and load (0..1000) (jtop-api.md
  section 5; R36 /sys/devices/platform/gpu.0, R35 /sys/devices/gpu.0 as in nvpmodel-verbose.txt).
- EMC: /sys/kernel/debug/bpmp/debug/clk/emc/{rate,max_rate,min_rate,mrq_rate_locked} (jetson_clocks "JC-2023" and
  jtop/core/memory.py), EMC load /sys/kernel/actmon_avg_activity/mc_all (jtop-api.md section 7).
- Fan: hwmon `pwmfan` with pwm1 (0..255) and `pwm_tach` with rpm (jtop/core/fan.py pairs a split tachometer node);
  rpm per pwm: emulator assumption.
"""

from __future__ import annotations

import grp
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import emu_profiles as P
import emu_state as S

ROOT_DIR = "root"  # <base>/root: the tree mounted at the real paths

# (i2c bus-addr, driver, [(channel label or "NC")...]) per tegrastats kind. Thor's VIN: the INA238 entry.
INA_CHIPS: Dict[str, List[Tuple[str, str, List[str]]]] = {
    "orin_jp6": [("1-0040", "ina3221", ["VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"])],
    "orin_r39": [("1-0040", "ina3221", ["VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"])],
    "agx_orin_jp5": [("1-0040", "ina3221", ["VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0"]),
                     ("1-0041", "ina3221", ["NC", "VDDQ_VDD2_1V8AO", "NC"])],
    "thor_r38": [("2-0040", "ina3221", ["VDD_GPU", "VDD_CPU_SOC_MSS", "VIN_SYS_5V0"]),
                 ("2-0044", "ina238", ["VIN"])],
}
# emulator assumption: bus voltages (the Orin module input is 5 V; Thor's carrier input 20 V USB-C PD)
BUS_MV = {"VIN": 20000}
DEFAULT_BUS_MV = 5048
# Thermal zones (type names) per kind, from the tegrastats captures; None = offline (-256 C in tegrastats).
ZONES: Dict[str, List[Tuple[str, Optional[float], float]]] = {
    # (type, base temperature C or None = offline, heat factor)
    "orin_jp6": [("cpu-thermal", 50.0, 1.0), ("gpu-thermal", 49.0, 1.1), ("soc0-thermal", 50.0, 0.8),
                 ("soc1-thermal", 50.2, 0.85), ("soc2-thermal", 49.0, 0.9), ("tj-thermal", 50.3, 1.1)],
    "agx_orin_jp5": [("CPU-therm", 42.6, 1.0), ("GPU-therm", None, 0.0), ("CV0-therm", None, 0.0),
                     ("CV1-therm", None, 0.0), ("CV2-therm", None, 0.0), ("SOC0-therm", 41.1, 0.85),
                     ("SOC1-therm", 41.25, 0.8), ("SOC2-therm", 40.1, 0.8), ("Tboard_tegra", 32.0, 0.0),
                     ("Tdiode_tegra", 33.0, 0.4), ("tj-therm", 42.8, 1.05)],
    "thor_r38": [("cpu-thermal", 37.3, 1.0), ("gpu-thermal", 38.9, 1.05), ("soc012-thermal", 37.5, 0.8),
                 ("soc345-thermal", 37.4, 0.8), ("tj-thermal", 38.9, 1.05)],
}
ZONES["orin_r39"] = ZONES["orin_jp6"]
OC_RATE_PER_S = 50.0  # emulator assumption, see the module doc
FAN_MAX_RPM = 5000  # emulator assumption


def _w(path: str, text: str) -> None:
    """Create the file, or rewrite it in place. A sysfs attribute keeps its inode: a reader that holds it
    open and re-reads at offset 0 gets the new value (Linux Documentation/filesystems/sysfs.rst, "Reading/
    Writing Attribute Data": a re-read needs a seek to 0), so a rename-based atomic write would leave such a
    reader on the old file forever. Written first, then cut to length: a reader racing the update can see a
    torn value for an instant (which real sysfs never shows); readers skip a value that does not parse."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        S.write_text_atomic(path, text)
        return
    try:
        data = text.encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def _link(target: str, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.lexists(path):
        os.symlink(target, path)


class Tree:
    """The emulated files of one device (paths inside `root` mirror the real ones)."""

    def __init__(self, base_dir: str, prof: Dict[str, Any], serial: str = "") -> None:
        self.root = os.path.join(base_dir, ROOT_DIR)
        self.prof = prof
        self.serial = serial  # the unit's serial number (serial-number node of the device tree)
        self.kind = prof["tegrastats"]
        self.hwmon: Dict[str, str] = {}  # hwmon name key -> real path of its directory (as the device sees it)
        self.oc_counts = [0.0, 0.0, 0.0]
        self.last_refresh: Optional[float] = None
        self.sampler = None
        self.base_prefix = "/usr"  # sys.base_prefix of the service's interpreter (set by the fixture)

    def p(self, real: str) -> str:
        """The file in the tree for a real absolute path."""
        return os.path.join(self.root, real.lstrip("/"))

    # ------------------------------------------------------------------------------------ static
    def build(self, host_group_file: str = "/etc/group") -> None:
        prof = self.prof
        n = 0
        hwmon_dirs: List[Tuple[str, str]] = []  # (hwmonN, real dir)
        i2c_parent = "/sys/devices/platform/bus@0/c240000.i2c"
        for addr, driver, labels in INA_CHIPS[self.kind]:
            bus = addr.split("-")[0]
            dev = f"{i2c_parent}/i2c-{bus}/{addr}"
            _w(self.p(f"{dev}/name"), f"{driver}\n")  # the i2c client's name (jtop matches ina3221 / ina238 in it)
            hw = f"hwmon{n + 1}"
            hdir = f"{dev}/hwmon/{hw}"
            _w(self.p(f"{hdir}/name"), f"{driver}\n")
            if driver == "ina3221":
                for k, label in enumerate(labels, 1):
                    _w(self.p(f"{hdir}/in{k}_label"), f"{label}\n")
                    _w(self.p(f"{hdir}/shunt{k}_resistor"), "5000\n")  # uOhm; emulator assumption (5 mOhm)
                    _w(self.p(f"{hdir}/curr{k}_crit"), "7784\n")  # sysfs-paths.md: 7784 mA on Orin NX
                    _w(self.p(f"{hdir}/curr{k}_max"), "6224\n")  # emulator assumption
                _w(self.p(f"{hdir}/samples"), "512\n")  # emulator assumption: the Jetson device tree's averaging
                _w(self.p(f"{hdir}/update_interval"), f"{self.update_interval_ms()}\n")
            else:  # ina238
                _w(self.p(f"{hdir}/power1_max"), "300000000\n")  # uW; emulator assumption
                _w(self.p(f"{hdir}/update_interval"), f"{self.update_interval_ms()}\n")  # emulator assumption
            _link(f"../../../devices/platform/bus@0/c240000.i2c/i2c-{bus}/{addr}", self.p(f"/sys/bus/i2c/devices/{addr}"))
            _link(f"../../../../devices/platform/bus@0/c240000.i2c/i2c-{bus}/{addr}",
                  self.p(f"/sys/bus/i2c/drivers/{driver}/{addr}"))
            self.hwmon[f"{driver}:{addr}"] = hdir
            hwmon_dirs.append((hw, hdir))
            n += 1
        if prof["soc"] == "tegra234":
            n += 1
            oc = f"/sys/devices/platform/soctherm-oc-event/hwmon/hwmon{n}"
            _w(self.p(f"{oc}/name"), "soctherm_oc\n")
            for k in (1, 2, 3):
                _w(self.p(f"{oc}/oc{k}_throt_en"), "1\n")  # reference id 70567317268: oc*_throt_en=1
            self.hwmon["soctherm_oc"] = oc
            hwmon_dirs.append((f"hwmon{n}", oc))
        n += 1
        fan = f"/sys/devices/platform/pwm-fan/hwmon/hwmon{n}"
        _w(self.p(f"{fan}/name"), "pwmfan\n")
        _w(self.p(f"{fan}/pwm1_enable"), "1\n")
        self.hwmon["pwmfan"] = fan
        hwmon_dirs.append((f"hwmon{n}", fan))
        n += 1
        tach = f"/sys/devices/platform/39c0000.tachometer/hwmon/hwmon{n}"
        _w(self.p(f"{tach}/name"), "pwm_tach\n")
        self.hwmon["pwm_tach"] = tach
        hwmon_dirs.append((f"hwmon{n}", tach))
        for hw, hdir in hwmon_dirs:
            _link(f"../..{hdir[len('/sys'):]}", self.p(f"/sys/class/hwmon/{hw}"))
        for i, (ztype, _, _) in enumerate(ZONES[self.kind]):
            _w(self.p(f"/sys/devices/virtual/thermal/thermal_zone{i}/type"), f"{ztype}\n")
            _link(f"../../devices/virtual/thermal/thermal_zone{i}", self.p(f"/sys/class/thermal/thermal_zone{i}"))
        # GPU: devfreq at the profile's path, `device` -> the GPU platform device
        gpu0 = "/sys/devices/gpu.0" if prof.get("verbose") == "r35" else "/sys/devices/platform/gpu.0"
        dev = prof["gpu_devfreq"]
        if not dev.startswith("/sys/class/devfreq/"):
            _link(f"../..{dev[len('/sys'):]}", self.p(f"/sys/class/devfreq/{os.path.basename(os.path.dirname(dev))}"))
        _link(os.path.relpath(gpu0, dev), self.p(f"{dev}/device"))
        _w(self.p(f"{gpu0}/of_node/name"), ("ga10b" if prof.get("verbose") == "r35" else "gpu") + "\n")
        _w(self.p(f"{gpu0}/enable_3d_scaling"), "1\n")
        _w(self.p(f"{dev}/governor"), "nvhost_podgov\n")
        freqs = sorted({prof["gpu_min_hz"], *[m["gpu_max_hz"] for m in prof["modes"]]})
        _w(self.p(f"{dev}/available_frequencies"), " ".join(str(f) for f in freqs) + "\n")
        self.gpu0, self.gpu_devfreq = gpu0, dev
        # CPUs
        _w(self.p("/sys/devices/system/cpu/possible"), f"0-{prof['cpus'] - 1}\n")
        _w(self.p("/sys/devices/system/cpu/present"), f"0-{prof['cpus'] - 1}\n")
        for c in range(prof["cpus"]):
            base = f"/sys/devices/system/cpu/cpu{c}/cpufreq"
            _w(self.p(f"{base}/scaling_governor"), "schedutil\n")
            _w(self.p(f"{base}/cpuinfo_min_freq"), f"{prof['cpu_min_khz']}\n")
            _w(self.p(f"{base}/cpuinfo_max_freq"), f"{max(m['cpu_max_khz'] for m in prof['modes'])}\n")
        # EMC (debugfs) and identity
        emc = "/sys/kernel/debug/bpmp/debug/clk/emc"
        _w(self.p(f"{emc}/min_rate"), f"{prof['emc_min_hz']}\n")
        _w(self.p(f"{emc}/max_rate"), f"{max(m['emc_max_hz'] for m in prof['modes'])}\n")
        # /proc/device-tree is a link to /sys/firmware/devicetree/base on a Jetson; the tree ends in a NUL byte
        _w(self.p("/sys/firmware/devicetree/base/model"), prof["device_tree_model"] + "\0")
        # The unit's serial, where jetson-stats reads it (jtop/core/jetson_variables.py, get_jetson_variables:
        # cat("/sys/firmware/devicetree/base/serial-number"); rbonghi/jetson_stats @01f201f); NUL-terminated.
        if self.serial:
            _w(self.p("/sys/firmware/devicetree/base/serial-number"), self.serial + "\0")
        _w(self.p("/etc/nv_tegra_release"), prof["nv_tegra_release"])
        _w(self.p("/etc/nvpmodel.conf"), P.nvpmodel_conf_text(prof))
        # The jtop group, as `jtop --install-service` creates it (groupadd jtop; usermod -a -G jtop <user>)
        with open(host_group_file, encoding="utf-8") as fh:
            groups = fh.read()
        if not any(line.startswith("jtop:") for line in groups.splitlines()):
            used = {g.gr_gid for g in grp.getgrall()}
            gid = next(g for g in range(990, 100, -1) if g not in used)
            groups = groups.rstrip("\n") + f"\njtop:x:{gid}:root\n"
        _w(self.p("/etc/group"), groups)
        # jetson-stats chooses its board reader by platform.machine() (the kernel's, which no namespace changes): on
        # an x86_64 test host it reads the DMI ids (jtop/core/hardware.py get_x86_64_variables), so the host's are copied
        dmi = "/sys/devices/virtual/dmi/id"
        if os.path.isdir(dmi):
            for name in os.listdir(dmi):
                src = os.path.join(dmi, name)
                if os.path.isfile(src) and not os.path.islink(src):
                    try:
                        with open(src, encoding="utf-8", errors="replace") as fh:
                            _w(self.p(src), fh.read())
                    except OSError:
                        pass
        else:
            os.makedirs(self.p(dmi), exist_ok=True)
        # jetson-stats runs /usr/bin/jetson_clocks (jtop/core/jetson_clocks.py PATH_JETSON_CLOCKS)
        os.makedirs(self.p("/usr/bin"), exist_ok=True)
        for d in ("/sys/class/power_supply", "/run/sshd", "/prefix.upper", "/prefix.work"):
            os.makedirs(self.p(d), exist_ok=True)
        os.chmod(self.p("/run/sshd"), 0o755)

    def link_tool(self, name: str, target: str) -> None:
        _link(target, self.p(f"/usr/bin/{name}"))

    def update_interval_ms(self) -> int:
        return 10  # emulator assumption: a conversion every 10 ms, so a >= 100 Hz reader sees fresh values

    def clear_run(self) -> None:
        """/run is a tmpfs: empty at every boot (except the sshd directory the emulated sshd needs)."""
        run = self.p("/run")
        for name in os.listdir(run):
            if name != "sshd":
                path = os.path.join(run, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    import shutil
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass

    def mounts(self) -> List[Dict[str, str]]:
        """What emu_ns.py mounts, in order."""
        return [
            {"kind": "bind", "src": self.p("/sys"), "dst": "/sys"},
            {"kind": "bind", "src": self.p("/run"), "dst": "/run"},
            {"kind": "overlay", "lower": f"{self.p('/etc')}:/etc", "dst": "/etc"},
            # jetson-stats keeps its service config in <sys.base_prefix>/local/jtop: per device, writable
            {"kind": "overlay", "lower": self.base_prefix, "upper": self.p("/prefix.upper"),
             "work": self.p("/prefix.work"), "dst": self.base_prefix},
            {"kind": "overlay", "lower": f"{self.p('/usr/bin')}:/usr/bin", "dst": "/usr/bin"},
        ]

    def reset_boot(self) -> None:
        self.oc_counts = [0.0, 0.0, 0.0]  # cumulative since boot (reference id 28238037071 notes)

    # ---------------------------------------------------------------------------------- dynamic
    def refresh(self, state: Dict[str, Any], state_dir: str) -> None:
        import emu_tools as T

        if self.sampler is None:
            self.sampler = T.Sampler(self.prof, state_dir)
        now = time.monotonic()
        dt = 0.0 if self.last_refresh is None else min(1.0, now - self.last_refresh)
        self.last_refresh = now
        prof = self.prof
        v = self.sampler.sample(state)
        mode = v["mode"]
        rails = T.rail_mw(prof, v)
        rng = self.sampler.rng
        for addr, driver, labels in INA_CHIPS[self.kind]:
            hdir = self.hwmon[f"{driver}:{addr}"]
            for k, label in enumerate(labels, 1):
                if label == "NC":
                    mw = 0.0
                else:
                    mw = max(0.0, rails[label] * (1 + rng.uniform(-0.02, 0.02)))
                mv = BUS_MV.get(label, DEFAULT_BUS_MV) + rng.randint(-8, 8)
                ma = int(round(mw * 1000.0 / mv))
                _w(self.p(f"{hdir}/in{k}_input"), f"{mv}\n")
                _w(self.p(f"{hdir}/curr{k}_input"), f"{ma}\n")
                if driver == "ina238":
                    _w(self.p(f"{hdir}/power1_input"), f"{int(round(mv * ma))}\n")  # uW = mV * mA
        if "soctherm_oc" in self.hwmon:
            if v["busy"] and mode["name"].startswith("MAXN"):
                self.oc_counts[2] += OC_RATE_PER_S * dt
            for k in (1, 2, 3):
                _w(self.p(f"{self.hwmon['soctherm_oc']}/oc{k}_event_cnt"), f"{int(self.oc_counts[k - 1])}\n")
        for i, (_, base, factor) in enumerate(ZONES[self.kind]):
            temp = -256000 if base is None else int((base + v["heat"] * factor) * 1000)
            _w(self.p(f"/sys/devices/virtual/thermal/thermal_zone{i}/temp"), f"{temp}\n")
        # GPU
        gpu_min = prof["gpu_min_hz"]
        locked = bool(state.get("gpu_locked"))
        _w(self.p(f"{self.gpu_devfreq}/cur_freq"), f"{v['gpu_mhz'] * 1000000}\n")
        _w(self.p(f"{self.gpu_devfreq}/max_freq"), f"{mode['gpu_max_hz']}\n")
        _w(self.p(f"{self.gpu_devfreq}/min_freq"), f"{mode['gpu_max_hz'] if locked else gpu_min}\n")
        _w(self.p(f"{self.gpu0}/load"), f"{int(v['gpu'] * 10)}\n")
        _w(self.p(f"{self.gpu0}/railgate_enable"), f"{int(state.get('gpu_railgate_enable', 1))}\n")
        _w(self.p(f"{self.gpu0}/tpc_pg_mask"), f"{mode['tpc_pg_mask']}\n")
        # CPUs
        online = []
        for c, cpu in enumerate(v["cpus"]):
            base = f"/sys/devices/system/cpu/cpu{c}"
            _w(self.p(f"{base}/online"), "0\n" if cpu is None else "1\n")
            if cpu is None:
                continue
            online.append(c)
            _w(self.p(f"{base}/cpufreq/scaling_cur_freq"), f"{cpu[1] * 1000}\n")
            _w(self.p(f"{base}/cpufreq/scaling_max_freq"), f"{mode['cpu_max_khz']}\n")
            _w(self.p(f"{base}/cpufreq/scaling_min_freq"),
               f"{mode['cpu_max_khz'] if state.get('cpu_locked') else prof['cpu_min_khz']}\n")
        _w(self.p("/sys/devices/system/cpu/online"), P.cpu_ranges(online) + "\n")
        # EMC
        emc = "/sys/kernel/debug/bpmp/debug/clk/emc"
        _w(self.p(f"{emc}/rate"), f"{v['emc_mhz'] * 1000000}\n")
        _w(self.p(f"{emc}/mrq_rate_locked"), "1\n" if state.get("emc_locked") else "0\n")
        _w(self.p("/sys/kernel/actmon_avg_activity/mc_all"), f"{v['emc_load'] * 10000}\n")  # emulator assumption: units
        # fan: nvfancontrol's pwm or the forced one
        pwm = state.get("fan_pwm")
        pwm = int(prof["fan_pwm"] if pwm is None else pwm)
        _w(self.p(f"{self.hwmon['pwmfan']}/pwm1"), f"{pwm}\n")
        _w(self.p(f"{self.hwmon['pwm_tach']}/rpm"), f"{int(FAN_MAX_RPM * pwm / 255)}\n")
