"""Devices over SSH (paramiko).

- Host keys are verified against known_hosts (the user's, or the device entry's own file). An
  unknown key is refused with its fingerprint; `device.accept_new_host_key=true` is the explicit
  opt-in that records it.
- Every command is an argument list quoted with shlex.join. A command with a timeout runs under
  `timeout --kill-after` on the device, so the remote process ends too, not only our wait.
- sudo: `sudo -n` (passwordless sudoers entries, the documented way), or `sudo -S` with the
  password from the environment variable the device entry names. The password is written to the
  command's stdin only: never into a command line, a log, a param or an artifact.
"""

from __future__ import annotations

import base64
import select
import hashlib
import os
import shlex
import socket
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import paramiko

from jbench.device.connection import CommandResult, CommandTimeout, Connection, ConnectionLost, DeviceError
from jbench.device.tunnel import TunnelForwarder

# Grace the device's `timeout` gives a command after TERM before KILL, and our own extra wait.
_KILL_AFTER_S = 5
_LOCAL_GRACE_S = 15


class HostKeyError(DeviceError):
    pass


def key_fingerprint(key: paramiko.PKey) -> str:
    """SHA256:... as `ssh-keygen -lf` prints it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


# Where OpenSSH keeps the user's host keys; an accepted new key is recorded there unless the device entry
# names its own file (so a later changed key is refused, as `ssh` would).
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


class _VerifyPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown host key: refuse (default) or record it when the user opted in."""

    def __init__(self, accept_new: bool, known_hosts: Path):
        self.accept_new = accept_new
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        fp = key_fingerprint(key)
        if not self.accept_new:
            raise HostKeyError(
                f"unknown host key for {hostname}: {key.get_name()} {fp}. Verify it on the device "
                f"(ssh-keygen -lf /etc/ssh/ssh_host_{key.get_name().replace('ssh-', '')}_key.pub), then add it to "
                f"known_hosts (ssh-keyscan / ssh once) or opt in with device.accept_new_host_key=true"
            )
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.known_hosts, "a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


def _known_host_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


class SSHConnection(Connection):
    def __init__(
        self,
        name: str,
        host: str,
        *,
        port: int = 22,
        user: Optional[str] = None,
        key: Optional[str] = None,
        known_hosts: Optional[str] = None,
        accept_new_host_key: bool = False,
        connect_timeout: float = 10.0,
        keepalive_s: float = 15.0,
        jump: Optional["SSHConnection"] = None,
        sudo_password_env: Optional[str] = None,
    ):
        self.name = name
        self.host, self.port, self.user = host, port, user
        self.key = os.path.expanduser(key) if key else None
        self.known_hosts = Path(os.path.expanduser(known_hosts)) if known_hosts else None
        self.accept_new_host_key = accept_new_host_key
        self.connect_timeout = connect_timeout
        self.keepalive_s = keepalive_s
        self.jump = jump
        self.sudo_password_env = sudo_password_env
        self._client: Optional[paramiko.SSHClient] = None
        self._home: Optional[str] = None
        self._lock = threading.Lock()

    # -- connection ------------------------------------------------------------------------------

    def _connect(self) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        if self.known_hosts is not None:
            if self.known_hosts.exists():
                client.load_host_keys(str(self.known_hosts))
        else:
            client.load_system_host_keys()
        record_in = self.known_hosts or Path(os.path.expanduser(DEFAULT_KNOWN_HOSTS))
        client.set_missing_host_key_policy(_VerifyPolicy(self.accept_new_host_key, record_in))
        sock = None
        if self.jump is not None:
            transport = self.jump.transport()
            try:
                sock = transport.open_channel("direct-tcpip", (self.host, self.port), ("127.0.0.1", 0),
                                              timeout=self.connect_timeout)
            except (paramiko.SSHException, OSError) as exc:
                raise DeviceError(f"device '{self.name}': jump host {self.jump.host} cannot reach {self.host}:{self.port}: {exc}") from None
        where = f"{self.user + '@' if self.user else ''}{self.host}:{self.port}"
        try:
            if sock is None:
                # Our own socket so TCP_NODELAY can be set: without it every channel open waits out
                # the peer's delayed ACK (~40 ms a command).
                sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.connect(
                self.host, port=self.port, username=self.user, key_filename=self.key,
                allow_agent=True, look_for_keys=self.key is None, timeout=self.connect_timeout,
                banner_timeout=self.connect_timeout, auth_timeout=self.connect_timeout, sock=sock,
            )
        except HostKeyError:
            client.close()
            raise
        except paramiko.BadHostKeyException as exc:
            client.close()
            name = _known_host_name(self.host, self.port)
            where = self.known_hosts or Path(os.path.expanduser(DEFAULT_KNOWN_HOSTS))
            raise HostKeyError(
                f"device '{self.name}': the host key of {name} CHANGED: known_hosts has {exc.expected_key.get_name()} "
                f"{key_fingerprint(exc.expected_key)}, the server offers {exc.key.get_name()} {key_fingerprint(exc.key)}. "
                f"If the device was reinstalled, verify the new key on it, then remove the old entry with "
                f"`ssh-keygen -R '{name}' -f {where}` and connect again; otherwise someone may be intercepting the "
                f"connection") from None
        except paramiko.AuthenticationException as exc:
            client.close()
            raise DeviceError(f"device '{self.name}': SSH authentication to {where} failed ({exc}); check device.user and device.key or your ssh-agent") from None
        except (socket.timeout, TimeoutError):
            client.close()
            raise DeviceError(f"device '{self.name}': {where} did not answer within {self.connect_timeout:g} s (connect timeout); is it on and reachable?") from None
        except (OSError, paramiko.SSHException) as exc:
            client.close()
            raise DeviceError(f"device '{self.name}': cannot connect to {where}: {exc}") from None
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(int(self.keepalive_s))
        return client

    def transport(self) -> paramiko.Transport:
        with self._lock:
            if self._client is None or not self._client.get_transport() or not self._client.get_transport().is_active():
                if self._client is not None:
                    self._client.close()
                self._client = self._connect()
            return self._client.get_transport()

    def forward_port(self, remote_port: int, remote_host: str = "127.0.0.1") -> TunnelForwarder:
        return TunnelForwarder(self.transport(), remote_port, remote_host)

    def open(self) -> "SSHConnection":
        self.transport()
        return self

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def reconnect(self, deadline_s: float, interval_s: float = 2.0) -> None:
        """Wait (bounded) for the device to accept SSH again, e.g. after a reboot."""
        self.close()
        end = time.monotonic() + deadline_s
        last: Optional[Exception] = None
        while time.monotonic() < end:
            try:
                self.transport()
                self._home = None
                return
            except HostKeyError:
                raise
            except DeviceError as exc:
                last = exc
                time.sleep(interval_s)
        raise DeviceError(f"device '{self.name}' did not come back within {deadline_s:g} s: {last}")

    # -- commands -------------------------------------------------------------------------------

    def command_line(self, argv: Sequence[str], *, timeout: Optional[float] = None, sudo: bool = False,
                     env: Optional[dict[str, str]] = None, cwd: Optional[str] = None) -> str:
        """The exact remote command line for argv (quoted; no config value can break out)."""
        argv = [str(a) for a in argv]
        if env:
            argv = ["env", *[f"{k}={v}" for k, v in env.items()], *argv]
        if timeout is not None:
            argv = ["timeout", f"--kill-after={_KILL_AFTER_S}", f"{timeout:g}", *argv]
        if sudo:
            argv = (["sudo", "-S", "-p", ""] if self._sudo_password() else ["sudo", "-n"]) + ["--", *argv]
        line = shlex.join(argv)
        if cwd:
            line = f"cd {shlex.quote(cwd)} && {line}"
        return line

    def _sudo_password(self) -> Optional[str]:
        if not self.sudo_password_env:
            return None
        return os.environ.get(self.sudo_password_env)

    def run(self, argv, *, timeout=None, env=None, cwd=None, sudo: bool = False, stdin: Optional[str] = None) -> CommandResult:
        argv = [str(a) for a in argv]
        line = self.command_line(argv, timeout=timeout, sudo=sudo, env=env, cwd=cwd)
        started = time.monotonic()
        try:
            chan = self.transport().open_session()
            chan.exec_command(line)
            feed = ""
            if sudo and self._sudo_password():
                feed += self._sudo_password() + "\n"
            if stdin:
                feed += stdin
            if feed:
                chan.sendall(feed.encode())
            chan.shutdown_write()
            out, err = _drain(chan, None if timeout is None else timeout + _KILL_AFTER_S + _LOCAL_GRACE_S)
            code = chan.recv_exit_status() if chan.exit_status_ready() else -1
        except _LocalDeadline:
            raise CommandTimeout(f"{shlex.join(argv)} on '{self.name}' did not finish within {timeout:g} s") from None
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise ConnectionLost(f"lost the SSH connection to '{self.name}' while running {argv[0]}: {exc or type(exc).__name__}") from None
        if code == -1:
            raise ConnectionLost(f"lost the SSH connection to '{self.name}' while running {argv[0]} (no exit status)")
        if timeout is not None and code in (124, 137):
            raise CommandTimeout(f"{shlex.join(argv)} on '{self.name}' did not finish within {timeout:g} s (ended on the device)")
        return CommandResult(argv, code, out, err, time.monotonic() - started)

    def sudo_argv(self, argv: Sequence[str]) -> list[str]:
        argv = [str(a) for a in argv]
        return (["sudo", "-S", "-p", ""] if self._sudo_password() else ["sudo", "-n"]) + ["--", *argv]

    def stream_lines(self, argv: Sequence[str], *, sudo: bool = False) -> "RemoteStream":
        """Start a long-running command and iterate its output lines (tegrastats)."""
        argv = [str(a) for a in argv]
        chan = self.transport().open_session()
        chan.get_pty(width=1000)  # a pty ends the remote process when the channel closes
        chan.exec_command(self.command_line(argv, sudo=sudo))
        if self._sudo_password() and (sudo or "-S" in argv):
            chan.sendall((self._sudo_password() + "\n").encode())
        return RemoteStream(chan)

    def exists(self, path: str) -> bool:
        return self.run(["test", "-e", self.expand_path(path)], timeout=30).returncode == 0

    def expand_path(self, path: str) -> str:
        if path == "~" or path.startswith("~/"):
            if self._home is None:
                res = self.run(["sh", "-c", 'printf %s "$HOME"'], timeout=30)
                self._home = res.stdout.strip() or "/"
            return self._home + path[1:]
        return path


class _LocalDeadline(Exception):
    pass


def _drain(chan: paramiko.Channel, deadline_s: Optional[float]) -> tuple[str, str]:
    """Read stdout and stderr until the command has exited and both streams are drained.

    Waits with select() on the channel (woken by data and by close), not by polling with sleeps:
    a short command costs one network round trip, not a sleep interval."""
    out, err = bytearray(), bytearray()
    end = None if deadline_s is None else time.monotonic() + deadline_s
    while True:
        if chan.recv_ready():
            out += chan.recv(65536)
            continue
        if chan.recv_stderr_ready():
            err += chan.recv_stderr(65536)
            continue
        if chan.exit_status_ready() and (chan.eof_received or chan.closed):
            break
        if end is not None and time.monotonic() > end:
            chan.close()
            raise _LocalDeadline()
        transport = chan.get_transport()
        if transport is None or not transport.is_active():
            raise EOFError("transport closed")
        select.select([chan], [], [], 0.2)
    return out.decode(errors="replace"), err.decode(errors="replace")


class RemoteStream:
    """Lines of a long-running remote command; close() ends it on the device."""

    def __init__(self, chan: paramiko.Channel):
        self.chan = chan
        self._buf = b""

    def __iter__(self) -> Iterator[str]:
        self.chan.settimeout(None)
        while True:
            try:
                data = self.chan.recv(65536)
            except (OSError, paramiko.SSHException):
                data = b""
            if not data:
                if self._buf:
                    yield self._buf.decode(errors="replace").rstrip("\r")
                return
            self._buf += data
            *lines, self._buf = self._buf.split(b"\n")
            for line in lines:
                yield line.decode(errors="replace").rstrip("\r")

    def close(self) -> None:
        try:
            self.chan.close()
        except Exception:  # closing a dead channel is not an error worth reporting
            pass
