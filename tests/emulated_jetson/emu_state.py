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
    nvpmodel_status       /var/lib/nvpmodel/status analogue ("pmode:0001 fmode:fan_mode_quiet")
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

STATE_FILE = "state.json"
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
    "clocks_locked": False,  # jetson_clocks state
    "fan_pwm": None,
    "sudo_password": None,  # None: passwordless sudo
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
    return merged


def load(state_dir: str) -> Dict[str, Any]:
    with _locked(state_dir):
        return _read(state_dir)


def update(state_dir: str, changes: Optional[Dict[str, Any]] = None,
           fn: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
    """Apply `changes` (and/or `fn(state)` in place) atomically; returns the new state."""
    with _locked(state_dir):
        state = _read(state_dir)
        if changes:
            state.update(changes)
        if fn is not None:
            fn(state)
        write_text_atomic(os.path.join(state_dir, STATE_FILE), json.dumps(state, indent=1, sort_keys=True) + "\n")
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


def processes_of_device(state_dir: str, names: List[str]) -> List[int]:
    """Pids of running processes of this emulated device whose command matches `names`."""
    found = []
    own = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == own:
            continue
        pid = int(entry)
        argv = proc_cmdline(pid)
        if not argv or not cmd_matches(argv, names):
            continue
        if proc_env_value(pid, STATE_ENV) == state_dir:
            found.append(pid)
    return found
