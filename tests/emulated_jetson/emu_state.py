"""State of one emulated Jetson, shared by the fixture (pytest side), the supervisor and the fake tools.

Standard library only, no relative imports: the fake tools in `bin/` import this file as a top-level
module (`import emu_state`) with the python3 found on the emulated device's PATH, and the fixture imports
it as `tests.emulated_jetson.emu_state`.

Layout of a state directory (`$JETSON_EMU_STATE` on the device):
    state.json            mutable state (see DEFAULT_STATE), read/written under an flock
    .state.lock           the lock file
    nvpmodel.conf         /etc/nvpmodel.conf analogue (written once at start)
    device-tree-model     /proc/device-tree/model analogue (ends with a NUL byte, like the real file)
    nv_tegra_release      /etc/nv_tegra_release analogue
    boot_id               /proc/sys/kernel/random/boot_id analogue (changes on every emulated boot)
    nvpmodel_status       /var/lib/nvpmodel/status analogue ("pmode:0001 fmode:fan_mode_quiet"); after a declined
                          reboot prompt it names the pending mode (issue 11 statement)
    gpu_railgate_enable   /sys/devices/platform/gpu.0/railgate_enable analogue ("1\n" / "0\n"), kept in sync with
                          the state key gpu_railgate_enable by update()
    home/                 $HOME of the login session (has an empty-ish .bashrc)
    root_home/            $HOME under the fake sudo (like Ubuntu's sudo, which sets HOME to root's home)
    .reboot_request       written by `reboot`/`nvpmodel` (YES), consumed by the supervisor
    tegrastats.pids       pids of `tegrastats --start` daemons
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

STATE_ENV = "JETSON_EMU_STATE"  # set in every ssh session (authorized_keys environment= option)
ROOT_ENV = "JETSON_EMU_ROOT"  # set to "1" by the fake sudo: the tools then act as root
# set to "1" in the environment of the device's system services (the jtop service of a real_paths device) and so of
# the tools they run: those are not started by an ssh session and are not listed as the sessions' processes
SERVICE_ENV = "JETSON_EMU_SERVICE"

STATE_FILE = "state.json"
RAILGATE_FILE = "gpu_railgate_enable"
LOCK_FILE = ".state.lock"
REBOOT_REQUEST = ".reboot_request"
TEGRASTATS_PIDS = "tegrastats.pids"

# Names whose processes count as a GPU workload for the fake tegrastats (matched on the basename of
# argv[0] or argv[1] of processes that carry this device's JETSON_EMU_STATE in their environment).
DEFAULT_BUSY_NAMES = ["llama-bench", "llama-cli", "llama-server", "emu-gpu-load"]
# Names the die-after mechanism watches by default.
DEFAULT_DIE_NAMES = ["tegrastats", "llama-bench", "emu-hang", "emu-gpu-load"]

DEFAULT_STATE: Dict[str, Any] = {
    "module": None,
    "nvpmodel_mode": None,  # current power mode id
    "nvpmodel_pending": None,  # id that becomes current at the next emulated boot
    "tool_delays": {},  # test control: {"TOOL FIRST_ARG": seconds} slows that call under sudo (emu.slow_tool)
    # jetson_clocks state, one key per knob the real script writes (NVIDIA jetson_clocks
    # 2015-2023, "JC-2023" in emu_tools.py: do_cpu/do_igpu/do_emc/do_fan). A plain `jetson_clocks` sets the first five; `--fan` also the fan.
    "cpu_locked": False,  # every cpuN scaling_min_freq == scaling_max_freq
    "gpu_locked": False,  # GPU devfreq min_freq == max_freq
    "emc_locked": False,  # /sys/kernel/debug/bpmp/debug/clk/emc/mrq_rate_locked == 1 (EMC at the cap)
    "cpuidle_disabled": False,  # every cpuN/cpuidle/stateM/disable == 1
    "gpu_railgate_enable": 1,  # /sys/devices/platform/gpu.0/railgate_enable (0 = railgating off)
    "nvfancontrol_active": True,  # `systemctl is-active nvfancontrol`
    "fan_pwm": None,  # forced pwm (255 after `jetson_clocks --fan`); None: nvfancontrol's value (profile fan_pwm)
    # Legacy single flag: True = all locked, False = none locked. Tests may still set it (set_state(clocks_locked=..),
    # EmulatedJetson.start(clocks_locked=..)); update()/load() turn it into the keys above and reset it to None.
    "clocks_locked": None,
    "sudo_password": None,  # None: passwordless sudo
    # sudo credential cache (sudoers timestamp records): {record key: epoch of the last authentication/use}
    "sudo_timestamps": {},
    "sudo_timestamp_timeout_s": 900.0,  # Ubuntu's sudo: 15 minutes (Ubuntu sudoers_timestamp(5)); 0: always ask,
                                        # < 0: never expires until reboot (sudoers(5) timestamp_timeout)
    "emulated_user": "nvidia",  # what `id`, `whoami` and the sudo prompt report (login is root underneath)
    "emulated_uid": 1000,
    "login_is_root": False,  # True: every session acts as root without sudo
    "hostname": None,
    "blocked": False,  # True: sshd is stopped (connections refused) until False again
    "reboot_delay_s": 3.0,  # how long sshd stays down during an emulated reboot
    "reboot_grace_s": 0.5,  # time between `reboot` returning and the sessions being killed
    "boot_count": 0,
    "boot_time": None,  # epoch seconds of the current emulated boot
    "die_after_s": None,  # one-shot: the next matching command's ssh session is killed after n s
    "die_match": None,  # list of command names for die_after_s; None: DEFAULT_DIE_NAMES
    "gpu_load_pct": None,  # force the GPU load tegrastats reports (None: idle, or busy when a workload runs)
    "cpu_load_pct": None,  # force the CPU load tegrastats reports
    "busy_names": None,  # None: DEFAULT_BUSY_NAMES
    "busy_gpu_load_pct": 97.0,
    "busy_cpu_load_pct": 60.0,
    "events": [],  # what the supervisor did (reboots, kills), newest last
}


def state_dir_from_env() -> str:
    path = os.environ.get(STATE_ENV)
    if not path:
        raise SystemExit(f"{STATE_ENV} is not set: this tool only runs inside an emulated Jetson session")
    return path


@contextlib.contextmanager
def _locked(state_dir: str) -> Iterator[None]:
    fd = os.open(os.path.join(state_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def write_text_atomic(path: str, text: str, mode: int = 0o644) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8", newline="") as fh:
        fh.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _read(state_dir: str) -> Dict[str, Any]:
    try:
        with open(os.path.join(state_dir, STATE_FILE), encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        data = {}
    merged = dict(DEFAULT_STATE)
    merged.update(data)
    normalize(merged)
    return merged


def load(state_dir: str) -> Dict[str, Any]:
    with _locked(state_dir):
        return _read(state_dir)


# --- jetson_clocks locks ------------------------------------------------------------------------------------
# The five knobs a plain `jetson_clocks` writes (NVIDIA jetson_clocks "JC-2023", see emu_tools.py:
# do_cpu/do_igpu/do_emc).
LOCK_KEYS = ("cpu_locked", "gpu_locked", "emc_locked", "cpuidle_disabled")


def set_all_locks(state: Dict[str, Any], locked: bool, fan: bool = False) -> None:
    """What a plain `jetson_clocks` (locked=True) or a reboot / restore of an unlocked store (locked=False) leaves.
    fan=True also forces (locked) or releases (not locked) the fan."""
    for key in LOCK_KEYS:
        state[key] = bool(locked)
    state["gpu_railgate_enable"] = 0 if locked else 1
    if fan or not locked:
        state["nvfancontrol_active"] = not locked
        state["fan_pwm"] = 255 if locked else None


def all_locked(state: Dict[str, Any]) -> bool:
    """Everything a plain `jetson_clocks` locks is locked (the fan is not part of it: only `--fan` forces it)."""
    return all(bool(state.get(k)) for k in LOCK_KEYS) and int(state.get("gpu_railgate_enable", 1)) == 0


def none_locked(state: Dict[str, Any]) -> bool:
    """Nothing of jetson_clocks is left: no lock, cpuidle on, railgating on, the fan under nvfancontrol."""
    return (not any(bool(state.get(k)) for k in LOCK_KEYS) and int(state.get("gpu_railgate_enable", 1)) == 1
            and bool(state.get("nvfancontrol_active", True)) and state.get("fan_pwm") is None)


def lock_state(state: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "cpu_locked": bool(state.get("cpu_locked")), "gpu_locked": bool(state.get("gpu_locked")),
        "emc_locked": bool(state.get("emc_locked")), "cpuidle_disabled": bool(state.get("cpuidle_disabled")),
        "railgate_enabled": int(state.get("gpu_railgate_enable", 1)) == 1,
        "nvfancontrol_active": bool(state.get("nvfancontrol_active", True)), "fan_pwm": state.get("fan_pwm"),
        "all_locked": all_locked(state), "none_locked": none_locked(state),
        "mode": state.get("nvpmodel_mode"), "pending_mode": state.get("nvpmodel_pending"),
    }


def normalize(state: Dict[str, Any]) -> None:
    """Turn the legacy `clocks_locked` flag (set directly by tests) into the separate lock keys."""
    legacy = state.get("clocks_locked")
    if legacy is not None:
        set_all_locks(state, bool(legacy))
        state["clocks_locked"] = None


def _sync_files(state_dir: str, state: Dict[str, Any]) -> None:
    path = os.path.join(state_dir, RAILGATE_FILE)
    text = f"{0 if int(state.get('gpu_railgate_enable', 1)) == 0 else 1}\n"
    try:
        with open(path, encoding="utf-8") as fh:
            if fh.read() == text:
                return
    except OSError:
        pass
    write_text_atomic(path, text)


def update(state_dir: str, changes: Optional[Dict[str, Any]] = None,
           fn: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
    """Apply `changes` (and/or `fn(state)` in place) atomically; returns the new state."""
    with _locked(state_dir):
        state = _read(state_dir)
        if changes:
            state.update(changes)
        if fn is not None:
            fn(state)
        normalize(state)
        write_text_atomic(os.path.join(state_dir, STATE_FILE), json.dumps(state, indent=1, sort_keys=True) + "\n")
        _sync_files(state_dir, state)
        return state


def add_event(state: Dict[str, Any], kind: str, **info: Any) -> None:
    events: List[Dict[str, Any]] = list(state.get("events") or [])
    events.append({"kind": kind, "time": time.time(), **info})
    state["events"] = events[-50:]


def is_root(state: Dict[str, Any]) -> bool:
    return os.environ.get(ROOT_ENV) == "1" or bool(state.get("login_is_root"))


# --- /proc helpers (Linux) ------------------------------------------------------------------------

def proc_ppid_map() -> Dict[int, int]:
    out: Dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        # comm may contain spaces/parentheses: split after the last ')'
        rest = data[data.rfind(b")") + 2:].split()
        try:
            out[int(name)] = int(rest[1])
        except (IndexError, ValueError):
            continue
    return out


def proc_start_time(pid: int) -> Optional[int]:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot): with the pid it names one process
    across pid reuse, as sudo's time stamp records do (sudoers(5): 'the start time of the session leader (or
    parent process)')."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2:].split()  # rest[0] is field 3 (state)
    try:
        return int(rest[22 - 3])
    except (IndexError, ValueError):
        return None


def proc_comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def proc_cmdline(pid: int) -> List[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except OSError:
        return []
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


def proc_env_value(pid: int, name: str) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode("utf-8", "replace")
    return None


def cmd_matches(argv: List[str], names: List[str]) -> bool:
    """True when argv[0] or argv[1] (script run by an interpreter) has a basename in `names`."""
    for part in argv[:2]:
        if os.path.basename(part) in names:
            return True
    return False


def descendants(root_pid: int, ppids: Optional[Dict[int, int]] = None) -> List[int]:
    ppids = proc_ppid_map() if ppids is None else ppids
    children: Dict[int, List[int]] = {}
    for pid, ppid in ppids.items():
        children.setdefault(ppid, []).append(pid)
    out: List[int] = []
    stack = list(children.get(root_pid, []))
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, []))
    return out


def processes_of_device(state_dir: str, names: Optional[List[str]]) -> List[int]:
    """Pids of running processes of this emulated device (everything its ssh sessions started carries its
    JETSON_EMU_STATE) whose command matches `names`; names=None: all of them."""
    found = []
    own = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == own:
            continue
        pid = int(entry)
        argv = proc_cmdline(pid)
        if not argv or (names is not None and not cmd_matches(argv, names)):
            continue
        if proc_env_value(pid, STATE_ENV) == state_dir and proc_env_value(pid, SERVICE_ENV) != "1":
            found.append(pid)
    return found
