"""The local machine as a device: commands run without a shell, as argument lists.

Nothing it starts outlives the controller:
- every command and stream runs in a session (process group) of its own; a timeout or Ctrl-C in
  run() ends the whole group (TERM, KILL after TERM_GRACE_S);
- a SIGKILL of the controller (or any death that runs no Python code) is covered by one small
  watchdog process per controller (`Reaper`): the controller registers each child's process group
  over a pipe; when the pipe reaches EOF (the controller is gone, however it ended) the watchdog
  ends every group still registered. PR_SET_PDEATHSIG would reach only the direct child (not a
  wrapper's children) and fires when the forking *thread* ends, so it is not used.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from jbench.device.connection import CommandInterrupted, CommandResult, CommandTimeout, Connection


# How long a process group gets to exit after SIGTERM before SIGKILL.
TERM_GRACE_S = 2.0


# The watchdog: reads "+PGID" / "-PGID" lines; at EOF (the controller died or exited) it ends every group
# still registered: TERM, then KILL after a grace. Its own session: a Ctrl-C at the terminal does not reach it.
_REAPER = r"""
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
groups = set()
for line in sys.stdin:
    line = line.strip()
    try:
        (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
    except (ValueError, IndexError):
        pass
def alive(g):
    try:
        os.killpg(g, 0)
        return True
    except ProcessLookupError:
        return False
    except OSError:
        return True
for sig in (signal.SIGTERM, signal.SIGKILL):
    for g in list(groups):
        try:
            os.killpg(g, sig)
        except OSError:
            pass
    end = time.monotonic() + float(sys.argv[1])
    while sig == signal.SIGTERM and time.monotonic() < end and any(alive(g) for g in groups):
        time.sleep(0.05)
"""


class Reaper:
    """One watchdog process per controller process (started on first use) that ends the process groups of
    our children when the controller goes away without ending them (SIGKILL, a crash)."""

    _lock = threading.Lock()
    _proc: "subprocess.Popen | None" = None
    _pid: int = 0  # the controller pid the watchdog belongs to (a forked child needs its own)

    @classmethod
    def _pipe(cls):
        if cls._proc is None or cls._pid != os.getpid() or cls._proc.poll() is not None:
            cls._proc = subprocess.Popen(
                [sys.executable, "-c", _REAPER, str(TERM_GRACE_S)], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, text=True)
            cls._pid = os.getpid()
        return cls._proc.stdin

    @classmethod
    def _send(cls, line: str) -> None:
        with cls._lock:
            try:
                pipe = cls._pipe()
                pipe.write(line + "\n")
                pipe.flush()
            except (OSError, ValueError):  # no watchdog: the normal paths still end the group
                pass

    @classmethod
    def ensure_started(cls) -> None:
        """Start the watchdog before a child is spawned, so the window in which a child is not yet
        registered is a pipe write, not a Python start."""
        with cls._lock:
            try:
                cls._pipe()
            except OSError:
                pass

    @classmethod
    def watch(cls, pgid: int) -> None:
        cls._send(f"+{pgid}")

    @classmethod
    def forget(cls, pgid: int) -> None:
        cls._send(f"-{pgid}")


def _signal_group(pgid: int, sig: int) -> bool:
    """Send sig to the group; False when no process of it is left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal (e.g. sudo's root child): still there
        return True
    return True


def end_process_group(proc: subprocess.Popen, grace_s: float | None = None) -> None:
    """SIGTERM the process group led by proc, wait up to grace_s for every member to exit, SIGKILL
    what is left, reap proc and close its pipes. Safe to call when the group is already gone."""
    grace = TERM_GRACE_S if grace_s is None else grace_s
    pgid = proc.pid  # start_new_session: the child leads its own group
    if _signal_group(pgid, signal.SIGTERM):
        deadline = time.monotonic() + grace
        while True:
            proc.poll()  # reap the leader, or its zombie keeps the group "alive"
            if not _signal_group(pgid, 0) or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        _signal_group(pgid, signal.SIGKILL)
    try:
        # Drain and close the pipes; bounded, as a process that left the group may hold them open.
        proc.communicate(timeout=1.0)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
    try:
        proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        pass


class LineStream:
    """Output lines of a running local command."""

    def __init__(self, argv: list[str]):
        # A session of its own, so close() ends the whole pipeline (bash, the tool, the stamper).
        Reaper.ensure_started()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     text=True, errors="replace", bufsize=1, start_new_session=True)
        Reaper.watch(self.proc.pid)

    def __iter__(self):
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            yield line.rstrip("\n")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        Reaper.forget(self.proc.pid)


@dataclass
class LocalPort:
    """A port on this machine needs no forwarding."""

    address: tuple[str, int]

    def close(self) -> None:
        pass


class LocalConnection(Connection):
    """The local machine as a device."""

    is_local = True

    def __init__(self, name: str = "local"):
        self.name = name

    def run(self, argv, *, timeout=None, env=None, cwd=None, sudo=False, stdin=None) -> CommandResult:
        argv = [str(a) for a in argv]
        shown = argv
        if sudo and os.geteuid() != 0:
            argv = ["sudo", "-n", "--", *argv]
        full_env = None
        if env:
            full_env = dict(os.environ)
            full_env.update(env)
        start = time.monotonic()
        Reaper.ensure_started()
        try:
            # A session (and process group) of its own: on a timeout or Ctrl-C the whole tree is
            # ended, not only the direct child (a `sh -c` wrapper, sudo, a tool's own workers).
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                text=True,
                errors="replace",
                env=full_env,
                cwd=cwd,
                start_new_session=True,
            )
        except FileNotFoundError as exc:
            return CommandResult(argv, 127, "", f"{argv[0]}: not found ({exc.strerror})", time.monotonic() - start)
        except PermissionError as exc:
            return CommandResult(argv, 126, "", f"{argv[0]}: {exc.strerror}", time.monotonic() - start)
        Reaper.watch(proc.pid)
        try:
            out, err = proc.communicate(input=stdin, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            end_process_group(proc)
            raise CommandTimeout(f"{shlex.join(argv)} did not finish within {timeout:g} s "
                                 "(its process group was ended)") from exc
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP turned into one by the CLI
            end_process_group(proc)
            try:  # what it printed until then (communicate keeps what it read; the pipes are at their end now)
                out, err = proc.communicate(timeout=5)
            except BaseException:
                raise exc from None
            raise CommandInterrupted(*exc.args, stdout=out or "", stderr=err or "") from None
        except BaseException:
            end_process_group(proc)
            raise
        finally:
            Reaper.forget(proc.pid)
        return CommandResult(shown, proc.returncode, out, err, time.monotonic() - start)

    def stream_lines(self, argv, *, sudo: bool = False) -> LineStream:
        argv = [str(a) for a in argv]
        return LineStream(self.sudo_argv(argv) if sudo else argv)

    def sudo_argv(self, argv) -> list[str]:
        argv = [str(a) for a in argv]
        return argv if os.geteuid() == 0 else ["sudo", "-n", "--", *argv]

    def exists(self, path: str) -> bool:
        return Path(self.expand_path(path)).exists()

    def expand_path(self, path: str) -> str:
        return os.path.expanduser(path)

    def put_file(self, local: str, remote: str) -> None:
        shutil.copyfile(local, self.expand_path(remote))

    def forward_port(self, remote_port: int, remote_host: str = "127.0.0.1") -> LocalPort:
        return LocalPort((remote_host, remote_port))
