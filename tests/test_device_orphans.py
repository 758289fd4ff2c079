"""Nothing the controller started on a device survives it, however it stops: Ctrl-C, SIGTERM, SIGKILL of the
controller process, or a dropped SSH connection. The controller is a child Python process; the commands are
quiet (no output that would end them by SIGPIPE), so only jbench's own guard can end them in time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.emulated_jetson import emu_state

REPO = Path(__file__).resolve().parent.parent
DEADLINE_S = 20.0

CONTROLLER = r"""
import json, sys, time
from jbench.device.connect import connect
from jbench.device.local import LocalConnection
cfg, mode, sudo = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
if mode == "run":
    conn = connect(cfg)
    print("ready", flush=True)
    try:
        res = conn.run(["sh", "-c", 'exec emu-hang 600 >/dev/null', "sh"], timeout=1800, sudo=sudo)
        print("finished", res.returncode, flush=True)
    except Exception as exc:
        print("error", type(exc).__name__, exc, flush=True)
        time.sleep(600)  # stay alive: the command must end because the connection dropped, not because we exited
elif mode == "stream":
    from jbench.device.telemetry.samplers import TegrastatsSampler
    conn = connect(cfg)
    sampler = TegrastatsSampler(conn, 100, sudo=sudo).start()
    assert sampler.wait_for_samples(2, 30), (sampler.problem, sampler.last_skipped)
    print("ready", flush=True)
    time.sleep(600)
elif mode == "local":
    print("ready", flush=True)
    LocalConnection().run(["bash", "-c", 'sleep 600 & a=$!; echo "$$ $a" > "$1"; wait', "bash", cfg["pids"]],
                          timeout=1800)
elif mode == "local-stream":
    stream = LocalConnection().stream_lines(["bash", "-c", 'sleep 600 & a=$!; echo "$$ $a" > "$1"; wait', "bash",
                                             cfg["pids"]])
    print("ready", flush=True)
    time.sleep(600)
"""


def _controller(cfg: dict, mode: str, sudo: bool = False, env: dict | None = None) -> subprocess.Popen:
    full_env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.Popen([sys.executable, "-c", CONTROLLER, json.dumps(cfg), mode, "1" if sudo else "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=REPO)


def _wait(predicate, timeout: float = DEADLINE_S) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def _cfg(emu) -> dict:
    cfg = emu.device_config(name="emu")
    cfg["connect_timeout_s"] = 5.0
    return cfg


def _reap(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.kill()
    out, err = proc.communicate(timeout=30)
    return out + err


def _running(emu, name: str) -> list[int]:
    return emu_state.processes_of_device(str(emu.state_dir), [name])


SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL}


@pytest.mark.ssh
@pytest.mark.parametrize("sig, sudo", [("SIGINT", "none"), ("SIGTERM", "none"), ("SIGKILL", "none"),
                                       ("SIGKILL", "nopasswd"), ("SIGINT", "password"), ("SIGKILL", "password")])
def test_remote_command_ends_when_the_controller_stops(emulated_jetson_factory, sig, sudo):
    password = "pw-orphans-1" if sudo == "password" else None
    emu = emulated_jetson_factory("orin_nano", sudo_password=password)
    cfg = _cfg(emu)
    env = {}
    if password:
        cfg["sudo_password_env"] = "JBENCH_ORPHAN_PW"
        env["JBENCH_ORPHAN_PW"] = password
    proc = _controller(cfg, "run", sudo=sudo != "none", env=env)
    try:
        assert _wait(lambda: _running(emu, "emu-hang")), "emu-hang never started: " + _reap(proc)
        time.sleep(0.5)
        proc.send_signal(SIGNALS[sig])
        proc.wait(timeout=30)
        assert _wait(lambda: not _running(emu, "emu-hang")), f"emu-hang survived {sig}: {_running(emu, 'emu-hang')}"
    finally:
        _reap(proc)


@pytest.mark.ssh
@pytest.mark.parametrize("sudo", ["none", "password"])
def test_remote_command_ends_when_the_connection_drops(emulated_jetson_factory, sudo):
    password = "pw-orphans-2" if sudo == "password" else None
    emu = emulated_jetson_factory("orin_nano", sudo_password=password)
    cfg = _cfg(emu)
    env = {}
    if password:
        cfg["sudo_password_env"] = "JBENCH_ORPHAN_PW"
        env["JBENCH_ORPHAN_PW"] = password
    emu.die_after(1.0, match=["emu-hang"])
    proc = _controller(cfg, "run", sudo=sudo != "none", env=env)
    try:
        assert _wait(lambda: _running(emu, "emu-hang")), "emu-hang never started: " + _reap(proc)
        # The controller lives on (it reports the lost connection); the command must end anyway.
        assert _wait(lambda: any(e.get("kind") == "session_killed" for e in emu.events), timeout=15)
        assert _wait(lambda: not _running(emu, "emu-hang")), "emu-hang survived the dropped connection"
        assert proc.poll() is None
    finally:
        out = _reap(proc)
    assert "ConnectionLost" in out, out


@pytest.mark.ssh
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_tegrastats_sampler_ends_when_the_controller_dies(orin_nano, sig):
    emu = orin_nano
    proc = _controller(_cfg(emu), "stream", sudo=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "ready", line + _reap(proc)
        assert _running(emu, "tegrastats")
        proc.send_signal(SIGNALS[sig])
        proc.wait(timeout=30)
        assert _wait(lambda: not _running(emu, "tegrastats")), "tegrastats survived the controller"
    finally:
        _reap(proc)


def _pids(path: Path) -> list[int]:
    assert _wait(lambda: path.exists() and len(path.read_text().split()) == 2, timeout=15), "the command never started"
    return [int(p) for p in path.read_text().split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["local", "local-stream"])
def test_local_children_end_when_the_controller_is_killed(tmp_path, mode):
    pids_file = tmp_path / "pids"
    proc = _controller({"pids": str(pids_file)}, mode)
    try:
        pids = _pids(pids_file)
        assert all(_alive(p) for p in pids)
        proc.kill()  # SIGKILL: no Python code of the controller runs
        proc.wait(timeout=30)
        assert _wait(lambda: not any(_alive(p) for p in pids)), f"survivors: {[p for p in pids if _alive(p)]}"
    finally:
        _reap(proc)


@pytest.mark.ssh
def test_ctrl_c_in_run_ends_the_remote_command_and_the_connection_stays_usable(orin_nano):
    from jbench.device.connect import connect

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    with connect(_cfg(orin_nano)) as conn:
        try:
            signal.setitimer(signal.ITIMER_REAL, 1.5)
            with pytest.raises(KeyboardInterrupt):
                conn.run(["sh", "-c", "exec emu-hang 600 >/dev/null", "sh"], timeout=1800)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        # This process lives on: the command must still end (no exit of ours closes anything).
        assert _wait(lambda: not _running(orin_nano, "emu-hang"), timeout=10), "emu-hang survived Ctrl-C"
        assert conn.run(["true"], timeout=10).ok  # the next command reconnects
