"""sudo with a password (device.sudo_password_env) over real SSH: the password is given once per connection
(`sudo -S -v` on a channel without a pty) and appears nowhere else -- not in a command's stdin or output, a
pty, an exception, a log record, the device's command log or state files, nor in `ps` on this machine.

Written for real sudo semantics (credentials cached per connection: `sudo -n` works after validation); the
tests also hold on an emulated sudo that keeps no credentials (then jbench falls back to `sudo -k -S`)."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from jbench.device.connect import connect
from jbench.device.connection import DeviceError
from jbench.device.telemetry.samplers import TegrastatsSampler

ENV = "JBENCH_TEST_SUDO_PW"


def _cfg(emu, **extra) -> dict:
    cfg = emu.device_config(name="emu")
    cfg["connect_timeout_s"] = 5.0
    cfg.update(extra)
    return cfg


def _files_mentioning(root: Path, secret: str, skip: set[str]) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and path.name not in skip:
            try:
                if secret.encode() in path.read_bytes():
                    hits.append(str(path))
            except OSError:
                pass
    return hits


class _PsWatch:
    """Polls `ps` on this machine (the device runs here too) and records any line showing the secret."""

    def __init__(self, secret: str):
        self.secret, self.hits, self.polls = secret, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            out = subprocess.run(["ps", "-eww", "-o", "args="], capture_output=True, text=True).stdout
            self.polls += 1
            self.hits += [line for line in out.splitlines() if self.secret in line]
            time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.mark.ssh
def test_password_sudo_works_and_the_password_appears_nowhere(emulated_jetson_factory, monkeypatch, caplog):
    secret = f"pw-{uuid.uuid4().hex}"
    emu = emulated_jetson_factory("orin_nano", sudo_password=secret)
    monkeypatch.setenv(ENV, secret)
    caplog.set_level(logging.DEBUG)
    cfg = _cfg(emu, sudo_password_env=ENV)
    texts: list[str] = []
    with _PsWatch(secret) as ps, connect(cfg) as conn:
        # The command's stdin carries only its own input: `cat` under sudo echoes exactly that.
        for _ in range(3):
            res = conn.run(["cat"], sudo=True, stdin="data\n", timeout=30)
            texts += [res.stdout, res.stderr]
            assert (res.returncode, res.stdout) == (0, "data\n"), res.stderr
        res = conn.run(["cat"], sudo=True)  # no stdin of its own: nothing at all
        texts += [res.stdout, res.stderr]
        assert (res.returncode, res.stdout) == (0, ""), res.stderr
        res = conn.run(["whoami"], sudo=True, timeout=30)
        texts += [res.stdout, res.stderr]
        assert res.stdout.strip() == "root"
        res = conn.run(["nvpmodel", "-q"], sudo=True, timeout=30)
        texts += [res.stdout, res.stderr]
        assert res.ok and "NV Power Mode" in res.stdout
        res = conn.run(["emu-hang", "2"], sudo=True, timeout=30)  # long enough for `ps` to see it
        texts += [res.stdout, res.stderr]
        assert res.ok
        for argv in (["nvpmodel", "-q"], ["cat"]):
            line = conn.command_line(argv, sudo=True, timeout=5)
            texts.append(line)
            assert secret not in line
        assert secret not in repr(conn) and secret not in str(vars(conn))

        # A stream with sudo=True (no pty: nothing is ever written into one), and the tegrastats sampler
        # (sudo inside its stamping pipeline).
        stream = conn.stream_lines(["tegrastats", "--interval", "100"], sudo=True)
        lines = []
        for line in stream:
            lines.append(line)
            if len(lines) >= 3:
                break
        stream.close()
        texts += lines
        assert all("RAM" in line for line in lines), lines
        sampler = TegrastatsSampler(conn, 100).start()
        assert sampler.wait_for_samples(3, 20), (sampler.problem, sampler.last_skipped)
        sampler.stop()
        texts += [sampler.last_skipped or "", sampler.problem or ""]

        # After a reconnect (a new connection: sudo's cache is not ours) it is validated again.
        conn.reconnect(30)
        res = conn.run(["cat"], sudo=True, stdin="again\n", timeout=30)
        texts += [res.stdout, res.stderr]
        assert (res.returncode, res.stdout) == (0, "again\n"), res.stderr
    assert ps.polls > 5 and not ps.hits, ps.hits
    assert not [t for t in texts if secret in t]
    assert not [r for r in caplog.records if secret in r.getMessage()]
    assert secret not in caplog.text
    assert secret not in emu.commands_log_path.read_text()
    assert not [entry for entry in emu.command_log() if secret in str(entry)]
    # state.json is the emulator's own configuration (it holds the password it asks for); nothing else may.
    assert not _files_mentioning(emu.state_dir, secret, skip={"state.json"})


@pytest.mark.ssh
def test_wrong_password_is_one_clear_error_naming_the_variable(emulated_jetson_factory, monkeypatch, caplog):
    secret = f"pw-{uuid.uuid4().hex}"
    wrong = f"wrong-{uuid.uuid4().hex}"
    emu = emulated_jetson_factory("orin_nano", sudo_password=secret)
    monkeypatch.setenv(ENV, wrong)
    caplog.set_level(logging.DEBUG)
    with connect(_cfg(emu, sudo_password_env=ENV)) as conn:
        with pytest.raises(DeviceError) as err:
            conn.run(["cat"], sudo=True, stdin="data\n", timeout=30)
        msg = str(err.value)
        assert ENV in msg and "device.sudo_password_env" in msg and "emu" in msg
        assert wrong not in msg and secret not in msg
        with pytest.raises(DeviceError, match=ENV):
            conn.stream_lines(["tegrastats"], sudo=True)
        # Commands without sudo are unaffected.
        assert conn.run(["true"], timeout=10).ok
    assert wrong not in caplog.text and secret not in caplog.text
    assert wrong not in emu.commands_log_path.read_text()


@pytest.mark.ssh
def test_passwordless_sudo_needs_no_password(orin_nano):
    with connect(_cfg(orin_nano)) as conn:
        assert "sudo -n --" in conn.command_line(["nvpmodel", "-q"], sudo=True)
        res = conn.run(["cat"], sudo=True, stdin="data\n", timeout=30)
        assert (res.returncode, res.stdout) == (0, "data\n")
        assert conn.run(["whoami"], sudo=True).stdout.strip() == "root"
