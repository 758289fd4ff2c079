"""A real `labgrid-coordinator` on loopback for tests (the `coordinator` fixture yields its HOST:PORT), and
`eventually`, the polling helper the farm tests share."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jbench.farm.coordinator import Coordinator, CoordinatorError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eventually(check, what: str, timeout: float = 60.0):
    # Polls a behaviour (a place freed, a queue position shown); the bound only keeps a broken test from hanging.
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.2)


def start_coordinator(workdir: Path) -> tuple[subprocess.Popen, str]:
    """Start a real labgrid-coordinator on a free loopback port, as a lab starts it (it keeps places.yaml in its
    cwd, `workdir`, with its output in coordinator.log there); returns once it answers."""
    workdir.mkdir(parents=True, exist_ok=True)
    address = f"127.0.0.1:{_free_port()}"
    exe = Path(sys.executable).with_name("labgrid-coordinator")
    with open(workdir / "coordinator.log", "w") as log:  # the child keeps its own copy
        proc = subprocess.Popen([str(exe), "--listen", address], cwd=workdir, stdout=log, stderr=subprocess.STDOUT)

    def up():
        if proc.poll() is not None:
            raise AssertionError(f"labgrid-coordinator exited: {(workdir / 'coordinator.log').read_text()}")
        try:
            Coordinator(address, connect_timeout_s=1).open().close()
            return True
        except CoordinatorError:
            return False

    try:
        eventually(up, "labgrid-coordinator answers")
    except BaseException:
        stop_process(proc)
        raise
    return proc, address


def stop_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def coordinator(tmp_path):
    """A real labgrid-coordinator on loopback (its HOST:PORT)."""
    proc, address = start_coordinator(tmp_path / "coordinator")
    try:
        yield address
    finally:
        stop_process(proc)
