"""`jbench devices`, `doctor` and `calibrate`: the device inventory and its checks."""

from __future__ import annotations

from typing import Optional

import click
from rich.table import Table

from jbench.cli import common_options, EXIT_FAILED_TRIALS, _config_dir_option, _fail, console, main


def _device_config(name: str, config_dirs) -> tuple[dict, Optional[dict], dict]:
    """(device, profile or None, backend) for a device entry, through the same composition as sweeps."""
    from omegaconf import OmegaConf

    from jbench.config import ConfigError, compose, load_profile, user_config_dirs

    try:
        dirs = user_config_dirs(list(config_dirs))
        cfg, _ = compose([f"device={name}"], dirs)
        device = OmegaConf.to_container(cfg.device, resolve=True)
        backend = OmegaConf.to_container(cfg.backend, resolve=True)
        profile = load_profile(device["profile"], dirs) if device.get("profile") else None
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    return device, profile, backend


def _checks_table(title: str, checks) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("item", "status", "detail", "fix"):
        table.add_column(col, overflow="fold")
    colors = {"pass": "green", "warn": "yellow", "fail": "red", "info": "blue"}
    for c in checks:
        table.add_row(c.item, f"[{colors[c.status]}]{c.status}[/]", c.detail, c.fix)
    return table


@main.group()
@common_options(results_dir=False)
def devices() -> None:
    """The device inventory: device/*.yaml in jbench's conf and your config dirs."""


@devices.command("list")
@common_options(results_dir=False)
@_config_dir_option
def devices_list(config_dirs) -> None:
    """List the devices jbench knows."""
    from jbench.config import ConfigError, available_choices, user_config_dirs

    try:
        names = available_choices("device", user_config_dirs(list(config_dirs)))
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    table = Table(title="devices", title_justify="left")
    for col in ("name", "kind", "address", "profile", "tags"):
        table.add_column(col)
    for name in names:
        device, _, _ = _device_config(name, config_dirs)
        address = "this machine" if device["kind"] == "local" else \
            f"{device.get('user') + '@' if device.get('user') else ''}{device.get('host')}:{device.get('port')}"
        tags = ", ".join(f"{k}={v}" for k, v in (device.get("tags") or {}).items())
        table.add_row(name, device["kind"], address, device.get("profile") or "-", tags)
    console.print(table)


@devices.command("check")
@common_options(results_dir=False)
@click.argument("names", nargs=-1)
@_config_dir_option
def devices_check(names, config_dirs) -> None:
    """Check reachability, sudo rights and tools of NAMES (default: every device)."""
    from jbench.config import available_choices, user_config_dirs
    from jbench.device.connection import DeviceError
    from jbench.device.connect import connect
    from jbench.device.doctor import check_device, worst

    names = names or available_choices("device", user_config_dirs(list(config_dirs)))
    failed = False
    for name in names:
        device, _, backend = _device_config(name, config_dirs)
        try:
            with connect(device) as conn:
                checks = check_device(conn, device, backend.get("binary_dir") if device["kind"] != "local" else None)
        except DeviceError as exc:
            from jbench.device.doctor import Check

            checks = [Check("reachable", "fail", str(exc))]
        failed |= worst(checks) == "fail"
        console.print(_checks_table(f"device {name}", checks))
    if failed:
        raise click.exceptions.Exit(EXIT_FAILED_TRIALS)


@devices.command("restore")
@common_options(results_dir=False)
@click.argument("name")
@click.option("--allow-reboot", is_flag=True, help="Reboot the device if its original power mode needs one.")
@click.option("--wait", "wait_s", type=float, default=0.0, show_default=True,
              help="Seconds to wait for another controller's lease.")
@_config_dir_option
def devices_restore(name, allow_reboot, wait_s, config_dirs) -> None:
    """Put NAME back in the power state a jbench sweep recorded (after a crash, or a restore that needed a reboot)."""
    from jbench.device.connect import connect
    from jbench.device.connection import DeviceError
    from jbench.device.lease import DeviceLease
    from jbench.device.power import PowerStrategy

    device, profile, _ = _device_config(name, config_dirs)
    if not device.get("profile"):
        raise _fail(f"device '{name}' has no Jetson profile (device.profile): jbench never changes its power state")
    try:
        with connect(device) as conn:
            lease = DeviceLease(conn, device, "restore", stale_s=float(device.get("lease_stale_s") or 120.0))
            lease.acquire(wait_s)
            try:
                power = PowerStrategy(conn, device, profile=profile)
                if power._read_state_file() is None:
                    console.print(f"device '{name}': no recorded state; nothing to restore")
                    return
                done = power.recover_leftover(allow_reboot=allow_reboot)
            finally:
                lease.release()
    except DeviceError as exc:
        raise _fail(str(exc)) from None
    if not done:
        console.print(f"[red]device '{name}' is not fully restored[/] (see the log above); the state file stays")
        raise click.exceptions.Exit(EXIT_FAILED_TRIALS)
    console.print(f"device '{name}': restored to its recorded original power state")


@main.command()
@common_options(results_dir=False)
@click.argument("device_name", metavar="DEVICE")
@_config_dir_option
def doctor(device_name: str, config_dirs) -> None:
    """Audit DEVICE before LLM work: versions, memory, clocks, power mode, disk, temperatures, GUI, swap."""
    from jbench.device.connection import DeviceError
    from jbench.device.connect import connect
    from jbench.device.doctor import doctor as run_doctor
    from jbench.device.doctor import worst

    device, profile, _ = _device_config(device_name, config_dirs)
    try:
        with connect(device) as conn:
            checks = run_doctor(conn, device, profile)
    except DeviceError as exc:
        raise _fail(str(exc)) from None
    console.print(_checks_table(f"doctor: {device_name}" + (f" ({profile['module']})" if profile else ""), checks))
    if worst(checks) == "fail":
        raise click.exceptions.Exit(EXIT_FAILED_TRIALS)



@main.command()
@common_options(results_dir=False)
@click.argument("device_name", metavar="DEVICE")
@click.option("--size-mb", type=int, default=512, show_default=True)
@_config_dir_option
def calibrate(device_name, size_mb, config_dirs) -> None:
    """Measure achievable memory bandwidth on DEVICE (numpy copy on the device's CPU) for the roofline."""
    from jbench.device.connection import DeviceError
    from jbench.device.connect import connect
    from jbench.device.bandwidth import measure_bandwidth, save_calibration

    device, profile, _ = _device_config(device_name, config_dirs)
    try:
        with connect(device) as conn:
            gbs = measure_bandwidth(conn, size_mb)
    except (DeviceError, ValueError) as exc:
        raise _fail(str(exc)) from None
    path = save_calibration(device_name, gbs)
    note = f" (datasheet {profile['memory_bandwidth_gbs']:g} GB/s)" if profile else ""
    console.print(f"{device_name}: {gbs:.1f} GB/s achievable (CPU copy){note}; saved to {path}", highlight=False)

