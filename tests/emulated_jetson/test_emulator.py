"""Self-tests of the emulated Jetson fixture (tests/emulated_jetson), through the real OpenSSH client and paramiko.
They live with the emulator, apart from the product tests; every one starts a real sshd."""

from __future__ import annotations

import io
import re
import subprocess
import time

import paramiko
import pytest

from jbench.device.telemetry.tegrastats import parse_line, total_input_power_mw
from tests.emulated_jetson import EmulatedJetson
from tests.emulated_jetson.fixtures import (  # noqa: F401  (fixtures)
    agx_orin,
    emulated_jetson_factory,
    orin_nano,
    orin_nano_super,
    orin_nano_super_r39,
    thor,
)

pytestmark = pytest.mark.ssh

STRICT = ("StrictHostKeyChecking=yes", "BatchMode=yes")


def ssh(emu: EmulatedJetson, command: str, *, known_hosts=None, input: str = "", timeout: float = 30):
    """The plain ssh invocation a user would type (no helper), against `known_hosts` (default: the device's)."""
    argv = ["ssh", "-F", "/dev/null", "-i", str(emu.key_path), "-p", str(emu.port),
            "-o", f"UserKnownHostsFile={known_hosts or emu.known_hosts_path}", "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", STRICT[0], "-o", STRICT[1], "-o", "IdentitiesOnly=yes", f"{emu.user}@{emu.host}", command]
    return subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)


def kv(line: str) -> dict:
    return dict(item.split("=", 1) for item in line.split() if "=" in item)


# ----------------------------------------------------------------------------------------------- identity

def test_three_devices_at_once_each_with_its_own_address_identity_and_modes(orin_nano, agx_orin, thor):
    devices = [orin_nano, agx_orin, thor]
    hosts = [emu.host for emu in devices]
    assert len(set(hosts)) == 3 and all(re.fullmatch(r"127\.0\.0\.\d+", h) for h in hosts)
    expected = {
        "orin_nano": ("NVIDIA Jetson Orin Nano Developer Kit", "# R36 (release), REVISION: 3.0", "15W\n0", "5.15.136-tegra"),
        "agx_orin": ("Jetson AGX Orin", "# R35 (release), REVISION: 4.1", "MODE_30W\n2", "5.10.120-tegra"),
        "thor": ("NVIDIA Jetson AGX Thor Developer Kit", "# R38 (release), REVISION: 4.0", "120W\n1", "6.8.12-tegra"),
    }
    for emu in devices:
        model, release, mode, kernel = expected[emu.module]
        # known_hosts holds `[127.0.0.N]:PORT ssh-ed25519 ...`; the fingerprint is what ssh-keygen -lf prints
        assert emu.known_hosts_path.read_text().strip() == f"[{emu.host}]:{emu.port} {emu.host_public_key}"
        assert emu.host_public_key.startswith("ssh-ed25519 ")
        listed = subprocess.run(["ssh-keygen", "-lf", str(emu.known_hosts_path)], capture_output=True, text=True)
        assert emu.host_key_fingerprint.startswith("SHA256:") and emu.host_key_fingerprint in listed.stdout
        result = ssh(emu, f"cat {emu.device_tree_model_path}; echo; head -n 1 {emu.nv_tegra_release_path}; "
                          f"nvpmodel -q; uname -r; uname -m; cat {emu.boot_id_path}; id -u")
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0] == model + "\0"  # /proc/device-tree/model ends with a NUL byte
        assert lines[1].startswith(release)
        assert "\n".join(lines[2:4]) == f"NV Power Mode: {mode}"
        assert lines[4:6] == [kernel, "aarch64"]
        assert lines[6] == emu.boot_id
        assert lines[7] == "1000"  # the session is an ordinary user until the fake sudo
        assert emu.device_config()["profile"] == emu.product_profile


def test_nvpmodel_conf_lists_the_devices_own_modes(orin_nano, thor):
    for emu, names in ((orin_nano, ["15W", "7W"]), (thor, ["MAXN", "120W", "90W", "70W"])):
        text = ssh(emu, f"cat {emu.nvpmodel_conf_path}").stdout
        modes = re.findall(r"^< POWER_MODEL ID=(\d+) NAME=(\S+) >$", text, re.M)
        assert [name for _, name in modes] == names == [m["name"] for m in emu.modes]
        assert re.search(rf"^< PM_CONFIG DEFAULT={emu.default_mode} >$", text, re.M)
    parsed = thor.run("nvpmodel -p --verbose").stdout  # the helper: same strict ssh invocation
    assert "NVPM VERB: PM_CONFIG: DEFAULT=120W(1)" in parsed
    assert re.findall(r"POWER_MODEL: ID=(\d+) NAME=(\w+)", parsed) == [("0", "MAXN"), ("1", "120W"), ("2", "90W"),
                                                                         ("3", "70W")]


# --------------------------------------------------------------------------------------------- host keys

def test_unknown_or_wrong_host_key_is_refused(orin_nano, agx_orin, tmp_path):
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    result = ssh(orin_nano, "true", known_hosts=empty)
    assert result.returncode == 255 and "Host key verification failed" in result.stderr
    # another device's key recorded for this address:port -> refused as well
    wrong = tmp_path / "known_hosts_wrong"
    wrong.write_text(f"[{orin_nano.host}]:{orin_nano.port} {agx_orin.host_public_key}\n")
    result = ssh(orin_nano, "true", known_hosts=wrong)
    assert result.returncode == 255 and "HOST IDENTIFICATION HAS CHANGED" in result.stderr

    client = paramiko.SSHClient()
    client.load_host_keys(str(empty))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    with pytest.raises(paramiko.SSHException):
        client.connect(orin_nano.host, port=orin_nano.port, username=orin_nano.user,
                       key_filename=str(orin_nano.key_path), allow_agent=False, look_for_keys=False, timeout=5)
    client.close()
    with orin_nano.paramiko_client() as good:
        _, out, _ = good.exec_command("echo ok; pwd")
        assert out.read().decode() == f"ok\n{orin_nano.home}\n"  # sessions start in the emulated $HOME
        with good.open_sftp() as sftp:  # sftp works and starts there too
            sftp.putfo(io.BytesIO(b"hello"), "pushed.txt")
        assert (orin_nano.home / "pushed.txt").read_bytes() == b"hello"


# ---------------------------------------------------------------------------------------------- nvpmodel

def test_nvpmodel_live_switch_needs_root_and_keeps_the_connection(thor):
    denied = ssh(thor, "nvpmodel -m 0")
    assert denied.returncode != 0 and "NVPM ERROR" in denied.stdout
    assert thor.nvpmodel_mode == 1 and not thor.needs_reboot(0)
    switched = ssh(thor, "sudo nvpmodel -m 0 && nvpmodel -q")
    assert switched.returncode == 0, switched.stdout + switched.stderr
    assert switched.stdout == "NV Power Mode: MAXN\n0\n"
    assert thor.boot_count == 0 and thor.nvpmodel_status_path.read_text().startswith("pmode:0000")
    bad = ssh(thor, "sudo nvpmodel -m 9")
    assert bad.returncode != 0 and "NVPM ERROR" in bad.stdout


def test_nvpmodel_mode_that_needs_a_reboot(emulated_jetson_factory):
    emu = emulated_jetson_factory("orin_nano", reboot_delay_s=1.5)
    assert emu.needs_reboot(emu.mode_id("7W"))
    ssh(emu, "sudo jetson_clocks")
    assert emu.clocks_locked
    # the real prompt; anything but YES/yes (here: empty stdin) changes nothing
    declined = ssh(emu, "sudo nvpmodel -m 1")
    assert declined.returncode != 0
    assert declined.stdout.splitlines()[:3] == [
        "NVPM WARN: Golden image context is already created",
        "NVPM WARN: Reboot required for changing to this power mode: 1",
        "NVPM WARN: DO YOU WANT TO REBOOT NOW? enter YES/yes to confirm:"]
    assert "NVPM ERROR: optMask is 1, no request for power mode" in declined.stdout
    assert emu.nvpmodel_mode == 0 and emu.boot_count == 0

    boot_id = emu.boot_id
    accepted = ssh(emu, "sudo nvpmodel -m 1", input="YES\n")
    assert accepted.returncode == 0 and accepted.stdout.endswith("NVPM WARN: rebooting\n")
    emu.wait_until_down(5)
    refused = ssh(emu, "true")
    assert refused.returncode == 255 and "Connection refused" in refused.stderr
    assert not emu.accepts_connections()
    emu.wait_for_boot(0, timeout=15)
    back = ssh(emu, "nvpmodel -q; sudo jetson_clocks --show | grep -E '^(Online CPUs:|GPU )'")
    assert back.returncode == 0, back.stderr
    lines = back.stdout.splitlines()
    assert lines[:2] == ["NV Power Mode: 7W", "1"]
    assert lines[2] == "Online CPUs: 0-3"  # 7W takes two cores offline
    gpu = kv(lines[3])
    assert int(gpu["MinFreq"]) < int(gpu["MaxFreq"])  # the jetson_clocks lock did not survive the reboot
    assert emu.boot_id != boot_id and emu.boot_count == 1 and not emu.clocks_locked
    assert [e["kind"] for e in emu.events].count("reboot") == 1


def test_sudo_reboot_drops_sessions_refuses_then_comes_back(agx_orin):
    agx_orin.set_state(reboot_delay_s=1.5)
    denied = ssh(agx_orin, "reboot")
    assert denied.returncode == 1 and "Interactive authentication required" in denied.stderr
    boot_id = agx_orin.boot_id
    with agx_orin.paramiko_client() as client:
        _, out, _ = client.exec_command("emu-hang")
        assert out.readline() == "emu-hang: started\n"
        assert ssh(agx_orin, "sudo reboot").returncode == 0
        agx_orin.wait_until_down(5)
        out.channel.settimeout(10)
        out.read()  # the open session ends with the emulated reboot
        assert out.channel.recv_exit_status() == -1  # no exit status: the connection was cut
    assert ssh(agx_orin, "true").returncode == 255
    agx_orin.wait_for_boot(0, timeout=15)
    assert ssh(agx_orin, "cat /dev/null").returncode == 0
    assert agx_orin.boot_id != boot_id and agx_orin.nvpmodel_mode == 2
    assert agx_orin.events[-1]["killed"] >= 1


# ----------------------------------------------------------------------------------------- jetson_clocks

def test_jetson_clocks_lock_show_store_restore(orin_nano, thor):
    denied = ssh(orin_nano, "jetson_clocks --show")
    assert denied.returncode == 1
    assert denied.stdout.strip() == "Error: Run this script(/usr/bin/jetson_clocks) as a root user"

    def show(emu):
        result = ssh(emu, "sudo jetson_clocks --show")
        assert result.returncode == 0, result.stderr
        return {line.split()[0]: kv(line) for line in result.stdout.splitlines() if "MaxFreq=" in line}

    unlocked = show(orin_nano)
    for name in ("GPU", "EMC", "cpu0:"):
        assert int(unlocked[name]["MinFreq"]) < int(unlocked[name]["MaxFreq"])
    store = f"{orin_nano.home}/clocks.conf"
    assert ssh(orin_nano, f"sudo jetson_clocks --store {store} && sudo jetson_clocks").returncode == 0
    assert orin_nano.clocks_locked
    locked = show(orin_nano)
    for name in ("GPU", "EMC", "cpu0:"):
        assert locked[name]["MinFreq"] == locked[name]["MaxFreq"] == locked[name]["CurrentFreq"], name
    assert locked["GPU"]["MaxFreq"] == "624750000" and locked["EMC"]["FreqOverride"] == "1"
    assert ssh(orin_nano, f"sudo jetson_clocks --restore {store}").returncode == 0
    assert not orin_nano.clocks_locked
    restored = show(orin_nano)["GPU"]
    assert int(restored["MinFreq"]) < int(restored["MaxFreq"])

    # Thor prints its GPU as gpu-gpc-0/gpu-nvd-0 and keeps EMC MinFreq < MaxFreq when locked (real R38 capture)
    assert ssh(thor, "sudo jetson_clocks").stdout.endswith("All done.\n")
    thor_locked = show(thor)
    assert thor_locked["gpu-gpc-0"]["MinFreq"] == thor_locked["gpu-gpc-0"]["MaxFreq"] == "1386000000"
    assert thor_locked["EMC"]["FreqOverride"] == "1"


# -------------------------------------------------------------------------------------------- tegrastats

def test_tegrastats_streams_parseable_lines_over_paramiko(orin_nano, agx_orin, thor):
    with orin_nano.paramiko_client() as client:
        _, out, _ = client.exec_command("sudo tegrastats --interval 100")
        idle = [parse_line(out.readline()) for _ in range(3)]
        orin_nano.set_load(gpu=90, cpu=50)
        time.sleep(0.3)
        loaded = [parse_line(out.readline()) for _ in range(6)][-1]
        out.channel.close()
    for sample in idle + [loaded]:
        assert sample is not None and not sample.unknown
        assert sample.timestamp is not None and sample.ram_total_mb == 7620
        assert {"VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"} <= set(sample.rails)
        assert sample.emc_freq_mhz is not None and len(sample.cpus) == 6
    assert loaded.gpu_load_pct >= 80 and loaded.gpu_freqs_mhz == [624.0]
    assert total_input_power_mw(loaded) > total_input_power_mw(idle[0]) + 3000  # VDD_IN follows the GPU load

    # without sudo: no EMC/GPU frequency, rails still there (JP6)
    non_root = parse_line(ssh(orin_nano, "timeout 0.5 tegrastats --interval 100").stdout.splitlines()[0])
    assert non_root.emc_freq_mhz is None and non_root.gpu_freqs_mhz == [] and "VDD_IN" in non_root.rails

    for emu, rails in ((agx_orin, {"VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0", "VDDQ_VDD2_1V8AO"}),
                       (thor, {"VDD_GPU", "VDD_CPU_SOC_MSS", "VIN_SYS_5V0", "VIN"})):
        lines = ssh(emu, "sudo timeout 0.35 tegrastats --interval 100").stdout.splitlines()
        assert len(lines) >= 2
        sample = parse_line(lines[0])
        assert sample is not None and not sample.unknown and set(sample.rails) == rails
        assert total_input_power_mw(sample) is not None
    assert len(parse_line(lines[0]).gpu_freqs_mhz) == 3  # Thor: GR3D_FREQ @[f,f,f]


def test_a_workload_process_shows_up_as_gpu_load(orin_nano):
    result = ssh(orin_nano, "emu-gpu-load 1.2 >/dev/null & sleep 0.6; sudo timeout 0.35 tegrastats --interval 100; wait")
    sample = parse_line(result.stdout.splitlines()[0])
    assert sample.gpu_load_pct >= 80


def test_tegrastats_start_and_stop_with_a_logfile(orin_nano):
    log = f"{orin_nano.home}/ts.log"
    assert ssh(orin_nano, f"sudo tegrastats --start --interval 100 --logfile {log}").returncode == 0
    time.sleep(0.5)
    assert ssh(orin_nano, "sudo tegrastats --stop").returncode == 0
    lines = open(log).read().splitlines()
    assert len(lines) >= 2 and all(parse_line(line) for line in lines)
    time.sleep(0.2)
    count = len(open(log).read().splitlines())
    time.sleep(0.3)
    assert len(open(log).read().splitlines()) == count  # stopped


# -------------------------------------------------------------------------------------------------- sudo

def test_sudo_password_required_and_accepted_with_dash_S(thor):
    assert ssh(thor, "sudo -n id -u").stdout == "0\n"  # passwordless by default
    thor.set_sudo_password("s3cret")
    no_prompt = ssh(thor, "sudo -n id -u")
    assert no_prompt.returncode == 1 and no_prompt.stderr == "sudo: a password is required\n"
    no_tty = ssh(thor, "sudo id -u")
    assert no_tty.returncode == 1 and "sudo: a password is required" in no_tty.stderr
    wrong = ssh(thor, "sudo -S id -u", input="nope\n")
    assert wrong.returncode == 1 and "[sudo] password for nvidia: Sorry, try again." in wrong.stderr
    ok = ssh(thor, "sudo -S -p '' -- id -u", input="s3cret\n")
    assert ok.returncode == 0 and ok.stdout == "0\n" and ok.stderr == ""
    # the password line is consumed, the rest of stdin reaches the command (here: nvpmodel's YES prompt)
    thor.set_state(reboot_delay_s=0.5)
    switched = ssh(thor, "sudo -S nvpmodel -m 3", input="s3cret\nYES\n")
    assert switched.returncode == 0 and "NVPM WARN: rebooting" in switched.stdout
    assert switched.stderr == "[sudo] password for nvidia: "
    thor.wait_for_boot(0, timeout=15)
    assert thor.nvpmodel_mode == 3


# ----------------------------------------------------------------------------------- drops and blocking

def test_die_mid_command_over_ssh_and_paramiko(agx_orin):
    agx_orin.die_after(0.8)
    started = time.monotonic()
    dropped = ssh(agx_orin, "emu-hang 20")
    assert dropped.returncode == 255 and time.monotonic() - started < 10
    assert dropped.stdout.startswith("emu-hang: started")
    assert ssh(agx_orin, "true").returncode == 0  # only that session died

    agx_orin.die_after(0.8)
    with agx_orin.paramiko_client() as client:
        _, out, _ = client.exec_command("sudo tegrastats --interval 100")
        out.channel.settimeout(10)
        lines = out.read().decode().splitlines()
        assert out.channel.recv_exit_status() == -1  # closed without an exit status
        assert 3 <= len(lines) <= 20 and parse_line(lines[0]) is not None
    kinds = [e["kind"] for e in agx_orin.events]
    assert kinds.count("session_killed") == 2


def test_block_refuses_new_connections_but_keeps_open_sessions(orin_nano):
    with orin_nano.paramiko_client() as client:
        orin_nano.block()
        refused = ssh(orin_nano, "true")
        assert refused.returncode == 255 and "Connection refused" in refused.stderr
        _, out, _ = client.exec_command("nvpmodel -q")  # the established connection still works
        assert out.read() == b"NV Power Mode: 15W\n0\n"
        orin_nano.unblock()
    assert ssh(orin_nano, "true").returncode == 0


def test_stop_kills_everything_and_frees_the_address():
    emu = EmulatedJetson.start("thor")
    client = emu.paramiko_client()
    _, hang, _ = client.exec_command("emu-hang")
    _, out, _ = client.exec_command("tegrastats --interval 200")
    assert hang.readline() == "emu-hang: started\n" and parse_line(out.readline()) is not None
    assert len(emu.processes()) >= 5  # supervisor, sshd listener, session sshd, emu-hang, tegrastats
    emu.stop()
    client.close()
    assert emu.processes() == []
    assert not emu.accepts_connections()
    assert not emu.base_dir.exists()


# ------------------------------------------------------------------------- issue 11: separate jetson_clocks locks

def show(emu: EmulatedJetson) -> dict:
    """`sudo jetson_clocks --show` as {first word: {key: value}} for the lines with MaxFreq= or IdleStates."""
    result = ssh(emu, "sudo jetson_clocks --show")
    assert result.returncode == 0, result.stderr
    out = {}
    for line in result.stdout.splitlines():
        if "MaxFreq=" in line or line.startswith("FAN"):
            out[line.split()[0]] = kv(line.replace("IdleStates:", ""))
    return out


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_plain_jetson_clocks_sets_every_lock_and_restore_of_an_unlocked_store_undoes_all(orin_nano):
    assert orin_nano.clock_state()["none_locked"] and orin_nano.clocks_unlocked
    assert orin_nano.gpu_railgate_path.read_text() == "1\n"
    assert orin_nano.device_config()["paths"]["gpu_railgate"] == str(orin_nano.gpu_railgate_path)
    assert orin_nano.device_config()["paths"]["boot_id"] == str(orin_nano.boot_id_path)
    store = f"{orin_nano.home}/unlocked.store"
    assert ssh(orin_nano, f"sudo jetson_clocks --store {store}").returncode == 0
    stored = dict(line.split(":", 1) for line in open(store).read().splitlines())
    # what NVIDIA's script stores: online, scaling_min_freq, cpuidle disable flags, GPU min_freq, railgate_enable,
    # EMC mrq_rate_locked (not the EMC rate), the fan status file
    assert stored["/sys/devices/system/cpu/cpu0/online"] == "1"
    assert stored["/sys/devices/system/cpu/cpu5/cpufreq/scaling_min_freq"] == "729600"
    assert stored["/sys/devices/system/cpu/cpu3/cpuidle/state1/disable"] == "0"
    assert stored["/sys/devices/platform/17000000.gpu/devfreq_dev/min_freq"] == "306000000"
    assert stored["/sys/devices/platform/gpu.0/railgate_enable"] == "1"
    assert stored["/sys/kernel/debug/bpmp/debug/clk/emc/mrq_rate_locked"] == "0"
    assert stored[f"{orin_nano.root_home}/.jetsonclocks_fan.txt"] == "active"
    assert not any(k.endswith("/emc/rate") or k.endswith("scaling_max_freq") for k in stored)

    assert ssh(orin_nano, "sudo jetson_clocks").returncode == 0
    st = orin_nano.clock_state()
    assert st["cpu_locked"] and st["gpu_locked"] and st["emc_locked"] and st["cpuidle_disabled"]
    assert not st["railgate_enabled"] and st["all_locked"] and orin_nano.clocks_locked
    assert st["nvfancontrol_active"] and st["fan_pwm"] is None  # the fan only with --fan
    assert orin_nano.gpu_railgate_path.read_text() == "0\n"
    assert ssh(orin_nano, f"cat {orin_nano.gpu_railgate_path}").stdout == "0\n"
    locked = show(orin_nano)
    assert locked["cpu0:"]["WFI"] == locked["cpu0:"]["c7"] == "0"  # 0 = idle state disabled
    assert locked["cpu0:"]["MinFreq"] == locked["cpu0:"]["MaxFreq"]
    assert locked["GPU"]["MinFreq"] == locked["GPU"]["MaxFreq"] == locked["GPU"]["CurrentFreq"]
    assert locked["EMC"]["FreqOverride"] == "1" and locked["EMC"]["CurrentFreq"] == locked["EMC"]["MaxFreq"]
    assert "railgate" not in ssh(orin_nano, "sudo jetson_clocks --show").stdout.lower()  # never printed

    restored = ssh(orin_nano, f"sudo jetson_clocks --restore {store}")
    assert restored.returncode == 0, restored.stdout
    assert orin_nano.clock_state()["none_locked"] and orin_nano.gpu_railgate_path.read_text() == "1\n"
    after = show(orin_nano)
    assert after["cpu0:"]["WFI"] == "1" and after["EMC"]["FreqOverride"] == "0"
    assert int(after["GPU"]["MinFreq"]) < int(after["GPU"]["MaxFreq"])

    missing = ssh(orin_nano, "sudo jetson_clocks --restore /nonexistent.conf")
    assert missing.returncode == 1 and missing.stdout == "Error: /nonexistent.conf file not found !\n"
    # the refusal of an existing store file is unchanged
    again = ssh(orin_nano, f"sudo jetson_clocks --store {store}")
    assert again.returncode == 1 and again.stdout.endswith(f"Error: file {store} already exists!\n")


def test_jetson_clocks_fan_stops_nvfancontrol_and_restore_starts_it(agx_orin):
    store = f"{agx_orin.home}/before.store"
    assert ssh(agx_orin, f"sudo jetson_clocks --store {store}").returncode == 0
    assert show(agx_orin)["FAN"] == {"control": "active", "hwmon2_pwm1": "55"}
    assert ssh(agx_orin, "sudo jetson_clocks --fan").returncode == 0  # --fan locks everything AND forces the fan
    st = agx_orin.clock_state()
    assert st["all_locked"] and not st["nvfancontrol_active"] and st["fan_pwm"] == 255
    assert show(agx_orin)["FAN"] == {"control": "inactive", "hwmon2_pwm1": "255"}
    assert ssh(agx_orin, f"sudo jetson_clocks --restore {store}").returncode == 0
    assert agx_orin.clock_state()["none_locked"]
    assert show(agx_orin)["FAN"] == {"control": "active", "hwmon2_pwm1": "55"}


def test_nvpmodel_live_switch_undoes_cpu_gpu_locks_only(orin_nano_super):
    emu = orin_nano_super
    unlocked_store = f"{emu.home}/unlocked.store"
    assert ssh(emu, f"sudo jetson_clocks --store {unlocked_store} && sudo jetson_clocks").returncode == 0
    assert emu.clocks_locked and not emu.needs_reboot(0)
    assert ssh(emu, "sudo nvpmodel -m 0").returncode == 0  # 25W -> 15W, live
    st = emu.clock_state()
    assert (st["mode_name"], st["cpu_locked"], st["gpu_locked"]) == ("15W", False, False)
    assert st["emc_locked"] and st["cpuidle_disabled"] and not st["railgate_enabled"]  # stay (issue 11)
    assert not emu.clocks_locked and not emu.clocks_unlocked  # partially locked
    assert emu.gpu_railgate_path.read_text() == "0\n"
    partial = show(emu)
    assert partial["EMC"]["FreqOverride"] == "1"
    assert partial["EMC"]["CurrentFreq"] == partial["EMC"]["MaxFreq"] == "2133000000"  # the 15W EMC cap
    assert partial["cpu0:"]["WFI"] == partial["cpu0:"]["c7"] == "0"
    assert int(partial["GPU"]["MinFreq"]) < int(partial["GPU"]["MaxFreq"])
    assert int(partial["cpu0:"]["MinFreq"]) < int(partial["cpu0:"]["MaxFreq"])
    # restoring the store taken before the lock undoes the rest (EMC, cpuidle, railgate)
    assert ssh(emu, f"sudo jetson_clocks --restore {unlocked_store}").returncode == 0
    assert emu.clocks_unlocked and show(emu)["EMC"]["FreqOverride"] == "0"


def test_declined_reboot_mode_stays_pending_until_the_next_reboot(emulated_jetson_factory):
    emu = emulated_jetson_factory("orin_nano_super", reboot_delay_s=0.5)
    assert emu.nvpmodel_mode_name == "25W" and emu.needs_reboot(3)
    lines = ["NVPM WARN: Golden image context is already created",
             "NVPM WARN: Reboot required for changing to this power mode: 3",
             "NVPM WARN: DO YOU WANT TO REBOOT NOW? enter YES/yes to confirm:"]
    declined = ssh(emu, "sudo nvpmodel -m 3", input="no\n")
    assert declined.returncode == 1
    assert declined.stdout.splitlines() == lines + ["NVPM ERROR: optMask is 1, no request for power mode"]
    assert emu.nvpmodel_pending == 3 and emu.nvpmodel_mode == 1 and emu.boot_count == 0
    assert emu.nvpmodel_status_path.read_text().startswith("pmode:0003")
    assert ssh(emu, "nvpmodel -q").stdout == "NV Power Mode: 25W\n1\n"  # the running mode
    # re-applying the running mode cancels the pending one
    assert ssh(emu, "sudo nvpmodel -m 1").returncode == 0
    assert emu.nvpmodel_pending is None and emu.nvpmodel_status_path.read_text().startswith("pmode:0001")
    # EOF / bad input: pending as well
    bad = ssh(emu, "sudo nvpmodel -m 3")
    assert bad.returncode == 1 and bad.stdout.splitlines()[-2:] == [
        "NVPM ERROR: bad input!", "NVPM ERROR: optMask is 1, no request for power mode"]
    assert emu.clock_state()["pending_mode_name"] == "7W"
    assert ssh(emu, "sudo jetson_clocks --fan").returncode == 0
    # the next reboot of any kind boots into it, with every jetson_clocks lock gone
    assert ssh(emu, "sudo shutdown -r now").returncode == 0
    emu.wait_for_boot(0, timeout=15)
    st = emu.clock_state()
    assert (st["mode_name"], st["pending_mode"], st["none_locked"]) == ("7W", None, True)
    assert ssh(emu, "nvpmodel -q").stdout == "NV Power Mode: 7W\n3\n"
    assert emu.nvpmodel_status_path.read_text().startswith("pmode:0003")
    assert emu.gpu_railgate_path.read_text() == "1\n"


def test_legacy_clocks_locked_key_means_all_or_nothing(emulated_jetson_factory):
    emu = emulated_jetson_factory("orin_nano", clocks_locked=True)
    assert emu.clock_state()["all_locked"] and emu.gpu_railgate_path.read_text() == "0\n"
    assert show(emu)["EMC"]["FreqOverride"] == "1"
    emu.set_state(clocks_locked=False)
    assert emu.clocks_unlocked and emu.state["clocks_locked"] is None
    emu.set_clocks(emc_locked=True)
    assert emu.clock_state()["emc_locked"] and not emu.clocks_unlocked


# ------------------------------------------------------------------------------------ issue 11: sudo time stamps

def _exec(client, command: str, stdin: str = ""):
    chan = client.get_transport().open_session()
    chan.exec_command(command)
    if stdin:
        chan.sendall(stdin.encode())
    chan.shutdown_write()
    out = chan.makefile("rb").read().decode()
    err = chan.makefile_stderr("rb").read().decode()
    return chan.recv_exit_status(), out, err


def test_sudo_time_stamp_is_shared_by_one_ssh_connection_and_not_across(emulated_jetson_factory):
    emu = emulated_jetson_factory("orin_nano_super", sudo_password="s3cret")
    with emu.paramiko_client() as one, emu.paramiko_client() as other:
        assert _exec(one, "sudo -n id -u") == (1, "", "sudo: a password is required\n")
        assert _exec(one, "sudo -S -p '' id -u", "s3cret\n") == (0, "0\n", "")
        # the same connection: the same parent (its per-connection sshd), so the record is valid
        assert _exec(one, "sudo -n id -u") == (0, "0\n", "")
        # another connection (another sshd parent) has none; neither does a plain ssh invocation
        assert _exec(other, "sudo -n id -u")[0] == 1
        assert ssh(emu, "sudo -n id -u").returncode == 1
        # the hazard: with a valid record `sudo -S` reads no password, so the password written to stdin reaches
        # the command -- here nvpmodel takes it as its answer to the reboot question
        code, out, err = _exec(one, "sudo -S nvpmodel -m 3", "s3cret\nYES\n")
        assert code == 1 and err == ""  # no prompt
        assert out.splitlines()[-2:] == ["NVPM ERROR: bad input!", "NVPM ERROR: optMask is 1, no request for power mode"]
        assert emu.nvpmodel_pending == 3 and emu.boot_count == 0
        # -k invalidates the record of this connection, -v authenticates again, -K drops every record
        assert _exec(one, "sudo -k")[0] == 0
        assert _exec(one, "sudo -n id -u")[0] == 1
        assert _exec(one, "sudo -S -p '' -v", "s3cret\n")[0] == 0
        assert _exec(one, "sudo -n id -u") == (0, "0\n", "")
        assert _exec(other, "sudo -S -p '' -v", "s3cret\n")[0] == 0 and len(emu.state["sudo_timestamps"]) == 2
        assert _exec(other, "sudo -K")[0] == 0 and emu.state["sudo_timestamps"] == {}
        assert _exec(one, "sudo -n id -u")[0] == 1
        # a shell between ssh and sudo is another parent: its own record, shared by the sudo calls of that shell
        # (the trailing echo keeps bash from exec'ing the last sudo, which would make sshd its parent again)
        assert _exec(one, "sudo -S -p '' true; sudo -n id -u; echo done", "s3cret\n") == (0, "0\ndone\n", "")
        assert _exec(one, "sudo -n id -u")[0] == 1  # the connection's own record is still gone


def test_sudo_time_stamp_expires_after_the_configured_timeout(emulated_jetson_factory):
    emu = emulated_jetson_factory("thor", sudo_password="pw", sudo_timestamp_timeout_s=1.0)
    with emu.paramiko_client() as client:
        assert _exec(client, "sudo -S -p '' -v", "pw\n")[0] == 0
        assert _exec(client, "sudo -n true")[0] == 0
        time.sleep(1.3)
        assert _exec(client, "sudo -n true") == (1, "", "sudo: a password is required\n")
        emu.set_state(sudo_timestamp_timeout_s=-1)  # < 0: valid until the next reboot
        assert _exec(client, "sudo -S -p '' -v", "pw\n")[0] == 0
        time.sleep(0.2)
        assert _exec(client, "sudo -n true")[0] == 0


def test_password_typed_into_a_pty_before_sudo_reads_is_echoed(thor):
    thor.set_sudo_password("s3cret")
    with thor.paramiko_client() as client:
        chan = client.get_transport().open_session()
        chan.get_pty()
        chan.exec_command("sleep 0.5; sudo id -u")
        chan.sendall(b"s3cret\n")  # type-ahead: sudo has not started yet, the tty still echoes
        chan.settimeout(10)
        out = b""
        while True:
            data = chan.recv(4096)
            if not data:
                break
            out += data
        assert chan.recv_exit_status() == 0
    text = out.decode()
    # the line discipline echoed the password (the hazard), then sudo prompted, read it and ran the command
    assert text.startswith("s3cret\r\n")
    assert "[sudo] password for nvidia: " in text and text.rstrip().endswith("0")


# ------------------------------------------------------------------------------------ issue 11: modules, helpers

def test_orin_nano_super_on_r39(orin_nano_super_r39):
    emu = orin_nano_super_r39
    assert emu.product_profile == "orin_nano_super" and emu.l4t == "39.2.1"
    result = ssh(emu, f"head -n 1 {emu.nv_tegra_release_path}; nvpmodel -q; uname -r; cat {emu.nvpmodel_conf_path}")
    lines = result.stdout.splitlines()
    assert lines[0].startswith("# R39 (release), REVISION: 2.1, GCID: 46758480")
    assert lines[1:3] == ["NV Power Mode: 25W", "1"] and lines[3] == "6.8.12-1021-tegra"
    assert re.findall(r"^< POWER_MODEL ID=(\d+) NAME=(\S+) >$", result.stdout, re.M) == [
        ("0", "15W"), ("1", "25W"), ("2", "MAXN_SUPER")]
    text = ssh(emu, "sudo jetson_clocks --show").stdout.splitlines()
    assert text[1] == "Online CPUs: 0-5, Offline CPUs: "
    assert re.fullmatch(r"cpu0:  Governor=schedutil MinFreq=729600 MaxFreq=1344000 CurrentFreq=\d+ "
                        r"IdleStates: WFI=1 c7=1 ", text[2])
    emc = [line for line in text if line.startswith("EMC ")][0]
    assert "FreqOverride" not in emc and kv(emc)["MinFreq"] == "204000000"
    assert text[-3:-1] == ["FAN Dynamic Speed Control=nvfancontrol hwmon0_pwm1=60",
                           "FAN Dynamic Speed Control=nvfancontrol hwmon0_pwm1_enable=1"]
    assert ssh(emu, "sudo jetson_clocks").returncode == 0
    locked = show(emu)
    assert locked["EMC"]["MinFreq"] == locked["EMC"]["MaxFreq"] == locked["EMC"]["CurrentFreq"] == "3199000000"
    assert "FreqOverride" not in locked["EMC"] and locked["cpu0:"]["WFI"] == "0"
    assert locked["GPU"]["MinFreq"] == locked["GPU"]["MaxFreq"] == locked["GPU"]["CurrentFreq"] == "918000000"
    sample = parse_line(ssh(emu, "sudo timeout 0.35 tegrastats --interval 100").stdout.splitlines()[0])
    assert sample is not None and not sample.unknown and sample.ram_total_mb == 7486
    assert sample.rails["VDD_IN"].max_mw is not None  # R39: cur/avg/max


def test_agx_orin_jp5_devfreq_path_and_modes(agx_orin):
    conf = ssh(agx_orin, f"cat {agx_orin.nvpmodel_conf_path}").stdout
    assert "MAX_FREQ /sys/devices/17000000.ga10b/devfreq_dev/max_freq" in conf
    assert "MIN_FREQ /sys/devices/17000000.ga10b/devfreq_dev/min_freq" in conf
    assert "MAX_FREQ /sys/kernel/nvpmodel_emc_cap/emc_iso_cap" in conf
    assert re.findall(r"^< POWER_MODEL ID=(\d+) NAME=(\S+) >$", conf, re.M) == [
        ("0", "MAXN"), ("1", "MODE_15W"), ("2", "MODE_30W"), ("3", "MODE_50W")]
    assert re.search(r"^< PM_CONFIG DEFAULT=2 >$", conf, re.M)
    parsed = ssh(agx_orin, "nvpmodel -p --verbose").stdout
    assert "NVPM VERB: PM_CONFIG: DEFAULT=MODE_30W(2)" in parsed
    assert "NVPM VERB: MAX_FREQ /sys/devices/17000000.ga10b/devfreq_dev/max_freq" in parsed
    verbose = ssh(agx_orin, "nvpmodel -q --verbose").stdout
    assert "PATH /sys/devices/17000000.ga10b/devfreq_dev/min_freq:" in verbose
    assert verbose.splitlines()[2:4] == ["NVPM VERB: Current mode: NV Power Mode: MODE_30W", "2"]


def test_device_processes_lists_what_the_sessions_left_running(orin_nano):
    assert orin_nano.device_processes() == []
    client = orin_nano.paramiko_client()
    _, out, _ = client.exec_command("emu-hang")
    assert out.readline() == "emu-hang: started\n"
    assert ssh(orin_nano, f"sudo tegrastats --start --interval 200 --logfile {orin_nano.home}/t.log").returncode == 0
    hang = orin_nano.device_processes(["emu-hang"])
    assert len(hang) == 1 and hang[0]["argv"][-1].endswith("emu-hang")
    assert len(orin_nano.device_processes(["tegrastats"])) == 1  # the daemon outlives its session
    client.close()
    assert wait_for(lambda: orin_nano.device_processes(["emu-hang"]) == [])  # SIGHUP/EPIPE with the connection
    assert ssh(orin_nano, "sudo tegrastats --stop").returncode == 0
    assert wait_for(lambda: orin_nano.device_processes() == []), orin_nano.device_processes()


def test_real_paths_files_and_oc_counters_under_maxn_super(emulated_jetson_factory):
    emu = emulated_jetson_factory("orin_nano_super", real_paths=True, nvpmodel_mode=2)
    names = emu.run("cat /sys/class/hwmon/hwmon*/name").stdout.split()
    assert names == ["ina3221", "soctherm_oc", "pwmfan", "pwm_tach"]
    hw = "/sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon1"
    labels = emu.run(f"cat {hw}/in1_label {hw}/in2_label {hw}/in3_label").stdout.split()
    assert labels == ["VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"]
    assert emu.run("cat /etc/nv_tegra_release").stdout == emu.profile["nv_tegra_release"]
    oc = "/sys/class/hwmon/hwmon2/oc3_event_cnt"
    before = int(emu.run(f"cat {oc}").stdout)
    assert before == 0
    emu.run("emu-gpu-load 3", timeout=30)
    after = int(emu.run(f"cat {oc}").stdout)
    assert after > 50  # emulator rate: 50/s while a workload runs in a MAXN* mode


def test_real_paths_oc_counters_stay_zero_below_maxn(emulated_jetson_factory):
    emu = emulated_jetson_factory("orin_nano_super", real_paths=True)  # 25W
    emu.run("emu-gpu-load 2", timeout=30)
    assert emu.run("cat /sys/class/hwmon/hwmon2/oc3_event_cnt").stdout.strip() == "0"
