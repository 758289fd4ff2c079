"""Whole `jbench` processes against faithful emulated Jetsons: two controllers, a controller killed at each step,
a wrong profile, a reboot recorded on the trial, a planted sudo password that must appear nowhere."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from .conftest import jbench_cli
from .test_ssh_devices import _trials, _wait_for, write_conf

JBENCH = str(Path(sys.executable).with_name("jbench"))


def _sweep_argv(conf: Path, llama_build: dict, *extra: str) -> list[str]:
    return [JBENCH, "sweep", "--config-dir", str(conf), "device=emu", f"backend.binary_dir={llama_build['bin_dir']}",
            "model.quant=Q4_0", "backend.n_prompt=512", "backend.n_gen=256", "backend.repetitions=50",
            "telemetry.source=none", "thermal.start_below_c=null", *extra]


def _popen(argv: list[str], results: Path) -> subprocess.Popen:
    env = dict(os.environ, JBENCH_RESULTS_DIR=str(results), COLUMNS="200")
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop(proc: subprocess.Popen, grace_s: float = 0) -> tuple[str, str]:
    """Wait up to grace_s for the process to end by itself, then kill it."""
    try:
        return proc.communicate(timeout=grace_s or 0.01)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate(timeout=60)


def _nothing_left(emu) -> bool:
    return not emu.device_processes(["llama-bench", "llama-server", "tegrastats", "emu-hang"])


@pytest.mark.ssh
@pytest.mark.e2e
def test_a_second_controller_never_touches_a_device_in_use(orin_nano_super_r39, tmp_path, llama_build, bundled_model):
    emu = orin_nano_super_r39
    conf = write_conf(tmp_path, emu)
    first = _popen(_sweep_argv(conf, llama_build, "power.mode=MAXN_SUPER", "power.jetson_clocks=true"), tmp_path / "r")
    try:
        assert _wait_for(lambda: emu.clock_state()["mode_name"] == "MAXN_SUPER" and emu.clock_state()["all_locked"])
        n_before = len(emu.command_log())
        res = jbench_cli(["run", "--config-dir", str(conf), "device=emu", f"backend.binary_dir={llama_build['bin_dir']}",
                          "model.quant=Q4_0", "power.mode=15W", "power.jetson_clocks=false", "telemetry.source=none"],
                         env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r2")})
        assert res.returncode == 2, res.stdout + res.stderr
        assert "in use by another jbench controller" in res.stderr and f"pid {first.pid}" in res.stderr
        # The second controller only read (preflight): no nvpmodel -m, no jetson_clocks but --show.
        changing = [c for c in emu.command_log()[n_before:]
                    if (c["tool"] == "nvpmodel" and "-m" in c["argv"])
                    or (c["tool"] == "jetson_clocks" and c["argv"] != ["--show"])]
        assert changing == [], changing
        st = emu.clock_state()
        assert st["mode_name"] == "MAXN_SUPER" and st["all_locked"], st
        first.send_signal(signal.SIGINT)
        _stop(first, grace_s=120)
    finally:
        _stop(first)
    assert first.returncode == 130
    st = emu.clock_state()
    assert st["mode_name"] == "25W" and st["none_locked"], st
    assert not list(Path(emu.home).glob(".cache/jbench/lease-*.json"))


@pytest.mark.ssh
@pytest.mark.e2e
def test_sigkilled_controller_is_cleaned_up_by_the_next_start(orin_nano_super_r39, tmp_path, llama_build, bundled_model):
    emu = orin_nano_super_r39
    conf = write_conf(tmp_path, emu)
    proc = _popen(_sweep_argv(conf, llama_build, "power.mode=MAXN_SUPER", "power.jetson_clocks=true"), tmp_path / "r")
    try:
        assert _wait_for(lambda: bool(emu.device_processes(["llama-bench"])), timeout=90), "llama-bench never started"
        proc.kill()
        proc.wait(timeout=30)
    finally:
        _stop(proc)
    # Nothing the dead controller started survives on the device for more than a few seconds.
    assert _wait_for(lambda: _nothing_left(emu), timeout=20), emu.device_processes()
    assert emu.clock_state()["mode_name"] == "MAXN_SUPER"  # nobody restored it yet
    res = jbench_cli(["run", "--config-dir", str(conf), "device=emu", f"backend.binary_dir={llama_build['bin_dir']}",
                      "model.quant=Q4_0", "backend.n_prompt=8", "backend.n_gen=2", "backend.repetitions=1",
                      "telemetry.source=none"], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 0, res.stdout + res.stderr
    st = emu.clock_state()
    assert st["mode_name"] == "25W" and st["none_locked"], st
    client = MlflowClient(f"sqlite:///{tmp_path}/r/mlflow.db")
    exp = client.get_experiment_by_name("adhoc")
    runs = client.search_runs([exp.experiment_id])
    assert not [r for r in runs if r.info.status == "RUNNING"]
    killed = [r for r in runs if r.info.status == "KILLED"]
    assert len(killed) == 2, [(r.info.run_name, r.info.status) for r in runs]  # the dead sweep and its trial
    assert all(r.data.tags["jbench.failure_reason"].startswith("controller died") for r in killed)


@pytest.mark.ssh
@pytest.mark.e2e
def test_a_device_that_does_not_match_its_profile_is_refused(agx_orin, tmp_path, bundled_model):
    conf = write_conf(tmp_path, agx_orin, profile="orin_nano_super")
    argv = ["run", "--config-dir", str(conf), "device=emu", "telemetry.source=none", "power.jetson_clocks=true"]
    res = jbench_cli(argv, env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 2, res.stdout + res.stderr
    assert "device-tree model is 'Jetson AGX Orin" in res.stderr and "device.allow_profile_mismatch=true" in res.stderr
    assert agx_orin.clock_state()["none_locked"] and not (tmp_path / "r" / "mlflow.db").exists()


@pytest.mark.ssh
@pytest.mark.e2e
def test_a_reboot_is_recorded_on_the_trial(emulated_jetson_factory, tmp_path, llama_build, bundled_model):
    emu = emulated_jetson_factory("agx_orin", reboot_delay_s=0.5, reboot_grace_s=0.2)
    conf = write_conf(tmp_path, emu)
    res = jbench_cli(["sweep", "--config-dir", str(conf), "device=emu", f"backend.binary_dir={llama_build['bin_dir']}",
                      "model.quant=Q4_0", "backend.n_prompt=8", "backend.n_gen=2", "backend.repetitions=1",
                      "telemetry.source=none", "thermal.start_below_c=null", "power.mode=MAXN,MODE_50W",
                      "power.jetson_clocks=true", "power.allow_reboot=true", "power.reboot_timeout_s=60"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 0, res.stdout + res.stderr
    _, trials = _trials(f"sqlite:///{tmp_path}/r/mlflow.db", "adhoc")
    by_mode = {t.data.params["power.mode"]: t.data.tags for t in trials}
    assert by_mode["MAXN"]["jetson.rebooted"] == "power mode change"  # MODE_30W -> MAXN reboots on JP5 AGX Orin
    assert "jetson.rebooted" not in by_mode["MODE_50W"]  # MAXN -> MODE_50W is live
    assert by_mode["MAXN"]["jetson.boot_id"] == by_mode["MODE_50W"]["jetson.boot_id"]
    assert by_mode["MAXN"]["power.lock.emc"] == "True" and by_mode["MAXN"]["jetson.power_mode"].startswith("MAXN")
    # Restored with consent (the original mode needs a reboot too).
    st = emu.clock_state()
    assert st["mode_name"] == "MODE_30W" and st["none_locked"], st


# step -> (emulated module, sweep overrides, how to slow the step down, when the controller is inside the step)
_SHORT = ["backend.n_prompt=8", "backend.n_gen=2", "backend.repetitions=1"]


def _logged(emu, tool: str, first: str, count: int = 1) -> bool:
    return sum(1 for c in emu.command_log() if c["tool"] == tool and c["argv"][:1] == [first]) >= count


STEPS = {
    "apply": ("orin_nano_super_r39", ["power.mode=MAXN_SUPER", "power.jetson_clocks=true", *_SHORT],
              ("nvpmodel", "-m", 6.0), lambda emu: _logged(emu, "nvpmodel", "-m")),
    "measure": ("orin_nano_super_r39", ["power.mode=MAXN_SUPER", "power.jetson_clocks=true"], None,
                lambda emu: bool(emu.device_processes(["llama-bench"]))),
    "restore": ("orin_nano_super_r39", ["power.mode=MAXN_SUPER", "power.jetson_clocks=true", *_SHORT],
                ("jetson_clocks", "--restore", 6.0), lambda emu: _logged(emu, "jetson_clocks", "--restore")),
    # 7W changes the online cores on the R36 Orin Nano Super: jbench reboots into it (consent given).
    "reboot_wait": ("orin_nano_super", ["power.mode=7W", "power.allow_reboot=true", "power.reboot_timeout_s=60",
                                        *_SHORT], None, lambda emu: emu.boot_count > 1 or not emu.accepts_connections()),
}


@pytest.mark.ssh
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("step", list(STEPS))
def test_controller_stopped_at_each_step_then_the_next_start(emulated_jetson_factory, step, sig, tmp_path, llama_build,
                                                             bundled_model):
    module, overrides, slow, inside = STEPS[step]
    emu = emulated_jetson_factory(module, reboot_delay_s=3.0, reboot_grace_s=0.2)
    default = emu.clock_state()["mode_name"]
    conf = write_conf(tmp_path, emu)
    if slow:
        emu.slow_tool(*slow)
    proc = _popen(_sweep_argv(conf, llama_build, *overrides), tmp_path / "r")
    try:
        assert _wait_for(lambda: inside(emu) or proc.poll() is not None, timeout=120), f"never reached {step}"
        assert proc.poll() is None, f"the sweep ended before {step}: {_stop(proc)}"
        time.sleep(0.5)
        proc.send_signal(sig)
        _stop(proc, grace_s=90)
    finally:
        _stop(proc)
    if slow:
        emu.slow_tool(slow[0], slow[1], None)
    # Whatever stopped it, nothing it started survives on the device.
    if step != "reboot_wait":  # a reboot ends every process anyway
        assert _wait_for(lambda: _nothing_left(emu), timeout=20), emu.device_processes()
    assert emu.wait_until_up() is None
    if sig != signal.SIGKILL and step in ("apply", "measure"):
        # A controller that could unwind restored the device itself.
        st = emu.clock_state()
        assert st["mode_name"] == default and st["none_locked"], (step, st)
    # The next start (which sets no power state itself) finishes the job and closes the dead controller's runs.
    res = jbench_cli(["run", "--config-dir", str(conf), "device=emu", f"backend.binary_dir={llama_build['bin_dir']}",
                      "model.quant=Q4_0", *_SHORT, "telemetry.source=none", "power.allow_reboot=true",
                      "power.reboot_timeout_s=60"], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 0, res.stdout + res.stderr
    st = emu.clock_state()
    assert st["mode_name"] == default and st["none_locked"] and st["pending_mode"] is None, (step, st)
    assert not list(Path(emu.home).glob(".cache/jbench/power-state-*.json"))
    assert not list(Path(emu.home).glob(".cache/jbench/lease-*.json"))
    assert not list(Path(emu.home).glob(".cache/jbench/jetson_clocks-*"))
    client = MlflowClient(f"sqlite:///{tmp_path}/r/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"], step


@pytest.mark.ssh
@pytest.mark.e2e
def test_a_planted_sudo_password_appears_nowhere(emulated_jetson_factory, tmp_path, llama_build, bundled_model):
    secret = "pl4nted-Secret-7731"
    emu = emulated_jetson_factory("orin_nano_super", sudo_password=secret, reboot_delay_s=0.5, reboot_grace_s=0.2)
    conf = write_conf(tmp_path, emu, sudo_password_env="JB_TEST_SUDO_PW")
    results = tmp_path / "r"
    # tegrastats runs (through sudo) beside each trial; the energy passes would only run llama-bench longer.
    argv = _sweep_argv(conf, llama_build, *_SHORT[:0], "backend.n_prompt=16", "backend.n_gen=4", "backend.repetitions=2",
                       "backend.threads=1", "power.mode=7W,MAXN_SUPER", "power.jetson_clocks=true",
                       "power.allow_reboot=true", "power.reboot_timeout_s=60", "telemetry.source=tegrastats",
                       "telemetry.interval_ms=100", "telemetry.idle_s=1", "telemetry.cooldown_s=0",
                       "telemetry.energy_pass=false")
    argv = [a for a in argv if a not in ("backend.n_prompt=512", "backend.n_gen=256", "backend.repetitions=50")]
    env = dict(os.environ, JBENCH_RESULTS_DIR=str(results), COLUMNS="200", JB_TEST_SUDO_PW=secret)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen_in_ps: list[str] = []
    while proc.poll() is None:  # both machines' process lists (the emulated device is this machine)
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        seen_in_ps += [line for line in ps.splitlines() if secret in line]
        time.sleep(0.2)
    out, err = proc.communicate()
    assert proc.returncode == 0, out + err
    assert not seen_in_ps and secret not in out and secret not in err
    # The reboot-needing mode really happened, on a device that needs a sudo password.
    _, trials = _trials(f"sqlite:///{results}/mlflow.db", "adhoc")
    assert {t.data.tags["power.mode_actual"] for t in trials} == {"7W", "MAXN_SUPER"}
    assert emu.boot_count >= 2 and all(t.info.status == "FINISHED" for t in trials)
    assert emu.clock_state()["mode_name"] == "25W"
    # Nowhere in the store, its artifacts, or anything on the device.
    found = []
    for root in (results, Path(emu.state_dir), Path(emu.home)):
        for path in Path(root).rglob("*"):
            if path == Path(emu.state_dir) / "state.json":
                continue  # the emulator's own account data (its /etc/shadow): the password is configured there
            if path.is_file() and secret.encode() in path.read_bytes():
                found.append(str(path))
    assert found == []
