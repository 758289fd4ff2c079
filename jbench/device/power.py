"""Bring a Jetson into a power state, verify it, and always put it back.

A small strategy in the manner of labgrid's: each step is logged with its arguments, and a
transition does nothing (and says so) when the device is already in the requested state.

- Mode names map to ids through the device's own nvpmodel.conf, never a table in jbench.
- The original state (mode and `jetson_clocks --store`) is saved in a state file on the device at
  the start of a sweep; `restore()` puts it back at the end, on errors and on Ctrl-C/SIGTERM, and
  `recover_leftover()` does it at the next start when a controller died and left the file behind.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from jbench.device.connection import Connection, DeviceError
from jbench.device.jetson import JetsonError, mentions_reboot, parse_clocks_show, parse_nvpmodel_conf, parse_nvpmodel_query

SUDOERS_HINT = (
    "add a sudoers entry on the device (sudo visudo -f /etc/sudoers.d/jbench):\n"
    "    {user} ALL=(root) NOPASSWD: /usr/sbin/nvpmodel, /usr/bin/jetson_clocks, /usr/bin/tegrastats, /usr/sbin/reboot\n"
    "or name an environment variable holding the sudo password with device.sudo_password_env"
)


class PowerStateError(DeviceError):
    pass


@dataclass(frozen=True)
class PowerSnapshot:
    mode: str
    mode_id: Optional[int]
    clocks_locked: bool


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


class PowerStrategy:
    def __init__(self, conn: Connection, device: dict, log: Optional[logging.Logger] = None):
        self.conn = conn
        self.device = device
        self.log = log or logging.getLogger("jbench.power")
        paths = device.get("paths") or {}
        state_dir = paths.get("state_dir", "~/.cache/jbench").rstrip("/")
        self.nvpmodel_conf = paths.get("nvpmodel_conf", "/etc/nvpmodel.conf")
        self.boot_id_path = paths.get("boot_id", "/proc/sys/kernel/random/boot_id")
        self.state_file = f"{state_dir}/power-state-{device['name']}.json"
        # jetson_clocks --store refuses to overwrite a file (it asks Y/N and exits 1 on no answer), so each
        # controller run stores into files of its own, and restore() removes them.
        token = uuid.uuid4().hex[:12]
        self.clocks_file = f"{state_dir}/jetson_clocks-{device['name']}-{token}.store"
        # The unlocked clocks of the current mode, stored right before jbench locks them.
        self.unlocked_file = f"{state_dir}/jetson_clocks-{device['name']}-{token}-unlocked.store"
        self._modes: Optional[dict[str, int]] = None
        self.last: Optional[PowerSnapshot] = None  # the state verified by the last apply()

    # -- reading --------------------------------------------------------------------------------

    def _sudo(self, argv: list[str], *, timeout: float = 60, stdin: Optional[str] = None):
        res = self.conn.run(argv, sudo=True, timeout=timeout, stdin=stdin)
        if res.returncode != 0 and ("password is required" in res.stderr or "incorrect password" in res.stderr
                                    or "Sorry, try again" in res.stderr):
            raise PowerStateError(f"sudo refused `{argv[0]}` on '{self.conn.name}'. "
                                  + SUDOERS_HINT.format(user=self.device.get("user") or "USER"))
        return res

    def check_sudo(self) -> None:
        res = self._sudo(["nvpmodel", "-q"], timeout=30)
        if res.returncode != 0:
            raise PowerStateError(f"`sudo nvpmodel -q` failed on '{self.conn.name}': {res.stderr.strip() or res.stdout.strip()}")

    def modes(self) -> dict[str, int]:
        """The device's own mode table (name -> id) from its nvpmodel.conf."""
        if self._modes is None:
            res = self.conn.run(["cat", self.nvpmodel_conf], timeout=30)
            modes, _ = parse_nvpmodel_conf(res.stdout) if res.returncode == 0 else ({}, None)
            if not modes:
                res = self.conn.run(["nvpmodel", "-p", "--verbose"], timeout=30)
                modes, _ = parse_nvpmodel_conf(res.stdout.replace("POWER_MODEL:", "< POWER_MODEL").replace("\n", " >\n"))
            if not modes:
                raise PowerStateError(f"cannot read the power modes of '{self.conn.name}' from {self.nvpmodel_conf} "
                                      "or `nvpmodel -p --verbose`: is this a Jetson with nvpmodel?")
            self._modes = modes
        return self._modes

    def mode_id(self, name: str) -> int:
        modes = self.modes()
        if name not in modes:
            listed = ", ".join(f"{n} ({i})" for n, i in sorted(modes.items(), key=lambda kv: kv[1]))
            raise PowerStateError(f"device '{self.conn.name}' has no power mode '{name}'. Its modes: {listed}")
        return modes[name]

    def current(self) -> PowerSnapshot:
        q = self.conn.run(["nvpmodel", "-q"], timeout=30)
        try:
            mode, mode_id = parse_nvpmodel_query(q.stdout + q.stderr)
        except JetsonError as exc:
            raise PowerStateError(f"'{self.conn.name}': {exc}") from None
        show = self._sudo(["jetson_clocks", "--show"], timeout=30)
        try:
            locked = parse_clocks_show(show.stdout).locked
        except JetsonError as exc:
            raise PowerStateError(f"'{self.conn.name}': {exc} (stderr: {show.stderr.strip()[:200]})") from None
        return PowerSnapshot(mode, mode_id, locked)

    # -- state file -----------------------------------------------------------------------------

    def _read_state_file(self) -> Optional[dict]:
        res = self.conn.run(["cat", self.conn.expand_path(self.state_file)], timeout=30)
        if res.returncode != 0 or not res.stdout.strip():
            return None
        try:
            return json.loads(res.stdout)
        except json.JSONDecodeError:
            self.log.warning("power: ignoring unreadable state file %s on %s", self.state_file, self.conn.name)
            return None

    def _write_state_file(self, state: dict) -> None:
        path = self.conn.expand_path(self.state_file)
        res = self.conn.run(["sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1"', "sh", path],
                            timeout=30, stdin=json.dumps(state, indent=2))
        if res.returncode != 0:
            raise PowerStateError(f"cannot write the power state file {path} on '{self.conn.name}': {res.stderr.strip()}")

    # -- steps ----------------------------------------------------------------------------------

    @step
    def recover_leftover(self) -> bool:
        """Restore a state a dead controller left behind; True if there was one."""
        state = self._read_state_file()
        if state is None:
            return False
        self.log.warning("power: found a state file left by %s (pid %s) at %s: restoring the device first",
                         state.get("controller"), state.get("pid"), state.get("saved_at"))
        self.restore()
        return True

    @step
    def save_original(self) -> PowerSnapshot:
        snap = self.current()
        store = self.conn.expand_path(self.clocks_file)
        self.conn.run(["mkdir", "-p", store.rsplit("/", 1)[0]], timeout=30)
        res = self._sudo(["jetson_clocks", "--store", store], timeout=60)
        if res.returncode != 0:
            raise PowerStateError(f"`jetson_clocks --store` failed on '{self.conn.name}': {res.stderr.strip()}")
        self._write_state_file({
            "mode": snap.mode, "mode_id": snap.mode_id, "clocks_locked": snap.clocks_locked,
            "clocks_store": store, "unlocked_store": self.conn.expand_path(self.unlocked_file),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "controller": socket.gethostname(), "pid": os.getpid(),
        })
        self.log.info("power: saved original state of %s: mode %s (%s), jetson_clocks %s",
                      self.conn.name, snap.mode, snap.mode_id, "on" if snap.clocks_locked else "off")
        return snap

    @step
    def apply(self, mode: Optional[str], jetson_clocks: Optional[bool], *, allow_reboot: bool = False,
              reboot_timeout_s: float = 300, fan: Optional[str] = None) -> list[str]:
        """Transition to the requested state; returns the changes made (empty: already there)."""
        changes: list[str] = []
        snap = self.current()
        if mode is not None and mode != snap.mode:
            self._set_mode(mode, allow_reboot=allow_reboot, reboot_timeout_s=reboot_timeout_s)
            changes.append(f"mode {snap.mode} -> {mode}")
            snap = self.current()  # nvpmodel re-applies the mode's clock limits
        if jetson_clocks is not None and jetson_clocks != snap.clocks_locked:
            unlocked = self.conn.expand_path(self.unlocked_file)
            if jetson_clocks:
                # Our own file from an earlier lock in this sweep: replaced, never answered Y to a prompt.
                self.conn.run(["rm", "-f", unlocked], timeout=30)
                self._sudo(["jetson_clocks", "--store", unlocked], timeout=60)
                res = self._sudo(["jetson_clocks"], timeout=120)
            elif self.conn.exists(unlocked):
                res = self._sudo(["jetson_clocks", "--restore", unlocked], timeout=120)
            else:
                # Locked before jbench came: re-applying the mode restores its DVFS limits.
                res = self._sudo(["nvpmodel", "-m", str(self.mode_id(snap.mode))], timeout=120, stdin="NO\n")
            if res.returncode != 0:
                raise PowerStateError(f"setting jetson_clocks {'on' if jetson_clocks else 'off'} failed on "
                                      f"'{self.conn.name}': {(res.stderr or res.stdout).strip()[:300]}")
            changes.append(f"jetson_clocks {'off -> on' if jetson_clocks else 'on -> off'}")
        if fan == "max":
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

    def verify(self, mode: Optional[str], jetson_clocks: Optional[bool]) -> PowerSnapshot:
        snap = self.current()
        problems = []
        if mode is not None and snap.mode != mode:
            problems.append(f"power mode is {snap.mode}, requested {mode}")
        if jetson_clocks is not None and snap.clocks_locked != jetson_clocks:
            problems.append("GPU/EMC clocks are " + ("not locked (min != max)" if jetson_clocks else "still locked"))
        if problems:
            raise PowerStateError(f"'{self.conn.name}' did not reach the requested power state: {'; '.join(problems)}")
        return snap

    def _set_mode(self, mode: str, *, allow_reboot: bool, reboot_timeout_s: float) -> None:
        mode_id = self.mode_id(mode)
        # Answer nvpmodel's reboot question with NO: jbench decides about reboots itself.
        res = self._sudo(["nvpmodel", "-m", str(mode_id)], timeout=120, stdin="NO\n")
        output = res.stdout + res.stderr
        now = parse_nvpmodel_query(self.conn.run(["nvpmodel", "-q"], timeout=30).stdout)[0]
        if now == mode:
            return
        if mentions_reboot(output):
            if not allow_reboot:
                raise PowerStateError(f"power mode {mode} needs a reboot of '{self.conn.name}'; "
                                      "set power.allow_reboot=true to let jbench reboot it")
            self.reboot_into(mode_id, reboot_timeout_s)
            now = parse_nvpmodel_query(self.conn.run(["nvpmodel", "-q"], timeout=30).stdout)[0]
            if now != mode:
                raise PowerStateError(f"'{self.conn.name}' came back from the reboot in mode {now}, not {mode}")
            return
        errors = " ".join(l.strip() for l in output.splitlines() if "NVPM ERROR" in l)
        raise PowerStateError(f"nvpmodel -m {mode_id} ({mode}) did not take effect on '{self.conn.name}' "
                              f"(still {now}): {errors or output.strip()[:300]}")

    @step
    def reboot_into(self, mode_id: int, timeout_s: float) -> None:
        """Switch with nvpmodel's own reboot (answering YES), then wait for SSH to come back."""
        boot_before = self._boot_id()
        try:
            self._sudo(["nvpmodel", "-m", str(mode_id)], timeout=60, stdin="YES\n")
        except DeviceError:
            pass  # the connection drops while the device goes down
        self._wait_for_new_boot(boot_before, timeout_s)

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

    @step
    def restore(self, *, allow_reboot: bool = False, reboot_timeout_s: float = 300) -> bool:
        """Put back the state saved by save_original(); True when done (state file removed)."""
        state = self._read_state_file()
        if state is None:
            self.log.info("power: no saved state on %s; nothing to restore", self.conn.name)
            return True
        snap = self.current()
        if snap.mode != state["mode"]:
            try:
                self._set_mode(state["mode"], allow_reboot=allow_reboot, reboot_timeout_s=reboot_timeout_s)
            except PowerStateError as exc:
                self.log.error("power: could not restore mode %s on %s: %s (state file kept: %s)",
                               state["mode"], self.conn.name, exc, self.state_file)
                return False
        res = self._sudo(["jetson_clocks", "--restore", state["clocks_store"]], timeout=120)
        if res.returncode != 0:
            self.log.error("power: jetson_clocks --restore failed on %s: %s", self.conn.name, res.stderr.strip())
            return False
        if state.get("clocks_locked"):
            self._sudo(["jetson_clocks"], timeout=120)
        final = self.current()
        # The store files go with the state file: the next sweep stores afresh.
        stores = [state["clocks_store"], self.conn.expand_path(self.unlocked_file)]
        if state.get("unlocked_store"):
            stores.append(state["unlocked_store"])
        self.conn.run(["rm", "-f", *dict.fromkeys(stores), self.conn.expand_path(self.state_file)], timeout=30)
        self.log.info("power: restored %s to mode %s, jetson_clocks %s", self.conn.name, final.mode,
                      "on" if final.clocks_locked else "off")
        return True
