"""A server on the device, from start to a guaranteed stop: what every serving backend shares (llama-server, any
OpenAI-compatible server started from a command template).

The server runs on the device through the Connection (argument lists only):

1. a free port is picked ON THE DEVICE (a constant python3 snippet binds port 0 on 127.0.0.1 and prints it);
2. the server starts as a long-running process (Connection.stream_lines) behind a constant python3 launcher that
   prints its pid and process group, then execs the server, so the pid is the server's; its log (stdout + stderr)
   is collected by a reader thread;
3. readiness: GET of the health path until 200 (llama-server and vLLM answer 503 or refuse while they load),
   bounded by a ready timeout; a server that exits first (bad flag, bind race, missing file) fails at once;
4. the server is ALWAYS stopped (`finally`): SIGTERM to its process group on the device, the stream closed
   (local: the process group is killed; SSH: the pty channel closes, which hangs the remote process up), then
   SIGKILL to the group if it is still alive after a grace period.

The controller reaches the port directly for a local device, and through the SSH connection's transport
(`direct-tcpip` channels behind a loopback listening socket) for an SSH device; the server itself should listen on
the device's 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import socket
import re
import shlex
import threading
import time
from collections import deque
from typing import Callable, Iterator, Mapping, Optional, Sequence

from jbench.backends.base import BackendError, looks_oom
from jbench.backends.serving.http import RequestError
from jbench.device.connection import CommandTimeout, Connection, DeviceError, PortForward


def http_get(address: tuple[str, int], path: str, timeout: float) -> tuple[int, str]:
    """(HTTP status, body text) of GET path on address, on a connection of its own."""
    conn = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


# Constant device-side snippets; values only ever travel as separate argv items.
FREE_PORT_SNIPPET = (
    "import socket\n"
    "s = socket.socket()\n"
    "s.bind(('127.0.0.1', 0))\n"
    "print(s.getsockname()[1])\n"
)


# Prints the pid (kept by exec) and the process group, then becomes the server.
LAUNCHER_SNIPPET = (
    "import os, sys\n"
    "print('@@jbench-server pid=%d pgid=%d' % (os.getpid(), os.getpgid(0)), flush=True)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)


_VMHWM = re.compile(r"^VmHWM:\s+(\d+)\s+kB", re.M)


_PID_LINE = re.compile(r"@@jbench-server pid=(\d+) pgid=(\d+)")


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


_BIND_FAILURE = re.compile(r"couldn't bind|could not bind|failed to bind|address already in use", re.I)


_MISSING = re.compile(r"FileNotFoundError|PermissionError|python3: (command )?not found")


def with_env(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """argv run with these environment variables added, as `env NAME=VALUE ... argv` (separate argv items, no
    shell): the launcher execs env, which execs the program, so the pid the launcher prints stays the server's."""
    if not env:
        return list(argv)
    return ["env", *(f"{k}={v}" for k, v in env.items()), *argv]



def pick_free_port(conn: Connection) -> int:
    """A port that was free on the device's loopback a moment ago (bound to 0 and released)."""
    try:
        res = conn.run(["python3", "-c", FREE_PORT_SNIPPET], timeout=30)
    except CommandTimeout as exc:
        raise BackendError("timeout", f"picking a free port on device '{conn.name}': {exc}") from None
    if res.returncode != 0 or not res.stdout.strip().isdigit():
        raise BackendError("backend_crash", f"could not pick a free port on device '{conn.name}' with python3 "
                           f"(exit {res.returncode}): {res.stderr.strip()[-300:]}", res.stdout, res.stderr)
    return int(res.stdout.strip())


class DeviceServer:
    """A server process on the device (its argv from argv_for_port(port)), from start to a guaranteed stop. Use as a context manager, or call
    start() and stop() (stop() is idempotent and safe after a failed start)."""

    STOP_GRACE_S = 10.0
    BIND_ATTEMPTS = 3

    NAME = "server"  # how messages name it
    HEALTH_PATH = "/health"  # GET this until it answers 200: ready
    MEASURES_RSS = True  # the pid is the server's own (not a container engine's client): its peak RSS is read

    def __init__(self, conn: Connection, argv_for_port: Callable[[int], list[str]], *, ready_timeout_s: float,
                 log: Optional[logging.Logger] = None, max_log_lines: int = 5000, name: Optional[str] = None,
                 health_path: Optional[str] = None):
        self.name = name or self.NAME
        self.health_path = health_path or self.HEALTH_PATH
        self.conn = conn
        self.argv_for_port = argv_for_port
        self.ready_timeout_s = ready_timeout_s
        self.log = log or logging.getLogger("jbench.latency")
        self.argv: Optional[list[str]] = None
        self.port: Optional[int] = None  # on the device
        self.pid: Optional[int] = None  # on the device
        self.pgid: Optional[int] = None
        self.address: Optional[tuple[str, int]] = None  # where the controller connects
        self._lines: deque[str] = deque(maxlen=max_log_lines)
        self._dropped = 0
        self._stream = None
        self._reader: Optional[threading.Thread] = None
        self._exited = threading.Event()
        self._pid_seen = threading.Event()
        self._forwarder: Optional[PortForward] = None
        self._forwarded_port: Optional[int] = None
        self._stopped = False
        self.peak_rss_kib: Optional[int] = None  # VmHWM read just before the stop (read_peak_rss)

    # -- log -------------------------------------------------------------------------------------

    def log_text(self) -> str:
        head = f"[jbench] {self._dropped} earlier server log lines dropped\n" if self._dropped else ""
        return head + "\n".join(self._lines) + ("\n" if self._lines else "")

    def _read(self, stream) -> None:
        try:
            for line in stream:
                line = _ANSI.sub("", line)
                if not self._pid_seen.is_set():
                    m = _PID_LINE.search(line)
                    if m:
                        self.pid, self.pgid = int(m.group(1)), int(m.group(2))
                        self._pid_seen.set()
                        continue
                if len(self._lines) == self._lines.maxlen:
                    self._dropped += 1
                self._lines.append(line)
        except Exception as exc:  # the stream broke (connection lost): the server counts as gone for us
            self._lines.append(f"[jbench] server log stream ended: {exc}")
        finally:
            self._exited.set()
            self._pid_seen.set()

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> "DeviceServer":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        for attempt in range(1, self.BIND_ATTEMPTS + 1):
            self._launch(pick_free_port(self.conn))
            try:
                self._wait_ready()
                return
            except _ServerExited:
                log = self.log_text()
                if attempt < self.BIND_ATTEMPTS and _BIND_FAILURE.search(log):
                    self.log.warning("llama-server could not bind port %s (taken since it was picked); retrying",
                                     self.port)
                    self._stop_process()
                    self._reset()
                    continue
                category = "missing_binary" if _MISSING.search(log) else "backend_crash"
                if looks_oom(log):
                    category = "out_of_memory"
                raise BackendError(category, f"{self.name} exited before it was ready: " + _tail(log, 5),
                                   raw_output=log) from None

    def _reset(self) -> None:
        self._lines.clear()
        self._dropped = 0
        self._exited = threading.Event()
        self._pid_seen = threading.Event()
        self.pid = self.pgid = None
        self._stream = self._reader = None

    def _launch(self, port: int) -> None:
        self.port = port
        self.argv = self.argv_for_port(port)
        self.log.info("starting on device '%s': %s", self.conn.name, shlex.join(self.argv))
        try:
            self._stream = self.conn.stream_lines(["python3", "-c", LAUNCHER_SNIPPET, *self.argv])
        except OSError as exc:
            raise BackendError("missing_binary", f"cannot start python3 on device '{self.conn.name}': {exc}") from None
        self._reader = threading.Thread(target=self._read, args=(self._stream,), name="jbench-server-log", daemon=True)
        self._reader.start()
        self._pid_seen.wait(timeout=30)
        if self.pid is not None:
            self.log.info("%s pid %d (process group %d), port %d on the device", self.name, self.pid, self.pgid, port)
        if self._forwarder is None or self._forwarded_port != port:
            if self._forwarder is not None:
                self._forwarder.close()
            self._forwarder, self._forwarded_port = self.conn.forward_port(port), port
        self.address = self._forwarder.address

    def _wait_ready(self) -> None:
        # Through a tunnel, every poll before the server listens is a refused direct-tcpip channel, which
        # paramiko logs at ERROR level: expected here, so those records are dropped while we wait.
        quiet = _RefusedChannelFilter() if not self.conn.is_local else None
        if quiet is not None:
            logging.getLogger("paramiko.transport").addFilter(quiet)
        try:
            self._poll_health()
        finally:
            if quiet is not None:
                logging.getLogger("paramiko.transport").removeFilter(quiet)

    def _poll_health(self) -> None:
        assert self.address is not None
        deadline = time.monotonic() + self.ready_timeout_s
        started = time.monotonic()
        last = "no answer yet"
        while True:
            if self._exited.is_set():
                raise _ServerExited()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BackendError(
                    "timeout",
                    f"{self.name} did not become ready within {self.ready_timeout_s:g} s (last {self.health_path}: {last}); "
                    "server log attached", raw_output=self.log_text())
            try:
                status, body = http_get(self.address, self.health_path, timeout=max(0.5, min(5.0, remaining)))
                if status == 200:
                    self.log.info("%s ready after %.2f s", self.name, time.monotonic() - started)
                    return
                last = f"HTTP {status} {body.strip()[:200]}"
            except (OSError, http.client.HTTPException) as exc:
                last = f"{type(exc).__name__}: {exc}"
            self._exited.wait(min(0.1, max(0.0, deadline - time.monotonic())))

    def alive(self) -> bool:
        """Whether the server process still exists on the device (kill -0)."""
        if self.pid is None:
            return not self._exited.is_set()
        try:
            return self.conn.run(["kill", "-0", str(self.pid)], timeout=15).returncode == 0
        except DeviceError:
            return False

    def _signal(self, sig: str) -> None:
        targets = []
        if self.pgid is not None and self.pgid > 1:
            targets.append(f"-{self.pgid}")
        if self.pid is not None and self.pid > 1:
            targets.append(str(self.pid))
        if not targets:
            return
        try:
            self.conn.run(["kill", f"-{sig}", "--", *targets], timeout=15)
        except DeviceError as exc:
            self.log.warning("kill -%s on device '%s' failed: %s", sig, self.conn.name, exc)

    def _stop_process(self) -> None:
        stream, reader = self._stream, self._reader
        if stream is None:
            return
        try:
            if not self._exited.is_set():
                self._signal("TERM")
                self._exited.wait(self.STOP_GRACE_S)
        finally:
            try:
                stream.close()
            finally:
                if self.pid is not None and self.alive():
                    end = time.monotonic() + self.STOP_GRACE_S
                    while time.monotonic() < end and self.alive():
                        time.sleep(0.1)
                    if self.alive():
                        self.log.warning("%s pid %d survived SIGTERM; sending SIGKILL", self.name, self.pid)
                        self._signal("KILL")
                if reader is not None:
                    reader.join(timeout=5)

    def read_peak_rss(self) -> None:
        """The server process's peak resident set (VmHWM of /proc/<pid>/status on the device) into peak_rss_kib;
        left None where it cannot be read (no /proc, the process gone, a container engine's client)."""
        if not self.MEASURES_RSS or self.pid is None or self._exited.is_set():
            return
        try:
            res = self.conn.run(["cat", f"/proc/{self.pid}/status"], timeout=15)
        except DeviceError:
            return
        m = _VMHWM.search(res.stdout)
        if res.returncode == 0 and m:
            self.peak_rss_kib = int(m.group(1))

    def stop(self) -> None:
        """Stop the server and the tunnel (its peak RSS read first); safe to call more than once and after a failed
        start."""
        if self._stopped:
            return
        self._stopped = True
        self.read_peak_rss()
        try:
            if self._forwarder is not None:
                self._forwarder.close()
        finally:
            self._stop_process()
            self.log.info("%s stopped", self.name)


@contextlib.contextmanager
def request_failures(server: DeviceServer, what: str = "serving") -> Iterator[None]:
    """A request that failed (refused, cut, timed out, not countable) becomes the trial's BackendError, with its
    category and the server's log: what a user reads to see why."""
    try:
        yield
    except (RequestError, OSError, http.client.HTTPException) as exc:
        category = "timeout" if isinstance(exc, socket.timeout) else getattr(exc, "category", "backend_crash")
        raise BackendError(category, f"{what} requests failed: {type(exc).__name__}: {exc}",
                           raw_output=server.log_text()) from None
    except BackendError as exc:
        if not exc.raw_output:
            exc.raw_output = server.log_text()
        raise


class _ServerExited(Exception):
    pass


class _RefusedChannelFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("open FAILED" in msg and "Connection refused" in msg)


def _tail(text: str, n: int) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-n:])
