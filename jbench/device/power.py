"""Bring a Jetson into a power state, verify it, and always put it back.

A small strategy in the manner of labgrid's: each step is logged with its arguments, and a
transition does nothing (and says so) when the device is already in the requested state.

What "the power state" is, from what the L4T tools really do:
- the nvpmodel mode (names and ids from the device's own nvpmodel.conf, never a table in jbench);
- the jetson_clocks lock, which is five things: CPU min = max, GPU min = max, the EMC rate lock
  (mrq_rate_locked), disabled cpuidle states and disabled GPU railgating. `nvpmodel -m` rewrites the
  CPU/GPU frequency caps but leaves the other three as they are, so a mode change after a lock leaves a
  half-locked device; jbench therefore unlocks with `jetson_clocks --restore` of a store taken while
  unlocked, and verifies every part;
- the fan.

The original state is saved in a state file on the device (with its owner and the `--store` files) at the
start of a sweep; `restore()` puts it back at the end, on errors and on Ctrl-C/SIGTERM, and
`recover_leftover()` does it at the next start when a controller died and left the file behind. A recorded
original is never replaced by the current (modified) state. Reboots happen only with consent
(`power.allow_reboot=true`); without it a restore that needs one keeps the state file and says which
command finishes the job.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shlex
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Optional

from jbench.core.schema import DeviceConfig, DeviceSection, ProfileConfig, ProfileSection, typed
from jbench.device.connection import Connection, DeviceError
from jbench.device.jetson import (ClocksShow, JetsonError, mentions_reboot, parse_clocks_show, parse_nvpmodel_conf,
                                  parse_nvpmodel_query)

SUDOERS_HINT = (
    "add a sudoers entry on the device (sudo visudo -f /etc/sudoers.d/jbench):\n"
    "    {user} ALL=(root) NOPASSWD: /usr/sbin/nvpmodel, /usr/bin/jetson_clocks, /usr/bin/tegrastats, /usr/sbin/reboot\n"
    "or name an environment variable holding the sudo password with device.sudo_password_env"
)

STATE_VERSION = 2


class PowerStateError(DeviceError):
    pass


@dataclass(frozen=True)
class ClockLocks:
    """The parts of a jetson_clocks lock; None where the device does not show that part."""

    cpu: Optional[bool]
    gpu: bool
    emc: Optional[bool]
    cpuidle_disabled: Optional[bool]
    railgate_disabled: Optional[bool]

    def parts(self) -> dict[str, Optional[bool]]:
        return asdict(self)

    @property
    def all(self) -> bool:
        return all(v is not False for v in self.parts().values()) and self.gpu

    @property
    def none(self) -> bool:
        return not any(v for v in self.parts().values())

    def describe(self) -> str:
        """'on', 'off', or 'partly on (emc, cpuidle_disabled)' naming the parts still locked."""
        if self.all:
            return "on"
        if self.none:
            return "off"
        return "partly on (" + ", ".join(k for k, v in self.parts().items() if v) + ")"


@dataclass(frozen=True)
class PowerSnapshot:
    mode: str
    mode_id: Optional[int]
    locks: ClockLocks
    fan_pwm: Optional[int] = None

    @property
    def clocks_locked(self) -> bool:
        """jetson_clocks fully on (every part locked)."""
        return self.locks.all

    def as_dict(self) -> dict:
        return {"mode": self.mode, "mode_id": self.mode_id, "locks": self.locks.parts(), "fan_pwm": self.fan_pwm}

    @staticmethod
    def from_dict(d: dict) -> "PowerSnapshot":
        locks = d.get("locks")
        if locks is None:  # a state file of jbench <= 0.3: one flag
            flag = bool(d.get("clocks_locked"))
            locks = {"cpu": flag, "gpu": flag, "emc": flag, "cpuidle_disabled": None, "railgate_disabled": None}
        return PowerSnapshot(d["mode"], d.get("mode_id"), ClockLocks(**locks), d.get("fan_pwm"))


def step(fn):
    """Log every step with its arguments (and how long it took)."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        shown = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
        self.log.info("power: %s(%s) on %s", fn.__name__, shown, self.conn.name)
        started = time.monotonic()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.log.debug("power: %s took %.2f s", fn.__name__, time.monotonic() - started)

    return wrapper


# `nvpmodel -q`, then the first readable railgate_enable among the candidates ($@), in one round trip.
# Candidates: the configured file, then where L4T releases put it (JetPack 5 jetson_clocks:
# /sys/devices/platform/gpu.0; older: the devfreq node's device directory).
_QUERY = 'nvpmodel -q 2>&1; echo @@railgate; for f in "$@"; do [ -r "$f" ] && { cat "$f"; break; }; done'


class PowerStrategy:
    def __init__(self, conn: Connection, device: DeviceSection, log: Optional[logging.Logger] = None, *,
                 sweep_id: Optional[str] = None, profile: ProfileSection = None):
        self.conn = conn
        # The section as the caller gave it (the sweep reads its name from here); self.config is its schema object.
        self.device = device
        self.config = typed(DeviceConfig, device, where="device")
        self.profile = typed(ProfileConfig, profile, where="profile") if profile else None
        self.log = log or logging.getLogger("jbench.power")
        self.sweep_id = sweep_id or uuid.uuid4().hex[:12]
        paths, name = self.config.paths, self.config.name
        state_dir = paths.state_dir.rstrip("/")
        self.nvpmodel_conf = paths.nvpmodel_conf
        self.nvpmodel_status = paths.nvpmodel_status
        self.boot_id_path = paths.boot_id
        railgate = [paths.gpu_railgate or "/sys/devices/platform/gpu.0/railgate_enable",
                    "/sys/devices/gpu.0/railgate_enable"]
        if self.profile and self.profile.gpu_devfreq:
            railgate.append(self.profile.gpu_devfreq.rstrip("/") + "/device/railgate_enable")
        self.railgate_paths = list(dict.fromkeys(railgate))
        self.state_file = f"{state_dir}/power-state-{name}.json"
        # jetson_clocks --store refuses to overwrite a file (it asks Y/N and exits 1 on no answer), so each
        # controller run stores into files of its own, and restore() removes them.
        token = uuid.uuid4().hex[:12]
        self.clocks_file = f"{state_dir}/jetson_clocks-{name}-{token}.store"
        # The clocks of an unlocked state, stored right before jbench first locks them.
        self.unlocked_file = f"{state_dir}/jetson_clocks-{name}-{token}-unlocked.store"
        self._modes: Optional[dict[str, int]] = None
        self._state: Optional[dict] = None  # the state file as this controller last wrote or adopted it
        self.last: Optional[PowerSnapshot] = None  # the state verified by the last apply()
        self.rebooted = False  # set when apply() rebooted the device (recorded on the trial)

    # -- reading --------------------------------------------------------------------------------

    def _sudo(self, argv: list[str], *, timeout: float = 60, stdin: Optional[str] = None):
        res = self.conn.run(argv, sudo=True, timeout=timeout, stdin=stdin)
        if res.returncode != 0 and ("password is required" in res.stderr or "incorrect password" in res.stderr
                                    or "Sorry, try again" in res.stderr):
            raise PowerStateError(f"sudo refused `{argv[0]}` on '{self.conn.name}'. "
                                  + SUDOERS_HINT.format(user=self.config.user or "USER"))
        return res

    def check_sudo(self) -> None:
        res = self._sudo(["nvpmodel", "-q"], timeout=30)
        if res.returncode != 0:
            raise PowerStateError(f"`sudo nvpmodel -q` failed on '{self.conn.name}': {res.stderr.strip() or res.stdout.strip()}")

    def modes(self) -> dict[str, int]:
        """The device's own mode table (name -> id) from its nvpmodel.conf."""
        if self._modes is None:
            self._modes = read_power_modes(self.conn, self.nvpmodel_conf)
        return self._modes

    def mode_id(self, name: str) -> int:
        modes = self.modes()
        if name not in modes:
            listed = ", ".join(f"{n} ({i})" for n, i in sorted(modes.items(), key=lambda kv: kv[1]))
            raise PowerStateError(f"device '{self.conn.name}' has no power mode '{name}'. Its modes: {listed} "
                                  f"(from its {self.nvpmodel_conf})")
        return modes[name]

    def current(self) -> PowerSnapshot:
        q = self.conn.run(["sh", "-c", _QUERY, "sh", *self.railgate_paths], timeout=30)
        query, _, railgate = q.stdout.partition("@@railgate")
        try:
            mode, mode_id = parse_nvpmodel_query(query)
        except JetsonError as exc:
            raise PowerStateError(f"'{self.conn.name}': {exc}") from None
        show_res = self._sudo(["jetson_clocks", "--show"], timeout=30)
        try:
            show: ClocksShow = parse_clocks_show(show_res.stdout)
        except JetsonError as exc:
            raise PowerStateError(f"'{self.conn.name}': {exc} (stderr: {show_res.stderr.strip()[:200]})") from None
        locks = ClockLocks(cpu=show.cpu_locked, gpu=show.gpu_locked, emc=show.emc_locked,
                           cpuidle_disabled=show.cpuidle_disabled,
                           railgate_disabled={"0": True, "1": False}.get(railgate.strip()))
        return PowerSnapshot(mode, mode_id, locks, show.fan_pwm)

    def pending_mode_id(self) -> Optional[int]:
        """The mode nvpmodel's boot service will apply at the next boot (/var/lib/nvpmodel/status), if readable."""
        res = self.conn.run(["cat", self.nvpmodel_status], timeout=30)
        for word in res.stdout.split():
            if word.startswith("pmode:") and word[6:].isdigit():
                return int(word[6:])
        return None

    # -- state file -----------------------------------------------------------------------------

    def _read_state_file(self) -> Optional[dict]:
        res = self.conn.run(["cat", self.conn.expand_path(self.state_file)], timeout=30)
        if res.returncode != 0 or not res.stdout.strip():
            return None
        try:
            state = json.loads(res.stdout)
        except json.JSONDecodeError:
            self.log.warning("power: ignoring unreadable state file %s on %s", self.state_file, self.conn.name)
            return None
        if "original" not in state and "mode" in state:  # jbench <= 0.3 wrote the snapshot at the top level
            state = {"version": 1, "original": state, "clocks_store": state.get("clocks_store"),
                     "unlocked_store": None, "owner": {"host": state.get("controller"), "pid": state.get("pid"),
                                                       "started_at": state.get("saved_at")}}
        return state

    def _write_state_file(self, state: dict) -> None:
        path = self.conn.expand_path(self.state_file)
        # Written to a temporary file and renamed: a crash never leaves half a state file.
        res = self.conn.run(["sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1.tmp" && mv "$1.tmp" "$1"',
                             "sh", path], timeout=30, stdin=json.dumps(state, indent=2))
        if res.returncode != 0:
            raise PowerStateError(f"cannot write the power state file {path} on '{self.conn.name}': {res.stderr.strip()}")
        self._state = state

    def _drop_unrecorded_store(self, store: str) -> None:
        try:
            state = self._read_state_file()
            if state is None or state.get("clocks_store") != store:
                self.conn.run(["rm", "-f", "--", store], timeout=30)
        except Exception as exc:  # the connection is gone too: the cause (raised by the caller) is what matters
            self.log.warning("power: could not remove %s on %s: %s", store, self.conn.name, exc)

    def _owner(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "sweep_id": self.sweep_id,
                "boot_id": self._boot_id(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    # -- steps ----------------------------------------------------------------------------------

    @step
    def recover_leftover(self, *, allow_reboot: bool = False, reboot_timeout_s: float = 300) -> bool:
        """Restore a state a dead controller left behind (call only while holding the device lease).

        True when there was none or it was restored; False when it is still there (it then stays the
        recorded original: save_original() adopts it instead of saving the modified state)."""
        state = self._read_state_file()
        if state is None:
            return True
        owner = state.get("owner") or {}
        self.log.warning("power: found a state file left by %s (pid %s, sweep %s) since %s: restoring the device first",
                         owner.get("host"), owner.get("pid"), owner.get("sweep_id"), owner.get("started_at"))
        self._state = state
        return self.restore(allow_reboot=allow_reboot, reboot_timeout_s=reboot_timeout_s)

    @step
    def save_original(self) -> PowerSnapshot:
        existing = self._read_state_file()
        if existing is not None:
            # A recorded original we could not restore yet: it stays the original, never the current state.
            existing["owner"] = self._owner()
            self._write_state_file(existing)
            snap = PowerSnapshot.from_dict(existing["original"])
            self.log.warning("power: %s keeps the original state recorded earlier (mode %s): restoring to it at "
                             "the end", self.conn.name, snap.mode)
            return snap
        snap = self.current()
        store = self.conn.expand_path(self.clocks_file)
        self.conn.run(["mkdir", "-p", store.rsplit("/", 1)[0]], timeout=30)
        try:
            res = self._sudo(["jetson_clocks", "--store", store], timeout=60)
            if res.returncode != 0:
                raise PowerStateError(f"`jetson_clocks --store {store}` failed on '{self.conn.name}': "
                                      f"{(res.stderr.strip() + ' ' + res.stdout.strip()).strip()}")
            self._write_state_file({
                "version": STATE_VERSION, "device": self.config.name, "original": snap.as_dict(),
                "clocks_store": store,
                # A store of an unlocked state is what unlocks later (in any mode: the mode is re-applied after it).
                "unlocked_store": store if snap.locks.none else None,
                "unlocked_store_mode": snap.mode if snap.locks.none else None,
                "owner": self._owner(),
            })
        except BaseException:
            # Failed or stopped (Ctrl-C, seen in CI) before a state file names the store: nothing would ever restore
            # from it or remove it, so it goes now, unless the state file did get written.
            self._drop_unrecorded_store(store)
            raise
        self.log.info("power: saved original state of %s: mode %s (%s), jetson_clocks %s, fan pwm %s",
                      self.conn.name, snap.mode, snap.mode_id, snap.locks.describe(), snap.fan_pwm)
        return snap

    @step
    def apply(self, mode: Optional[str], jetson_clocks: Optional[bool], *, allow_reboot: bool = False,
              reboot_timeout_s: float = 300, fan: Optional[str] = None) -> list[str]:
        """Transition to the requested state; returns the changes made (empty: already there)."""
        if fan == "max" and jetson_clocks is False:
            raise PowerStateError("power.fan=max runs `jetson_clocks --fan`, which also locks the clocks (NVIDIA's "
                                  "script): it cannot run with power.jetson_clocks=false")
        changes: list[str] = []
        self.rebooted = False
        snap = self.current()
        if mode is not None and mode != snap.mode:
            self._set_mode(mode, allow_reboot=allow_reboot, reboot_timeout_s=reboot_timeout_s)
            changes.append(f"mode {snap.mode} -> {mode}" + (" (reboot)" if self.rebooted else ""))
            snap = self.current()  # nvpmodel rewrote the CPU/GPU caps; EMC lock, cpuidle and railgating stay
        if jetson_clocks is True and not snap.locks.all:
            if snap.locks.none:
                self._store_unlocked(snap)
            res = self._sudo(["jetson_clocks"], timeout=120)
            if res.returncode != 0:
                raise PowerStateError(f"jetson_clocks failed on '{self.conn.name}': {(res.stderr or res.stdout).strip()[:300]}")
            changes.append(f"jetson_clocks {snap.locks.describe()} -> on")
        elif jetson_clocks is False and not snap.locks.none:
            self._unlock(snap, allow_reboot=allow_reboot, reboot_timeout_s=reboot_timeout_s)
            changes.append(f"jetson_clocks {snap.locks.describe()} -> off")
        if fan == "max" and snap.fan_pwm != 255:
            # `--fan` is a plain lock run plus the fan at full speed.
            res = self._sudo(["jetson_clocks", "--fan"], timeout=60)
            if res.returncode == 0:
                changes.append("fan -> max")
        if changes:
            self.log.info("power: %s: %s", self.conn.name, "; ".join(changes))
            self.last = self.verify(mode, jetson_clocks)
        else:
            # Nothing changed: the snapshot just read is the verification.
            self.log.info("power: %s already in the requested state; nothing to do", self.conn.name)
            self.last = snap
        return changes

    def _store_unlocked(self, snap: PowerSnapshot) -> None:
        """Keep a store of this unlocked state (once per sweep) so the lock can be undone completely later."""
        state = self._state or self._read_state_file() or {}
        if state.get("unlocked_store"):
            return
        path = self.conn.expand_path(self.unlocked_file)
        self.conn.run(["mkdir", "-p", path.rsplit("/", 1)[0]], timeout=30)
        res = self._sudo(["jetson_clocks", "--store", path], timeout=60)
        if res.returncode != 0:
            raise PowerStateError(f"`jetson_clocks --store {path}` failed on '{self.conn.name}': "
                                  f"{(res.stderr.strip() + ' ' + res.stdout.strip()).strip()}")
        if state:
            state.update({"unlocked_store": path, "unlocked_store_mode": snap.mode})
            self._write_state_file(state)
        else:
            self._state = {"unlocked_store": path, "unlocked_store_mode": snap.mode}

    def _unlock(self, snap: PowerSnapshot, *, allow_reboot: bool, reboot_timeout_s: float) -> None:
        """Undo every part of a jetson_clocks lock in the current mode."""
        state = self._state or self._read_state_file() or {}
        store = state.get("unlocked_store")
        if store:
            res = self._sudo(["jetson_clocks", "--restore", store], timeout=120)
            if res.returncode != 0:
                raise PowerStateError(f"`jetson_clocks --restore {store}` failed on '{self.conn.name}': "
                                      f"{(res.stderr or res.stdout).strip()[:300]}")
            if state.get("unlocked_store_mode") != snap.mode:
                # The store holds another mode's CPU online/min values: re-applying the mode puts this mode's back.
                self._reapply_mode(snap)
            return
        if allow_reboot:
            # Locked before jbench came and never seen unlocked: only a reboot releases EMC/cpuidle/railgating.
            self.reboot(reboot_timeout_s)
            now = self.current()
            if now.mode != snap.mode:
                self._set_mode(snap.mode, allow_reboot=True, reboot_timeout_s=reboot_timeout_s)
            return
        raise PowerStateError(
            f"'{self.conn.name}' was locked by jetson_clocks before jbench started and jbench has no store of its "
            f"unlocked clocks: `nvpmodel -m` would release only the CPU/GPU frequencies, not the EMC lock, cpuidle "
            f"or GPU railgating. Reboot the device once (or set power.allow_reboot=true) and run again")

    def _reapply_mode(self, snap: PowerSnapshot) -> None:
        mode_id = snap.mode_id if snap.mode_id is not None else self.mode_id(snap.mode)
        res = self._sudo(["nvpmodel", "-m", str(mode_id)], timeout=120, stdin="NO\n")
        if res.returncode != 0:
            raise PowerStateError(f"re-applying mode {snap.mode} ({mode_id}) failed on '{self.conn.name}': "
                                  f"{(res.stdout + res.stderr).strip()[:300]}")

    def verify(self, mode: Optional[str], jetson_clocks: Optional[bool]) -> PowerSnapshot:
        """Read the state back; raise PowerStateError naming every part that is not as requested."""
        snap = self.current()
        problems = []
        if mode is not None and snap.mode != mode:
            problems.append(f"power mode is {snap.mode}, requested {mode}")
        if jetson_clocks is not None:
            wrong = [k for k, v in snap.locks.parts().items() if v is not None and v != jetson_clocks]
            if wrong:
                problems.append(f"jetson_clocks requested {'on' if jetson_clocks else 'off'} but "
                                + ", ".join(f"{k} is {'locked' if not jetson_clocks else 'not locked'}" for k in wrong))
        if problems:
            raise PowerStateError(f"'{self.conn.name}' did not reach the requested power state: {'; '.join(problems)}")
        return snap

    def _set_mode(self, mode: str, *, allow_reboot: bool, reboot_timeout_s: float) -> None:
        mode_id = self.mode_id(mode)
        before = parse_nvpmodel_query(self.conn.run(["nvpmodel", "-q"], timeout=30).stdout)
        # Answer nvpmodel's reboot question with NO: jbench decides about reboots itself.
        res = self._sudo(["nvpmodel", "-m", str(mode_id)], timeout=120, stdin="NO\n")
        output = res.stdout + res.stderr
        now = parse_nvpmodel_query(self.conn.run(["nvpmodel", "-q"], timeout=30).stdout)[0]
        if now == mode:
            return
        if mentions_reboot(output):
            if not allow_reboot:
                left = self._clear_pending(before)
                raise PowerStateError(f"power mode {mode} needs a reboot of '{self.conn.name}'; "
                                      "set power.allow_reboot=true to let jbench reboot it" + left)
            self.reboot_into(mode_id, reboot_timeout_s)
            now = parse_nvpmodel_query(self.conn.run(["nvpmodel", "-q"], timeout=30).stdout)[0]
            if now != mode:
                raise PowerStateError(f"'{self.conn.name}' came back from the reboot in mode {now}, not {mode}")
            return
        errors = " ".join(l.strip() for l in output.splitlines() if "NVPM ERROR" in l)
        raise PowerStateError(f"nvpmodel -m {mode_id} ({mode}) did not take effect on '{self.conn.name}' "
                              f"(still {now}): {errors or output.strip()[:300]}")

    def _clear_pending(self, running: tuple[str, Optional[int]]) -> str:
        """After a declined reboot question: re-apply the running mode so no other mode waits for the next boot.

        Returns '' when the device is clean, else a sentence for the error message."""
        name, mode_id = running
        mode_id = mode_id if mode_id is not None else self.mode_id(name)
        self._sudo(["nvpmodel", "-m", str(mode_id)], timeout=120, stdin="NO\n")
        pending = self.pending_mode_id()
        if pending is not None and pending != mode_id:
            return (f". WARNING: nvpmodel still records mode {pending} for the next boot of '{self.conn.name}'; "
                    f"run `sudo nvpmodel -m {mode_id}` on it before it reboots")
        self.log.info("power: %s: declined reboot; re-applied mode %s so nothing is pending", self.conn.name, name)
        return ""

    @step
    def reboot_into(self, mode_id: int, timeout_s: float) -> None:
        """Switch with nvpmodel's own reboot (answering YES), then wait for SSH to come back."""
        boot_before = self._boot_id()
        try:
            self._sudo(["nvpmodel", "-m", str(mode_id)], timeout=60, stdin="YES\n")
        except DeviceError:
            pass  # the connection drops while the device goes down
        self._wait_for_new_boot(boot_before, timeout_s)
        self.rebooted = True

    def _boot_id(self) -> str:
        res = self.conn.run(["cat", self.boot_id_path], timeout=30)
        return res.stdout.strip()

    def _wait_for_new_boot(self, boot_before: str, timeout_s: float) -> None:
        if self.conn.is_local:
            raise PowerStateError(f"'{self.conn.name}' is this machine: jbench cannot wait for its own reboot")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(1.0)
            try:
                self.conn.reconnect(max(1.0, deadline - time.monotonic()))
            except DeviceError as exc:
                raise PowerStateError(f"'{self.conn.name}' did not come back within {timeout_s:g} s after the reboot: {exc}") from None
            try:
                if not boot_before or self._boot_id() != boot_before:
                    self._modes = None
                    return
            except DeviceError:
                continue  # went down between reconnect and the check
        raise PowerStateError(f"'{self.conn.name}' did not reboot within {timeout_s:g} s")

    @step
    def reboot(self, timeout_s: float) -> None:
        boot_before = self._boot_id()
        try:
            self._sudo(["reboot"], timeout=30)
        except DeviceError:
            pass  # the connection drops while the device goes down
        self._wait_for_new_boot(boot_before, timeout_s)
        self.rebooted = True

    def finish_command(self, state: dict) -> str:
        """What a user runs to finish a restore jbench could not do without a reboot."""
        name, user = self.config.name, self.config.user
        original = PowerSnapshot.from_dict(state["original"])
        where = f"{user + '@' if user else ''}{self.config.host or name}"
        manual = (f"ssh {where} {shlex.quote(f'sudo nvpmodel -m {original.mode_id}')} (answer YES to reboot), then "
                  f"{shlex.quote('sudo jetson_clocks --restore ' + str(state.get('clocks_store')))}")
        return f"`jbench devices restore {name} --allow-reboot`, or by hand: {manual}"

    @step
    def restore(self, *, allow_reboot: bool = False, reboot_timeout_s: float = 300) -> bool:
        """Put back the state saved by save_original(); True when done (state file removed)."""
        state = self._read_state_file()
        if state is None:
            self.log.info("power: no saved state on %s; nothing to restore", self.conn.name)
            return True
        original = PowerSnapshot.from_dict(state["original"])
        snap = self.current()
        if snap.mode != original.mode:
            try:
                self._set_mode(original.mode, allow_reboot=allow_reboot, reboot_timeout_s=reboot_timeout_s)
            except PowerStateError as exc:
                self.log.error("power: could not restore mode %s on %s: %s. The state file %s stays on the device; "
                               "to finish: %s", original.mode, self.conn.name, exc, self.state_file,
                               self.finish_command(state))
                return False
        store = state.get("clocks_store")
        if store:
            res = self._sudo(["jetson_clocks", "--restore", store], timeout=120)
            if res.returncode != 0:
                self.log.error("power: jetson_clocks --restore %s failed on %s: %s", store, self.conn.name,
                               (res.stderr or res.stdout).strip())
                return False
        if original.locks.all:
            # The store keeps the EMC lock flag but not the rate: a plain run locks at the mode's maxima again.
            self._sudo(["jetson_clocks"], timeout=120)
        final = self.current()
        differs = [k for k, v in original.locks.parts().items()
                   if v is not None and final.locks.parts().get(k) is not None and final.locks.parts()[k] != v]
        if final.mode != original.mode or differs:
            self.log.error("power: %s is not back in its original state (mode %s, want %s; differs: %s); the state "
                           "file %s stays on the device", self.conn.name, final.mode, original.mode,
                           ", ".join(differs) or "-", self.state_file)
            return False
        if original.fan_pwm is not None and original.fan_pwm != 255 and final.fan_pwm == 255:
            self.log.warning("power: the fan of %s is still at full speed after the restore", self.conn.name)
        # The store files go with the state file: the next sweep stores afresh.
        stores = [s for s in (store, state.get("unlocked_store"), self.conn.expand_path(self.unlocked_file)) if s]
        self.conn.run(["rm", "-f", *dict.fromkeys(stores), self.conn.expand_path(self.state_file)], timeout=30)
        self._state = None
        self.log.info("power: restored %s to mode %s, jetson_clocks %s", self.conn.name, final.mode,
                      final.locks.describe())
        return True


def read_power_modes(conn: Connection, nvpmodel_conf: str = "/etc/nvpmodel.conf") -> dict[str, int]:
    """The device's own mode table (name -> id): its nvpmodel.conf, else `nvpmodel -p --verbose`."""
    res = conn.run(["cat", nvpmodel_conf], timeout=30)
    modes, _ = parse_nvpmodel_conf(res.stdout) if res.returncode == 0 else ({}, None)
    if not modes:
        res = conn.run(["nvpmodel", "-p", "--verbose"], timeout=30)
        modes, _ = parse_nvpmodel_conf(res.stdout.replace("POWER_MODEL:", "< POWER_MODEL").replace("\n", " >\n"))
    if not modes:
        raise PowerStateError(f"cannot read the power modes of '{conn.name}' from {nvpmodel_conf} "
                              "or `nvpmodel -p --verbose`: is this a Jetson with nvpmodel?")
    return modes
