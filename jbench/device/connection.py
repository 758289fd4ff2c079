"""How jbench runs commands on a device.

Every command is an argument list. LocalConnection runs it without a shell; the SSH connection
quotes it with shlex.join for the remote shell. A config value such as a model path
`a; rm -rf ~` therefore always stays one argument.
"""

from __future__ import annotations

import shlex
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator, Optional, Protocol, Sequence


class DeviceError(Exception):
    """A device-side problem a user can act on (unreachable, missing tool, permissions)."""


class CommandTimeout(DeviceError):
    pass


class CommandInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM/SIGHUP turned into one) while a command ran: it was ended, and what it had printed so far
    goes with the interruption (an interrupted trial keeps it, as a failed one keeps its output)."""

    def __init__(self, *args: object, stdout: str = "", stderr: str = ""):
        super().__init__(*args)
        self.stdout, self.stderr = stdout, stderr


class ConnectionLost(DeviceError):
    """The connection dropped while a command ran (device rebooted, crashed, network)."""


class OutputLines(Protocol):
    """Output lines of a running command; close() ends the command on the device."""

    def __iter__(self) -> Iterator[str]: ...

    def close(self) -> None: ...


class PortForward(Protocol):
    """A port on the device made reachable from the controller: connect to `address`."""

    address: tuple[str, int]

    def close(self) -> None: ...


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
    """The interface every device connection offers (jbench.device.local, jbench.device.ssh).

    Callers ask the interface what a connection can do (is_local, forward_port, reconnect) instead
    of testing its type."""

    name: str
    # True when commands run on this machine (no network between the controller and the device).
    is_local: bool = False

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
    def stream_lines(self, argv: Sequence[str], *, sudo: bool = False) -> OutputLines:
        """Start a long-running command (as root through sudo when asked); iterate its output lines;
        close() ends it on the device. It also ends when the controller stops or the connection drops."""

    @abstractmethod
    def sudo_argv(self, argv: Sequence[str]) -> list[str]:
        """argv run through sudo the way this connection does it (for commands inside a pipeline)."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def expand_path(self, path: str) -> str:
        """Expand ~ the way the device's user sees it."""

    @abstractmethod
    def put_file(self, local: str, remote: str) -> None:
        """Copy a file of this machine to `remote` on the device (a path as the device sees it)."""

    @abstractmethod
    def forward_port(self, remote_port: int, remote_host: str = "127.0.0.1") -> PortForward:
        """Make remote_host:remote_port, as the device sees it, reachable from this machine."""

    def reconnect(self, deadline_s: float) -> None:
        """Wait (bounded) until the device accepts commands again, e.g. after a reboot or a dropped
        link. Raises DeviceError when it does not come back in time."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
