"""The local machine as a device: commands run without a shell, as argument lists."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from jbench.device.connection import CommandResult, CommandTimeout, Connection


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

    def forward_port(self, remote_port: int, remote_host: str = "127.0.0.1") -> LocalPort:
        return LocalPort((remote_host, remote_port))
