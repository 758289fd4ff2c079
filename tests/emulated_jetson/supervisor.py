"""Supervisor of one emulated Jetson: runs its sshd and emulates reboots, blocking and dropped connections.

Started by the fixture (`python supervisor.py CONFIG_JSON`), one per emulated device. It is a child subreaper,
so every process of the device (sshd, its sessions, commands that daemonize) stays its descendant and can be
killed on an emulated reboot and at teardown. It exits when its parent (the test process) dies.

Loop (every 50 ms):
- `.reboot_request` in the state dir (written by the fake `reboot`/`nvpmodel`): after reboot_grace_s, stop sshd,
  kill every session and command of the device, apply the pending nvpmodel mode (also one left by a declined
  reboot prompt), reset every jetson_clocks lock and the sudo time stamps,
  new boot_id/boot_time, keep sshd down for reboot_delay_s, start it again (connections are refused meanwhile).
- state `blocked`: keep sshd stopped (connections refused) until it is false again; sessions are kept.
- state `die_after_s`: the next process matching `die_match` gets its ssh session killed after that many seconds
  (SIGKILL of its sshd session processes: the client sees the connection drop, the command itself is left to die
  of SIGPIPE like on a real dropped link).
- status.json in the control dir tells the fixture what is up.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import emu_state as S  # noqa: E402

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# process names of sshd's per-connection processes (OpenSSH >= 9.8 runs them as sshd-session / sshd-auth)
SSHD_COMMS = ("sshd", "sshd-session", "sshd-auth")


class Supervisor:
    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.state_dir = cfg["state_dir"]
        self.ctl_dir = cfg["ctl_dir"]
        self.parent = os.getppid()
        self.sshd: subprocess.Popen | None = None
        self.sshd_pid: int | None = None
        self.stopping = False
        self.rebooting = False
        self.known: set[int] = set()
        self.die_armed = False
        self.die_watch: list[tuple[int, float]] = []
        self.status_cache = None
        self.log_fh = open(os.path.join(self.ctl_dir, "supervisor.log"), "a", buffering=1)
        # real_paths devices: the emulated files at their real paths (emu_sysfs.py), rewritten every
        # update_interval, and the system services started in sshd's mount namespace (the jtop service)
        self.real = cfg.get("real_paths")
        self.tree = None
        self.services: list[subprocess.Popen] = []
        self.next_refresh = 0.0
        if self.real:
            import emu_profiles
            import emu_sysfs

            self.tree = emu_sysfs.Tree(self.real["base_dir"], emu_profiles.profile(self.real["module"]))
            self.tree.build()  # idempotent: the fixture built it; this learns the layout
            self.tree.refresh(S.load(self.state_dir), self.state_dir)

    def log(self, msg: str) -> None:
        self.log_fh.write(f"{time.strftime('%H:%M:%S')} {msg}\n")

    # --- sshd --------------------------------------------------------------------------------------
    def start_sshd(self) -> None:
        if self.sshd_pid is not None:
            return
        if self.tree is not None and not self.services:
            self.tree.clear_run()  # /run is a tmpfs: empty at boot
        log = open(self.cfg["sshd_log"], "ab")
        self.sshd = subprocess.Popen(self.cfg["sshd_cmd"], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()
        self.sshd_pid = self.sshd.pid
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._reap_once(self.sshd_pid):
                self.log("sshd exited during start")
                self.sshd_pid = None
                return
            if self._banner_ok():
                self.log(f"sshd up pid={self.sshd_pid}")
                self.start_services()
                return
            time.sleep(0.02)
        self.log("sshd did not answer in 10 s")

    def start_services(self) -> None:
        """Start the device's services in sshd's mount namespace, as their systemd units do (jtop.service:
        Environment="JTOP_SERVICE=True", ExecStart=<jtop> --force, as root). One set per boot."""
        if not self.real or self.services or self.sshd_pid is None:
            return
        for argv in self.real.get("services") or []:
            env = dict(self.real["service_env"])
            log = open(os.path.join(self.ctl_dir, f"service-{os.path.basename(argv[0])}.log"), "ab")
            proc = subprocess.Popen(["nsenter", f"--mount=/proc/{self.sshd_pid}/ns/mnt", "--", *argv],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
            log.close()
            self.services.append(proc)
            self.log(f"service started pid={proc.pid} {argv}")

    def _banner_ok(self) -> bool:
        try:
            with socket.create_connection((self.cfg["host"], self.cfg["port"]), timeout=0.5) as sock:
                sock.settimeout(1.0)
                return sock.recv(64).startswith(b"SSH-")
        except OSError:
            return False

    def stop_sshd(self) -> None:
        pid = self.sshd_pid
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            if self._reap_once(pid):
                break
            time.sleep(0.01)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        self.sshd_pid = None
        self.log("sshd stopped")

    def _reap_once(self, pid: int) -> bool:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            return done == pid
        except ChildProcessError:
            return True

    def reap_orphans(self) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.sshd_pid:
                self.log("sshd died unexpectedly")
                self.sshd_pid = None

    # --- processes ---------------------------------------------------------------------------------
    def kill_all_descendants(self) -> int:
        pids = [p for p in S.descendants(os.getpid()) if p != os.getpid()]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if sig == signal.SIGTERM:
                deadline = time.monotonic() + 0.3
                while time.monotonic() < deadline:
                    self.reap_orphans()
                    if not [p for p in pids if os.path.exists(f"/proc/{p}") and S.proc_comm(p)]:
                        break
                    time.sleep(0.02)
        self.reap_orphans()
        self.sshd_pid = None
        return len(pids)

    def session_of(self, pid: int) -> list[int]:
        """The sshd session processes above `pid` (not the listener)."""
        ppids = S.proc_ppid_map()
        chain = []
        cur = ppids.get(pid)
        while cur and cur not in (os.getpid(), 1):
            if cur != self.sshd_pid and S.proc_comm(cur) in SSHD_COMMS:
                chain.append(cur)
            cur = ppids.get(cur)
        return chain

    # --- features ----------------------------------------------------------------------------------
    def do_reboot(self, state: dict) -> None:
        request_path = os.path.join(self.state_dir, S.REBOOT_REQUEST)
        try:
            with open(request_path, encoding="utf-8") as fh:
                request = json.load(fh)
        except (OSError, ValueError):
            request = {}
        self.rebooting = True
        self.write_status()
        time.sleep(max(0.0, float(state.get("reboot_grace_s") or 0.0)))
        self.stop_sshd()
        killed = self.kill_all_descendants()
        self.services = []
        if self.tree is not None:
            self.tree.reset_boot()
        self.write_status()
        delay = float(state.get("reboot_delay_s") or 0.0)
        boot_id = str(uuid.uuid4())

        def apply(s: dict) -> None:
            if s.get("nvpmodel_pending") is not None:
                s["nvpmodel_mode"] = s["nvpmodel_pending"]
            s["nvpmodel_pending"] = None
            # jetson_clocks settings do not survive a reboot (they are sysfs/debugfs writes): CPU/GPU/EMC unlocked,
            # cpuidle enabled, railgate_enable 1, the fan back under nvfancontrol
            S.set_all_locks(s, False)
            # sudo's time stamp records live on a tmpfs (/run/sudo/ts): gone after a reboot
            s["sudo_timestamps"] = {}
            s["boot_count"] = int(s.get("boot_count") or 0) + 1
            s["boot_time"] = time.time() + delay
            S.add_event(s, "reboot", by=request.get("by"), killed=killed, boot_id=boot_id, delay_s=delay)

        new_state = S.update(self.state_dir, fn=apply)
        S.write_text_atomic(os.path.join(self.state_dir, "boot_id"), boot_id + "\n")
        mode = new_state.get("nvpmodel_mode")
        if mode is not None:
            S.write_text_atomic(os.path.join(self.state_dir, "nvpmodel_status"),
                                f"pmode:{int(mode):04d} fmode:fan_mode_quiet\n")
        for name in (S.REBOOT_REQUEST, S.TEGRASTATS_PIDS):
            try:
                os.unlink(os.path.join(self.state_dir, name))
            except OSError:
                pass
        self.log(f"reboot by {request.get('by')!r}: killed {killed} processes, down for {delay} s")
        end = time.monotonic() + delay
        while time.monotonic() < end and not self.stopping:
            self.reap_orphans()
            time.sleep(0.02)
        self.rebooting = False
        if not S.load(self.state_dir).get("blocked") and not self.stopping:
            self.start_sshd()

    def watch_die(self, state: dict, current: list[int]) -> None:
        """One-shot: the first process started after `die_after_s` was set whose argv matches, and still runs
        `die_after_s` seconds later, gets its ssh session killed then. Processes that already matched when it was armed are ignored (a pid
        is re-checked every loop because a session's pid execs from sshd to the shell to the command)."""
        now = time.monotonic()
        if state.get("die_after_s") is not None and not self.die_armed:
            self.die_armed = True
            self.die_after = float(state["die_after_s"])
            self.die_names = state.get("die_match") or S.DEFAULT_DIE_NAMES
            self.known = {p for p in current if S.cmd_matches(S.proc_cmdline(p), self.die_names)}
        if self.die_armed:
            for pid in current:
                if pid in self.known:
                    continue
                argv = S.proc_cmdline(pid)
                if argv and S.cmd_matches(argv, self.die_names):
                    self.die_watch.append((pid, now + self.die_after))
                    self.die_armed = False
                    S.update(self.state_dir, {"die_after_s": None},
                             fn=lambda s, a=argv: S.add_event(s, "die_armed", argv=a))
                    self.log(f"die-after: watching pid {pid} {argv}")
                    break
        for item in list(self.die_watch):
            pid, deadline = item
            if pid not in current and now < deadline:
                # The command ended before its deadline (a `llama-bench --version` probe): a connection cannot drop
                # under a command that is gone, so the one-shot waits for the next matching command instead.
                self.die_watch.remove(item)
                self.die_armed = True
                self.known = {p for p in current if S.cmd_matches(S.proc_cmdline(p), self.die_names)}
                S.update(self.state_dir, fn=lambda s, p=pid: S.add_event(s, "die_rearmed", pid=p))
                self.log(f"die-after: pid {pid} ended before its deadline; re-armed")
                continue
            if now >= deadline:
                self.die_watch.remove(item)
                chain = self.session_of(pid)
                # the event is recorded first: a client that sees the drop can already read it
                S.update(self.state_dir, fn=lambda s, p=pid, c=chain: S.add_event(s, "session_killed", pid=p, sshd=c))
                for victim in chain:  # SIGKILL: the connection drops without an exit status
                    try:
                        os.kill(victim, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.log(f"die-after: killed session {chain} of pid {pid}")

    def write_status(self) -> None:
        status = {"supervisor_pid": os.getpid(), "sshd_pid": self.sshd_pid, "up": self.sshd_pid is not None,
                  "rebooting": self.rebooting}
        if status != self.status_cache:
            S.write_text_atomic(os.path.join(self.ctl_dir, "status.json"), json.dumps(status) + "\n")
            self.status_cache = status

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        if not S.load(self.state_dir).get("blocked"):
            self.start_sshd()
        self.write_status()
        while not self.stopping:
            try:
                if not self.parent_alive():
                    self.log("parent gone")
                    break
                self.reap_orphans()
                state = S.load(self.state_dir)
                if os.path.exists(os.path.join(self.state_dir, S.REBOOT_REQUEST)):
                    self.do_reboot(state)
                    state = S.load(self.state_dir)
                if state.get("blocked") and self.sshd_pid is not None:
                    self.stop_sshd()
                elif not state.get("blocked") and self.sshd_pid is None and not self.rebooting:
                    self.start_sshd()
                if self.tree is not None and time.monotonic() >= self.next_refresh:
                    self.tree.refresh(state, self.state_dir)
                    self.next_refresh = time.monotonic() + self.tree.update_interval_ms() / 1000.0
                if state.get("die_after_s") is not None or self.die_armed or self.die_watch:
                    self.watch_die(state, [p for p in S.descendants(os.getpid())])
                self.write_status()
            except Exception:  # keep supervising; the log tells what went wrong
                self.log(traceback.format_exc())
            time.sleep(0.05 if self.tree is None else 0.01)
        self.stop_sshd()
        self.kill_all_descendants()
        self.log("stopped")
        self.sshd_pid = None
        self.write_status()
        return 0

    def _on_term(self, signum, frame) -> None:
        self.stopping = True


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as fh:
        cfg = json.load(fh)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    return Supervisor(cfg).run()


if __name__ == "__main__":
    sys.exit(main())
