"""Farm leases through a real labgrid coordinator (`labgrid-coordinator` on loopback) over emulated Jetsons."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from jbench.farm import FarmBusy, lease, reap
from jbench.farm import places as P
from jbench.farm.coordinator import Coordinator, CoordinatorError
from jbench.farm.health import unquarantine

from .conftest import jbench_cli
from .labgrid_fixture import _free_port, coordinator, eventually  # noqa: F401  (coordinator: a fixture)

pytestmark = [pytest.mark.coordinator, pytest.mark.ssh]


def _device(emu, name: str) -> dict:
    cfg = emu.device_config(name=name)
    cfg["connect_timeout_s"] = 5.0
    return cfg


def _conf(tmp_path: Path, devices: dict) -> Path:
    """device/<name>.yaml entries for the places to map to (what a lab keeps in its config dir)."""
    conf = tmp_path / "conf"
    (conf / "device").mkdir(parents=True, exist_ok=True)
    for name, cfg in devices.items():
        (conf / "device" / f"{name}.yaml").write_text(yaml.safe_dump({"defaults": ["device_schema", "_self_"], **cfg}))
    return conf


def _add(address: str, place: str, device: str, **tags) -> None:
    with Coordinator(address) as c:
        c.add_place(place)
        c.set_tags(place, {**tags, P.DEVICE: device, P.HEALTH: P.HEALTHY})


def _place(address: str, name: str):
    with Coordinator(address) as c:
        return c.place(name)


def _reservations(address: str):
    with Coordinator(address) as c:
        return c.reservations()


def test_reserve_by_tags_waits_in_priority_order_and_releases(coordinator, orin_nano_super, agx_orin, tmp_path):
    conf = _conf(tmp_path, {"nano1": _device(orin_nano_super, "nano1"), "agx1": _device(agx_orin, "agx1")})
    _add(coordinator, "jetson-nano-1", "nano1", module="orin_nano", l4t="36.4.4", carrier="devkit", **{"class": "nano8"})
    _add(coordinator, "jetson-agx-1", "agx1", module="agx_orin", l4t="35.4.1", carrier="devkit", **{"class": "agx64"})

    with lease(coordinator, {"class": "nano8"}, sweep_id="first", config_dirs=[conf], heartbeat_s=0.5) as first:
        assert [d["name"] for d in first.devices] == ["nano1"]
        assert first.devices[0]["port"] == orin_nano_super.port
        held = _place(coordinator, "jetson-nano-1")
        assert held.acquired and held.tags[P.OWNER].endswith(f":{os.getpid()}:first")
        assert _place(coordinator, "jetson-agx-1").acquired is None  # another class is not touched

        messages = {"low": [], "high": []}
        got = {}
        release = {"low": threading.Event(), "high": threading.Event()}

        def waiter(key, prio):
            with lease(coordinator, {"class": "nano8"}, priority=prio, sweep_id=key, config_dirs=[conf],
                       heartbeat_s=0.5, on_wait=messages[key].append) as mine:
                got[key] = (mine.places[0], sorted(got))
                release[key].wait(60)

        low = threading.Thread(target=waiter, args=("low", 0.0))
        low.start()
        eventually(lambda: any("position 1 of 1" in m for m in messages["low"]), "the low-priority waiter sees position 1")
        high = threading.Thread(target=waiter, args=("high", 10.0))
        high.start()
        # The later, higher-priority reservation goes ahead of the earlier one; both see it, and the holder.
        eventually(lambda: any("position 1 of 2" in m for m in messages["high"]), "the high-priority waiter is first")
        eventually(lambda: any("position 2 of 2" in m for m in messages["low"]), "the low-priority waiter is second")
        assert any("jetson-nano-1 held by" in m and ":first" in m for m in messages["low"])
        assert not got
    # The first lease ended: the higher priority gets the place, then the other one.
    eventually(lambda: "high" in got, "the high-priority waiter gets the place")
    assert got["high"] == ("jetson-nano-1", [])
    assert "low" not in got
    release["high"].set()
    high.join(30)
    eventually(lambda: "low" in got, "the low-priority waiter gets the place next")
    release["low"].set()
    low.join(30)
    place = _place(coordinator, "jetson-nano-1")
    assert place.acquired is None and P.OWNER not in place.tags and P.HEARTBEAT not in place.tags
    assert _reservations(coordinator) == []


def test_release_on_exception(coordinator, orin_nano_super, tmp_path):
    conf = _conf(tmp_path, {"nano1": _device(orin_nano_super, "nano1")})
    _add(coordinator, "jetson-nano-1", "nano1", module="orin_nano", **{"class": "nano8"})
    with pytest.raises(RuntimeError, match="trial blew up"):
        with lease(coordinator, {"class": "nano8"}, config_dirs=[conf]) as held:
            assert _place(coordinator, "jetson-nano-1").acquired
            raise RuntimeError("trial blew up")
    assert held.places == []
    assert _place(coordinator, "jetson-nano-1").acquired is None
    assert _reservations(coordinator) == []


def test_timeout_names_the_holder(coordinator, orin_nano_super, tmp_path):
    conf = _conf(tmp_path, {"nano1": _device(orin_nano_super, "nano1")})
    _add(coordinator, "jetson-nano-1", "nano1", **{"class": "nano8"})
    with lease(coordinator, {"class": "nano8"}, sweep_id="holder", config_dirs=[conf], health_check=False):
        with pytest.raises(FarmBusy, match=r"class=nano8.*jetson-nano-1 held by .*:holder"):
            with lease(coordinator, {"class": "nano8"}, config_dirs=[conf], reserve_timeout_s=0, health_check=False):
                pass
    assert _reservations(coordinator) == []


def test_failed_health_check_quarantines_and_selection_moves_on(coordinator, orin_nano_super, agx_orin,
                                                                 emulated_jetson_factory, tmp_path):
    down = emulated_jetson_factory("orin_nano")
    conf = _conf(tmp_path, {"nano1": _device(orin_nano_super, "nano1"), "agx1": _device(agx_orin, "agx1"),
                            "down1": _device(down, "down1")})
    # "wrong": the place says AGX Orin, the device behind it is an Orin Nano; "down": sshd is gone.
    _add(coordinator, "good", "agx1", module="agx_orin", l4t="35.4.1", **{"class": "mix"})
    _add(coordinator, "wrong", "nano1", module="agx_orin", l4t="35.4.1", **{"class": "mix"})
    _add(coordinator, "down", "down1", module="orin_nano", **{"class": "mix"})
    down.block()
    with lease(coordinator, {"name": "good"}, config_dirs=[conf]):
        # While "good" is taken, the other two are tried, found unfit, quarantined, and the lease waits on.
        messages: list[str] = []
        result = {}

        def second():
            with lease(coordinator, {"class": "mix"}, config_dirs=[conf], heartbeat_s=0.5,
                       on_wait=messages.append) as mine:
                result["places"] = list(mine.places)
                result["quarantined"] = dict(mine.quarantined)

        t = threading.Thread(target=second)
        t.start()
        eventually(lambda: sum("quarantined" in m for m in messages) == 2, "both unfit places are quarantined")
    t.join(60)
    assert result["places"] == ["good"]
    assert set(result["quarantined"]) == {"wrong", "down"}
    wrong, gone = _place(coordinator, "wrong"), _place(coordinator, "down")
    assert wrong.tags[P.HEALTH] == "quarantined" and "module: the place says agx_orin" in wrong.tags[P.QUARANTINE]
    assert "Orin Nano" in wrong.tags[P.QUARANTINE]
    assert gone.tags[P.HEALTH] == "quarantined" and gone.tags[P.QUARANTINE].startswith("health check: unreachable")
    assert wrong.acquired is None and gone.acquired is None

    res = jbench_cli(["farm", "list", "--coordinator", coordinator])
    assert res.returncode == 0, res.stderr
    assert "quarantined" in res.stdout and "module: the place says agx_orin" in res.stdout

    # Quarantined places are not selected; unquarantine puts one back.
    with pytest.raises(FarmBusy):
        with lease(coordinator, {"name": "wrong"}, config_dirs=[conf], reserve_timeout_s=0, health_check=False):
            pass
    res = jbench_cli(["farm", "unquarantine", "wrong", "--coordinator", coordinator])
    assert res.returncode == 0, res.stderr
    assert P.QUARANTINE not in _place(coordinator, "wrong").tags
    with lease(coordinator, {"name": "wrong"}, config_dirs=[conf], health_check=False) as again:
        assert again.places == ["wrong"]


def _start_holder(coordinator: str, conf: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    exe = Path(sys.executable).with_name("jbench")
    proc = subprocess.Popen([str(exe), "farm", "reserve", "--coordinator", coordinator, "--config-dir", str(conf),
                             "--tag", "class=nano8", "--sweep-id", "nightly", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"})
    line = proc.stdout.readline()
    assert line.startswith("reserved jetson-nano-1: device nano1"), (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, line


@pytest.mark.e2e
def test_cli_holder_releases_on_sigint_and_list_status_show_it(coordinator, orin_nano_super, tmp_path):
    conf = _conf(tmp_path, {"nano1": _device(orin_nano_super, "nano1")})
    res = jbench_cli(["farm", "add", "jetson-nano-1", "--device", "nano1", "-t", "module=orin_nano", "-t", "sku=8gb",
                      "-t", "l4t=36.4.4", "-t", "carrier=devkit", "-t", "class=nano8", "--coordinator", coordinator])
    assert res.returncode == 0, res.stderr
    proc, _ = _start_holder(coordinator, conf)
    try:
        place = _place(coordinator, "jetson-nano-1")
        assert place.acquired and place.tags[P.OWNER].endswith(f":{proc.pid}:nightly")
        listed = jbench_cli(["farm", "list", "--coordinator", coordinator])
        assert listed.returncode == 0, listed.stderr
        row = next(l for l in listed.stdout.splitlines() if "jetson-nano-1" in l)
        for word in ("held", "nano1", "orin_nano", "8gb", "36.4.4", "devkit", "nano8", f"{proc.pid}:nightly"):
            assert word in row, (word, row)
        status = jbench_cli(["farm", "status"], env_extra={"LG_COORDINATOR": coordinator})
        assert status.returncode == 0, status.stderr
        assert "1 place(s): 1 held" in status.stdout and "acquired" in status.stdout and "class=nano8" in status.stdout
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    place = _place(coordinator, "jetson-nano-1")
    assert place.acquired is None and P.OWNER not in place.tags
    assert _reservations(coordinator) == []


@pytest.mark.e2e
def test_sigkilled_holder_is_freed_by_the_stale_policy_not_before(coordinator, orin_nano_super, tmp_path):
    conf = _conf(tmp_path, {"nano1": _device(orin_nano_super, "nano1")})
    _add(coordinator, "jetson-nano-1", "nano1", module="orin_nano", **{"class": "nano8"})
    proc, _ = _start_holder(coordinator, conf, "--heartbeat-s", "0.5")
    try:
        first = _place(coordinator, "jetson-nano-1").tags[P.HEARTBEAT]
        eventually(lambda: _place(coordinator, "jetson-nano-1").tags[P.HEARTBEAT] != first, "the holder heart-beats")
        with Coordinator(coordinator) as c:
            assert reap(c, 2.0) == []  # a live holder keeps its place
    finally:
        proc.kill()
        proc.wait()
    # Dead: its heartbeat stops, but the place stays held until the heartbeat is stale_after_s old.
    with Coordinator(coordinator) as c:
        assert reap(c, 3600.0) == []
        assert c.place("jetson-nano-1").acquired
    messages: list[str] = []
    with lease(coordinator, {"class": "nano8"}, config_dirs=[conf], stale_after_s=2.0, heartbeat_s=0.5,
               sweep_id="next-night", on_wait=messages.append) as mine:
        assert mine.places == ["jetson-nano-1"]
        assert _place(coordinator, "jetson-nano-1").tags[P.OWNER].endswith(":next-night")
    assert any(f":{proc.pid}:nightly" in m for m in messages)  # it waited, naming the dead holder


def test_bad_input_is_one_message_exit_2(coordinator):
    res = jbench_cli(["farm", "reserve", "--coordinator", coordinator, "--tag", "classnano"])
    assert res.returncode == 2 and "is not key=value" in res.stderr and "Traceback" not in res.stderr
    res = jbench_cli(["farm", "quarantine", "nope", "--reason", "x", "--coordinator", coordinator])
    assert res.returncode == 2 and "no place 'nope'" in res.stderr and "Traceback" not in res.stderr


def test_a_class_sweep_the_farm_cannot_serve_is_one_message_exit_2(coordinator, orin_nano_super, tmp_path):
    """No coordinator at the address, or every place of the class held past farm.reserve_timeout_s: one `error:`
    line naming the fix or the holder, exit 2, nothing run on the device (its power tools untouched)."""
    conf = _conf(tmp_path, {"nano1": {**_device(orin_nano_super, "nano1"), "device_class": "nano8"}})
    _add(coordinator, "jetson-nano-1", "nano1", **{"class": "nano8"})
    common = ["sweep", "--config-dir", str(conf), "device=@nano8", "telemetry.source=none", "power.mode=15W"]
    env = {"JBENCH_RESULTS_DIR": str(tmp_path / "r")}
    res = jbench_cli([*common, f"farm.coordinator=127.0.0.1:{_free_port()}"], env_extra=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no labgrid coordinator answers" in res.stderr and "Traceback" not in res.stderr
    with lease(coordinator, {"class": "nano8"}, sweep_id="holder", config_dirs=[conf], health_check=False):
        res = jbench_cli([*common, f"farm.coordinator={coordinator}", "farm.reserve_timeout_s=0"], env_extra=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "jetson-nano-1 held by" in res.stderr and "Traceback" not in res.stderr
    assert not [c for c in orin_nano_super.command_log() if c["tool"] in ("nvpmodel", "jetson_clocks")]
    assert not (tmp_path / "r" / "mlflow.db").exists()
