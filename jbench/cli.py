"""The `jbench` command: one entry point for every job.

Errors a user can cause end in one clear message (exit 2) naming the fix; a sweep with failed
trials exits 1 after recording them; tracebacks are reserved for bugs.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path
from typing import Optional

import click
from rich.console import Console
from rich.table import Table

from . import __version__

console = Console()
err_console = Console(stderr=True)

EXIT_FAILED_TRIALS = 1
EXIT_USER_ERROR = 2

_OVERRIDES = {"ignore_unknown_options": True, "allow_extra_args": False}
_config_dir_option = click.option(
    "--config-dir",
    "config_dirs",
    multiple=True,
    type=click.Path(file_okay=False),
    help="Your own config directory (device/, model/, experiment/ ...), searched before jbench's. "
    "Repeatable; also $JBENCH_CONFIG_PATH.",
)


def _fail(message: str) -> "click.exceptions.Exit":
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    return click.exceptions.Exit(EXIT_USER_ERROR)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="jbench")
@click.option("-v", "--verbose", is_flag=True, help="Show debug logs.")
def main(verbose: bool) -> None:
    """jbench: Jetson LLM benchmark orchestration and experiment tracking."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not verbose:
        # MLflow announces store migrations at INFO; jbench prints its own progress.
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        logging.getLogger("alembic").setLevel(logging.WARNING)


def _plan(overrides, config_dirs, use_grid: bool):
    from .config import ConfigError, user_config_dirs
    from .sweeps.plan import plan

    try:
        dirs = user_config_dirs(list(config_dirs))
        return plan(list(overrides), dirs, use_grid=use_grid)
    except ConfigError as exc:
        raise _fail(str(exc)) from None


def _fmt(value: float, std: float = math.nan) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if std is None or math.isnan(std):
        return f"{value:.2f}"
    return f"{value:.2f} ± {std:.2f}"


def _summary_table(outcome) -> Table:
    table = Table(title=f"{outcome.experiment}: sweep {outcome.sweep_id}", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("trial")
    table.add_column("status")
    table.add_column("prefill tok/s", justify="right")
    table.add_column("decode tok/s", justify="right")
    table.add_column("run id / reason", overflow="fold")
    for o in outcome.outcomes:
        m = o.metrics
        color = {"FINISHED": "green", "FAILED": "red"}.get(o.status, "yellow")
        table.add_row(
            str(o.trial.index),
            o.trial.label,
            f"[{color}]{o.status}[/]",
            _fmt(m.get("prefill_tps", math.nan), m.get("prefill_tps_std", math.nan)),
            _fmt(m.get("decode_tps", math.nan), m.get("decode_tps_std", math.nan)),
            (o.run_id or "")[:12] + ("" if o.status == "FINISHED" else f"  {o.category}: {o.error}"),
        )
    return table


def _sigterm_as_interrupt() -> None:
    """SIGTERM (a CI job cancelled, `kill`) unwinds like Ctrl-C, so devices are restored."""
    import signal

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def _execute(plan_, dry_run: bool) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from .sweeps.runner import PreflightError, run_plan
    from .tracking import Tracker

    if plan_.problems:
        err_console.print(f"[bold red]error:[/] {len(plan_.problems)} problem(s) in the sweep; nothing was run:")
        for p in plan_.problems:
            err_console.print(f"  - {p}", highlight=False)
        raise click.exceptions.Exit(EXIT_USER_ERROR)
    if not plan_.trials:
        raise _fail("the sweep has no trials")
    console.print(f"[bold]{plan_.experiment}[/]: {len(plan_.trials)} trial(s)"
                  + (f" over {', '.join(plan_.dims)}" if plan_.dims else ""))
    if dry_run:
        for t in plan_.trials:
            console.print(f"  {t.index:>4}  {t.label}  [dim]{t.config_hash}[/]", highlight=False)
        return

    progress = Progress(
        TextColumn("[bold]trial {task.completed}/{task.total}[/]"),
        BarColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=False,
    )

    def tracker():
        t = Tracker(plan_.tracking.get("uri"), plan_.tracking["results_dir"])
        console.print(f"tracking to {t.uri}", highlight=False)
        return t

    _sigterm_as_interrupt()
    with progress:
        task = progress.add_task("", total=len(plan_.trials))

        def start(trial):
            progress.update(task, description=f"running {trial.label}")

        def end(outcome):
            progress.advance(task)
            for finding in outcome.findings:
                progress.console.print(f"[yellow]trial {outcome.trial.index} finding:[/] {finding}", highlight=False)
            if outcome.status != "FINISHED":
                progress.console.print(
                    f"[red]trial {outcome.trial.index} FAILED[/] ({outcome.category}): {outcome.error}", highlight=False
                )

        try:
            result = run_plan(plan_, tracker_factory=tracker, on_trial_start=start, on_trial_end=end)
        except PreflightError as exc:
            progress.stop()
            raise _fail(f"the device is not ready; nothing was run:\n{exc}") from None
        except KeyboardInterrupt:
            progress.stop()
            err_console.print("[yellow]interrupted: the current trial and the sweep are recorded as KILLED[/]")
            raise click.exceptions.Exit(130) from None
    console.print(_summary_table(result))
    notes = sorted({n for o in result.outcomes for n in o.notes})
    for note in notes:  # said once per sweep, not once per trial
        err_console.print(f"[yellow]energy not measured:[/] {note}", highlight=False)
    console.print(f"results: {result.tracking_uri} (experiment '{result.experiment}'); "
                  f"browse them with `jbench ui`", highlight=False)
    if result.failed:
        err_console.print(f"[bold red]{len(result.failed)} of {len(result.outcomes)} trial(s) failed[/]")
        raise click.exceptions.Exit(EXIT_FAILED_TRIALS)


@main.command(context_settings=_OVERRIDES)
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@_config_dir_option
@click.option("--dry-run", is_flag=True, help="Print the planned trials and run nothing.")
def sweep(overrides: tuple[str, ...], config_dirs: tuple[str, ...], dry_run: bool) -> None:
    """Run an experiment's grid: jbench sweep +experiment=quant_ladder [key=value|key=a,b ...]"""
    _execute(_plan(overrides, config_dirs, use_grid=True), dry_run)


@main.command(context_settings=_OVERRIDES)
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@_config_dir_option
@click.option("--dry-run", is_flag=True, help="Print the trial and run nothing.")
def run(overrides: tuple[str, ...], config_dirs: tuple[str, ...], dry_run: bool) -> None:
    """Run one trial (the experiment's grid is not expanded): jbench run model.quant=Q8_0"""
    _execute(_plan(overrides, config_dirs, use_grid=False), dry_run)


@main.command(context_settings=_OVERRIDES)
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@_config_dir_option
@click.option("--cuda/--no-cuda", default=None, help="Force a CUDA or CPU build (default: CUDA when nvcc and an NVIDIA GPU are found).")
@click.option("--jobs", "-j", type=int, default=None, help="Parallel build jobs (default: all cores).")
@click.option("--force", is_flag=True, help="Rebuild llama.cpp even if a build exists.")
@click.option("--skip-model", is_flag=True, help="Only build llama.cpp.")
def setup(overrides, config_dirs, cuda: Optional[bool], jobs: Optional[int], force: bool, skip_model: bool) -> None:
    """Provision the embedded default: build llama.cpp, install and quantize the bundled model."""
    from omegaconf import OmegaConf

    from .config import ConfigError, compose, user_config_dirs
    from .provision import SetupError, build_llamacpp, install_bundled_model

    def say(msg: str) -> None:
        console.print(f"[cyan]setup[/] {msg}", highlight=False)

    try:
        cfg, _ = compose(list(overrides), user_config_dirs(list(config_dirs)))
        model = OmegaConf.to_container(cfg.model, resolve=True)
        started = time.monotonic()
        build = build_llamacpp(cuda, jobs, force, say)
        if not skip_model:
            if model.get("source") != "bundled":
                say(f"model '{model['name']}' is not a bundled model: nothing to install")
            else:
                manifest = install_bundled_model(model, build, say)
                for quant in [model["source_quant"], *model.get("ladder", [])]:
                    entry = manifest["files"].get(quant)
                    if entry:
                        note = f"requantized from {entry['requantized_from']}" if entry.get("requantized_from") else "original"
                        say(f"  {quant:<7} {entry['path']}  ({note})")
    except (ConfigError, SetupError) as exc:
        raise _fail(str(exc)) from None
    say(f"ready in {time.monotonic() - started:.0f} s. Next: jbench sweep +experiment=quant_ladder")


def _device_config(name: str, config_dirs) -> tuple[dict, Optional[dict], dict]:
    """(device, profile or None, backend) for a device entry, through the same composition as sweeps."""
    from omegaconf import OmegaConf

    from .config import ConfigError, compose, load_profile, user_config_dirs

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
def devices() -> None:
    """The device inventory: device/*.yaml in jbench's conf and your config dirs."""


@devices.command("list")
@_config_dir_option
def devices_list(config_dirs) -> None:
    """List the devices jbench knows."""
    from .config import ConfigError, available_choices, user_config_dirs

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
@click.argument("names", nargs=-1)
@_config_dir_option
def devices_check(names, config_dirs) -> None:
    """Check reachability, sudo rights and tools of NAMES (default: every device)."""
    from .config import available_choices, user_config_dirs
    from .device.connection import DeviceError, connect
    from .device.doctor import check_device, worst

    names = names or available_choices("device", user_config_dirs(list(config_dirs)))
    failed = False
    for name in names:
        device, _, backend = _device_config(name, config_dirs)
        try:
            with connect(device) as conn:
                checks = check_device(conn, device, backend.get("binary_dir") if device["kind"] != "local" else None)
        except DeviceError as exc:
            from .device.doctor import Check

            checks = [Check("reachable", "fail", str(exc))]
        failed |= worst(checks) == "fail"
        console.print(_checks_table(f"device {name}", checks))
    if failed:
        raise click.exceptions.Exit(EXIT_FAILED_TRIALS)


@main.command()
@click.argument("device_name", metavar="DEVICE")
@_config_dir_option
def doctor(device_name: str, config_dirs) -> None:
    """Audit DEVICE before LLM work: versions, memory, clocks, power mode, disk, temperatures, GUI, swap."""
    from .device.connection import DeviceError, connect
    from .device.doctor import doctor as run_doctor
    from .device.doctor import worst

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
@click.option("--port", default=5000, show_default=True)
@click.option("--results-dir", default=None, help="Results directory (default: $JBENCH_RESULTS_DIR or ./results).")
def ui(port: int, results_dir: Optional[str]) -> None:
    """Open the MLflow UI on jbench's results."""
    import os
    import subprocess

    from .tracking import resolve_uri

    results = results_dir or os.environ.get("JBENCH_RESULTS_DIR", "results")
    uri = resolve_uri(None, results)
    console.print(f"MLflow UI on http://127.0.0.1:{port} for {uri} (Ctrl-C to stop)", highlight=False)
    argv = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port)]
    if uri.startswith("sqlite:"):
        argv += ["--default-artifact-root", (Path(results).resolve() / "artifacts").as_uri()]
    raise SystemExit(subprocess.call(argv))


if __name__ == "__main__":
    main()
