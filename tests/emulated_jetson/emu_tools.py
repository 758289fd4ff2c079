"""The fake Jetson tools of the emulated device (nvpmodel, jetson_clocks, tegrastats, sudo, reboot, ...).

`bin/<tool>` is a three-line python3 script that calls `main(<tool>, argv)` here. Standard library only; runs
inside an ssh session of the emulated device, where $JETSON_EMU_STATE names the device's state directory.
Output templates live next to the code that fills them, each with the `# source:` of the real capture it copies
(file names relative to tests/data/jetson-formats/). See emu_profiles.py for the module data.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import emu_profiles as P
import emu_state as S

USAGE_EXIT = 1


def _out(text: str = "") -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _err(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _log_invocation(state_dir: str, tool: str, argv: Sequence[str], root: bool) -> None:
    try:
        with open(os.path.join(state_dir, "commands.log"), "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"time": time.time(), "tool": tool, "argv": list(argv), "root": root}) + "\n")
    except OSError:
        pass


def request_reboot(state_dir: str, by: str) -> None:
    S.write_text_atomic(os.path.join(state_dir, S.REBOOT_REQUEST), json.dumps({"by": by, "time": time.time()}) + "\n")


def write_nvpmodel_status(state_dir: str, mode_id: int) -> None:
    # source: sysfs-paths.md section 6 ('/var/lib/nvpmodel/status holds e.g. pmode:0002 fmode:fan_mode_quiet')
    S.write_text_atomic(os.path.join(state_dir, "nvpmodel_status"), f"pmode:{mode_id:04d} fmode:fan_mode_quiet\n")


# ============================================================================================ nvpmodel

def _nvpmodel_usage() -> None:
    # emulator text (no capture of the real usage text in the corpus)
    _out("Usage: nvpmodel [-m <mode id>] [-q] [-p] [-f <conf file>] [-d <fan mode>] [--verbose]")


def _verbose_param_lines(prof: Dict[str, Any], mode: Dict[str, Any], state: Dict[str, Any]) -> List[str]:
    """`nvpmodel -q --verbose` PARAM lines of the active mode.

    source (R36 shape and paths): UNRESOLVED-provenance.txt, Orin Nano Super R36.4.3 `sudo -n nvpmodel -q --verbose`:
      NVPM VERB: PARAM CPU_ONLINE: ARG CORE_0: PATH /sys/devices/system/cpu/cpu0/online: REAL_VAL: 1 CONF_VAL: 1
      NVPM VERB: PARAM TPC_POWER_GATING: ARG TPC_PG_MASK: PATH /sys/devices/platform/gpu.0/tpc_pg_mask: REAL_VAL: 240 CONF_VAL: 240
      NVPM VERB: PARAM GPU: ARG MIN_FREQ: PATH /sys/devices/platform/17000000.gpu/devfreq_dev/min_freq: REAL_VAL: 306000000 CONF_VAL: 0
      NVPM VERB: PARAM EMC: ARG MAX_FREQ: PATH /sys/kernel/nvpmodel_clk_cap/emc: REAL_VAL: 3199000000 CONF_VAL: 3199000000
    source (JP5 paths): nvpmodel-verbose.txt, AGX Orin JP5 `-p --verbose` (/sys/devices/gpu.0/tpc_pg_mask,
      /sys/devices/17000000.ga10b/devfreq_dev, /sys/kernel/nvpmodel_emc_cap/emc_iso_cap).
    Thor (R38): emulator assumption (devfreq gpu-gpc-0 from sysfs-paths.md; no Thor verbose capture exists).
    """
    style = prof["verbose"]
    gpu0 = "/sys/devices/gpu.0" if style == "r35" else "/sys/devices/platform/gpu.0"
    emc_path = "/sys/kernel/nvpmodel_emc_cap/emc_iso_cap" if style == "r35" else "/sys/kernel/nvpmodel_clk_cap/emc"
    cpu_locked, gpu_locked = bool(state.get("cpu_locked")), bool(state.get("gpu_locked"))
    lines = []
    for core in range(prof["cpus"]):
        val = 1 if core < mode["cores"] else 0
        lines.append(f"NVPM VERB: PARAM CPU_ONLINE: ARG CORE_{core}: PATH /sys/devices/system/cpu/cpu{core}/online: "
                     f"REAL_VAL: {val} CONF_VAL: {val}")
    if style != "r38":
        lines.append(f"NVPM VERB: PARAM TPC_POWER_GATING: ARG TPC_PG_MASK: PATH {gpu0}/tpc_pg_mask: "
                     f"REAL_VAL: {mode['tpc_pg_mask']} CONF_VAL: {mode['tpc_pg_mask']}")
        lines.append(f"NVPM VERB: PARAM GPU_POWER_CONTROL_ENABLE: ARG GPU_PWR_CNTL_EN: PATH {gpu0}/power/control: "
                     "REAL_VAL: auto CONF_VAL: on")
    seen = []
    for core in range(mode["cores"]):
        name = P._cpu_param_name(prof, core)
        if name in seen:
            continue
        seen.append(name)
        cpu_min = mode["cpu_max_khz"] if cpu_locked else prof["cpu_min_khz"]
        lines.append(f"NVPM VERB: PARAM {name}: ARG MIN_FREQ: PATH /sys/devices/system/cpu/cpu{core}/cpufreq/"
                     f"scaling_min_freq: REAL_VAL: {cpu_min} CONF_VAL: {prof['cpu_min_khz']}")
        lines.append(f"NVPM VERB: PARAM {name}: ARG MAX_FREQ: PATH /sys/devices/system/cpu/cpu{core}/cpufreq/"
                     f"scaling_max_freq: REAL_VAL: {mode['cpu_max_khz']} CONF_VAL: {mode['cpu_max_khz']}")
    dev = prof["gpu_devfreq"]
    gpu_min = mode["gpu_max_hz"] if gpu_locked else prof["gpu_min_hz"]
    lines.append(f"NVPM VERB: PARAM GPU: ARG MIN_FREQ: PATH {dev}/min_freq: REAL_VAL: {gpu_min} CONF_VAL: 0")
    lines.append(f"NVPM VERB: PARAM GPU: ARG MAX_FREQ: PATH {dev}/max_freq: REAL_VAL: {mode['gpu_max_hz']} "
                 f"CONF_VAL: {mode['gpu_max_hz']}")
    if style != "r38":
        lines.append(f"NVPM VERB: PARAM GPU_POWER_CONTROL_DISABLE: ARG GPU_PWR_CNTL_DIS: PATH {gpu0}/power/control: "
                     "REAL_VAL: auto CONF_VAL: auto")
    lines.append(f"NVPM VERB: PARAM EMC: ARG MAX_FREQ: PATH {emc_path}: REAL_VAL: {mode['emc_max_hz']} "
                 f"CONF_VAL: {mode['emc_max_hz']}")
    return lines


def _print_parse_verbose(prof: Dict[str, Any]) -> None:
    """`nvpmodel -p --verbose`.

    source: nvpmodel-verbose.txt, jetson_stats emulator heredoc show_verbose_orin (AGX Orin JP5):
      NVPM VERB: Config file: /etc/nvpmodel.conf
      NVPM VERB: parsing done for /etc/nvpmodel.conf
      succeed to parse file /etc/nvpmodel.conf.
      NVPM VERB: PM_CONFIG: DEFAULT=MODE_30W(2)
      NVPM VERB: PARAM TYPE=FILE NAME=CPU_ONLINE
      NVPM VERB: CORE_0 /sys/devices/system/cpu/cpu0/online
      ...
      NVPM VERB:
      NVPM VERB: POWER_MODEL: ID=0 NAME=MAXN
      NVPM VERB: CPU_ONLINE CORE_0 1
      ...
      NVPM VERB: GPU MAX_FREQ 2147483647
      NVPM VERB: EMC MAX_FREQ 0
      NVPM VERB:
    """
    default = P.mode_by_id(prof, prof["default_mode"])
    _out("NVPM VERB: Config file: /etc/nvpmodel.conf")
    _out("NVPM VERB: parsing done for /etc/nvpmodel.conf")
    if prof["verbose"] == "r35":
        _out("succeed to parse file /etc/nvpmodel.conf.")
    _out(f"NVPM VERB: PM_CONFIG: DEFAULT={default['name']}({default['id']})")
    _out("NVPM VERB: PARAM TYPE=FILE NAME=CPU_ONLINE")
    for core in range(prof["cpus"]):
        _out(f"NVPM VERB: CORE_{core} /sys/devices/system/cpu/cpu{core}/online")
    dev = prof["gpu_devfreq"]
    _out("NVPM VERB: PARAM TYPE=CLOCK NAME=GPU")
    _out(f"NVPM VERB: FREQ_TABLE {dev}/available_frequencies")
    _out(f"NVPM VERB: MAX_FREQ {dev}/max_freq")
    _out(f"NVPM VERB: MIN_FREQ {dev}/min_freq")
    _out("NVPM VERB: PARAM TYPE=CLOCK NAME=EMC")
    _out("NVPM VERB: MAX_FREQ " + ("/sys/kernel/nvpmodel_emc_cap/emc_iso_cap" if prof["verbose"] == "r35"
                                  else "/sys/kernel/nvpmodel_clk_cap/emc"))
    _out("NVPM VERB:")
    for mode in prof["modes"]:
        _out(f"NVPM VERB: POWER_MODEL: ID={mode['id']} NAME={mode['name']}")
        for core in range(prof["cpus"]):
            _out(f"NVPM VERB: CPU_ONLINE CORE_{core} {1 if core < mode['cores'] else 0}")
        _out(f"NVPM VERB: TPC_POWER_GATING TPC_PG_MASK {mode['tpc_pg_mask']}")
        _out("NVPM VERB: GPU_POWER_CONTROL_ENABLE GPU_PWR_CNTL_EN on")
        seen = []
        for core in range(prof["cpus"]):
            name = P._cpu_param_name(prof, core)
            if name not in seen:
                seen.append(name)
                _out(f"NVPM VERB: {name} MIN_FREQ {prof['cpu_min_khz']}")
                _out(f"NVPM VERB: {name} MAX_FREQ {mode['cpu_max_khz']}")
        _out("NVPM VERB: GPU MIN_FREQ 0")
        _out(f"NVPM VERB: GPU MAX_FREQ {mode['gpu_max_hz']}")
        _out("NVPM VERB: GPU_POWER_CONTROL_DISABLE GPU_PWR_CNTL_DIS auto")
        _out(f"NVPM VERB: EMC MAX_FREQ {mode['emc_max_hz']}")
        _out("NVPM VERB:")


def nvpmodel(args: List[str], state_dir: str) -> int:
    query = verbose = parse = False
    set_id: Optional[str] = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-q", "--query"):
            query = True
        elif arg == "--verbose":
            verbose = True
        elif arg in ("-p", "--parse"):
            parse = True
        elif arg in ("-m", "--mode", "-f", "--file", "-d", "--fan"):
            if i + 1 >= len(args):
                _nvpmodel_usage()
                return USAGE_EXIT
            if arg in ("-m", "--mode"):
                set_id = args[i + 1]
            i += 1  # -f/-d values accepted and ignored
        elif arg.startswith("-m") and len(arg) > 2:
            set_id = arg[2:]
        elif arg in ("-h", "--help"):
            _nvpmodel_usage()
            return 0
        else:
            _nvpmodel_usage()
            return USAGE_EXIT
        i += 1
    if not (query or parse or set_id is not None):
        _nvpmodel_usage()
        return USAGE_EXIT

    state = S.load(state_dir)
    prof = P.profile(state["module"])
    if set_id is not None:
        if not S.is_root(state):
            # emulator text (not captured): the real tool fails writing sysfs files without root; jtop and jbench
            # scan for 'NVPM ERROR'. The last line is real (nvpmodel-q.txt failure block).
            _out("NVPM ERROR: Error opening /var/lib/nvpmodel/status: Permission denied")
            _out("NVPM ERROR: failed to set power mode!")
            return 1
        try:
            target = P.mode_by_id(prof, int(set_id))
        except (KeyError, ValueError):
            # emulator text for an unknown id; the last line is real (nvpmodel-q.txt failure block)
            _out(f"NVPM ERROR: Invalid power mode ID: {set_id}")
            _out("NVPM ERROR: failed to set power mode!")
            return 1
        current = state["nvpmodel_mode"]
        if target["id"] != current and P.needs_reboot(prof, current, target["id"]):
            # source: public files, repository not resolved -- reference id 44360776697 (AGX Orin, confirmed):
            #   NVPM WARN: Golden image context is already created
            #   NVPM WARN: Reboot required for changing to this power mode: 0
            #   NVPM WARN: DO YOU WANT TO REBOOT NOW? enter YES/yes to confirm:
            #   yes
            #   NVPM WARN: rebooting
            # reference id 59343683172 ("declined via the interactive prompt", Orin):
            #   ... enter YES/yes to confirm:
            #   NVPM ERROR: optMask is 1, no request for power mode
            # reference id 52522571082 (Thor, no golden-image line, input not YES):
            #   NVPM ERROR: bad input!
            #   NVPM ERROR: optMask is 1, no request for power mode
            if prof.get("golden_image_warning"):
                _out("NVPM WARN: Golden image context is already created")
            _out(f"NVPM WARN: Reboot required for changing to this power mode: {target['id']}")
            _out("NVPM WARN: DO YOU WANT TO REBOOT NOW? enter YES/yes to confirm:")
            answer = sys.stdin.readline()
            # Accepted or not, the target is recorded as the mode of the next boot (state nvpmodel_pending and
            # /var/lib/nvpmodel/status = pmode:<target>), and the running mode is unchanged until that boot.
            # source: issue 11 statement (a declined reboot leaves the mode pending: the next reboot of any kind
            # boots into it). Note: third-party evidence (almond-bot/axol
            # almond_axol/utils/jetson.py @3d3c09c, "Declining the reboot prompt CANCELS the switch -- nvpmodel
            # records nothing") suggests the opposite; the emulator follows the issue's description of L4T.
            S.update(state_dir, {"nvpmodel_pending": target["id"]},
                     fn=lambda s: S.add_event(s, "nvpmodel_pending", mode=target["id"],
                                              accepted=answer.strip() in ("YES", "yes")))
            write_nvpmodel_status(state_dir, target["id"])
            if answer.strip() in ("YES", "yes"):
                _out("NVPM WARN: rebooting")
                request_reboot(state_dir, f"nvpmodel -m {target['id']}")
                return 0
            if answer.strip().lower() not in ("no", "n"):
                _out("NVPM ERROR: bad input!")
            _out("NVPM ERROR: optMask is 1, no request for power mode")
            return 1
        # A live switch (or re-applying the running mode) writes what the mode's PARAM lines list: CPU online,
        # CPU/GPU MIN_FREQ/MAX_FREQ, the EMC cap, TPC mask, GPU power/control (the PARAM lines of the
        # AGX Orin JP5 `nvpmodel -p --verbose` and the R36.4.3 verbose dump). So the CPU and GPU min=max locks of
        # jetson_clocks are undone (min goes back to the conf's MIN_FREQ). No PARAM touches cpuidle/stateN/disable,
        # the debugfs EMC mrq_rate_locked or railgate_enable: those stay as jetson_clocks left them
        # (source: issue 11 statement, "nvpmodel -m N does not undo what jetson_clocks locked: the EMC rate lock
        # (mrq_rate_locked), disabled cpuidle states and GPU railgating stay"). The fan is not a PARAM either.
        # Writing the status file replaces a pending mode: `nvpmodel -m <running id>` cancels it.
        S.update(state_dir, {"nvpmodel_mode": target["id"], "nvpmodel_pending": None, "cpu_locked": False,
                             "gpu_locked": False},
                 fn=lambda s: S.add_event(s, "nvpmodel_mode", mode=target["id"]))
        write_nvpmodel_status(state_dir, target["id"])
        state = S.load(state_dir)

    if query:
        # the running mode, also while another one is pending (issue 11 statement: "`nvpmodel -q` reports the
        # running mode"; almond-bot/axol @3d3c09c suggests -q may read the status file)
        mode = P.mode_by_id(prof, state["nvpmodel_mode"])
        if verbose:
            # source: nvpmodel-verbose.txt (`-q --verbose` header) / UNRESOLVED-provenance.txt (R36.4.3):
            #   NVPM VERB: Config file: /etc/nvpmodel.conf
            #   NVPM VERB: parsing done for /etc/nvpmodel.conf
            #   NVPM VERB: Current mode: NV Power Mode: 25W
            #   1
            _out("NVPM VERB: Config file: /etc/nvpmodel.conf")
            _out("NVPM VERB: parsing done for /etc/nvpmodel.conf")
            _out(f"NVPM VERB: Current mode: NV Power Mode: {mode['name']}")
            _out(str(mode["id"]))
            for line in _verbose_param_lines(prof, mode, state):
                _out(line)
        else:
            # source: nvpmodel-q.txt (Orin Nano R39.2.0):
            #   NV Power Mode: 15W
            #   0
            _out(f"NV Power Mode: {mode['name']}")
            _out(str(mode["id"]))
    if parse and verbose:
        _print_parse_verbose(prof)
    return 0


# ======================================================================================= jetson_clocks

def _clock_values(prof: Dict[str, Any], state: Dict[str, Any]) -> Dict[str, Any]:
    """What --show prints, per knob (JC-2023: each lock is its own sysfs/debugfs file)."""
    mode = P.mode_by_id(prof, state["nvpmodel_mode"])
    cpu_l, gpu_l, emc_l = bool(state.get("cpu_locked")), bool(state.get("gpu_locked")), bool(state.get("emc_locked"))
    rng = random.Random()
    cpu_steps = [prof["cpu_min_khz"], 883200, 1036800, 1190400, mode["cpu_max_khz"]]
    cpu_cur = [mode["cpu_max_khz"] if cpu_l else rng.choice([s for s in cpu_steps if s <= mode["cpu_max_khz"]])
               for _ in range(prof["cpus"])]
    emc_idle = min(mode["emc_max_hz"], 2133000000) if prof["soc"] == "tegra234" else prof["emc_min_hz"]
    # EMC locked: mrq_rate_locked=1 and the rate written at the cap (do_emc: `cat <max> > .../emc/rate`); after a
    # later `nvpmodel -m` the cap is the new mode's and the rate follows it (emulator assumption: how
    # BPMP treats a locked rate under a new cap is undocumented).
    fan_auto = prof["fan_pwm"]
    return {
        "mode": mode, "cpu_locked": cpu_l, "gpu_locked": gpu_l, "emc_locked": emc_l,
        "locked": S.all_locked(state),
        "cpu_min": mode["cpu_max_khz"] if cpu_l else prof["cpu_min_khz"], "cpu_max": mode["cpu_max_khz"],
        "cpu_cur": cpu_cur,
        "gpu_min": mode["gpu_max_hz"] if gpu_l else prof["gpu_min_hz"], "gpu_max": mode["gpu_max_hz"],
        "gpu_cur": mode["gpu_max_hz"] if gpu_l else prof["gpu_min_hz"],
        "emc_min": mode["emc_max_hz"] if emc_l else prof["emc_min_hz"], "emc_max": mode["emc_max_hz"],
        "emc_cur": mode["emc_max_hz"] if emc_l else emc_idle,
        # cpuidle `IdleStates: WFI=<1 if enabled>` (`idle_states+="=$((idle_disable == 0)) "`)
        "idle": 0 if state.get("cpuidle_disabled") else 1,
        "fan": state.get("fan_pwm") if state.get("fan_pwm") is not None else fan_auto,
        "fan_active": bool(state.get("nvfancontrol_active", True)),
    }


def _show_r36(prof: Dict[str, Any], state: Dict[str, Any]) -> List[str]:
    # source: UNRESOLVED-provenance.txt, Orin Nano Super R36.4.3 `sudo -n jetson_clocks --show` (trailing space kept):
    #   SOC family:tegra234  Machine:NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super
    #   Online CPUs: 0-5
    #   cpu0:  Online=1 Governor=schedutil MinFreq=729600 MaxFreq=1344000 CurrentFreq=729600 IdleStates: WFI=1 c7=1 
    #   GPU MinFreq=306000000 MaxFreq=918000000 CurrentFreq=306000000
    #   Active GPU TPCs: 4
    #   EMC MinFreq=204000000 MaxFreq=3199000000 CurrentFreq=2133000000 FreqOverride=0
    #   FAN Dynamic Speed Control=nvfancontrol hwmon0_pwm1=69
    #   NV Power Mode: 25W
    # offline cores keep their line with Online=0 (jetson_clocks-show.txt, TX2 'Online CPUs: 0,3-5').
    v = _clock_values(prof, state)
    mode = v["mode"]
    online = list(range(mode["cores"]))
    lines = [f"SOC family:{prof['soc']}  Machine:{prof['device_tree_model']}", f"Online CPUs: {P.cpu_ranges(online)}"]
    for core in range(prof["cpus"]):
        on = 1 if core in online else 0
        lines.append(f"{'cpu%d:' % core:<6} Online={on} Governor=schedutil MinFreq={v['cpu_min']} MaxFreq={v['cpu_max']} "
                     f"CurrentFreq={v['cpu_cur'][core]} IdleStates: WFI={v['idle']} c7={v['idle']} ")
    lines.append(f"GPU MinFreq={v['gpu_min']} MaxFreq={v['gpu_max']} CurrentFreq={v['gpu_cur']}")
    lines.append(f"Active GPU TPCs: {mode['active_tpcs']}")
    lines.append(f"EMC MinFreq={v['emc_min']} MaxFreq={v['emc_max']} CurrentFreq={v['emc_cur']} "
                 f"FreqOverride={1 if v['emc_locked'] else 0}")
    # emulator assumption: the R36 script's fan line keeps 'nvfancontrol' also when --fan stopped the service (no
    # capture of that case); only the pwm changes (255 after --fan, JC-2023 do_fan).
    lines.append(f"FAN Dynamic Speed Control=nvfancontrol hwmon0_pwm1={v['fan']}")
    lines.append(f"NV Power Mode: {mode['name']}")
    return lines


def _show_r39(prof: Dict[str, Any], state: Dict[str, Any]) -> List[str]:
    # source: jetson_clocks-show.txt, vdavid21/edge-inference-benchmark-lab @7eb0b09 env-jetson-orin-20260919T113300Z.md
    #   (Orin Nano Super, L4T R39.2.1, 25W, unlocked; trailing spaces kept; no 'Online=', no FreqOverride):
    #   SOC family:tegra234  Machine:NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super
    #   Online CPUs: 0-5, Offline CPUs: 
    #   cpu0:  Governor=schedutil MinFreq=729600 MaxFreq=1344000 CurrentFreq=960000 IdleStates: WFI=1 c7=1 
    #   GPU MinFreq=306000000 MaxFreq=918000000 CurrentFreq=306000000
    #   Active GPU TPCs: 4
    #   EMC MinFreq=204000000 MaxFreq=3199000000 CurrentFreq=665600000
    #   FAN Dynamic Speed Control=nvfancontrol hwmon0_pwm1=60
    #   FAN Dynamic Speed Control=nvfancontrol hwmon0_pwm1_enable=1
    #   NV Power Mode: 25W
    # source (locked): UNRESOLVED-provenance.txt, AGX Orin R39.2.0 with jetson_clocks active: 'IdleStates: WFI=0 c7=0',
    #   'GPU MinFreq=1300500000 MaxFreq=1300500000 CurrentFreq=1300500000', 'EMC MinFreq=3199000000 MaxFreq=3199000000
    #   CurrentFreq=3199000000' (locked EMC: MinFreq == MaxFreq == CurrentFreq).
    v = _clock_values(prof, state)
    mode = v["mode"]
    online = list(range(mode["cores"]))
    offline = [c for c in range(prof["cpus"]) if c not in online]
    lines = [f"SOC family:{prof['soc']}  Machine:{prof['device_tree_model']}",
             f"Online CPUs: {P.cpu_ranges(online)}, Offline CPUs: " + (P.cpu_ranges(offline) if offline else "")]
    for core in online:  # emulator assumption: offline cores print no line (the Thor R38 new-format capture)
        lines.append(f"{'cpu%d:' % core:<6} Governor=schedutil MinFreq={v['cpu_min']} MaxFreq={v['cpu_max']} "
                     f"CurrentFreq={v['cpu_cur'][core]} IdleStates: WFI={v['idle']} c7={v['idle']} ")
    lines.append(f"GPU MinFreq={v['gpu_min']} MaxFreq={v['gpu_max']} CurrentFreq={v['gpu_cur']}")
    lines.append(f"Active GPU TPCs: {mode['active_tpcs']}")
    lines.append(f"EMC MinFreq={v['emc_min']} MaxFreq={v['emc_max']} CurrentFreq={v['emc_cur']}")
    lines.append(f"FAN Dynamic Speed Control=nvfancontrol hwmon0_pwm1={v['fan']}")
    # emulator assumption: pwm1_enable 1 under nvfancontrol (captured), 1 (manual) also after --fan
    lines.append("FAN Dynamic Speed Control=nvfancontrol hwmon0_pwm1_enable=1")
    lines.append(f"NV Power Mode: {mode['name']}")
    return lines


def _show_r35_agx(prof: Dict[str, Any], state: Dict[str, Any]) -> List[str]:
    # source: jetson_clocks-show.txt, catid/blog2022 AGX Orin 64GB JetPack 5.1 (cpu lines in lexical order, one space
    #   after 'cpuN:', trailing space, DLA/PVA lines, 'FAN Dynamic Speed control=active', no 'Active GPU TPCs'):
    #   SOC family:tegra234  Machine:Jetson AGX Orin
    #   Online CPUs: 0-11
    #   cpu0: Online=1 Governor=schedutil MinFreq=729600 MaxFreq=2201600 CurrentFreq=2201600 IdleStates: WFI=1 c7=1 
    #   cpu1: ...   cpu10: ...   cpu11: ...   cpu2: ...
    #   GPU MinFreq=306000000 MaxFreq=1300500000 CurrentFreq=306000000
    #   EMC MinFreq=204000000 MaxFreq=3199000000 CurrentFreq=2133000000 FreqOverride=0
    #   DLA0_CORE:   Online=1 MinFreq=0 MaxFreq=1600000000 CurrentFreq=1600000000
    #   DLA0_FALCON: Online=1 MinFreq=0 MaxFreq=844800000 CurrentFreq=844800000
    #   DLA1_CORE:   Online=1 MinFreq=0 MaxFreq=1600000000 CurrentFreq=1600000000
    #   DLA1_FALCON: Online=1 MinFreq=0 MaxFreq=844800000 CurrentFreq=844800000
    #   PVA0_VPS0: Online=1 MinFreq=0 MaxFreq=1152000000 CurrentFreq=1152000000
    #   PVA0_AXI:  Online=1 MinFreq=0 MaxFreq=832000000 CurrentFreq=832000000
    #   FAN Dynamic Speed control=active hwmon2_pwm1=55
    #   NV Power Mode: MAXN
    v = _clock_values(prof, state)
    mode = v["mode"]
    online = list(range(mode["cores"]))
    lines = [f"SOC family:{prof['soc']}  Machine:{prof['device_tree_model']}", f"Online CPUs: {P.cpu_ranges(online)}"]
    for core in sorted(range(prof["cpus"]), key=lambda c: str(c)):
        on = 1 if core in online else 0
        lines.append(f"cpu{core}: Online={on} Governor=schedutil MinFreq={v['cpu_min']} MaxFreq={v['cpu_max']} "
                     f"CurrentFreq={v['cpu_cur'][core]} IdleStates: WFI={v['idle']} c7={v['idle']} ")
    lines.append(f"GPU MinFreq={v['gpu_min']} MaxFreq={v['gpu_max']} CurrentFreq={v['gpu_cur']}")
    lines.append(f"EMC MinFreq={v['emc_min']} MaxFreq={v['emc_max']} CurrentFreq={v['emc_cur']} "
                 f"FreqOverride={1 if v['emc_locked'] else 0}")
    lines.append(f"DLA0_CORE:   Online=1 MinFreq=0 MaxFreq={mode['dla_core_hz']} CurrentFreq={mode['dla_core_hz']}")
    lines.append(f"DLA0_FALCON: Online=1 MinFreq=0 MaxFreq={mode['dla_falcon_hz']} CurrentFreq={mode['dla_falcon_hz']}")
    lines.append(f"DLA1_CORE:   Online=1 MinFreq=0 MaxFreq={mode['dla_core_hz']} CurrentFreq={mode['dla_core_hz']}")
    lines.append(f"DLA1_FALCON: Online=1 MinFreq=0 MaxFreq={mode['dla_falcon_hz']} CurrentFreq={mode['dla_falcon_hz']}")
    lines.append(f"PVA0_VPS0: Online=1 MinFreq=0 MaxFreq={mode['pva_vps_hz']} CurrentFreq={mode['pva_vps_hz']}")
    lines.append(f"PVA0_AXI:  Online=1 MinFreq=0 MaxFreq={mode['pva_axi_hz']} CurrentFreq={mode['pva_axi_hz']}")
    # JC-2023 do_fan show: "FAN Dynamic Speed control=${NVFANCONTROL_STATUS} ..." (`systemctl is-active nvfancontrol`)
    lines.append(f"FAN Dynamic Speed control={'active' if v['fan_active'] else 'inactive'} hwmon2_pwm1={v['fan']}")
    lines.append(f"NV Power Mode: {mode['name']}")
    return lines


def _show_r38_thor(prof: Dict[str, Any], state: Dict[str, Any]) -> List[str]:
    # source: public file, repository not resolved, reference id 44448955983 (AGX Thor devkit, JetPack 7 / R38,
    #   `sudo jetson_clocks --show` right after `sudo jetson_clocks` in MAXN). New (R38+) format: no 'Online=' per cpu,
    #   ', Offline CPUs:' suffix, devfreq names gpu-gpc-0 / gpu-nvd-0 instead of 'GPU', and -- unlike Orin -- the locked
    #   EMC line keeps MinFreq < MaxFreq with FreqOverride=1:
    #   SOC family:tegra264  Machine:NVIDIA Jetson AGX Thor Developer Kit
    #   Online CPUs: 0-13, Offline CPUs:
    #   cpu0:  Governor=schedutil MinFreq=2601000 MaxFreq=2601000 CurrentFreq=2601000 IdleStates: WFI=0 cc7=0
    #   cpu10: Governor=schedutil MinFreq=2601000 MaxFreq=2601000 CurrentFreq=2601000 IdleStates: WFI=0 cc7=0
    #   gpu-gpc-0 MinFreq=1575000000 MaxFreq=1575000000 CurrentFreq=1575000000
    #   gpu-nvd-0 MinFreq=1692000000 MaxFreq=1692000000 CurrentFreq=1692000000
    #   EMC MinFreq=665600000 MaxFreq=4266000000 CurrentFreq=4266000000 FreqOverride=1
    #   PVA0_VPS0: Online=0 MinFreq=0 MaxFreq=1215000000 CurrentFreq=1215000000
    #   PVA0_AXI:  Online=0 MinFreq=0 MaxFreq=909000000 CurrentFreq=909000000
    #   FAN Dynamic Speed Control=nvfancontrol hwmon1_pwm1=73
    #   FAN Dynamic Speed Control=nvfancontrol hwmon1_pwm1_enable=1
    #   NV Power Mode: MAXN
    # emulator assumption: the unlocked values (min 972000 / 314000000, current idle values).
    v = _clock_values(prof, state)
    mode = v["mode"]
    online = list(range(mode["cores"]))
    offline = [c for c in range(prof["cpus"]) if c not in online]
    lines = [f"SOC family:{prof['soc']}  Machine:{prof['device_tree_model']}",
             f"Online CPUs: {P.cpu_ranges(online)}, Offline CPUs:" + (f" {P.cpu_ranges(offline)}" if offline else "")]
    for core in online:
        lines.append(f"{'cpu%d:' % core:<6} Governor=schedutil MinFreq={v['cpu_min']} MaxFreq={v['cpu_max']} "
                     f"CurrentFreq={v['cpu_cur'][core]} IdleStates: WFI={v['idle']} cc7={v['idle']}")
    nvd = mode["nvd_max_hz"]
    lines.append(f"gpu-gpc-0 MinFreq={v['gpu_min']} MaxFreq={v['gpu_max']} CurrentFreq={v['gpu_cur']}")
    gl, el = v["gpu_locked"], v["emc_locked"]
    lines.append(f"gpu-nvd-0 MinFreq={nvd if gl else prof['gpu_min_hz']} MaxFreq={nvd} "
                 f"CurrentFreq={nvd if gl else prof['gpu_min_hz']}")
    lines.append(f"EMC MinFreq={prof['emc_min_hz']} MaxFreq={mode['emc_max_hz']} "
                 f"CurrentFreq={mode['emc_max_hz'] if el else prof['emc_min_hz']} FreqOverride={1 if el else 0}")
    lines.append("PVA0_VPS0: Online=0 MinFreq=0 MaxFreq=1215000000 CurrentFreq=1215000000")
    lines.append("PVA0_AXI:  Online=0 MinFreq=0 MaxFreq=909000000 CurrentFreq=909000000")
    lines.append(f"FAN Dynamic Speed Control=nvfancontrol hwmon1_pwm1={v['fan']}")
    lines.append("FAN Dynamic Speed Control=nvfancontrol hwmon1_pwm1_enable=1")
    lines.append(f"NV Power Mode: {mode['name']}")
    return lines


_SHOW = {"r36": _show_r36, "r35_agx": _show_r35_agx, "r38_thor": _show_r38_thor, "r39": _show_r39}


# "JC-2023" = NVIDIA's jetson_clocks script "Copyright (c) 2015-2023" (tegra234 / JetPack 5): public copy, repository
# not resolved, reference id 14744631961. Its store/restore/lock logic matches the citable 2015-2020 copy
# (VictorySpecificationII/jetson_prometheus_exporter-docker @1161667 `jetson_clocks`), which lacks tegra234 and the
# nvfancontrol fan handling.
RAILGATE_PATH = "/sys/devices/platform/gpu.0/railgate_enable"  # JC-2023 do_igpu: GPU_RAIL_GATE
EMC_LOCK_PATH = "/sys/kernel/debug/bpmp/debug/clk/emc/mrq_rate_locked"  # JC-2023 do_emc: EMC_FREQ_OVERRIDE
CPUIDLE_STATES = ("WFI", "c7")  # cpuN/cpuidle/state0 = WFI, state1 = c7 (the --show captures: 'IdleStates: WFI=1 c7=1')


def _fan_status_file(home: str) -> str:
    # JC-2023: FAN_STATUS_FILE="${HOME}/.jetsonclocks_fan.txt" (under sudo: root's home)
    return os.path.join(home, ".jetsonclocks_fan.txt")


def _store_text(prof: Dict[str, Any], state: Dict[str, Any], home: str) -> str:
    """`jetson_clocks --store` file: what NVIDIA's script stores, one `path:value` line each (JC-2023; store() is `echo "${file}:$(cat ${file})" >>"${CONF_FILE}"`), in the script's order:
    do_hotplug cpuN/online; do_cpu every scaling_min_freq then every cpuidle/stateM/disable; do_igpu devfreq min_freq
    and railgate_enable; do_emc only mrq_rate_locked (NOT the rate); do_fan the fan status file (it holds
    `systemctl is-active nvfancontrol`)."""
    v = _clock_values(prof, state)
    cores = v["mode"]["cores"]
    lines = []
    for core in range(prof["cpus"]):
        lines.append(f"/sys/devices/system/cpu/cpu{core}/online:{1 if core < cores else 0}")
    for core in range(prof["cpus"]):
        lines.append(f"/sys/devices/system/cpu/cpu{core}/cpufreq/scaling_min_freq:{v['cpu_min']}")
    for core in range(prof["cpus"]):
        for idx, _ in enumerate(CPUIDLE_STATES):
            lines.append(f"/sys/devices/system/cpu/cpu{core}/cpuidle/state{idx}/disable:{1 - v['idle']}")
    lines.append(f"{prof['gpu_devfreq']}/min_freq:{v['gpu_min']}")
    lines.append(f"{RAILGATE_PATH}:{0 if int(state.get('gpu_railgate_enable', 1)) == 0 else 1}")
    lines.append(f"{EMC_LOCK_PATH}:{1 if v['emc_locked'] else 0}")
    lines.append(f"{_fan_status_file(home)}:{'active' if v['fan_active'] else 'inactive'}")
    return "\n".join(lines) + "\n"


def _restore(prof: Dict[str, Any], path: str, state_dir: str) -> None:
    """`restore()` writes every stored value back, then `fan_restore` starts/stops nvfancontrol per the stored status."""
    values: Dict[str, str] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            key, sep, value = line.strip().partition(":")  # the script: `cut -f1 -d :` / `cut -f2 -d :`
            if sep:
                values[key] = value.split(":")[0]

    def apply(s: Dict[str, Any]) -> None:
        mode = P.mode_by_id(prof, s["nvpmodel_mode"])
        mins = [int(v) for k, v in values.items() if k.endswith("/cpufreq/scaling_min_freq") and v.isdigit()]
        if mins:  # the kernel clamps min to max: a stored min >= the running cap is a lock
            s["cpu_locked"] = min(mins) >= mode["cpu_max_khz"]
        gpu_min = values.get(f"{prof['gpu_devfreq']}/min_freq")
        if gpu_min is not None and gpu_min.isdigit():
            s["gpu_locked"] = int(gpu_min) >= mode["gpu_max_hz"]
        idle = [v for k, v in values.items() if "/cpuidle/state" in k and k.endswith("/disable")]
        if idle:
            s["cpuidle_disabled"] = any(v.strip() == "1" for v in idle)
        if RAILGATE_PATH in values:
            s["gpu_railgate_enable"] = 0 if values[RAILGATE_PATH].strip() == "0" else 1
        if EMC_LOCK_PATH in values:
            s["emc_locked"] = values[EMC_LOCK_PATH].strip() == "1"
        fan = [v for k, v in values.items() if k.endswith("/.jetsonclocks_fan.txt")]
        if fan:
            active = fan[0].strip() == "active"
            s["nvfancontrol_active"] = active
            if active:  # nvfancontrol takes the pwm over again
                s["fan_pwm"] = None
        S.add_event(s, "clocks_restored", file=path, all_locked=S.all_locked(s), none_locked=S.none_locked(s))

    S.update(state_dir, fn=apply)
    for key, value in values.items():
        if key.endswith("/.jetsonclocks_fan.txt") and os.path.isdir(os.path.dirname(key)):
            S.write_text_atomic(key, value + "\n")  # restore() writes every stored path back, this file too


_JC_USAGE = "usage: jetson_clocks [--show] [--store [file]] [--restore [file]] [--fan]"  # emulator text


def jetson_clocks(args: List[str], state_dir: str) -> int:
    # argument parsing as NVIDIA's script (JC-2023 main): --show/--store/--restore set ACTION, --store/--restore
    # take the next word as the file when there is one, --fan only sets FAN_SPEED_OVERRIDE (so `jetson_clocks --fan`
    # locks everything AND forces the fan).
    action, conf, fan_override = "", None, False
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--show":
            action = "show"
        elif arg in ("--store", "--restore"):
            action = arg[2:]
            if i + 1 < len(args) and args[i + 1]:
                conf = args[i + 1]
            i += 1
        elif arg == "--fan":
            fan_override = True
        elif arg in ("-h", "--help"):
            _out(_JC_USAGE)
            return 0
        else:
            _out(_JC_USAGE)
            return 1
        i += 1
    state = S.load(state_dir)
    if not S.is_root(state):
        # source: README.md ('Needs root (message `Error: Run this script(/usr/bin/jetson_clocks) as a root user`')
        _out("Error: Run this script(/usr/bin/jetson_clocks) as a root user")
        return 1
    prof = P.profile(state["module"])
    home = os.environ.get("HOME") or state_dir
    default_conf = os.path.join(home, "l4t_dfs.conf")
    path = conf or default_conf
    if action == "show":
        for line in _SHOW[prof["clocks_show"]](prof, state):
            _out(line)
        return 0
    if action == "store":
        if os.path.exists(path):
            # source: NVIDIA's jetson_clocks script (Copyright 2015-2020, public copy in
            # VictorySpecificationII/jetson_prometheus_exporter-docker, file `jetson_clocks`, function main; the
            # same code in the 2015-2023 tegra234 version): it never overwrites a store file unasked --
            #     echo "File $CONF_FILE already exists. Can I overwrite it? Y/N:"
            #     read answer
            #     case $answer in y | Y) rm -f $CONF_FILE ;; *) echo "Error: file $CONF_FILE already exists!"; exit 1 ;;
            # Both lines go to stdout; EOF (no answer) or anything but a single y/Y refuses with exit 1.
            _out(f"File {path} already exists. Can I overwrite it? Y/N:")
            answer = sys.stdin.readline().strip()
            if answer not in ("y", "Y"):
                _out(f"Error: file {path} already exists!")
                return 1
            os.remove(path)
        text = _store_text(prof, state, home)
        S.write_text_atomic(path, text)
        try:  # do_fan store: `echo "${NVFANCONTROL_STATUS}" >"${FAN_STATUS_FILE}"`
            S.write_text_atomic(_fan_status_file(home), ("active" if state.get("nvfancontrol_active", True)
                                                         else "inactive") + "\n")
        except OSError:
            pass
        return 0
    if action == "restore":
        if not os.path.exists(path):
            # source: JC-2023 main: echo "Error: $CONF_FILE file not found !"; exit 1
            _out(f"Error: {path} file not found !")
            return 1
        _restore(prof, path, state_dir)
        return 0
    # no action: lock (JC-2023): do_cpu min=max + every cpuidle state disabled, do_igpu
    # railgate_enable=0 + min_freq=max_freq, do_emc mrq_rate_locked=1 + rate=cap; do_fan only with --fan:
    # `systemctl stop nvfancontrol` and pwm 255 (JC-2023).
    if not os.path.exists(default_conf):
        S.write_text_atomic(default_conf, _store_text(prof, state, home))
    S.update(state_dir, fn=lambda s: (S.set_all_locks(s, True, fan=fan_override),
                                      S.add_event(s, "clocks_locked", fan=fan_override)))
    if prof["key"] == "thor":
        # source: public file, repository not resolved, reference id 44448955983 (`sudo jetson_clocks` on Thor)
        _out("Enabled Legacy persistence mode for GPU 00000000:01:00.0.")
        _out("All done.")
    return 0


# ========================================================================================== tegrastats

def _fmt_temp(value: float) -> str:
    """tegrastats prints millidegree sensors truncated to 3 decimals without trailing zeros (53.968C, 50.75C, 50C)."""
    if value <= -256:
        return "-256"
    stepped = round(value * 32) / 32
    milli = int(stepped * 1000)
    text = f"{milli // 1000}.{milli % 1000:03d}".rstrip("0").rstrip(".")
    return text


class Sampler:
    """Plausible values for one tegrastats line; keeps running averages of the rails like tegrastats does."""

    def __init__(self, prof: Dict[str, Any], state_dir: str) -> None:
        self.prof = prof
        self.state_dir = state_dir
        self.rng = random.Random()
        self.sums: Dict[str, float] = {}
        self.count = 0
        self.temp_offset = 0.0
        self.last_busy_check = 0.0
        self.busy = False

    def _busy(self, state: Dict[str, Any]) -> bool:
        now = time.monotonic()
        if now - self.last_busy_check > 0.25:
            names = state.get("busy_names") or S.DEFAULT_BUSY_NAMES
            self.busy = bool(S.processes_of_device(self.state_dir, names))
            self.last_busy_check = now
        return self.busy

    def sample(self, state: Dict[str, Any]) -> Dict[str, Any]:
        prof, rng = self.prof, self.rng
        mode = P.mode_by_id(prof, state["nvpmodel_mode"])
        locked = S.all_locked(state)
        cpu_locked, gpu_locked, emc_locked = (bool(state.get("cpu_locked")), bool(state.get("gpu_locked")),
                                              bool(state.get("emc_locked")))
        busy = self._busy(state)
        if state.get("gpu_load_pct") is not None:
            gpu = float(state["gpu_load_pct"])
        elif busy:
            gpu = float(state.get("busy_gpu_load_pct") or 97.0)
        else:
            gpu = rng.choice([0, 0, 0, 1, 2, 3])
        gpu = max(0.0, min(100.0, gpu + (rng.uniform(-2, 2) if gpu >= 5 else 0)))
        if state.get("cpu_load_pct") is not None:
            cpu_base, cpu_spread = float(state["cpu_load_pct"]), 5.0
        elif busy:
            cpu_base, cpu_spread = float(state.get("busy_cpu_load_pct") or 60.0), 15.0
        else:
            cpu_base, cpu_spread = 2.0, 3.0
        cpus = []
        for core in range(prof["cpus"]):
            if core >= mode["cores"]:
                cpus.append(None)
                continue
            load = int(max(0, min(100, rng.gauss(cpu_base, cpu_spread))))
            if cpu_locked or load > 40:
                mhz = mode["cpu_max_khz"] // 1000
            else:
                mhz = prof["cpu_min_khz"] // 1000
            cpus.append((load, mhz))
        online = [c for c in cpus if c is not None]
        cpu_avg = sum(c[0] for c in online) / max(1, len(online))
        gpu_max_mhz = mode["gpu_max_hz"] // 1000000
        if gpu_locked or gpu >= 5:
            gpu_mhz = gpu_max_mhz
        else:
            gpu_mhz = prof["gpu_min_hz"] // 1000000
        emc_max_mhz = mode["emc_max_hz"] // 1000000
        emc_mhz = emc_max_mhz if (emc_locked or busy or gpu >= 20) else (prof["emc_min_hz"] // 1000000 if prof["key"] == "thor"
                                                                      else min(emc_max_mhz, 2133) if prof["key"] == "agx_orin"
                                                                      else 665)
        emc_load = int(min(99, gpu * 0.4 + cpu_avg * 0.05 + rng.uniform(0, 2)))
        # temperatures drift towards a load-dependent target
        target = 0.12 * gpu + 0.05 * cpu_avg + (1.5 if locked else 0.0)
        self.temp_offset += (target - self.temp_offset) * 0.3
        heat = self.temp_offset + rng.uniform(-0.3, 0.3)
        ram_used = int(prof["ram_total_mb"] * (0.45 if busy or gpu > 20 else 0.3) + rng.randint(-4, 4))
        return {"mode": mode, "locked": locked, "busy": busy, "gpu": int(round(gpu)), "gpu_mhz": gpu_mhz,
                "cpus": cpus, "cpu_avg": cpu_avg, "emc_mhz": emc_mhz, "emc_load": emc_load, "heat": heat,
                "ram_used": ram_used, "lfb": f"{rng.randint(2, 40)}x4MB"}

    def rails(self, values: Dict[str, float]) -> Dict[str, str]:
        self.count += 1
        out = {}
        for name, cur in values.items():
            cur = int(max(0, cur * (1 + self.rng.uniform(-0.02, 0.02))))
            self.sums[name] = self.sums.get(name, 0.0) + cur
            out[name] = f"{cur}mW/{int(self.sums[name] / self.count)}mW"
        return out


def rail_mw(prof: Dict[str, Any], v: Dict[str, Any]) -> Dict[str, float]:
    """Nominal power (mW) of each rail the module monitors, from one Sampler.sample() `v`: the one model behind the
    fake tegrastats' rails and the emulated INA3221/INA238 hwmon files (emu_sysfs.py), so both tell the same story.
    emulator assumption: the coefficients (rails rise several W at high GPU load and with jetson_clocks); idle levels
    are those of the captures quoted at each tegrastats line below."""
    kind = prof["tegrastats"]
    if kind in ("orin_jp6", "orin_r39"):
        gpu_f = v["gpu_mhz"] / 918.0
        cgc = 480 + 22 * v["cpu_avg"] + 68 * v["gpu"] * gpu_f + (250 if v["locked"] else 0)
        soc = (1350 if kind == "orin_jp6" else 1127) + 20 * v["gpu"] + 3 * v["emc_load"] + (150 if v["locked"] else 0)
        return {"VDD_IN": (cgc + soc) * 1.25 + (2450 if kind == "orin_jp6" else 2050), "VDD_CPU_GPU_CV": cgc,
                "VDD_SOC": soc}
    if kind == "agx_orin_jp5":
        gpu_f = v["gpu_mhz"] / 1300.0
        return {"VDD_GPU_SOC": 2300 + 250 * v["gpu"] * gpu_f + (400 if v["locked"] else 0),
                "VDD_CPU_CV": 390 + 45 * v["cpu_avg"],
                "VIN_SYS_5V0": 4000 + 9 * v["gpu"] + 5 * v["cpu_avg"],
                "VDDQ_VDD2_1V8AO": 300 + 5 * v["gpu"] + 2 * v["emc_load"]}
    if kind == "thor_r38":
        gpu_f = v["gpu_mhz"] / 1575.0
        vdd_gpu = 1950 + 355 * v["gpu"] * gpu_f + (600 if v["locked"] else 0)
        cpu_soc = 5500 + 85 * v["cpu_avg"] + 30 * v["gpu"]
        vin_sys = 5600 + 120 * v["gpu"]
        return {"VDD_GPU": vdd_gpu, "VDD_CPU_SOC_MSS": cpu_soc, "VIN_SYS_5V0": vin_sys,
                "VIN": (vdd_gpu + cpu_soc + vin_sys) * 1.15 + 4000}
    raise KeyError(kind)


def _cpu_list(cpus: List[Optional[tuple]]) -> str:
    return ",".join("off" if c is None else f"{c[0]}%@{c[1]}" for c in cpus)


def _line_orin_jp6(s: Sampler, v: Dict[str, Any], root: bool, ts: str) -> str:
    prof, h = s.prof, v["heat"]
    rails = s.rails(rail_mw(prof, v))
    t = {"cpu": 50.0 + h, "soc2": 49.0 + h * 0.9, "soc0": 50.0 + h * 0.8, "gpu": 49.0 + h * 1.1, "soc1": 50.2 + h * 0.85}
    tj = max(t.values())
    temps = (f"cpu@{_fmt_temp(t['cpu'])}C soc2@{_fmt_temp(t['soc2'])}C soc0@{_fmt_temp(t['soc0'])}C "
             f"gpu@{_fmt_temp(t['gpu'])}C tj@{_fmt_temp(tj)}C soc1@{_fmt_temp(t['soc1'])}C")
    swap = f"SWAP {int(prof['swap_total_mb'] * 0.1)}/{prof['swap_total_mb']}MB (cached 1MB)"
    rail_txt = f"VDD_IN {rails['VDD_IN']} VDD_CPU_GPU_CV {rails['VDD_CPU_GPU_CV']} VDD_SOC {rails['VDD_SOC']}"
    head = f"{ts} RAM {v['ram_used']}/{prof['ram_total_mb']}MB (lfb {v['lfb']}) {swap} CPU [{_cpu_list(v['cpus'])}]"
    if root:
        # source: tegrastats-orin-nano.txt, henrygd/beszel agent/gpu_test.go 'more valid data' (Orin Nano 8GB, JP6, root):
        # 11-15-2024 08:38:09 RAM 6185/7620MB (lfb 8x2MB) SWAP 851/3810MB (cached 1MB) CPU [15%@729,11%@729,14%@729,13%@729,11%@729,8%@729] EMC_FREQ 43%@2133 GR3D_FREQ 63%@[621] NVDEC off NVJPG off NVJPG1 off VIC off OFA off APE 200 cpu@53.968C soc2@52.437C soc0@50.75C gpu@53.343C tj@53.968C soc1@51.656C VDD_IN 12479mW/12479mW VDD_CPU_GPU_CV 4667mW/4667mW VDD_SOC 2817mW/2817mW
        return (f"{head} EMC_FREQ {v['emc_load']}%@{v['emc_mhz']} GR3D_FREQ {v['gpu']}%@[{v['gpu_mhz']}] "
                f"NVDEC off NVJPG off NVJPG1 off VIC off OFA off APE 200 {temps} {rail_txt}")
    # source: tegrastats-orin-nano.txt, beszel 'orin nano' (JP6, WITHOUT root: no EMC_FREQ, GR3D_FREQ without @, no engines):
    # 06-18-2025 11:25:24 RAM 3452/7620MB (lfb 25x4MB) SWAP 1518/16384MB (cached 174MB) CPU [1%@1420,2%@1420,0%@1420,2%@1420,2%@729,1%@729] GR3D_FREQ 0% cpu@50.031C soc2@49.031C soc0@50C gpu@49.031C tj@50.25C soc1@50.25C VDD_IN 4824mW/4824mW VDD_CPU_GPU_CV 518mW/518mW VDD_SOC 1475mW/1475mW
    return f"{head} GR3D_FREQ {v['gpu']}% {temps} {rail_txt}"


def _line_orin_r39(s: Sampler, v: Dict[str, Any], root: bool, ts: str) -> str:
    prof, h = s.prof, v["heat"]
    two = s.rails(rail_mw(prof, v))
    maxes = s.__dict__.setdefault("maxes", {})
    rails = {}
    for name, text in two.items():  # R39: cur/avg/max
        cur = int(text.split("/")[0][:-2])
        maxes[name] = max(maxes.get(name, 0), cur)
        rails[name] = f"{text}/{maxes[name]}mW"
    t = {"cpu": 45.8 + h, "soc2": 44.8 + h * 0.9, "soc0": 46.1 + h * 0.8, "gpu": 46.8 + h * 1.1, "soc1": 46.3 + h * 0.85}
    t["tj"] = max(t.values())
    temps = []
    for name in ("cpu", "soc2", "soc0", "gpu", "tj", "soc1"):  # R39: cur/max per zone
        key = "t_" + name
        maxes[key] = max(maxes.get(key, -300.0), t[name])
        temps.append(f"{name}@{_fmt_temp(t[name])}C/{_fmt_temp(maxes[key])}C")
    rail_txt = f"VDD_IN {rails['VDD_IN']} VDD_CPU_GPU_CV {rails['VDD_CPU_GPU_CV']} VDD_SOC {rails['VDD_SOC']}"
    head = f"{ts} RAM {v['ram_used']}/{prof['ram_total_mb']}MB (lfb {v['lfb']}) CPU [{_cpu_list(v['cpus'])}]"
    if root:
        # source: tegrastats-orin-nano.txt, vdavid21/edge-inference-benchmark-lab @7eb0b09 (Orin Nano Super, R39.2.1,
        #   root; no SWAP field, engines NVDEC0/NVJPG0/NVJPG1, cur/max temperatures, cur/avg/max rails):
        # 09-19-2026 13:33:02 RAM 2850/7486MB (lfb 33x4MB) CPU [2%@729,0%@729,0%@729,0%@729,1%@729,0%@729] EMC_FREQ 5%@665 GR3D_FREQ 0%@[305] NVDEC0 off NVJPG0 off NVJPG1 off VIC off OFA off APE 200 cpu@45.812C/45.812C soc2@44.843C/44.843C soc0@46.093C/46.093C gpu@46.843C/46.843C tj@46.843C/46.843C soc1@46.281C/46.281C VDD_IN 3582mW/3582mW/3582mW VDD_CPU_GPU_CV 523mW/523mW/523mW VDD_SOC 1127mW/1127mW/1127mW
        return (f"{head} EMC_FREQ {v['emc_load']}%@{v['emc_mhz']} GR3D_FREQ {v['gpu']}%@[{v['gpu_mhz']}] "
                f"NVDEC0 off NVJPG0 off NVJPG1 off VIC off OFA off APE 200 {' '.join(temps)} {rail_txt}")
    # emulator assumption: non-root R39 Orin Nano line = the root line without EMC_FREQ, GR3D_FREQ's '@' and the
    # engines (as on JP6, tegrastats-orin-nano.txt beszel 'orin nano'); no R39 non-root Orin Nano capture
    return f"{head} GR3D_FREQ {v['gpu']}% {' '.join(temps)} {rail_txt}"


def _line_agx_orin_jp5(s: Sampler, v: Dict[str, Any], root: bool, ts: str) -> str:
    prof, h = s.prof, v["heat"]
    t = {"CPU": 42.6 + h, "SOC2": 40.1 + h * 0.8, "Tdiode": 33.0 + h * 0.4, "SOC0": 41.1 + h * 0.85, "SOC1": 41.25 + h * 0.8}
    tj = max(t.values())
    temps = (f"CV0@-256C CPU@{_fmt_temp(t['CPU'])}C Tboard@32C SOC2@{_fmt_temp(t['SOC2'])}C "
             f"Tdiode@{_fmt_temp(t['Tdiode'])}C SOC0@{_fmt_temp(t['SOC0'])}C CV1@-256C GPU@-256C tj@{_fmt_temp(tj)}C "
             f"SOC1@{_fmt_temp(t['SOC1'])}C CV2@-256C")
    swap = f"SWAP 19/{prof['swap_total_mb']}MB (cached 0MB)"
    head = f"{ts} RAM {v['ram_used']}/{prof['ram_total_mb']}MB (lfb {v['lfb']}) {swap} CPU [{_cpu_list(v['cpus'])}]"
    if not root:
        # source: tegrastats-agx-orin.txt, jetson_stats emulator TEMPLATE 'Orin' non-root (JP5: EMC/GR3D without @, no
        #   engines, no rails):
        # 01-03-2023 16:10:22 RAM 2257/30536MB (lfb 5392x4MB) SWAP 0/15268MB (cached 0MB) CPU [...] EMC_FREQ 0% GR3D_FREQ $RAND_GPU% CV0@-256C CPU@41.375C Tboard@29C SOC2@39C Tdiode@30.75C SOC0@38.906C CV1@-256C GPU@-256C tj@41.468C SOC1@38.843C CV2@-256C
        return f"{head} EMC_FREQ {v['emc_load']}% GR3D_FREQ {v['gpu']}% {temps}"
    gpc = v["gpu_mhz"] if (v["locked"] or v["gpu"] > 0) else 0
    rails = s.rails(rail_mw(prof, v))
    # source: tegrastats-agx-orin.txt, GDWR/jetson_exporter pkg/tegrastats/parse_cpus_test.go (AGX Orin 64GB, JP5.1+, root):
    # 04-11-2025 10:36:27 RAM 4321/62801MB (lfb 1759x4MB) SWAP 19/31400MB (cached 0MB) CPU [0%@729,...] EMC_FREQ 0%@2133 GR3D_FREQ 0%@[0,0] VIC_FREQ 729 APE 174 CV0@-256C CPU@44.562C Tboard@32C SOC2@40.093C Tdiode@33C SOC0@41.093C CV1@-256C GPU@-256C tj@44.343C SOC1@41.25C CV2@-256C VDD_GPU_SOC 2340mW/2340mW VDD_CPU_CV 390mW/390mW VIN_SYS_5V0 4025mW/4025mW NC 0mW/0mW VDDQ_VDD2_1V8AO 301mW/301mW NC 0mW/0mW
    return (f"{head} EMC_FREQ {v['emc_load']}%@{v['emc_mhz']} GR3D_FREQ {v['gpu']}%@[{gpc},{gpc}] VIC_FREQ 729 APE 174 "
            f"{temps} VDD_GPU_SOC {rails['VDD_GPU_SOC']} VDD_CPU_CV {rails['VDD_CPU_CV']} "
            f"VIN_SYS_5V0 {rails['VIN_SYS_5V0']} NC 0mW/0mW VDDQ_VDD2_1V8AO {rails['VDDQ_VDD2_1V8AO']} NC 0mW/0mW")


def _line_thor_r38(s: Sampler, v: Dict[str, Any], root: bool, ts: str) -> str:
    prof, h = s.prof, v["heat"]
    gpc = v["gpu_mhz"]
    rails = s.rails(rail_mw(prof, v))
    t = {"cpu": 37.3 + h, "tj": 38.9 + h * 1.05, "soc012": 37.5 + h * 0.8, "gpu": 38.9 + h * 1.05, "soc345": 37.4 + h * 0.8}
    temps = (f"cpu@{_fmt_temp(t['cpu'])}C tj@{_fmt_temp(t['tj'])}C soc012@{_fmt_temp(t['soc012'])}C "
             f"gpu@{_fmt_temp(t['gpu'])}C soc345@{_fmt_temp(t['soc345'])}C")
    rail_txt = (f"VDD_GPU {rails['VDD_GPU']} VDD_CPU_SOC_MSS {rails['VDD_CPU_SOC_MSS']} "
                f"VIN_SYS_5V0 {rails['VIN_SYS_5V0']} VIN {rails['VIN']}")
    head = f"{ts} RAM {v['ram_used']}/{prof['ram_total_mb']}MB (lfb {v['lfb']}) CPU [{_cpu_list(v['cpus'])}]"
    if root:
        # source: UNRESOLVED-provenance.txt, Thor R38.4 root line ('Reading tegrastats output', reference id 54612712197 --
        #   the same file as this profile's nv_tegra_release; it has VIN and gpu@; the resolved lesomnus R38.4 lines in
        #   tegrastats-thor.txt have the same tokens but no VIN):
        # 04-21-2026 15:50:52 RAM 105265/125772MB (lfb 34x4MB) CPU [0%@972,...] EMC_FREQ 0%@2750 GR3D_FREQ @[314,314,314] NVENC0_FREQ @314 NVENC1_FREQ @314 NVDEC0_FREQ @314 NVDEC1_FREQ @314 NVJPG0_FREQ @314 VIC off OFA_FREQ @315 PVA0_FREQ off APE 300 cpu@37.343C tj@38.875C soc012@37.468C gpu@38.875C soc345@37.406C VDD_GPU 1962mW/1962mW VDD_CPU_SOC_MSS 5887mW/5887mW VIN_SYS_5V0 5635mW/5635mW VIN 19780mW/19780mW
        return (f"{head} EMC_FREQ {v['emc_load']}%@{v['emc_mhz']} GR3D_FREQ @[{gpc},{gpc},{gpc}] NVENC0_FREQ @314 "
                f"NVENC1_FREQ @314 NVDEC0_FREQ @314 NVDEC1_FREQ @314 NVJPG0_FREQ @314 VIC off OFA_FREQ @315 "
                f"PVA0_FREQ off APE 300 {temps} {rail_txt}")
    # source: UNRESOLVED-provenance.txt, Thor non-root line (Rust TegrastatsParser test, R38 2-value rails incl. VIN, no
    #   EMC/GR3D/engines); gpu@ is kept because the GPU is powered here (cf. tegrastats-thor.txt, non-root JP7.2 with gpu@):
    # 01-20-2026 22:46:22 RAM 17842/125772MB (lfb 79x4MB) CPU [0%@972,...] cpu@30.468C tj@31.218C soc012@30.218C soc345@31.218C VDD_GPU 0mW/0mW VDD_CPU_SOC_MSS 5535mW/5535mW VIN_SYS_5V0 5040mW/5040mW VIN 16802mW/16802mW
    return f"{head} {temps} {rail_txt}"


_TEGRASTATS_LINES: Dict[str, Callable[[Sampler, Dict[str, Any], bool, str], str]] = {
    "orin_jp6": _line_orin_jp6, "orin_r39": _line_orin_r39, "agx_orin_jp5": _line_agx_orin_jp5, "thor_r38": _line_thor_r38,
}


def tegrastats_line(sampler: Sampler, state: Dict[str, Any], root: bool) -> str:
    values = sampler.sample(state)
    # every JP5+ sample starts with MM-DD-YYYY HH:MM:SS (README.md, tegrastats difference 1)
    ts = time.strftime("%m-%d-%Y %H:%M:%S")
    return _TEGRASTATS_LINES[sampler.prof["tegrastats"]](sampler, values, root, ts)


def _read_pids(path: str) -> List[int]:
    try:
        with open(path, encoding="utf-8") as fh:
            return [int(x) for x in fh.read().split() if x.isdigit()]
    except OSError:
        return []


def tegrastats(args: List[str], state_dir: str) -> int:
    interval_ms = 1000
    logfile: Optional[str] = None
    start = stop = False
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--interval" and i + 1 < len(args):
            try:
                interval_ms = int(args[i + 1])
            except ValueError:
                _err(f"tegrastats: invalid interval {args[i + 1]!r}")
                return 1
            i += 1
        elif arg == "--logfile" and i + 1 < len(args):
            logfile = args[i + 1]
            i += 1
        elif arg == "--start":
            start = True
        elif arg == "--stop":
            stop = True
        elif arg in ("--verbose", "--readall"):
            pass
        elif arg in ("-h", "--help"):
            _out("Usage: tegrastats [--interval <millisec>] [--logfile <filename>] [--start] [--stop] [--verbose]")
            return 0
        else:
            _err(f"tegrastats: unknown option {arg}")  # emulator text
            _out("Usage: tegrastats [--interval <millisec>] [--logfile <filename>] [--start] [--stop] [--verbose]")
            return 1
        i += 1
    pid_file = os.path.join(state_dir, S.TEGRASTATS_PIDS)
    if stop:
        for pid in _read_pids(pid_file):
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        try:
            os.unlink(pid_file)
        except OSError:
            pass
        return 0
    state = S.load(state_dir)
    root = S.is_root(state)
    prof = P.profile(state["module"])
    if start:
        path = os.path.abspath(logfile or "tegrastats.log")
        if os.fork() > 0:
            return 0
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        with open(pid_file, "a", encoding="utf-8") as fh:
            fh.write(f"{os.getpid()}\n")
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        logfile = path
    out = open(logfile, "a", encoding="utf-8", buffering=1) if logfile else sys.stdout
    sampler = Sampler(prof, state_dir)
    interval = max(interval_ms, 1) / 1000.0
    next_at = time.monotonic()
    while True:
        state = S.load(state_dir)
        out.write(tegrastats_line(sampler, state, root) + "\n")
        out.flush()
        next_at += interval
        delay = next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            next_at = time.monotonic()


# ================================================================================================ sudo

_SUDO_USAGE = ("usage: sudo -h | -K | -k | -V\n"
               "usage: sudo -v [-ABkNnS] [-g group] [-h host] [-p prompt] [-u user]\n"
               "usage: sudo [-ABbEHkNnPS] [-C num] [-D directory] [-g group] [-h host] [-p prompt] [-R directory] "
               "[-T timeout] [-u user] [VAR=value] [-i | -s] [command [arg ...]]")


def _read_line_unbuffered(fd: int = 0) -> Optional[str]:
    """One line from fd without reading past the newline (the rest of stdin stays for the command)."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 1)
        except OSError:
            chunk = b""
        if not chunk:
            return data.decode("utf-8", "replace") if data else None
        if chunk == b"\n":
            return data.decode("utf-8", "replace")
        data += chunk


def _sudo_record_key() -> str:
    """The time stamp record this sudo call uses (sudoers(5) timestamp_type; default `tty`, sudo configure.ac):
    with a controlling terminal one record per terminal (+ session id and the session leader's start time);
    "If no terminal is present, the behavior is the same as ppid": one record per parent process, identified by its
    pid and its start time (/proc/<ppid>/stat field 22) so that a reused pid does not inherit it. Research notes
    section 4. Over ssh every exec channel of one connection is forked by the same per-connection sshd process, so
    `ssh host 'sudo ...'` calls on one connection (shell exec'ing sudo directly) share a record, other connections
    do not -- that is also what real sudo does."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            data = fh.read()
        rest = data[data.rfind(b")") + 2:].split()  # rest[0] = field 3
        sid, tty_nr = int(rest[6 - 3]), int(rest[7 - 3])
    except (OSError, IndexError, ValueError):
        sid, tty_nr = 0, 0
    if tty_nr:
        return f"tty:{tty_nr}:sid={sid}:{S.proc_start_time(sid)}"
    ppid = os.getppid()
    return f"ppid:{ppid}:{S.proc_start_time(ppid)}"


def _sudo_record_valid(state: Dict[str, Any], key: str, now: float) -> bool:
    stamp = (state.get("sudo_timestamps") or {}).get(key)
    if stamp is None:
        return False
    timeout = float(state.get("sudo_timestamp_timeout_s") if state.get("sudo_timestamp_timeout_s") is not None
                    else 900.0)
    if timeout == 0:  # sudoers(5) timestamp_timeout: "Set this to 0 to always prompt for a password"
        return False
    if timeout < 0:  # "a value less than 0 ... will not expire until the system is rebooted"
        return True
    return now - float(stamp) < timeout


def _set_sudo_record(state_dir: str, key: Optional[str], stamp: Optional[float], clear_all: bool = False) -> None:
    def fn(s: Dict[str, Any]) -> None:
        records = {} if clear_all else dict(s.get("sudo_timestamps") or {})
        if key is not None:
            if stamp is None:
                records.pop(key, None)
            else:
                records[key] = stamp
        s["sudo_timestamps"] = records

    S.update(state_dir, fn=fn)


def _tty_password(prompt: str) -> Optional[str]:
    """Read a password from /dev/tty with echo off. The mode is changed without flushing pending input (unlike
    Python's getpass, which uses TCSAFLUSH): what was typed before sudo started reading stays and is used, and the
    pty line discipline has already echoed it (sudo-project/sudo @2e18923 src/tgetpass.c: sudo switches echo off when it
    starts reading; type-ahead was echoed before -- emulator assumption that nothing is flushed)."""
    import termios

    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return None
    try:
        os.write(fd, prompt.encode())
        old = termios.tcgetattr(fd)
        new = list(old)
        new[3] &= ~termios.ECHO
        termios.tcsetattr(fd, termios.TCSADRAIN, new)
        try:
            data = b""
            while not data.endswith(b"\n"):
                chunk = os.read(fd, 1)
                if not chunk:
                    break
                data += chunk
        finally:
            termios.tcsetattr(fd, termios.TCSADRAIN, old)
            os.write(fd, b"\n")
        if not data:
            return None
        return data.decode("utf-8", "replace").rstrip("\r\n")
    finally:
        os.close(fd)


def sudo(args: List[str], state_dir: str) -> int:
    non_interactive = stdin_password = False
    remove_all = False
    prompt: Optional[str] = None
    validate_only = reset_only = False
    target_user = "root"
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-") or arg == "-":
            break
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            if name == "non-interactive":
                non_interactive = True
            elif name == "stdin":
                stdin_password = True
            elif name == "prompt":
                if not value:
                    i += 1
                    value = args[i] if i < len(args) else ""
                prompt = value
            elif name == "reset-timestamp":
                reset_only = True
            elif name == "remove-timestamp":
                remove_all = True
            elif name in ("preserve-env", "set-home", "login", "shell"):
                pass
            elif name == "user":
                if not value:
                    i += 1
                    value = args[i] if i < len(args) else "root"
                target_user = value
            elif name == "validate":
                validate_only = True
            else:
                _err(f"sudo: unrecognized option '{arg}'")
                _err(_SUDO_USAGE)
                return 1
            i += 1
            continue
        flags = arg[1:]
        j = 0
        while j < len(flags):
            flag = flags[j]
            if flag in "pu":
                value = flags[j + 1:]
                if not value:
                    i += 1
                    if i >= len(args):
                        _err(f"sudo: option requires an argument -- '{flag}'")
                        _err(_SUDO_USAGE)
                        return 1
                    value = args[i]
                if flag == "p":
                    prompt = value
                else:
                    target_user = value
                break
            if flag == "n":
                non_interactive = True
            elif flag == "S":
                stdin_password = True
            elif flag == "k":
                reset_only = True
            elif flag == "v":
                validate_only = True
            elif flag == "K":
                remove_all = True
            elif flag in "EHAbisPN":
                pass
            else:
                _err(f"sudo: invalid option -- '{flag}'")
                _err(_SUDO_USAGE)
                return 1
            j += 1
        i += 1
    command = args[i:]
    record = _sudo_record_key()
    if remove_all and not command:
        # sudo(8) -K removes every cached credential of the user (sudo-project/sudo @2e18923 docs/sudoers.mdoc.in, docs/sudo.mdoc.in)
        _set_sudo_record(state_dir, None, None, clear_all=True)
        return 0
    if not command and not validate_only:
        if reset_only:
            # sudo(8) -k without a command: "invalidates the user's cached credentials for the current session"
            _set_sudo_record(state_dir, record, None)
            return 0
        _err(_SUDO_USAGE)
        return 1
    state = S.load(state_dir)
    user = state.get("emulated_user") or "nvidia"
    password = state.get("sudo_password")
    now = time.time()
    cached = (password is not None and not S.is_root(state) and not reset_only
              and _sudo_record_valid(state, record, now))
    if cached:
        # A valid time stamp: no authentication, so nothing is read -- with -S a password written to stdin stays
        # there and reaches the command (inferred from sudo-project/sudo @2e18923 docs/sudoers.mdoc.in, docs/sudo.mdoc.in, sudo(8) -v "authenticating the user
        # if necessary"). Every successful use refreshes the record (sudoers' check path updates the time stamp
        # unless -k was given).
        _set_sudo_record(state_dir, record, now)
    elif password is not None and not S.is_root(state):
        if prompt is None:
            prompt = "[sudo] password for %p: "
        host = state.get("hostname") or "jetson"
        shown = (prompt.replace("%%", "\0").replace("%p", user).replace("%u", user).replace("%H", host)
                 .replace("%h", host).replace("\0", "%"))
        if non_interactive:
            # sudo 1.9: `sudo -n` when a password would be needed
            _err("sudo: a password is required")
            return 1
        if not stdin_password and not os.isatty(0):
            _err("sudo: a terminal is required to read the password; either use the -S option to read from "
                 "standard input or configure an askpass helper")
            _err("sudo: a password is required")
            return 1
        wrong = 0
        while True:
            if stdin_password:
                sys.stderr.write(shown)
                sys.stderr.flush()
                given = _read_line_unbuffered(0)
            else:
                given = _tty_password(shown)
            if given is None:
                sys.stderr.write("\n")
                if wrong:
                    _err(f"sudo: {wrong} incorrect password attempt" + ("s" if wrong > 1 else ""))
                else:
                    _err("sudo: no password was provided")
                    _err("sudo: a password is required")
                return 1
            if given == password:
                if not reset_only:  # sudo(8) -k with a command: "will not update the user's cached credentials"
                    _set_sudo_record(state_dir, record, time.time())
                break
            wrong += 1
            _err("Sorry, try again.")
            if wrong >= 3:
                _err("sudo: 3 incorrect password attempts")
                return 1
    if validate_only and not command:
        return 0
    env = dict(os.environ)
    env.update({
        S.ROOT_ENV: "1", "SUDO_USER": user, "SUDO_UID": str(state.get("emulated_uid") or 1000),
        "SUDO_GID": str(state.get("emulated_uid") or 1000), "SUDO_COMMAND": " ".join(command),
        "USER": target_user, "LOGNAME": target_user, "HOME": os.path.join(state_dir, "root_home"),
    })
    while command and "=" in command[0] and not command[0].startswith("="):  # sudo VAR=value cmd
        name, _, value = command[0].partition("=")
        env[name] = value
        command = command[1:]
    exe = command[0] if "/" in command[0] else shutil.which(command[0], path=env.get("PATH"))
    if not exe or not os.path.exists(exe):
        _err(f"sudo: {command[0]}: command not found")
        return 1
    os.execve(exe, command, env)
    return 1  # not reached


# ============================================================================= reboot and friends

def _not_root_reboot() -> int:
    # systemd's messages for an unprivileged `reboot` (emulator: the usual systemd wording)
    _err("Failed to set wall message, ignoring: Interactive authentication required.")
    _err("Failed to reboot system via logind: Interactive authentication required.")
    _err("Failed to start reboot.target: Interactive authentication required.")
    _err("See system logs and 'systemctl status reboot.target' for details.")
    return 1


def reboot(args: List[str], state_dir: str) -> int:
    state = S.load(state_dir)
    if not S.is_root(state):
        return _not_root_reboot()
    request_reboot(state_dir, "reboot " + " ".join(args))
    return 0


def shutdown(args: List[str], state_dir: str) -> int:
    if "-c" in args:
        return 0
    if "-r" not in args and "--reboot" not in args:
        _err("shutdown: only 'shutdown -r' (reboot) is emulated on this fake Jetson")
        return 1
    state = S.load(state_dir)
    if not S.is_root(state):
        return _not_root_reboot()
    request_reboot(state_dir, "shutdown " + " ".join(args))
    return 0


# ============================================================================== identity commands

def _identity(state: Dict[str, Any]):
    if S.is_root(state):
        return 0, "root"
    return int(state.get("emulated_uid") or 1000), state.get("emulated_user") or "nvidia"


def id_(args: List[str], state_dir: str) -> int:
    state = S.load(state_dir)
    uid, name = _identity(state)
    names = [a for a in args if not a.startswith("-")]
    if names and names[0] not in (name, "root"):
        os.execv("/usr/bin/id", ["id", *args])
    if names and names[0] == "root":
        uid, name = 0, "root"
    flags = "".join(a.lstrip("-") for a in args if a.startswith("-"))
    # emulator assumption: the default Jetson user's supplementary groups
    groups = [(uid, name)] if uid == 0 else [(uid, name), (4, "adm"), (24, "cdrom"), (27, "sudo"), (29, "audio"),
                                             (44, "video"), (46, "plugdev"), (109, "render"), (116, "i2c"), (999, "gpio")]
    if "u" in flags:
        _out(name if "n" in flags else str(uid))
    elif "g" in flags:
        _out(name if "n" in flags else str(uid))
    elif "G" in flags:
        _out(" ".join(g[1] if "n" in flags else str(g[0]) for g in groups))
    else:
        _out(f"uid={uid}({name}) gid={uid}({name}) groups=" + ",".join(f"{g}({n})" for g, n in groups))
    return 0


def whoami(args: List[str], state_dir: str) -> int:
    _out(_identity(S.load(state_dir))[1])
    return 0


def uname(args: List[str], state_dir: str) -> int:
    state = S.load(state_dir)
    prof = P.profile(state["module"])
    host = state.get("hostname") or prof["hostname"]
    fields = {"s": "Linux", "n": host, "r": prof["kernel_release"], "v": prof["kernel_version"], "m": "aarch64",
              "p": "aarch64", "i": "aarch64", "o": "GNU/Linux"}
    long_names = {"kernel-name": "s", "nodename": "n", "kernel-release": "r", "kernel-version": "v", "machine": "m",
                  "processor": "p", "hardware-platform": "i", "operating-system": "o"}
    wanted = set()
    for arg in args:
        if arg in ("-a", "--all"):
            wanted |= set(fields)
        elif arg.startswith("--") and arg[2:] in long_names:
            wanted.add(long_names[arg[2:]])
        elif arg.startswith("-") and not arg.startswith("--"):
            wanted |= set(arg[1:])
        else:
            _err(f"uname: extra operand '{arg}'")
            return 1
    if not wanted:
        wanted = {"s"}
    _out(" ".join(fields[k] for k in "snrvmpio" if k in wanted))
    return 0


def uptime(args: List[str], state_dir: str) -> int:
    """`uptime` of the emulated boot (procps format; -s since, -p pretty)."""
    state = S.load(state_dir)
    boot = float(state.get("boot_time") or time.time())
    up = max(0, int(time.time() - boot))
    if "-s" in args or "--since" in args:
        _out(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(boot)))
        return 0
    days, rest = divmod(up, 86400)
    hours, minutes = rest // 3600, (rest % 3600) // 60
    if "-p" in args or "--pretty" in args:
        parts = [f"{n} {unit}{'s' if n != 1 else ''}" for n, unit in ((days, "day"), (hours, "hour"), (minutes, "minute"))
                 if n]
        _out("up " + (", ".join(parts) if parts else "0 minutes"))
        return 0
    span = (f"{days} day{'s' if days != 1 else ''}, " if days else "") + (
        f"{hours:2d}:{minutes:02d}" if hours else f"{minutes} min")
    _out(f" {time.strftime('%H:%M:%S')} up {span},  1 user,  load average: 0.00, 0.00, 0.00")
    return 0


def hostname(args: List[str], state_dir: str) -> int:
    state = S.load(state_dir)
    _out(state.get("hostname") or P.profile(state["module"])["hostname"])
    return 0


# ============================================================================== test helpers

def emu_hang(args: List[str], state_dir: str) -> int:
    """`emu-hang [SECONDS]`: a long-running command (prints a tick every second) for drop/timeout tests."""
    seconds = float(args[0]) if args else float("inf")
    start = time.monotonic()
    _out("emu-hang: started")
    tick = 0
    while time.monotonic() - start < seconds:
        time.sleep(min(1.0, max(0.0, seconds - (time.monotonic() - start))))
        tick += 1
        _out(f"emu-hang: {tick}")
    _out("emu-hang: done")
    return 0


def emu_gpu_load(args: List[str], state_dir: str) -> int:
    """`emu-gpu-load SECONDS`: an emulated GPU workload; tegrastats reports busy_gpu_load_pct while it runs."""
    seconds = float(args[0]) if args else 1.0
    _out(f"emu-gpu-load: running for {seconds:g} s")
    time.sleep(seconds)
    _out("emu-gpu-load: done")
    return 0


TOOLS: Dict[str, Callable[[List[str], str], int]] = {
    "nvpmodel": nvpmodel, "jetson_clocks": jetson_clocks, "tegrastats": tegrastats, "sudo": sudo,
    "reboot": reboot, "shutdown": shutdown, "id": id_, "whoami": whoami, "uname": uname, "hostname": hostname,
    "uptime": uptime,
    "emu-hang": emu_hang, "emu-gpu-load": emu_gpu_load,
}


def main(tool: str, argv: List[str]) -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # die on a closed pipe like the C tools do
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    state_dir = S.state_dir_from_env()
    if tool not in ("id", "whoami", "uname", "hostname", "uptime"):
        try:
            root = S.is_root(S.load(state_dir))
        except OSError:
            root = False
        _log_invocation(state_dir, tool, argv, root)
        # Test control, not an emulated behaviour: `emu.slow_tool(tool, first_arg, seconds)` makes a step last long
        # enough for a test to stop the controller in the middle of it.
        try:
            delays = S.load(state_dir).get("tool_delays") or {}
        except OSError:
            delays = {}
        delay = delays.get(f"{tool} {argv[0] if argv else ''}".strip())
        if delay and S.is_root(S.load(state_dir)):
            time.sleep(float(delay))
    return TOOLS[tool](argv, state_dir)
