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


@pytest.fixture
def coordinator(tmp_path):
    """A real labgrid-coordinator on loopback, started as a lab starts it (it keeps places.yaml in its cwd)."""
    workdir = tmp_path / "coordinator"
    workdir.mkdir()
    address = f"127.0.0.1:{_free_port()}"
    exe = Path(sys.executable).with_name("labgrid-coordinator")
    log = open(workdir / "coordinator.log", "w")
    proc = subprocess.Popen([str(exe), "--listen", address], cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    try:
        def up():
            if proc.poll() is not None:
                raise AssertionError(f"labgrid-coordinator exited: {(workdir / 'coordinator.log').read_text()}")
            try:
                Coordinator(address, connect_timeout_s=1).open().close()
                return True
            except CoordinatorError:
                return False
        eventually(up, "labgrid-coordinator answers")
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
