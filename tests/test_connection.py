"""The local connection: argument lists, never a shell."""

from __future__ import annotations

from pathlib import Path

import pytest

from jbench.device.connection import CommandTimeout, DeviceError

from jbench.device.local import LocalConnection

from jbench.device.connect import connect
from jbench.device.fingerprint import host_fingerprint, parse_host_fingerprint


def test_config_values_stay_single_arguments(tmp_path):
    conn = LocalConnection()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    hostile = f"a; rm -rf {victim}; echo $(touch {tmp_path}/pwned)"
    res = conn.run(["ls", hostile])
    assert res.returncode != 0 and "No such file" in res.stderr
    assert victim.exists() and not (tmp_path / "pwned").exists()
    assert conn.exists(hostile) is False


def test_missing_program_and_timeout():
    conn = LocalConnection()
    res = conn.run(["/nonexistent/llama-bench", "-h"])
    assert res.returncode == 127 and "not found" in res.stderr
    with pytest.raises(CommandTimeout, match="did not finish within 0.2 s"):
        conn.run(["sleep", "5"], timeout=0.2)


def test_unknown_device_kind():
    with pytest.raises(DeviceError, match="kind 'telnet' is not supported. Valid kinds: local, ssh"):
        connect({"name": "x", "kind": "telnet"})


def test_host_fingerprint_of_this_machine():
    tags = host_fingerprint(LocalConnection())
    assert tags["host.kernel"].startswith("Linux")
    assert int(tags["host.cpu_count"]) >= 1 and int(tags["host.ram_mib"]) > 0
    assert tags["host.cpu"]


def test_fingerprint_parser_leaves_out_what_is_absent():
    text = "@@hostname\norin\n@@kernel\nLinux 5.15.148-tegra aarch64\n@@os\nPRETTY_NAME=\"Ubuntu 22.04.4 LTS\"\n@@cpuinfo\n@@lscpu\nModel name:  Cortex-A78AE\n@@ncpu\n6\n@@meminfo\nMemTotal:        7802868 kB\n@@gpu\n@@dtmodel\nNVIDIA Jetson Orin Nano Developer Kit\n"
    tags = parse_host_fingerprint(text)
    assert tags == {
        "host.hostname": "orin", "host.kernel": "Linux 5.15.148-tegra aarch64", "host.os": "Ubuntu 22.04.4 LTS",
        "host.cpu": "Cortex-A78AE", "host.cpu_count": "6", "host.ram_mib": "7619",
        "host.model": "NVIDIA Jetson Orin Nano Developer Kit",
    }
