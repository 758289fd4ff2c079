"""LocalConnection.run ends the whole process tree of a command on a timeout or Ctrl-C, so a
timed-out llama-bench (or anything a wrapper started) cannot outlive its trial."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from jbench.device import local
from jbench.device.connection import CommandTimeout
from jbench.device.local import LocalConnection


def _tree(pids_file: Path, *, ignore_term: bool = False) -> list[str]:
    """bash leading a group with two background sleeps; writes the pids of all three."""
    trap = 'trap "" TERM; ' if ignore_term else ""
    script = f'{trap}sleep 60 & a=$!; sleep 60 & b=$!; echo "$$ $a $b" > {pids_file}; wait'
    return ["bash", "-c", script]


def _pids(pids_file: Path) -> list[int]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if pids_file.exists() and pids_file.read_text().strip():
            return [int(x) for x in pids_file.read_text().split()]
        time.sleep(0.05)
    raise AssertionError("the process tree did not start")


def _alive(pid: int) -> bool:
    """True while pid is a running (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _assert_all_gone(pids: list[int]) -> None:
    leader = pids[0]
    deadline = time.monotonic() + 5  # orphans are reaped by init shortly after they die
    while time.monotonic() < deadline and (_group_exists(leader) or any(_alive(p) for p in pids)):
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), f"survivors: {[p for p in pids if _alive(p)]}"
    assert not _group_exists(leader), "a process of the command's group survived"


def test_timeout_ends_the_whole_group(tmp_path):
    pids_file = tmp_path / "pids"
    started = time.monotonic()
    with pytest.raises(CommandTimeout, match="did not finish within 1 s"):
        LocalConnection().run(_tree(pids_file), timeout=1)
    pids = _pids(pids_file)
    assert pids[0] != os.getpgid(0)  # the command had a group of its own
    _assert_all_gone(pids)
    assert time.monotonic() - started < 1 + local.TERM_GRACE_S + 3


def test_processes_ignoring_sigterm_are_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "TERM_GRACE_S", 0.3)
    pids_file = tmp_path / "pids"
    with pytest.raises(CommandTimeout):
        LocalConnection().run(_tree(pids_file, ignore_term=True), timeout=0.5)
    _assert_all_gone(_pids(pids_file))


def test_ctrl_c_while_waiting_ends_the_group_and_propagates(tmp_path):
    pids_file = tmp_path / "pids"

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.7)
        with pytest.raises(KeyboardInterrupt):
            LocalConnection().run(_tree(pids_file), timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    _assert_all_gone(_pids(pids_file))


def test_normal_runs_are_unchanged(tmp_path):
    conn = LocalConnection()
    res = conn.run(["bash", "-c", "cat; echo err >&2; exit 3"], stdin="hello\n")
    assert (res.returncode, res.stdout, res.stderr) == (3, "hello\n", "err\n")
    res = conn.run(["pwd"], cwd=tmp_path, env={"JBENCH_X": "1"})
    assert res.returncode == 0 and res.stdout.strip() == str(tmp_path)
    assert conn.run(["bash", "-c", "echo $JBENCH_X"], env={"JBENCH_X": "7"}).stdout == "7\n"
    assert conn.run(["/nonexistent/tool"]).returncode == 127
