"""The on-device lease: one controller per device, a holder named, stale leases taken over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from jbench.core.schema import DeviceConfig, DevicePaths
from jbench.device.connection import DeviceError
from jbench.device.lease import DeviceLease, LeaseBusy
from jbench.device.local import LocalConnection


def _device(tmp_path) -> dict:
    return {"name": "board", "paths": {"state_dir": str(tmp_path / "state")}}


def test_second_controller_is_refused_naming_the_holder_then_gets_it_after_release(tmp_path):
    conn = LocalConnection("board")
    first = DeviceLease(conn, _device(tmp_path), "sweep-a")
    first.acquire()
    try:
        second = DeviceLease(conn, _device(tmp_path), "sweep-b")
        with pytest.raises(LeaseBusy, match=r"in use by another jbench controller: .*pid %d \(sweep sweep-a" % os.getpid()):
            second.acquire(0)
        with pytest.raises(LeaseBusy, match="device.lease_wait_s"):
            second.acquire(0)
    finally:
        first.release()
    assert not (tmp_path / "state" / "lease-board.json").exists()
    second.acquire(0)
    second.release()


@pytest.mark.slow  # the waiting controller looks again every 5 s
def test_a_waiting_controller_gets_the_device_when_the_holder_releases(tmp_path):
    conn = LocalConnection("board")
    first = DeviceLease(conn, _device(tmp_path), "sweep-a")
    first.acquire()
    messages: list[str] = []
    threading.Timer(1.0, first.release).start()
    second = DeviceLease(conn, _device(tmp_path), "sweep-b")
    second.acquire(30, on_wait=messages.append)
    assert second.held and messages and "in use by" in messages[0] and "sweep sweep-a" in messages[0]
    owner = json.loads((tmp_path / "state" / "lease-board.json").read_text())
    assert owner["sweep_id"] == "sweep-b"
    second.release()


def test_a_lease_of_a_dead_controller_on_this_host_is_taken_over_at_once(tmp_path):
    # A controller that was SIGKILLed: its pid is gone.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    lease_file = tmp_path / "state" / "lease-board.json"
    lease_file.parent.mkdir(parents=True)
    import socket

    lease_file.write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "sweep_id": "dead", "token": "x"}))
    lease = DeviceLease(LocalConnection("board"), _device(tmp_path), "sweep-new")
    lease.acquire(0)
    assert json.loads(lease_file.read_text())["sweep_id"] == "sweep-new"
    lease.release()


def test_a_lease_from_another_host_counts_until_its_heartbeat_is_stale(tmp_path):
    lease_file = tmp_path / "state" / "lease-board.json"
    lease_file.parent.mkdir(parents=True)
    lease_file.write_text(json.dumps({"host": "ci-runner-7", "pid": 4242, "sweep_id": "far", "token": "x"}))
    conn = LocalConnection("board")
    with pytest.raises(LeaseBusy, match="ci-runner-7 pid 4242"):
        DeviceLease(conn, _device(tmp_path), "near", stale_s=60).acquire(0)
    old = time.time() - 120  # its controller stopped beating two minutes ago (the device's clock)
    os.utime(lease_file, (old, old))
    lease = DeviceLease(conn, _device(tmp_path), "near", stale_s=60)
    lease.acquire(0)
    assert json.loads(lease_file.read_text())["sweep_id"] == "near"
    lease.release()


def test_a_device_config_gives_the_lease_its_place_and_its_stale_time(tmp_path):
    # The typed device entry, as `jbench devices restore` passes it: lease_stale_s and paths.state_dir are read there.
    device = DeviceConfig(name="board", paths=DevicePaths(state_dir=str(tmp_path / "state")), lease_stale_s=60)
    lease_file = tmp_path / "state" / "lease-board.json"
    lease_file.parent.mkdir(parents=True)
    lease_file.write_text(json.dumps({"host": "ci-runner-7", "pid": 4242, "sweep_id": "far", "token": "x"}))
    old = time.time() - 90  # stale after the device's 60 s, live under the schema's default of 120 s
    os.utime(lease_file, (old, old))
    with pytest.raises(LeaseBusy, match="ci-runner-7"):
        DeviceLease(LocalConnection("board"), _device(tmp_path), "near").acquire(0)
    lease = DeviceLease(LocalConnection("board"), device, "near")
    lease.acquire(0)
    assert json.loads(lease_file.read_text())["sweep_id"] == "near"
    lease.release()


def test_the_holder_keeps_its_lease_fresh(tmp_path, monkeypatch):
    import jbench.device.lease as lease_mod

    monkeypatch.setattr(lease_mod, "HEARTBEAT_S", 0.2)
    lease = DeviceLease(LocalConnection("board"), _device(tmp_path), "sweep-a")
    lease.acquire()
    lease_file = tmp_path / "state" / "lease-board.json"
    old = time.time() - 500
    os.utime(lease_file, (old, old))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and time.time() - lease_file.stat().st_mtime > 100:
        time.sleep(0.1)
    assert time.time() - lease_file.stat().st_mtime < 100, "the heartbeat never touched the lease"
    lease.release()


def test_only_one_of_many_racing_controllers_gets_the_device(tmp_path):
    conn = LocalConnection("board")
    leases = [DeviceLease(conn, _device(tmp_path), f"sweep-{i}") for i in range(6)]
    won: list[str] = []

    def take(lease: DeviceLease) -> None:
        try:
            lease.acquire(0)
            won.append(lease.sweep_id)
        except LeaseBusy:
            pass

    threads = [threading.Thread(target=take, args=(lease,)) for lease in leases]
    # Same process: mark every racer live so none counts as "left by an earlier sweep of this process".
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    holder = json.loads((tmp_path / "state" / "lease-board.json").read_text())["sweep_id"]
    assert holder in won
    for lease in leases:
        lease.release()


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


@pytest.mark.slow
@pytest.mark.parametrize("stale_by", ["heartbeat", "dead_pid"])
def test_many_racing_takers_of_a_stale_lease_leave_exactly_one_holder_every_round(tmp_path, stale_by):
    # Each round: a stale lease (another host's, heartbeat long gone; or a dead controller's on this host), then
    # several controllers that all read it as stale at the same moment and take it over. A take-over that moves
    # whatever file is there (`mv`) can move the fresh lease another taker just wrote: two holders.
    import socket

    conn = LocalConnection("board")
    lease_file = tmp_path / "state" / "lease-board.json"
    lease_file.parent.mkdir(parents=True)
    takers, rounds = 6, 25
    for rnd in range(rounds):
        if stale_by == "heartbeat":
            lease_file.write_text(json.dumps({"host": "ci-runner-7", "pid": 4242, "sweep_id": f"old-{rnd}", "token": f"t{rnd}"}))
            old = time.time() - 600
            os.utime(lease_file, (old, old))
        else:
            lease_file.write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "sweep_id": f"old-{rnd}",
                                              "token": f"t{rnd}"}))
        leases = [DeviceLease(conn, _device(tmp_path), f"r{rnd}-{i}", stale_s=60) for i in range(takers)]
        start = threading.Barrier(takers)
        won: list[DeviceLease] = []
        busy: list[str] = []

        def take(lease: DeviceLease) -> None:
            start.wait()
            try:
                lease.acquire(0)
                won.append(lease)
            except LeaseBusy as exc:
                busy.append(str(exc))

        threads = [threading.Thread(target=take, args=(lease,)) for lease in leases]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        try:
            assert len(won) == 1, f"round {rnd}: {len(won)} controllers hold the device: {[w.sweep_id for w in won]}"
            assert len(busy) == takers - 1 and all(f"(sweep {won[0].sweep_id}," in m for m in busy), busy
            owner = json.loads(lease_file.read_text())
            assert owner["token"] == won[0].owner["token"], f"round {rnd}: the lease file is not the winner's"
        finally:
            for lease in won:
                lease.release()
        assert not lease_file.exists()
        assert not [p.name for p in lease_file.parent.iterdir() if p.name.startswith("lease-board.json.stale")]


def test_a_take_over_removes_only_the_very_lease_it_judged_stale(tmp_path):
    conn = LocalConnection("board")
    lease_file = tmp_path / "state" / "lease-board.json"
    lease_file.parent.mkdir(parents=True)
    lease_file.write_text(json.dumps({"host": "ci-runner-7", "pid": 4242, "sweep_id": "old", "token": "t-old"}))
    old = time.time() - 600
    os.utime(lease_file, (old, old))
    taker = DeviceLease(conn, _device(tmp_path), "late", stale_s=60)
    stale = taker.holder()
    assert taker.is_stale(stale)[0]
    # Its holder was only slow: it beat after we read the lease. Still its lease.
    os.utime(lease_file)
    assert taker._take_over(stale, "test") is False
    assert json.loads(lease_file.read_text())["token"] == "t-old"
    # Another taker was first: the file is now a fresh lease (old again, to isolate the content check).
    lease_file.write_text(json.dumps({"host": "ci-runner-8", "pid": 1, "sweep_id": "first", "token": "t-first"}))
    os.utime(lease_file, (old, old))
    assert taker._take_over(stale, "test") is False
    assert json.loads(lease_file.read_text())["token"] == "t-first"
    # The very file it read, still stale: removed.
    fresh = taker.holder()
    assert taker._take_over(fresh, "test") is True
    assert not lease_file.exists()


def test_a_stale_lease_that_cannot_be_taken_over_is_an_error_not_an_endless_loop(tmp_path, monkeypatch):
    conn = LocalConnection("board")
    lease_file = tmp_path / "state" / "lease-board.json"
    lease_file.parent.mkdir(parents=True)
    lease_file.write_text(json.dumps({"host": "ci-runner-7", "pid": 4242, "sweep_id": "old", "token": "t-old"}))
    old = time.time() - 600
    os.utime(lease_file, (old, old))
    taker = DeviceLease(conn, _device(tmp_path), "late", stale_s=60)
    tries = []
    monkeypatch.setattr(taker, "_take_over", lambda holder, why: tries.append(holder.text) or False)
    with pytest.raises(DeviceError, match="could not be taken over; remove it by hand"):
        taker.acquire(0)
    assert len(tries) == 2 and lease_file.exists() and not taker.held
