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
    ) -> CommandResult:
        """Run argv to completion. Never raises for a non-zero exit; raises CommandTimeout."""

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


class LocalConnection(Connection):
    """The local machine as a device."""

    def __init__(self, name: str = "local"):
        self.name = name

    def run(self, argv, *, timeout=None, env=None, cwd=None) -> CommandResult:
        argv = [str(a) for a in argv]
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
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise CommandTimeout(f"{shlex.join(argv)} did not finish within {timeout:g} s") from exc
        except FileNotFoundError as exc:
            return CommandResult(argv, 127, "", f"{argv[0]}: not found ({exc.strerror})", time.monotonic() - start)
        except PermissionError as exc:
            return CommandResult(argv, 126, "", f"{argv[0]}: {exc.strerror}", time.monotonic() - start)
        return CommandResult(argv, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)

    def exists(self, path: str) -> bool:
        return Path(self.expand_path(path)).exists()

    def expand_path(self, path: str) -> str:
        return os.path.expanduser(path)


def connect(device: dict) -> Connection:
    """Open the connection a device config asks for."""
    kind = device.get("kind", "local")
    if kind == "local":
        return LocalConnection(device.get("name", "local"))
    raise DeviceError(f"device '{device.get('name')}': kind '{kind}' is not supported. Valid kinds: local")
