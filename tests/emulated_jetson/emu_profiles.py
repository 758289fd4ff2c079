"""What each emulated Jetson module is: identity files, power modes, clocks, and the real output formats
its tools print. Standard library only, no relative imports (the fake tools import it as a top-level module).

Provenance rules (the same as tests/data/jetson-formats/README.md): every output template below carries a
`# source:` comment naming the corpus file it was copied from (paths relative to tests/data/jetson-formats/),
or, where the corpus has a gap, the public file it comes from ("public file, repository not resolved,
reference id N" = an id in the code-search index used while writing this, as UNRESOLVED-provenance.txt does).
Values that are not from any capture are marked `# emulator assumption`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

# --- power modes ------------------------------------------------------------------------------------
# A mode: id, name, online cores, CPU/GPU/EMC caps, GPU power-gating mask. Switching between two modes with a
# different (cores, tpc_pg_mask) needs a reboot, as real nvpmodel does (jtop decides "needs reboot" from the
# TPC_POWER_GATING mask, jtop-api.md section 6; the public notes quoted below confirm it per module).


def _mode(mode_id: int, name: str, cores: int, cpu_max_khz: int, gpu_max_hz: int, emc_max_hz: int,
          tpc_pg_mask: int, active_tpcs: Optional[int] = None, **extra: Any) -> Dict[str, Any]:
    return {"id": mode_id, "name": name, "cores": cores, "cpu_max_khz": cpu_max_khz, "gpu_max_hz": gpu_max_hz,
            "emc_max_hz": emc_max_hz, "tpc_pg_mask": tpc_pg_mask, "active_tpcs": active_tpcs, **extra}


# Orin Nano 8GB devkit (p3767-0005), JetPack 6.0 / L4T R36.3 (before the "Super" firmware).
# source: nvpmodel-modes.txt -- Orin Nano devkit running the non-Super conf: 'ID=0 NAME=15W', 'ID=1 NAME=7W'
#   (R39.2.0 capture; the same two modes as the JP5/JP6 non-Super conf, cf. the Orin Nano 4GB note: 7W modes).
# source (clocks of 15W): jetson_clocks-show.txt, Orin Nano R39.2.0 15W: cpu MaxFreq=1510400, GPU MaxFreq=624750000,
#   EMC MaxFreq=2133000000, Active GPU TPCs: 4.
# source (7W needs a reboot: 6 -> 4 cores): public file, repository not resolved, reference id 61694038302
#   ("7 W (mode 3) requires a REBOOT ... Because mode 3 changes the number of online CPU cores (6 -> 4)").
# emulator assumption: the 7W caps (CPU 1113600 kHz, GPU 408 MHz) and its TPC mask.
ORIN_NANO_MODES = [
    _mode(0, "15W", 6, 1510400, 624750000, 2133000000, 240, 4),
    _mode(1, "7W", 4, 1113600, 408000000, 2133000000, 252, 2),
]

# Orin Nano 8GB devkit with the Super conf (nvpmodel_p3767_0003_super), JetPack 6.2.1 / L4T R36.4.4.
# source: nvpmodel-modes.txt -- Orin Nano Super: 'ID=0 NAME=15W', 'ID=1 NAME=25W', 'ID=2 NAME=MAXN_SUPER'; ARK (R36.5):
#   "on Orin Nano MAXN_SUPER is mode 2 and the Nano boots in mode 1 (25W)".
# source (mode 3 = 7W, reboot; 15W CPU 1.50 GHz / GPU 612 MHz / EMC 2133, 25W CPU 1.34 GHz / GPU 918 / EMC 3199 on
#   JP6.2.1): public file, repository not resolved, reference id 61694038302.
# source (25W clocks): UNRESOLVED-provenance.txt, Orin Nano Super R36.4.3 `jetson_clocks --show` (1344000 / 918000000 /
#   3199000000, Active GPU TPCs: 4). MAXN_SUPER GPU 1020 MHz: README.md "Known gaps" line. emulator assumption: the
#   MAXN_SUPER CPU cap 1728000 and all 7W caps.
ORIN_NANO_SUPER_MODES = [
    _mode(0, "15W", 6, 1510400, 612000000, 2133000000, 240, 4),
    _mode(1, "25W", 6, 1344000, 918000000, 3199000000, 240, 4),
    _mode(2, "MAXN_SUPER", 6, 1728000, 1020000000, 3199000000, 240, 4),
    _mode(3, "7W", 4, 1113600, 408000000, 2133000000, 252, 2),
]

# Orin Nano 8GB devkit with the Super conf, JetPack 7.2.1 / L4T R39.2.1.
# source: nvpmodel-modes.txt -- Orin Nano Super devkit, L4T R39.2.1 (vdavid21/edge-inference-benchmark-lab @7eb0b09
#   env-jetson-orin-20260919T113300Z.md, grep of /etc/nvpmodel.conf): 'ID=0 NAME=15W', 'ID=1 NAME=25W',
#   'ID=2 NAME=MAXN_SUPER' -- no 7W mode in that conf, so none here.
# source (25W default: `nvpmodel -q` 'NV Power Mode: 25W' / '1'): nvpmodel-q.txt, same file.
# source (25W clocks 1344000 / 918000000 / 3199000000, Active GPU TPCs: 4): jetson_clocks-show.txt, same file.
# The 15W and MAXN_SUPER caps are those of the R36.4.4 profile (emulator assumption: no R39 capture of them).
ORIN_NANO_SUPER_R39_MODES = [m for m in ORIN_NANO_SUPER_MODES if m["name"] != "7W"]

# AGX Orin 64GB devkit, JetPack 5.1.2 / L4T R35.4.1.
# source: nvpmodel-modes.txt -- 'AGX Orin JP5: ID=0 MAXN, 1 MODE_15W, 2 MODE_30W, 3 MODE_50W (DEFAULT=MODE_30W(2))'.
# source (cores, TPC_PG_MASK, CPU/GPU/EMC caps per mode): nvpmodel-verbose.txt, `nvpmodel -p --verbose` AGX Orin JP5
#   (MAXN: 12 cores mask 0; MODE_15W: 4 cores mask 248 CPU 1113600 GPU 420750000 EMC 2133000000; MODE_30W: 8 cores
#   mask 240 CPU 1728000 GPU 624750000; MODE_50W: 12 cores mask 0 CPU 1497600 GPU 828750000; EMC 0 = no cap);
#   MAXN clocks and DLA/PVA from jetson_clocks-show.txt (catid, AGX Orin 64GB JP5.1).
# source (MODE_30W -> MAXN needs a reboot): public file, repository not resolved, reference id 44360776697
#   ("NV Power Mode: MODE_30W / 2 ... sudo nvpmodel -m 0 ... Reboot required for changing to this power mode: 0").
AGX_ORIN_MODES = [
    _mode(0, "MAXN", 12, 2201600, 1300500000, 3199000000, 0, None,
          dla_core_hz=1600000000, dla_falcon_hz=844800000, pva_vps_hz=1152000000, pva_axi_hz=832000000),
    _mode(1, "MODE_15W", 4, 1113600, 420750000, 2133000000, 248, None,
          dla_core_hz=614400000, dla_falcon_hz=294400000, pva_vps_hz=307200000, pva_axi_hz=217600000),
    _mode(2, "MODE_30W", 8, 1728000, 624750000, 3199000000, 240, None,
          dla_core_hz=1369600000, dla_falcon_hz=729600000, pva_vps_hz=512000000, pva_axi_hz=358400000),
    _mode(3, "MODE_50W", 12, 1497600, 828750000, 3199000000, 0, None,
          dla_core_hz=1369600000, dla_falcon_hz=729600000, pva_vps_hz=704000000, pva_axi_hz=486400000),
]

# AGX Thor devkit (T5000, p3834-0008), JetPack 7.1 / L4T R38.4.0.
# source: nvpmodel-modes.txt -- 'AGX Thor (L4T 38.4.0): jetson_release shows NV Power Mode[1]: 120W (ID 1 = 120W)'.
# source (0=MAXN 1=120W 2=90W 3=70W; 2 and 3 need a reboot, GPU PG mask 15873 vs 64, 14 -> 12 cores; GPC 1575/1386/1530
#   MHz, CPU 2601 MHz, 70W CPU 1998 MHz): public file, repository not resolved, reference id 52522571082.
# source (120W is the default, `nvpmodel -q` prints 'NV Power Mode: 120W' / '1'; MAXN clocks gpu-gpc-0 1575000000,
#   gpu-nvd-0 1692000000, EMC 4266000000, cpu 2601000): public file, repository not resolved, reference id 44448955983.
THOR_MODES = [
    _mode(0, "MAXN", 14, 2601000, 1575000000, 4266000000, 64, None, nvd_max_hz=1692000000),
    _mode(1, "120W", 14, 2601000, 1386000000, 4266000000, 64, None, nvd_max_hz=1692000000),
    _mode(2, "90W", 12, 2601000, 1530000000, 4266000000, 15873, None, nvd_max_hz=1692000000),
    _mode(3, "70W", 12, 1998000, 1530000000, 4266000000, 15873, None, nvd_max_hz=1692000000),
]


# --- identity files -----------------------------------------------------------------------------------

# source: public file, repository not resolved, reference id 5678281470 (`head -n 1 /etc/nv_tegra_release`, R36.3.0,
#   with `uname -a` '5.15.136-tegra #1 SMP PREEMPT Mon May 6 09:56:39 PDT 2024'); the three lines after the first are
#   the R36 layout (reference id 33380463252, another R36.3.0 file).
NV_TEGRA_RELEASE_R36_3_0 = (
    "# R36 (release), REVISION: 3.0, GCID: 36191598, BOARD: generic, EABI: aarch64, DATE: Mon May  6 17:34:21 UTC 2024\n"
    "# KERNEL_VARIANT: oot\n"
    "TARGET_USERSPACE_LIB_DIR=nvidia\n"
    "TARGET_USERSPACE_LIB_DIR_PATH=usr/lib/aarch64-linux-gnu/nvidia\n"
)
# source: public file, repository not resolved, reference id 8818311156 (the '# Jetson System Information' file that
#   UNRESOLVED-provenance.txt also quotes; GCID 41062509 matches tegrastats-agx-orin.txt's R36.4.4 note).
NV_TEGRA_RELEASE_R36_4_4 = (
    "# R36 (release), REVISION: 4.4, GCID: 41062509, BOARD: generic, EABI: aarch64, DATE: Mon Jun 16 16:07:13 UTC 2025\n"
    "# KERNEL_VARIANT: oot\n"
    "TARGET_USERSPACE_LIB_DIR=nvidia\n"
    "TARGET_USERSPACE_LIB_DIR_PATH=usr/lib/aarch64-linux-gnu/nvidia\n"
)
# source: public files, repository not resolved, reference ids 44341695611 and 24958966622 (`cat /etc/nv_tegra_release`
#   on JetPack 5.1.2 prints this single line).
NV_TEGRA_RELEASE_R35_4_1 = (
    "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, DATE: Tue Aug  1 19:57:35 UTC 2023\n"
)
# source: public file, repository not resolved, reference id 54612712197 (the Thor R38.4 file UNRESOLVED-provenance.txt
#   quotes; GCID 43443517 matches tegrastats-thor.txt's R38.4 note); the lines after KERNEL_VARIANT are the R38 layout
#   (reference id 65864031650, an R38.2 Thor).
NV_TEGRA_RELEASE_R38_4_0 = (
    "# R38 (release), REVISION: 4.0, GCID: 43443517, BOARD: generic, EABI: aarch64, DATE: Wed Dec 31 00:15:19 UTC 2025\n"
    "# KERNEL_VARIANT: oot\n"
    "TARGET_USERSPACE_LIB_DIR=nvidia\n"
    "TARGET_USERSPACE_LIB_DIR_PATH=usr/lib/aarch64-linux-gnu/nvidia\n"
    "INSTALL_TYPE=\n"
)

# source: public file, repository not resolved, reference id 61451829400 (a console log: `cat /etc/nv_tegra_release`
#   after `uname -a` '6.8.12-1021-tegra #1 SMP PREEMPT Thu Aug  6 21:56:04 PDT 2026'; copied with its provenance to
#   tests/data/jetson-formats/nv_tegra_release-r39.txt). The same first line is quoted in several R39.2.1 how-tos.
NV_TEGRA_RELEASE_R39_2_1 = (
    "# R39 (release), REVISION: 2.1, GCID: 46758480, BOARD: generic, EABI: aarch64, DATE: Fri Aug  7 05:54:22 AM UTC 2026\n"
    "# KERNEL_VARIANT: oot\n"
    "TARGET_USERSPACE_LIB_DIR=nvidia\n"
    "TARGET_USERSPACE_LIB_DIR_PATH=usr/lib/aarch64-linux-gnu/nvidia\n"
)

_COMMON_ORIN_NANO = {
    "soc": "tegra234",
    "cpu_min_khz": 729600, "gpu_min_hz": 306000000, "emc_min_hz": 204000000,
    "cpu_param": "CPU_A78_{i}",
    "ram_total_mb": 7620, "swap_total_mb": 3810,
    "tegrastats": "orin_jp6", "clocks_show": "r36", "verbose": "r36",
    "gpu_devfreq": "/sys/devices/platform/17000000.gpu/devfreq_dev",
    "fan_pwm": 69, "fan_pwm_locked": 255,
    "golden_image_warning": True,
}

PROFILES: Dict[str, Dict[str, Any]] = {
    "orin_nano": dict(
        _COMMON_ORIN_NANO,
        title="Jetson Orin Nano 8GB Developer Kit, JetPack 6.0 (L4T R36.3.0)",
        # source: nvpmodel-modes.txt / jetson_clocks-show.txt R39.2.0 ('Machine:NVIDIA Jetson Orin Nano Developer Kit')
        device_tree_model="NVIDIA Jetson Orin Nano Developer Kit",
        nv_tegra_release=NV_TEGRA_RELEASE_R36_3_0, l4t="36.3.0", jetpack="6.0",
        kernel_release="5.15.136-tegra", kernel_version="#1 SMP PREEMPT Mon May 6 09:56:39 PDT 2024",
        hostname="orin-nano", nvpmodel_conf_name="nvpmodel_p3767_0003",
        modes=ORIN_NANO_MODES, default_mode=0, cpus=6,
    ),
    "orin_nano_super": dict(
        _COMMON_ORIN_NANO,
        title="Jetson Orin Nano 8GB Developer Kit (Super conf), JetPack 6.2.1 (L4T R36.4.4)",
        # source: UNRESOLVED-provenance.txt, R36.4.3 Orin Nano Super `jetson_clocks --show` Machine: line
        device_tree_model="NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super",
        nv_tegra_release=NV_TEGRA_RELEASE_R36_4_4, l4t="36.4.4", jetpack="6.2.1",
        kernel_release="5.15.148-tegra", kernel_version="#1 SMP PREEMPT Mon Jun 16 08:24:48 PDT 2025",  # emulator assumption (date)
        hostname="orin-nano-super", nvpmodel_conf_name="nvpmodel_p3767_0003_super",
        modes=ORIN_NANO_SUPER_MODES, default_mode=1, cpus=6,
    ),
    "orin_nano_super_r39": dict(
        _COMMON_ORIN_NANO,
        title="Jetson Orin Nano 8GB Developer Kit (Super conf), JetPack 7.2.1 (L4T R39.2.1)",
        # source: jetson_clocks-show.txt, Orin Nano Super R39.2.1 'Machine:' line
        device_tree_model="NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super",
        nv_tegra_release=NV_TEGRA_RELEASE_R39_2_1, l4t="39.2.1", jetpack="7.2.1",
        # source: reference id 61451829400 (see NV_TEGRA_RELEASE_R39_2_1)
        kernel_release="6.8.12-1021-tegra", kernel_version="#1 SMP PREEMPT Thu Aug  6 21:56:04 PDT 2026",
        hostname="orin-nano-super-r39", nvpmodel_conf_name="nvpmodel_p3767_0003_super",
        modes=ORIN_NANO_SUPER_R39_MODES, default_mode=1, cpus=6,
        # source: tegrastats-orin-nano.txt, R39.2.1 Orin Nano Super lines ('RAM 2850/7486MB', no SWAP field)
        ram_total_mb=7486, swap_total_mb=None,
        tegrastats="orin_r39", clocks_show="r39",
        # emulator assumption: the R36 verbose shape and paths (no R39 `nvpmodel --verbose` capture)
        fan_pwm=60,  # source: jetson_clocks-show.txt R39.2.1 'hwmon0_pwm1=60'
    ),
    "agx_orin": {
        "title": "Jetson AGX Orin 64GB Developer Kit, JetPack 5.1.2 (L4T R35.4.1)",
        # source: jetson_clocks-show.txt, catid AGX Orin 64GB JP5.1: 'Machine:Jetson AGX Orin'
        "device_tree_model": "Jetson AGX Orin",
        "nv_tegra_release": NV_TEGRA_RELEASE_R35_4_1, "l4t": "35.4.1", "jetpack": "5.1.2",
        "kernel_release": "5.10.120-tegra", "kernel_version": "#1 SMP PREEMPT Tue Aug 1 12:32:50 PDT 2023",  # emulator assumption (date)
        "hostname": "agx-orin", "nvpmodel_conf_name": "nvpmodel_p3701_0000",
        "soc": "tegra234", "modes": AGX_ORIN_MODES, "default_mode": 2, "cpus": 12,
        "cpu_min_khz": 729600, "gpu_min_hz": 306000000, "emc_min_hz": 204000000,
        "cpu_param": "CPU_A78_{cluster}",
        "ram_total_mb": 62801, "swap_total_mb": 31400,
        "tegrastats": "agx_orin_jp5", "clocks_show": "r35_agx", "verbose": "r35",
        "gpu_devfreq": "/sys/devices/17000000.ga10b/devfreq_dev",
        "fan_pwm": 55, "fan_pwm_locked": 255,
        "golden_image_warning": True,
    },
    "thor": {
        "title": "Jetson AGX Thor Developer Kit (T5000, 128GB), JetPack 7.1 (L4T R38.4.0)",
        # source: public file, repository not resolved, reference id 44448955983 ('Machine:NVIDIA Jetson AGX Thor Developer Kit')
        "device_tree_model": "NVIDIA Jetson AGX Thor Developer Kit",
        "nv_tegra_release": NV_TEGRA_RELEASE_R38_4_0, "l4t": "38.4.0", "jetpack": "7.1",
        # source: tegrastats-thor.txt (R38.4 block 't.Run("6.8.12")'); emulator assumption (build date)
        "kernel_release": "6.8.12-tegra", "kernel_version": "#1 SMP PREEMPT_DYNAMIC Tue Dec 30 08:12:33 PST 2025",
        "hostname": "agx-thor", "nvpmodel_conf_name": "nvpmodel_p3834_0008",
        "soc": "tegra264", "modes": THOR_MODES, "default_mode": 1, "cpus": 14,
        "cpu_min_khz": 972000, "gpu_min_hz": 314000000, "emc_min_hz": 665600000,  # gpu min: emulator assumption
        "cpu_param": "CPU_NEOVERSE_{i}",  # emulator assumption (no Thor conf in the corpus)
        "ram_total_mb": 125772, "swap_total_mb": None,
        "tegrastats": "thor_r38", "clocks_show": "r38_thor", "verbose": "r38",
        "gpu_devfreq": "/sys/class/devfreq/gpu-gpc-0",
        "fan_pwm": 73, "fan_pwm_locked": 73,
        "golden_image_warning": False,  # the Thor capture (reference id 52522571082) has no such line
    },
}

ALIASES = {
    "orin_nano_8gb": "orin_nano", "orin-nano": "orin_nano", "nano_orin": "orin_nano",
    "orin_nano_super_jp7": "orin_nano_super_r39",
    "agx_orin_64gb": "agx_orin", "agx-orin": "agx_orin", "agx_thor": "thor", "thor_t5000": "thor",
}


def profile(module: str) -> Dict[str, Any]:
    key = ALIASES.get(module, module)
    if key not in PROFILES:
        raise KeyError(f"unknown emulated module {module!r}; known: {', '.join(sorted(PROFILES))}")
    prof = dict(PROFILES[key])
    prof["key"] = key
    return prof


def mode_by_id(prof: Dict[str, Any], mode_id: int) -> Dict[str, Any]:
    for mode in prof["modes"]:
        if mode["id"] == mode_id:
            return mode
    raise KeyError(mode_id)


def needs_reboot(prof: Dict[str, Any], from_id: int, to_id: int) -> bool:
    a, b = mode_by_id(prof, from_id), mode_by_id(prof, to_id)
    return (a["cores"], a["tpc_pg_mask"]) != (b["cores"], b["tpc_pg_mask"])


def cpu_ranges(indices: List[int]) -> str:
    """[0,1,2,3,5] -> '0-3,5' (the `Online CPUs:` notation)."""
    out: List[str] = []
    start = prev = None
    for i in indices:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(out)


# --- /etc/nvpmodel.conf -----------------------------------------------------------------------------------
# source (syntax): nvpmodel-conf-nano.txt (POWER_MODEL section, `< POWER_MODEL ID=n NAME=x >`, `CPU_ONLINE CORE_i v`,
#   `GPU MAX_FREQ v`, `EMC MAX_FREQ v`), nvpmodel-modes.txt conf notes (`< PARAM TYPE=FILE|CLOCK NAME=X >`,
#   `< PM_CONFIG DEFAULT=n >`, -1 = INT_MAX); PARAM paths: nvpmodel-verbose.txt / UNRESOLVED-provenance.txt.

def _cpu_param_name(prof: Dict[str, Any], core: int) -> str:
    return prof["cpu_param"].format(i=core, cluster=core // 4)


def nvpmodel_conf_text(prof: Dict[str, Any]) -> str:
    lines = [
        f"# /etc/nvpmodel.conf of an EMULATED {prof['title']} (tests/emulated_jetson; the real file is",
        f"# /etc/nvpmodel/{prof['nvpmodel_conf_name']}.conf). Only what jbench reads is emulated.",
        "",
        "< PARAM TYPE=FILE NAME=CPU_ONLINE >",
    ]
    for core in range(prof["cpus"]):
        lines.append(f"CORE_{core} /sys/devices/system/cpu/cpu{core}/online")
    # source: nvpmodel-verbose.txt (AGX Orin JP5: /sys/devices/gpu.0/tpc_pg_mask, /sys/kernel/nvpmodel_emc_cap/emc_iso_cap)
    #   and UNRESOLVED-provenance.txt (R36.4.3: /sys/devices/platform/gpu.0/tpc_pg_mask, /sys/kernel/nvpmodel_clk_cap/emc)
    r35 = prof.get("verbose") == "r35"
    gpu0 = "/sys/devices/gpu.0" if r35 else "/sys/devices/platform/gpu.0"
    emc_cap = "/sys/kernel/nvpmodel_emc_cap/emc_iso_cap" if r35 else "/sys/kernel/nvpmodel_clk_cap/emc"
    lines += ["", "< PARAM TYPE=FILE NAME=TPC_POWER_GATING >", f"TPC_PG_MASK {gpu0}/tpc_pg_mask", ""]
    seen = []
    for core in range(prof["cpus"]):
        name = _cpu_param_name(prof, core)
        if name in seen:
            continue
        seen.append(name)
        lines += [f"< PARAM TYPE=CLOCK NAME={name} >",
                  f"FREQ_TABLE /sys/devices/system/cpu/cpu{core}/cpufreq/scaling_available_frequencies",
                  f"MAX_FREQ /sys/devices/system/cpu/cpu{core}/cpufreq/scaling_max_freq",
                  f"MIN_FREQ /sys/devices/system/cpu/cpu{core}/cpufreq/scaling_min_freq", ""]
    dev = prof["gpu_devfreq"]
    lines += ["< PARAM TYPE=CLOCK NAME=GPU >", f"FREQ_TABLE {dev}/available_frequencies",
              f"MAX_FREQ {dev}/max_freq", f"MIN_FREQ {dev}/min_freq", "",
              "< PARAM TYPE=CLOCK NAME=EMC >", f"MAX_FREQ {emc_cap}", "",
              "###########################", "#                         #", "# POWER_MODEL DEFINITIONS #",
              "#                         #", "###########################", ""]
    for mode in prof["modes"]:
        lines.append(f"< POWER_MODEL ID={mode['id']} NAME={mode['name']} >")
        for core in range(prof["cpus"]):
            lines.append(f"CPU_ONLINE CORE_{core} {1 if core < mode['cores'] else 0}")
        lines.append(f"TPC_POWER_GATING TPC_PG_MASK {mode['tpc_pg_mask']}")
        for name in seen:
            lines.append(f"{name} MIN_FREQ {prof['cpu_min_khz']}")
            lines.append(f"{name} MAX_FREQ {mode['cpu_max_khz']}")
        lines.append("GPU MIN_FREQ 0")
        lines.append(f"GPU MAX_FREQ {mode['gpu_max_hz']}")
        lines.append(f"EMC MAX_FREQ {mode['emc_max_hz']}")
        lines.append("")
    lines.append(f"< PM_CONFIG DEFAULT={prof['default_mode']} >")
    return "\n".join(lines) + "\n"
