"""Devices over real SSH: emulated Jetsons (real OpenSSH sshd on loopback, fake L4T tools)."""

from __future__ import annotations

import json
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
from mlflow.tracking import MlflowClient

from jbench.backends.base import command_failure, looks_oom
from jbench.core.schema import DeviceConfig, ProfileConfig, typed
from jbench.device.connection import CommandTimeout, DeviceError

from jbench.device.connect import connect
from jbench.device.doctor import doctor
from jbench.device.jetson import jetson_fingerprint, parse_clocks_show
from jbench.device.power import PowerStateError, PowerStrategy
from jbench.device.ssh import HostKeyError

from .conftest import jbench_cli


def _alive(pid: int) -> bool:
    """Whether pid is a live process (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def device_cfg(emu, **extra) -> dict:
    cfg = emu.device_config(name="emu")
    cfg["paths"]["boot_id"] = str(emu.boot_id_path)
    cfg["connect_timeout_s"] = 5.0
    cfg.update(extra)
    return cfg


def write_conf(tmp_path: Path, emu, **extra) -> Path:
    conf = tmp_path / "conf"
    (conf / "device").mkdir(parents=True, exist_ok=True)
    body = {"defaults": ["device_schema", "_self_"], **device_cfg(emu, **extra)}
    (conf / "device" / "emu.yaml").write_text(yaml.safe_dump(body))
    return conf


# -- connection ----------------------------------------------------------------------------------


@pytest.mark.ssh
def test_commands_are_argument_lists_and_config_values_cannot_inject(orin_nano, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    with connect(device_cfg(orin_nano)) as conn:
        hostile = f"a; rm -rf {victim}; touch {tmp_path}/pwned $(touch {tmp_path}/pwned2)"
        res = conn.run(["ls", hostile], timeout=10)
        assert res.returncode != 0
        res = conn.run(["printf", "%s", hostile], timeout=10)
        assert res.stdout == hostile  # one argument, byte for byte
        assert conn.exists(hostile) is False
    assert victim.exists() and not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()


@pytest.mark.ssh
def test_unknown_host_key_is_refused_with_fingerprint_and_opt_in(orin_nano, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(HostKeyError) as err:
        connect(device_cfg(orin_nano, known_hosts=str(empty)))
    assert orin_nano.host_key_fingerprint in str(err.value)
    assert "device.accept_new_host_key=true" in str(err.value)
    # The explicit opt-in records the key; afterwards the normal verification passes.
    with connect(device_cfg(orin_nano, known_hosts=str(empty), accept_new_host_key=True)) as conn:
        assert conn.run(["true"]).ok
    assert orin_nano.host_public_key.split()[1] in empty.read_text()
    with connect(device_cfg(orin_nano, known_hosts=str(empty))) as conn:
        assert conn.run(["true"]).ok


@pytest.mark.ssh
def test_wrong_host_key_is_refused(orin_nano, agx_orin, tmp_path):
    # agx_orin's key recorded for orin_nano's address: a changed key must never be accepted.
    known = tmp_path / "known_hosts"
    known.write_text(agx_orin.host_key_line.replace(f"[{agx_orin.host}]:{agx_orin.port}", f"[{orin_nano.host}]:{orin_nano.port}") + "\n")
    with pytest.raises(HostKeyError) as err:
        connect(device_cfg(orin_nano, known_hosts=str(known), accept_new_host_key=True))
    msg = str(err.value)
    assert "CHANGED" in msg and agx_orin.host_key_fingerprint in msg and orin_nano.host_key_fingerprint in msg
    assert f"ssh-keygen -R '[{orin_nano.host}]:{orin_nano.port}' -f {known}" in msg


@pytest.mark.ssh
def test_accepted_new_key_is_recorded_in_the_users_known_hosts_and_a_changed_key_refused(
        orin_nano, agx_orin, tmp_path, monkeypatch):
    # No known_hosts in the device entry: the user's ~/.ssh/known_hosts, as `ssh` uses it.
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = device_cfg(orin_nano, accept_new_host_key=True)
    cfg["known_hosts"] = None
    with connect(cfg) as conn:
        assert conn.run(["true"]).ok
    recorded = (tmp_path / ".ssh" / "known_hosts").read_text()
    assert f"[{orin_nano.host}]:{orin_nano.port}" in recorded and orin_nano.host_key_line.split()[-1] in recorded
    # The same address now answers with another key (agx_orin's): refused, even with accept_new_host_key.
    impostor = device_cfg(agx_orin, accept_new_host_key=True)
    impostor["known_hosts"] = None
    (tmp_path / ".ssh" / "known_hosts").write_text(
        recorded.replace(f"[{orin_nano.host}]:{orin_nano.port}", f"[{agx_orin.host}]:{agx_orin.port}"))
    with pytest.raises(HostKeyError, match="CHANGED"):
        connect(impostor)


def test_unreachable_host_fails_within_the_connect_timeout(tmp_path):
    # A TCP listener that never speaks SSH: the banner wait is bounded by the connect timeout.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    port = silent.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(DeviceError) as err:
        connect({"name": "dead", "kind": "ssh", "host": "127.0.0.1", "port": port, "connect_timeout_s": 1.5,
                 "known_hosts": str(tmp_path / "kh")})
    assert time.monotonic() - started < 10
    assert "dead" in str(err.value)
    silent.close()
    with pytest.raises(DeviceError, match="cannot connect"):
        connect({"name": "closed", "kind": "ssh", "host": "127.0.0.1", "port": port, "connect_timeout_s": 1.5,
                 "known_hosts": str(tmp_path / "kh")})


@pytest.mark.ssh
def test_timeout_ends_the_remote_process(orin_nano, tmp_path):
    pidfile = tmp_path / "sleeper.pid"
    with connect(device_cfg(orin_nano)) as conn:
        with pytest.raises(CommandTimeout, match="did not finish within 1 s"):
            conn.run(["sh", "-c", f"echo $$ > {pidfile}; exec sleep 30"], timeout=1)
        pid = int(pidfile.read_text())
        # The device's `timeout` has sent TERM by the time run() returns; the process is gone once reaped.
        assert _wait_for(lambda: not _alive(pid), timeout=10), f"pid {pid} still runs after the timeout"


@pytest.mark.ssh
def test_a_sigkill_before_the_time_limit_is_a_failed_command_not_a_timeout(orin_nano):
    # The kernel's OOM killer sends SIGKILL: the command exits 137 long before its limit. `timeout -s KILL` (and
    # --kill-after) exits 137 as well, so only the time it took tells the two apart.
    with connect(device_cfg(orin_nano)) as conn:
        res = conn.run(["sh", "-c", "echo loading >&2; kill -KILL $$"], timeout=600)
        assert res.returncode == 137 and "loading" in res.stderr
        # The notice a shell prints for a job killed by SIGKILL, which the shared OOM rule reads.
        assert looks_oom(res.stderr, res.returncode)
        err = command_failure("llama-bench", res)
        assert err.category == "out_of_memory", str(err)
        # A real time limit stays a timeout: TERM ignored, so the device's `timeout` kills (137) after the grace.
        with pytest.raises(CommandTimeout, match="did not finish within 1 s"):
            conn.run(["sh", "-c", "trap '' TERM; sleep 30"], timeout=1)
        # ... and one that ends on TERM (124) too.
        with pytest.raises(CommandTimeout, match="did not finish within 1 s"):
            conn.run(["sleep", "30"], timeout=1)
        # Another signal is a crash, not an out-of-memory kill.
        seg = conn.run(["sh", "-c", "kill -SEGV $$"], timeout=600)
        assert seg.returncode == 139 and command_failure("x", seg).category == "backend_crash"


# -- power state -----------------------------------------------------------------------------------


@pytest.mark.ssh
def test_mode_switch_clock_lock_verify_and_restore(orin_nano_super):
    emu = orin_nano_super
    with connect(device_cfg(emu)) as conn:
        power = PowerStrategy(conn, device_cfg(emu))
        assert set(power.modes()) == {"15W", "25W", "MAXN_SUPER", "7W"}  # from the device's own nvpmodel.conf
        original = power.save_original()
        assert (original.mode, original.clocks_locked) == ("25W", False)
        changes = power.apply("MAXN_SUPER", True)
        assert changes == ["mode 25W -> MAXN_SUPER", "jetson_clocks off -> on"]
        assert emu.nvpmodel_mode_name == "MAXN_SUPER" and emu.clocks_locked
        assert power.apply("MAXN_SUPER", True) == []  # already there: nothing to do
        assert power.apply("MAXN_SUPER", False) == ["jetson_clocks on -> off"]
        with pytest.raises(PowerStateError, match=r"no power mode 'MAXN'. Its modes: 15W \(0\), 25W \(1\), MAXN_SUPER \(2\), 7W \(3\)"):
            power.apply("MAXN", None)
        power.apply("15W", True)
        assert power.restore() is True
        assert emu.nvpmodel_mode_name == "25W" and not emu.clocks_locked
        assert power._read_state_file() is None


@pytest.mark.ssh
def test_the_same_power_sequence_twice_in_a_row(orin_nano_super):
    # jetson_clocks --store refuses an existing file (asks Y/N, exit 1 without an answer): the second sweep
    # on a device must not meet the first one's store files, and none may be left behind.
    emu = orin_nano_super
    store_dir = Path(emu.home) / ".cache" / "jbench"
    with connect(device_cfg(emu)) as conn:
        probe = f"{emu.home}/x.store"
        assert conn.run(["touch", probe]).ok
        refused = conn.run(["jetson_clocks", "--store", probe], sudo=True)
        assert refused.returncode == 1 and "already exists. Can I overwrite it? Y/N:" in refused.stdout
        assert f"Error: file {probe} already exists!" in refused.stdout
        for _ in range(2):
            power = PowerStrategy(conn, device_cfg(emu))
            power.save_original()
            assert power.apply("MAXN_SUPER", True) == ["mode 25W -> MAXN_SUPER", "jetson_clocks off -> on"]
            power.apply("MAXN_SUPER", False)
            power.apply("15W", True)  # a second lock in the same sweep stores the unlocked clocks again
            assert power.restore() is True
            assert emu.nvpmodel_mode_name == "25W" and not emu.clocks_locked
            assert not list(store_dir.glob("jetson_clocks-*")), list(store_dir.iterdir())


@pytest.mark.ssh
def test_reboot_mode_refused_without_opt_in_and_done_with_it(orin_nano_super):
    emu = orin_nano_super
    with connect(device_cfg(emu)) as conn:
        power = PowerStrategy(conn, device_cfg(emu))
        with pytest.raises(PowerStateError, match="needs a reboot .* power.allow_reboot=true"):
            power.apply("7W", None)
        assert emu.nvpmodel_mode_name == "25W"
        boots = emu.boot_count
        power.apply("7W", None, allow_reboot=True, reboot_timeout_s=60)
        assert emu.boot_count == boots + 1 and emu.nvpmodel_mode_name == "7W"
        assert power.current().mode == "7W"


@pytest.mark.ssh
def test_sudo_password_from_environment_never_logged(orin_nano, tmp_path, monkeypatch):
    emu = orin_nano
    emu.set_sudo_password("s3cret-Pw!")
    with connect(device_cfg(emu)) as conn:
        with pytest.raises(PowerStateError) as err:
            PowerStrategy(conn, device_cfg(emu)).check_sudo()
        assert "NOPASSWD: /usr/sbin/nvpmodel, /usr/bin/jetson_clocks, /usr/bin/tegrastats, /usr/sbin/reboot" in str(err.value)
    monkeypatch.setenv("EMU_SUDO_PW", "s3cret-Pw!")
    cfg = device_cfg(emu, sudo_password_env="EMU_SUDO_PW")
    with connect(cfg) as conn:
        power = PowerStrategy(conn, cfg)
        power.check_sudo()
        assert "s3cret" not in conn.command_line(["nvpmodel", "-q"], sudo=True)
        assert power.apply(None, True) == ["jetson_clocks off -> on"]


# -- fingerprint, doctor, devices check -------------------------------------------------------------


@pytest.mark.ssh
@pytest.mark.parametrize("module, l4t, model_word", [("orin_nano", "36.3.0", "Orin Nano"), ("agx_orin", "35.4.1", "AGX Orin")])
def test_fingerprint_and_doctor_on_two_modules(emulated_jetson_factory, module, l4t, model_word):
    emu = emulated_jetson_factory(module)
    cfg = device_cfg(emu)
    with connect(cfg) as conn:
        tags = jetson_fingerprint(conn, cfg["paths"])
        assert model_word in tags["jetson.module"] and tags["jetson.l4t"] == l4t
        assert tags["jetson.jetpack"] and tags["jetson.power_mode"].startswith(emu.nvpmodel_mode_name)
        from jbench.config import load_profile

        device = typed(DeviceConfig, cfg)
        checks = {c.item: c for c in doctor(conn, device, typed(ProfileConfig, load_profile(device.profile)))}
    assert checks["module"].status == "pass" and model_word in checks["module"].detail
    assert f"L4T {l4t}" in checks["L4T / JetPack"].detail
    assert checks["jetson_clocks"].status == "warn" and "sudo jetson_clocks" in checks["jetson_clocks"].fix
    assert checks["power mode"].detail.startswith(emu.nvpmodel_mode_name)
    for item in ("RAM", "free disk", "swap/zram", "desktop GUI", "temperatures"):
        assert item in checks


@pytest.mark.ssh
@pytest.mark.e2e
def test_devices_and_doctor_commands(orin_nano, tmp_path):
    conf = write_conf(tmp_path, orin_nano)
    res = jbench_cli(["devices", "list", "--config-dir", str(conf)])
    assert res.returncode == 0 and "emu" in res.stdout and "orin_nano_8gb" in res.stdout
    res = jbench_cli(["devices", "check", "emu", "--config-dir", str(conf)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "tool tegrastats" in res.stdout and "sudo rights" in res.stdout
    res = jbench_cli(["doctor", "emu", "--config-dir", str(conf)])
    assert res.returncode in (0, 1) and "L4T 36.3.0" in res.stdout and "Traceback" not in res.stderr


# -- sweeps over SSH ----------------------------------------------------------------------------------


def _trials(uri, experiment):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    return client, sorted((r for r in runs if r.data.tags.get("jbench.kind") == "trial"),
                          key=lambda r: int(r.data.tags["jbench.trial_index"]))


@pytest.mark.ssh
@pytest.mark.e2e
def test_quant_ladder_over_ssh_with_power_state_and_telemetry(orin_nano_super, tmp_path, llama_build, bundled_model):
    emu = orin_nano_super
    conf = write_conf(tmp_path, emu)
    res = jbench_cli(["sweep", "--config-dir", str(conf), "+experiment=quant_ladder", "device=emu",
                      "model.quant=Q4_0,Q8_0", f"backend.binary_dir={llama_build['bin_dir']}",
                      "backend.n_prompt=16", "backend.n_gen=4", "backend.repetitions=2",
                      "power.mode=MAXN_SUPER,25W", "power.jetson_clocks=true",
                      # 50 ms: the model loads in under half a second here, and its window needs energy.min_samples.
                      "telemetry.source=tegrastats", "telemetry.interval_ms=50", "telemetry.idle_s=1",
                      "telemetry.cooldown_s=0", "energy.min_window_s=1",
                      # 4-token repetitions against second-long energy passes: their speeds differ more than the
                      # speed-match rule allows (tests/test_energy_speed_match.py); opened here for the energy checks.
                      "energy.speed_tolerance=10",
                      # quality over SSH (its device cache, reuse across power modes): tests/test_quality.py
                      "quality.enabled=false"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 0, res.stdout + res.stderr
    client, trials = _trials(f"sqlite:///{tmp_path}/r/mlflow.db", "quant_ladder")
    # Ordered by power state, then model: both quants in MAXN_SUPER, then both in 25W.
    assert [(t.data.params["power.mode"], t.data.params["model.quant"]) for t in trials] == [
        ("MAXN_SUPER", "Q4_0"), ("MAXN_SUPER", "Q8_0"), ("25W", "Q4_0"), ("25W", "Q8_0")]
    for t in trials:
        tags, m = t.data.tags, t.data.metrics
        mode = t.data.params["power.mode"]
        assert t.data.params["device.name"] == "emu" and tags["jetson.l4t"] == "36.4.4" and "Orin Nano" in tags["jetson.module"]
        assert tags["power.mode_actual"] == mode and tags["power.jetson_clocks_actual"] == "True"
        # The fingerprint is the trial's own, not the sweep's start: the mode this trial ran in.
        assert tags["jetson.power_mode"].startswith(mode + " ") and tags["jetson.boot_id"]
        assert m["decode_tps"] > 0 and tags["telemetry.source"] == "tegrastats"
        assert tags["energy.status"] == "ok", tags["energy.status"]
        assert m["decode_energy_j"] > 0 and m["decode_avg_power_w"] > 0 and m["idle_power_w"] > 0
    assert trials[0].data.tags["power.changes"] == "mode 25W -> MAXN_SUPER; jetson_clocks off -> on"
    assert trials[1].data.tags["power.changes"] == "none"
    # Restored at the end of the sweep.
    assert emu.nvpmodel_mode_name == "25W" and not emu.clocks_locked


@pytest.mark.ssh
@pytest.mark.e2e
def test_failed_trial_and_exception_still_restore(orin_nano_super, tmp_path, bundled_model):
    emu = orin_nano_super
    conf = write_conf(tmp_path, emu)
    fake = Path(__file__).parent / "fixtures" / "unparseable_llamacpp"
    res = jbench_cli(["run", "--config-dir", str(conf), "device=emu", f"backend.binary_dir={fake}",
                      "power.mode=15W", "power.jetson_clocks=true", "telemetry.source=none",
                      "backend.n_gen=4", "backend.n_prompt=8"], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 4
    _, trials = _trials(f"sqlite:///{tmp_path}/r/mlflow.db", "adhoc")
    assert trials[0].data.tags["jbench.failure_category"] == "unparseable_output"
    assert emu.nvpmodel_mode_name == "25W" and not emu.clocks_locked


@pytest.mark.ssh
@pytest.mark.e2e
def test_unknown_mode_is_an_error_before_any_trial(orin_nano, tmp_path):
    conf = write_conf(tmp_path, orin_nano)
    res = jbench_cli(["sweep", "--config-dir", str(conf), "device=emu", "power.mode=MAXN_TURBO"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 2
    assert "no power mode 'MAXN_TURBO'. Its modes: 15W (0), 7W (1)" in res.stderr
    assert not (tmp_path / "r" / "mlflow.db").exists()


def _start_sweep(conf, tmp_path, llama_build, emu):
    env = dict(os.environ, JBENCH_RESULTS_DIR=str(tmp_path / "r"), COLUMNS="200")
    argv = [str(Path(sys.executable).with_name("jbench")), "sweep", "--config-dir", str(conf), "device=emu",
            f"backend.binary_dir={llama_build['bin_dir']}", "model.quant=Q4_0", "backend.n_prompt=512",
            "backend.n_gen=256", "backend.repetitions=50", "power.mode=MAXN_SUPER", "power.jetson_clocks=true",
            "telemetry.source=none"]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.ssh
@pytest.mark.e2e
def test_sigint_to_the_controller_restores_the_device(orin_nano_super, tmp_path, llama_build, bundled_model):
    emu = orin_nano_super
    proc = _start_sweep(write_conf(tmp_path, emu), tmp_path, llama_build, emu)
    try:
        assert _wait_for(lambda: emu.nvpmodel_mode_name == "MAXN_SUPER" and emu.clocks_locked), "power state never applied"
        # Interrupt while the trial's llama-bench runs on the device (its process list shows it).
        assert _wait_for(lambda: proc.poll() is not None or bool(emu.device_processes(["llama-bench"])), timeout=120)
        assert proc.poll() is None, "the sweep ended before its llama-bench ran: " + "".join(proc.communicate())
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert emu.nvpmodel_mode_name == "25W" and not emu.clocks_locked
    _, trials = _trials(f"sqlite:///{tmp_path}/r/mlflow.db", "adhoc")
    assert trials[0].info.status == "KILLED"
    # ...and the interrupted llama-bench did not outlive the controller on the device.
    assert _wait_for(lambda: not emu.device_processes(["llama-bench"]), timeout=20), emu.device_processes()


@pytest.mark.ssh
@pytest.mark.e2e
def test_leftover_state_file_is_restored_at_the_next_start(orin_nano_super, tmp_path, llama_build, bundled_model):
    emu = orin_nano_super
    conf = write_conf(tmp_path, emu)
    proc = _start_sweep(conf, tmp_path, llama_build, emu)
    try:
        assert _wait_for(lambda: emu.nvpmodel_mode_name == "MAXN_SUPER" and emu.clocks_locked)
        proc.kill()  # the controller dies without any chance to restore
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert emu.nvpmodel_mode_name == "MAXN_SUPER"
    state_files = list(Path(emu.home).glob(".cache/jbench/power-state-*.json"))
    assert state_files, "the state file should be left behind"
    # The next jbench start on that device restores it first (this run sets no power state itself).
    res = jbench_cli(["run", "--config-dir", str(conf), "device=emu", f"backend.binary_dir={llama_build['bin_dir']}",
                      "model.quant=Q4_0", "backend.n_prompt=8", "backend.n_gen=2", "backend.repetitions=1",
                      "telemetry.source=none"], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r2")})
    assert res.returncode == 0, res.stdout + res.stderr
    assert emu.nvpmodel_mode_name == "25W" and not emu.clocks_locked
    assert not list(Path(emu.home).glob(".cache/jbench/power-state-*.json"))


@pytest.mark.ssh
@pytest.mark.e2e
def test_connection_dropped_mid_trial_is_retried_then_failed_and_the_sweep_goes_on(orin_nano, tmp_path, llama_build, bundled_model):
    emu = orin_nano
    conf = write_conf(tmp_path, emu)
    common = ["sweep", "--config-dir", str(conf), "device=emu", f"backend.binary_dir={llama_build['bin_dir']}",
              "backend.n_prompt=64", "backend.n_gen=32", "backend.repetitions=3", "telemetry.source=none",
              "thermal.start_below_c=null"]
    # Retries off: the dropped trial is FAILED with the reason; the next trial still runs.
    emu.die_after(0.5, match=["llama-bench"])
    res = jbench_cli([*common, "model.quant=Q4_0,Q8_0", "sweep.connection_retries=0"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 4, res.stdout + res.stderr
    _, trials = _trials(f"sqlite:///{tmp_path}/r/mlflow.db", "adhoc")
    assert trials[0].info.status == "FAILED" and "lost the SSH connection" in trials[0].data.tags["jbench.failure_reason"]
    assert trials[0].data.tags["jbench.failure_category"] == "connection_lost"
    assert trials[1].info.status == "FINISHED" and trials[1].data.metrics["decode_tps"] > 0
    # Default: the connection is re-established with backoff and the trial runs again, in the same run.
    emu.die_after(0.5, match=["llama-bench"])
    res = jbench_cli([*common, "model.quant=Q4_0"], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r2")})
    assert res.returncode == 0, res.stdout + res.stderr
    client, trials = _trials(f"sqlite:///{tmp_path}/r2/mlflow.db", "adhoc")
    assert [t.info.status for t in trials] == ["FINISHED"]  # one run: not a FAILED one plus a FINISHED one
    assert trials[0].data.tags["jbench.retries"] == "1" and trials[0].data.metrics["decode_tps"] > 0
    log = client.download_artifacts(trials[0].info.run_id, "trial.log")
    assert "connection lost" in open(log).read()  # the dropped attempt is in the trial's log


@pytest.mark.ssh
def test_jump_host(orin_nano, agx_orin, tmp_path):
    # Reach agx_orin through orin_nano (ProxyJump). The device entry's key is used for both hops, so
    # orin_nano also accepts agx_orin's key; both host keys are verified.
    line = orin_nano.authorized_keys_path.read_text().splitlines()[0]
    options = line[: line.index(" ssh-")]
    with open(orin_nano.authorized_keys_path, "a") as f:
        f.write(f"{options} {agx_orin.public_key_path.read_text().strip()}\n")
    known = tmp_path / "known_hosts"
    known.write_text(orin_nano.host_key_line + "\n" + agx_orin.host_key_line + "\n")
    cfg = device_cfg(agx_orin, known_hosts=str(known), jump=f"{orin_nano.user}@{orin_nano.host}:{orin_nano.port}")
    with connect(cfg) as conn:
        assert conn.jump is not None
        res = conn.run(["nvpmodel", "-q"], timeout=20)
        assert agx_orin.nvpmodel_mode_name in res.stdout
    # An unknown jump host key is refused like any other.
    known.write_text(agx_orin.host_key_line + "\n")
    with pytest.raises(HostKeyError):
        connect(device_cfg(agx_orin, known_hosts=str(known), jump=f"{orin_nano.user}@{orin_nano.host}:{orin_nano.port}"))
