"""One controller per device at a time: a lease file on the device itself.

Works with no coordinator (issue 14 puts a labgrid reservation on top for farms). The lease is a JSON
file in jbench's state directory on the device:

- created atomically and whole (written to a file of its own, then hard-linked to the lease's name: `ln` fails
  when the lease exists, as O_EXCL does, so of two controllers exactly one creates it);
- names its owner (controller host, pid, user, sweep id, start time);
- kept fresh by a heartbeat: the owner touches the file every `HEARTBEAT_S`; its age is measured on the
  device's own clock (`stat -c %Y` against `date +%s`), so clock skew between controllers does not matter;
- stale when the heartbeat is older than `stale_s`, or at once when the owner ran on this host and its
  process is gone (a SIGKILLed controller on the same workstation is recovered without waiting).

A stale lease is taken over under a lock on the device (`flock` on `<lease>.lock`, so concurrent takers
act one after another): the taker removes the lease only if it is still, byte for byte, the file it judged
stale, and, when it was judged stale by its heartbeat, still that old. A second taker that read the same stale
lease then finds the first taker's fresh lease (or none) and removes nothing; creating the fresh lease
stays exclusive (`ln`), so of all the takers exactly one holds the device. (Moving whatever file is at the path, as a
plain `mv` would, can move the fresh lease another taker has just written, leaving two holders.) A live
holder is never disturbed: the second controller waits up to `wait_s` with a message naming the holder, or
refuses.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

from jbench.core.schema import DeviceConfig, DeviceSection, typed
from jbench.device.connection import Connection, DeviceError

HEARTBEAT_S = 10.0

# Sweeps of this process holding or acquiring a device's lease (device name -> sweep ids): a lease file with our
# own pid is live only while its sweep is listed here (else an earlier sweep of this process left it).
_HELD: dict[str, set[str]] = {}
_HELD_LOCK = threading.Lock()

# Writes stdin to $1 only if $1 does not exist yet, whole: into a file of its own first, then hard-linked to $1
# (`ln` fails when $1 exists, as O_EXCL does), so a reader never sees a lease half written.
_CREATE = ('mkdir -p "$(dirname "$1")" || exit 1; t="$1.new-$$"; rm -f "$t"; cat > "$t" && ln "$t" "$1" 2>/dev/null; '
           'r=$?; rm -f "$t"; exit $r')
# The lease's text (as `$(cat)` gives it, the form _TAKE_OVER compares), a marker line, its age in seconds on the
# device's clock. Text and age are of one and the same file: its inode and mtime before and after the read agree
# (else, replaced meanwhile by a taker, it is read again). Exit 3: no lease.
_READ = ('n=0; while :; do a=$(stat -c "%i %Y" "$1" 2>/dev/null) || exit 3; c=$(cat "$1" 2>/dev/null) || exit 3; '
         'b=$(stat -c "%i %Y" "$1" 2>/dev/null) || exit 3; [ "$a" = "$b" ] || [ $n -ge 20 ] && break; n=$((n+1)); done; '
         'printf "%s\\n@@age\\n%s\\n" "$c" "$(( $(date +%s) - ${b#* } ))"')
_AGE_MARK = "\n@@age\n"
# Removes the stale lease $1 under the lock $2, only if its text is still $3 and (for a lease stale by its
# heartbeat) it is still at least $4 seconds old. Exit 0: removed; 4: not the lease judged stale any more (another
# taker was first, or its holder beat); 5: the lock was not had within 30 s; 127: no flock on the device.
_TAKE_OVER = (
    'command -v flock >/dev/null 2>&1 || exit 127; exec 9>>"$2" || exit 5; flock -w 30 9 || exit 5; '
    'c=$(cat "$1" 2>/dev/null) || exit 4; [ "$c" = "$3" ] || exit 4; '
    'm=$(stat -c %Y "$1" 2>/dev/null) || exit 4; [ $(( $(date +%s) - m )) -ge "$4" ] || exit 4; '
    'rm -f "$1"'
)


class LeaseBusy(DeviceError):
    """Another live controller holds the device."""


@dataclass(frozen=True)
class Holder:
    owner: dict
    age_s: float
    text: str = ""  # the lease file as read: a take-over removes only this very file

    def describe(self) -> str:
        o = self.owner
        since = o.get("started_at", "?")
        return (f"{o.get('user', '?')}@{o.get('host', '?')} pid {o.get('pid', '?')} (sweep {o.get('sweep_id', '?')}, "
                f"since {since}, last heartbeat {self.age_s:.0f} s ago)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DeviceLease:
    def __init__(self, conn: Connection, device: DeviceSection, sweep_id: str, *, stale_s: Optional[float] = None,
                 log: Optional[logging.Logger] = None):
        """device: the DeviceConfig, or its plain section; stale_s None: the device's lease_stale_s."""
        cfg = typed(DeviceConfig, device, where="device")
        self.conn = conn
        self.name = cfg.name
        self.sweep_id = sweep_id
        self.stale_s = cfg.lease_stale_s if stale_s is None else stale_s
        self.log = log or logging.getLogger("jbench.lease")
        self.path = f"{cfg.paths.state_dir.rstrip('/')}/lease-{self.name}.json"
        self.owner = {
            "host": socket.gethostname(), "pid": os.getpid(), "user": getpass.getuser(), "sweep_id": sweep_id,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "token": uuid.uuid4().hex,
        }
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.held = False

    # -- reading --------------------------------------------------------------------------------

    def holder(self) -> Optional[Holder]:
        path = self.conn.expand_path(self.path)
        res = self.conn.run(["sh", "-c", _READ, "sh", path], timeout=30)
        if res.returncode == 3:
            return None
        text, _, age = res.stdout.rpartition(_AGE_MARK)
        try:
            owner = json.loads(text.strip() or "{}")
        except json.JSONDecodeError:
            owner = {"host": "?", "note": "unreadable lease file"}
        if not isinstance(owner, dict):
            owner = {"host": "?", "note": "unreadable lease file"}
        try:
            age_s = float(age.strip())
        except ValueError:
            age_s = float("inf")
        return Holder(owner, age_s, text)

    def is_stale(self, holder: Holder) -> tuple[bool, str]:
        o = holder.owner
        if o.get("token") == self.owner["token"]:
            return False, "ours"
        if self._owner_gone(o):
            return True, ("left by an earlier sweep of this process" if o["pid"] == os.getpid() else
                          f"its controller (pid {o['pid']} on this host) is gone")
        if holder.age_s > self.stale_s:
            return True, f"no heartbeat for {holder.age_s:.0f} s (stale after {self.stale_s:g} s)"
        return False, "live"

    def _owner_gone(self, o: dict) -> bool:
        """Whether the lease's owner ran on this host and is gone (stale whatever the heartbeat's age)."""
        if o.get("host") != self.owner["host"] or not isinstance(o.get("pid"), int):
            return False
        if o["pid"] == os.getpid():
            with _HELD_LOCK:
                return o.get("sweep_id") not in _HELD.get(self.name, set())
        return not _pid_alive(o["pid"])

    # -- acquiring ------------------------------------------------------------------------------

    def _try_create(self) -> bool:
        path = self.conn.expand_path(self.path)
        res = self.conn.run(["sh", "-c", _CREATE, "sh", path], timeout=30, stdin=json.dumps(self.owner, indent=2))
        return res.returncode == 0

    def _take_over(self, holder: Holder, why: str) -> bool:
        """Remove the stale lease holder was read from, if it is still that very file (see the module's
        docstring); the caller then creates its own, exclusively. A taker that was not first removes nothing
        (False)."""
        path = self.conn.expand_path(self.path)
        # Judged stale by its owner's death: any age will do; by its heartbeat: it must still be that old (a
        # holder that was only slow and beat since then keeps its lease).
        min_age = 0 if self._owner_gone(holder.owner) else int(self.stale_s) + 1
        res = self.conn.run(["sh", "-c", _TAKE_OVER, "sh", path, f"{path}.lock", holder.text, str(min_age)], timeout=60)
        if res.returncode == 0:
            self.log.warning("lease: device '%s' was held by %s: %s; taking it over", self.name,
                             holder.describe(), why)
            return True
        if res.returncode == 127:
            raise DeviceError(f"device '{self.name}': a stale lease ({holder.describe()}: {why}) cannot be "
                              f"taken over safely: `flock` (util-linux) is not installed on the device. Install it, or "
                              f"remove {path} by hand once no controller uses the device")
        if res.returncode == 5:
            raise DeviceError(f"device '{self.name}': could not lock {path}.lock within 30 s to take over "
                              f"a stale lease ({holder.describe()}): {res.stderr.strip() or 'no reason given'}")
        return False

    def acquire(self, wait_s: float = 0.0, *, on_wait: Optional[Callable[[str], None]] = None) -> None:
        """Hold the device or raise LeaseBusy naming the holder (after waiting up to wait_s)."""
        deadline = time.monotonic() + max(0.0, wait_s)
        with _HELD_LOCK:
            _HELD.setdefault(self.name, set()).add(self.sweep_id)
        try:
            self._acquire(deadline, wait_s, on_wait)
        except BaseException:
            with _HELD_LOCK:
                _HELD.get(self.name, set()).discard(self.sweep_id)
            raise
        self.held = True
        self._thread = threading.Thread(target=self._beat, name=f"lease-{self.name}", daemon=True)
        self._thread.start()

    def _acquire(self, deadline: float, wait_s: float, on_wait: Optional[Callable[[str], None]]) -> None:
        told = False
        refused: Optional[str] = None  # the text of a stale lease our take-over left in place
        while True:
            if self._try_create():
                break
            holder = self.holder()
            if holder is None:
                continue  # released between our two commands
            stale, why = self.is_stale(holder)
            if stale:
                if self._take_over(holder, why):
                    continue
                if holder.text == refused:  # the same file twice: no race, it cannot be removed this way
                    raise DeviceError(f"device '{self.name}': the stale lease {self.path} ({holder.describe()}: "
                                      f"{why}) could not be taken over; remove it by hand once no controller uses "
                                      f"the device")
                refused = holder.text  # another taker was first, or the holder beat: look again
                continue
            if time.monotonic() >= deadline:
                hint = ("wait for it, or let jbench wait: device.lease_wait_s=SECONDS" if wait_s <= 0 else
                        f"waited {wait_s:g} s")
                raise LeaseBusy(f"device '{self.name}' is in use by another jbench controller: "
                                f"{holder.describe()}. jbench does not touch a device while its holder lives; "
                                f"{hint}. A holder that died is taken over once its heartbeat is "
                                f"{self.stale_s:g} s old (device.lease_stale_s).")
            if not told:
                msg = f"device '{self.name}' is in use by {holder.describe()}; waiting up to {wait_s:g} s"
                (on_wait or self.log.warning)(msg)
                told = True
            time.sleep(min(5.0, max(0.5, deadline - time.monotonic())))

    def _beat(self) -> None:
        path = self.conn.expand_path(self.path)
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.conn.run(["touch", "-c", path], timeout=30)
            except Exception:  # a reboot or a dropped link: the next beat tries again
                pass

    def release(self) -> None:
        """Give the device back (only a lease that is still ours is removed)."""
        if not self.held:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HEARTBEAT_S + 5)
        try:
            holder = self.holder()
            if holder is not None and holder.owner.get("token") == self.owner["token"]:
                self.conn.run(["rm", "-f", self.conn.expand_path(self.path)], timeout=30)
        finally:
            with _HELD_LOCK:
                _HELD.get(self.name, set()).discard(self.sweep_id)
            self.held = False
