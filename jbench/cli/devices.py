"""`jbench devices`, `doctor` and `calibrate`: the device inventory and its checks."""

from __future__ import annotations

from typing import Any, Optional

import click
from rich.table import Table

from jbench.cli.app import common_options, _config_dir_option, _fail, console, main
from jbench.core.exitcodes import ExitCode
from jbench.core.schema import DeviceConfig, ModelConfig, ProfileConfig, typed
from jbench.core.trial import backend_config
from jbench.device.connection import DeviceError
from jbench.device.doctor import Check, build_check, check_device, doctor as run_doctor, model_check, worst
from jbench.device.lease import DeviceLease
from jbench.device.power import PowerStrategy
from jbench.device.bandwidth import CPU, GPU, NOISY_SPREAD, CalibrationError, calibrate as measure, save_calibration


def _device_config(name: str, config_dirs) -> tuple[DeviceConfig, Optional[ProfileConfig], Any]:
    """(device, profile or None, backend CONFIG) for a device entry, through the same composition as sweeps."""
    from omegaconf import OmegaConf

    from jbench.config import ConfigError, compose, load_profile, user_config_dirs

    try:
        dirs = user_config_dirs(list(config_dirs))
        cfg, _ = compose([f"device={name}"], dirs)
        device = typed(DeviceConfig, OmegaConf.to_container(cfg.device, resolve=True), where="device")
        backend = backend_config(OmegaConf.to_container(cfg.backend, resolve=True))
        profile = typed(ProfileConfig, load_profile(device.profile, dirs), where="profile") if device.profile else None
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    return device, profile, backend


def _default_model(config_dirs) -> ModelConfig:
    """The model a plain `jbench run` would benchmark (conf/config.yaml's choice, or the user's)."""
    from omegaconf import OmegaConf

    from jbench.config import ConfigError, compose, user_config_dirs

    try:
        cfg, _ = compose([], user_config_dirs(list(config_dirs)))
        return typed(ModelConfig, OmegaConf.to_container(cfg.model, resolve=True), where="model")
    except ConfigError as exc:
        raise _fail(str(exc)) from None


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
        address = "this machine" if device.kind == "local" else \
            f"{device.user + '@' if device.user else ''}{device.host}:{device.port}"
        tags = ", ".join(f"{k}={v}" for k, v in device.tags.items())
        table.add_row(name, device.kind, address, device.profile or "-", tags)
    console.print(table)


@devices.command("check")
@common_options(results_dir=False)
@click.argument("names", nargs=-1)
@_config_dir_option
def devices_check(names, config_dirs) -> None:
    """Check reachability, sudo rights and tools of NAMES (default: every device)."""
    from jbench.backends.llamacpp.backend import LlamaCppConfig
    from jbench.config import available_choices, user_config_dirs
    from jbench.device.connect import connect

    names = names or available_choices("device", user_config_dirs(list(config_dirs)))
    failed = False
    for name in names:
        device, _, backend = _device_config(name, config_dirs)
        # A remote device's llama-bench is checked where the config names its build (backend.binary_dir).
        remote_build = backend.binary_dir if isinstance(backend, LlamaCppConfig) and device.kind != "local" else None
        try:
            with connect(device) as conn:
                checks = check_device(conn, device, remote_build)
        except DeviceError as exc:

            checks = [Check("reachable", "fail", str(exc))]
        failed |= worst(checks) == "fail"
        console.print(_checks_table(f"device {name}", checks))
    if failed:
        raise click.exceptions.Exit(ExitCode.FAILED)


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

    device, profile, _ = _device_config(name, config_dirs)
    if not device.profile:
        raise _fail(f"device '{name}' has no Jetson profile (device.profile): jbench never changes its power state")
    try:
        with connect(device) as conn:
            lease = DeviceLease(conn, device, "restore")
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
        raise click.exceptions.Exit(ExitCode.FAILED)
    console.print(f"device '{name}': restored to its recorded original power state")


@main.command()
@common_options(results_dir=False)
@click.argument("device_name", metavar="DEVICE")
@_config_dir_option
def doctor(device_name: str, config_dirs) -> None:
    """Audit DEVICE before LLM work: versions, memory, clocks, power mode, disk, temperatures, GUI, swap; for this
    machine (a local device) also what a sweep needs here: the llama.cpp build, the model's files, the CPU governor."""
    from jbench.backends.llamacpp.backend import LlamaCppConfig
    from jbench.device.connect import connect

    device, profile, backend = _device_config(device_name, config_dirs)
    try:
        with connect(device) as conn:
            checks = run_doctor(conn, device, profile)
    except DeviceError as exc:
        raise _fail(str(exc)) from None
    if device.kind == "local":  # what a sweep here needs: the backend's build (llama.cpp's), the model's files
        if isinstance(backend, LlamaCppConfig):
            checks.append(build_check(backend.binary_dir))
        checks.append(model_check(_default_model(config_dirs)))
    console.print(_checks_table(f"doctor: {device_name}" + (f" ({profile.module})" if profile else ""), checks))
    if worst(checks) == "fail":
        raise click.exceptions.Exit(ExitCode.FAILED)


@main.command()
@common_options(results_dir=False)
@click.argument("device_name", metavar="DEVICE")
@click.option("--probe", type=click.Choice(["auto", "cpu", "gpu", "both"]), default="auto", show_default=True,
              help="cpu: all cores reading; gpu: a CUDA read kernel (built with the device's nvcc); "
                   "auto: cpu, and gpu too where it can run; both: cpu and gpu, failing if either cannot.")
@click.option("--size-mb", type=click.IntRange(min=16), default=None,
              help="Probe buffer (default: 512 for cpu, or 8x the last-level cache if larger; 1024 for gpu).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU probe threads (default: the device's online cores); match backend.threads if you set it.")
@click.option("--runs", type=click.IntRange(min=3, max=100), default=7, show_default=True,
              help="Probe runs: median, min and spread over them; the ceiling is the best run.")
@_config_dir_option
def calibrate(device_name, probe, size_mb, threads, runs, config_dirs) -> None:
    """Measure the read bandwidth that decode's compute path achieves on DEVICE, for the roofline ceiling.

    The result is kept per device, probe and power state (nvpmodel mode and jetson_clocks on a Jetson, the
    CPU governor elsewhere); sweeps use the one matching each trial."""
    from jbench.device.connect import connect

    device, profile, _ = _device_config(device_name, config_dirs)
    probes = {"auto": [CPU, GPU], "both": [CPU, GPU], "cpu": [CPU], "gpu": [GPU]}[probe]
    done = 0
    try:
        with connect(device) as conn:
            for p in probes:
                try:
                    cal = measure(conn, device, profile, probe=p, size_mb=size_mb,
                                  threads=threads if p == CPU else None, runs=runs)
                except CalibrationError as exc:
                    if probe == "auto" and p == GPU:
                        # auto: the GPU probe only where the device has a usable CUDA GPU.
                        console.print(f"{device_name}: no GPU read probe here ({exc})", markup=False, highlight=False)
                        continue
                    raise _fail(str(exc)) from None
                path = save_calibration(cal, threads_key=threads if p == CPU else None)
                done += 1
                console.print(f"{device_name} ({p} probe, {cal.power_state}): {cal.summary()}\n"
                              f"  method: {cal.method}\n  saved to {path}", markup=False, highlight=False)
                if cal.spread > NOISY_SPREAD:
                    console.print(f"  the runs spread {cal.spread:.0%} (over {NOISY_SPREAD:.0%}): something else "
                                  "was using the memory; run it again on an idle device", markup=False, highlight=False)
    except DeviceError as exc:
        raise _fail(str(exc)) from None
    if profile and done:
        console.print(f"  datasheet: {profile.memory_bandwidth_gbs:g} GB/s ({profile.name})", markup=False,
                      highlight=False)
