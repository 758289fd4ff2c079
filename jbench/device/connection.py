"""How jbench runs commands on a device.

Every command is an argument list. LocalConnection runs it without a shell; the SSH connection
quotes it with shlex.join for the remote shell. A config value such as a model path
`a; rm -rf ~` therefore always stays one argument.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence


class DeviceError(Exception):
    """A device-side problem a user can act on (unreachable, missing tool, permissions)."""


class CommandTimeout(DeviceError):
    pass


@dataclass
class CommandResult:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def command_line(self) -> str:
        return shlex.join(self.argv)


class Connection(ABC):
    """The interface every device connection offers (local now, SSH in jbench.device.ssh)."""

    name: str

    @abstractmethod
    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: Optional[float] = None,
        env: Optional[dict[str, str]] = None,
        cwd: Optional[str] = None,
        sudo: bool = False,
        stdin: Optional[str] = None,
    ) -> CommandResult:
        """Run argv to completion (as root through sudo when asked, with stdin text if given).

        Never raises for a non-zero exit; raises CommandTimeout, or DeviceError when the device
        cannot be reached."""

    @abstractmethod
    def stream_lines(self, argv: Sequence[str]) -> "LineStream":
        """Start a long-running command; iterate its output lines; close() ends it on the device."""

    @abstractmethod
    def sudo_argv(self, argv: Sequence[str]) -> list[str]:
        """argv run through sudo the way this connection does it (for commands inside a pipeline)."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def expand_path(self, path: str) -> str:
        """Expand ~ the way the device's user sees it."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class LineStream:
    """Output lines of a running local command."""

    def __init__(self, argv: list[str]):
        # A session of its own, so close() ends the whole pipeline (bash, the tool, the stamper).
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     text=True, errors="replace", bufsize=1, start_new_session=True)

    def __iter__(self):
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            yield line.rstrip("\n")

    def close(self) -> None:
        import signal

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


class LocalConnection(Connection):
    """The local machine as a device."""

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
        try:
            proc = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=timeout,
                env=full_env,
                cwd=cwd,
                input=stdin,
                stdin=None if stdin is not None else subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise CommandTimeout(f"{shlex.join(argv)} did not finish within {timeout:g} s") from exc
        except FileNotFoundError as exc:
            return CommandResult(argv, 127, "", f"{argv[0]}: not found ({exc.strerror})", time.monotonic() - start)
        except PermissionError as exc:
            return CommandResult(argv, 126, "", f"{argv[0]}: {exc.strerror}", time.monotonic() - start)
        return CommandResult(shown, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)

    def stream_lines(self, argv) -> LineStream:
        return LineStream([str(a) for a in argv])

    def sudo_argv(self, argv) -> list[str]:
        argv = [str(a) for a in argv]
        return argv if os.geteuid() == 0 else ["sudo", "-n", "--", *argv]

    def exists(self, path: str) -> bool:
        return Path(self.expand_path(path)).exists()

    def expand_path(self, path: str) -> str:
        return os.path.expanduser(path)


def _jump_connection(spec: str, device: dict) -> Connection:
    """device.jump 'user@host:port' -> an SSH connection to the jump host (same host-key rules)."""
    from jbench.device.ssh import SSHConnection

    user, _, hostport = spec.rpartition("@")
    host, _, port = hostport.partition(":")
    return SSHConnection(f"{device['name']}-jump", host, port=int(port or 22), user=user or None,
                         key=device.get("key"), known_hosts=device.get("known_hosts"),
                         accept_new_host_key=bool(device.get("accept_new_host_key")),
                         connect_timeout=float(device.get("connect_timeout_s", 10)))


def connect(device: dict) -> Connection:
    """Open the connection a device config asks for (SSH connects here: errors come early)."""
    kind = device.get("kind", "local")
    if kind == "local":
        return LocalConnection(device.get("name", "local"))
    if kind == "ssh":
        from jbench.device.ssh import SSHConnection

        if not device.get("host"):
            raise DeviceError(f"device '{device.get('name')}': kind ssh needs device.host")
        conn = SSHConnection(
            device["name"], device["host"], port=int(device.get("port") or 22), user=device.get("user"),
            key=device.get("key"), known_hosts=device.get("known_hosts"),
            accept_new_host_key=bool(device.get("accept_new_host_key")),
            connect_timeout=float(device.get("connect_timeout_s", 10)),
            keepalive_s=float(device.get("keepalive_s", 15)),
            jump=_jump_connection(device["jump"], device) if device.get("jump") else None,
            sudo_password_env=device.get("sudo_password_env"),
        )
        return conn.open()
    raise DeviceError(f"device '{device.get('name')}': kind '{kind}' is not supported. Valid kinds: local, ssh")
