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

from jbench import __version__

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
    from jbench.config import ConfigError, user_config_dirs
    from jbench.sweeps.plan import plan

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
        color = {"FINISHED": "green", "FAILED": "red", "SKIPPED": "cyan"}.get(str(o.status), "yellow")
        table.add_row(
            str(o.trial.index),
            o.trial.label,
            f"[{color}]{o.status}[/]",
            _fmt(m.get("prefill_tps", math.nan), m.get("prefill_tps_std", math.nan)),
            _fmt(m.get("decode_tps", math.nan), m.get("decode_tps_std", math.nan)),
            (o.run_id or "")[:12] + ("" if o.status == "FINISHED" else f"  {o.category}: {o.error}")
            + ("  [noisy]" if o.noisy else ""),
        )
    return table


def _sigterm_as_interrupt() -> None:
    """SIGTERM (a CI job cancelled, `kill`) unwinds like Ctrl-C, so devices are restored."""
    import signal

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def _history(plan_) -> dict:
    """FINISHED trials of the plan's experiment (for estimates), without creating a store."""
    from jbench.tracking.common import resolve_uri, store_exists

    uri = resolve_uri(plan_.tracking.get("uri"), plan_.tracking["results_dir"])
    if not store_exists(uri):
        return {}
    from jbench.tracking.resume_index import finished_trials_sqlite

    exp_name = plan_.tracking.get("experiment_name") or plan_.experiment
    fast = finished_trials_sqlite(uri, exp_name, key="config_hash")
    if fast is not None:
        return fast
    from jbench.tracking.reader import finished_trials  # imports mlflow (~1-2 s): only when sqlite3 cannot answer

    try:
        return finished_trials(uri, exp_name)
    except Exception as exc:  # an unreachable tracking server must not stop a dry run
        err_console.print(f"[yellow]no duration estimate: {exc}[/]")
        return {}


def _execute(plan_, dry_run: bool) -> None:
    if plan_.problems:
        err_console.print(f"[bold red]error:[/] {len(plan_.problems)} problem(s) in the sweep; nothing was run:")
        for p in plan_.problems:
            err_console.print(f"  - {p}", highlight=False)
        raise click.exceptions.Exit(EXIT_USER_ERROR)
    if not plan_.trials:
        raise _fail("the sweep has no trials")
    console.print(f"[bold]{plan_.experiment}[/]: {len(plan_.trials)} trial(s)"
                  + (f" over {', '.join(plan_.dims)}" if plan_.dims else ""))
    for note in plan_.notes:
        console.print(f"[cyan]note:[/] {note}", highlight=False)
    notes_shown = len(plan_.notes)
    if dry_run:
        from jbench.trial import resume_key

        history = _history(plan_)
        known = 0.0
        unknown = 0
        for t in plan_.trials:
            wall = (history.get(t.resume_key) or history.get(resume_key(t.config_hash, 1)) or {}).get("wall_s")
            if wall:
                known += wall
            else:
                unknown += 1
            est = f"~{wall:.0f} s" if wall else "no estimate"
            console.print(f"  {t.index:>4}  {t.label}  [dim]{t.config_hash}  {est}[/]", highlight=False)
        done = sum(1 for t in plan_.trials if t.resume_key in history)
        console.print(f"estimated duration: {known / 60:.1f} min for {len(plan_.trials) - unknown} trial(s) from earlier "
                      f"runs of the same configuration; {unknown} trial(s) without history"
                      + (f"; {done} already FINISHED (resume skips them unless sweep.rerun=true)" if done else ""),
                      highlight=False)
        return

    # Imported only to run: the sweep imports mlflow when it needs a store, which a dry run does not.
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from jbench.sweeps.sweep import PreflightError, Sweep

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
        from jbench.tracking.writer import Tracker  # mlflow: only once the runner asks for a store

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
                progress.console.print(f"[yellow]trial {outcome.trial.index} finding:[/] {finding.message}",
                                       highlight=False)
            if outcome.status == "FAILED":
                progress.console.print(
                    f"[red]trial {outcome.trial.index} FAILED[/] ({outcome.category}): {outcome.error}", highlight=False
                )
            elif outcome.status == "SKIPPED":
                progress.console.print(f"[cyan]trial {outcome.trial.index} skipped[/] ({outcome.category}): "
                                       f"{outcome.error}", highlight=False)

        try:
            result = Sweep(plan_, tracker, on_trial_start=start, on_trial_end=end).run()
        except PreflightError as exc:
            progress.stop()
            raise _fail(f"the device is not ready; nothing was run:\n{exc}") from None
        except KeyboardInterrupt:
            progress.stop()
            err_console.print("[yellow]interrupted: the current trial and the sweep are recorded as KILLED[/]")
            raise click.exceptions.Exit(130) from None
    console.print(_summary_table(result))
    for note in result.notes[notes_shown:]:  # drops decided at preflight (backends not available)
        console.print(f"[cyan]note:[/] {note}", highlight=False)
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

    from jbench.config import ConfigError, compose, user_config_dirs
    from jbench.models.provision import SetupError, build_llamacpp, install_bundled_model

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
def devices() -> None:
    """The device inventory: device/*.yaml in jbench's conf and your config dirs."""


@devices.command("list")
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


def _results_tracker(results_dir: Optional[str]):
    import os

    from jbench.tracking.writer import Tracker

    return Tracker(None, results_dir or os.environ.get("JBENCH_RESULTS_DIR", "results"))


_results_option = click.option("--results-dir", default=None,
                               help="Results directory (default: $JBENCH_RESULTS_DIR or ./results); "
                                    "$MLFLOW_TRACKING_URI wins when set.")


def _sample_loader(tracker):
    from jbench.tracking.reader import repetition_samples

    return lambda run_ids, metric: repetition_samples(tracker, list(run_ids), metric)


def _selection(tracker, spec: str):
    """A sweep id, a run id, or TAG=VALUE -> the trial runs it names."""
    from jbench.tracking.reader import runs_frame, with_current_hashes

    if "=" in spec:
        tag, _, value = spec.partition("=")
        df = runs_frame(tracker, tag_filters={tag: value})
    else:
        df = runs_frame(tracker, sweep_ids=[spec])
        if df.empty:
            df = runs_frame(tracker, run_ids=[spec])
    if df.empty:
        raise _fail(f"'{spec}' selects no trial runs: give a sweep id (tag jbench.sweep_id), a run id, or TAG=VALUE")
    return with_current_hashes(df)  # runs recorded under an older hash scheme match today's


@main.command()
@click.option("--experiment", "experiment", default=None, help="Experiment name (default: the newest sweep's).")
@click.option("--sweep", "sweep_id", default=None, help="One sweep (jbench.sweep_id) instead of the whole experiment.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--no-log", is_flag=True, help="Do not attach the report to the sweep's parent MLflow run.")
@_results_option
def report(experiment, sweep_id, out_dir, no_log, results_dir) -> None:
    """HTML and markdown report with plots: quant ladder, context scaling, power modes, telemetry, findings."""
    from jbench.reporting.report import build_report
    from jbench.tracking.reader import runs_frame, telemetry_frame

    tracker = _results_tracker(results_dir)
    try:
        df = runs_frame(tracker, [experiment] if experiment else None, sweep_ids=[sweep_id] if sweep_id else None)
    except LookupError as exc:
        raise _fail(str(exc)) from None
    if df.empty:
        raise _fail("no trial runs found for that selection; run a sweep first")
    if experiment is None and sweep_id is None:
        newest = df.sort_values("start_time").iloc[-1]
        experiment = newest["experiment"]
        df = df[df["experiment"] == experiment]
    out = Path(out_dir or Path(tracker.results_dir) / "reports" / (sweep_id or experiment or "all"))
    tel = telemetry_frame(tracker, list(df["run_id"]))
    files = build_report(df, _sample_loader(tracker), tel if tel is not None and len(tel) else None,
                         out_dir=out, title=f"jbench report: {sweep_id or experiment}")
    console.print(f"report: {files.html_path}\nsummary: {files.markdown_path}", highlight=False)
    if not no_log:
        parents = runs_frame(tracker, [df["experiment"].iloc[0]], kinds=("sweep",),
                             sweep_ids=sorted(set(df["tags.jbench.sweep_id"].dropna())))
        for run_id in parents["run_id"]:
            tracker.log_files(run_id, [("report", files.html_path), ("report", files.markdown_path)])
        console.print(f"attached to {len(parents)} sweep run(s) in MLflow")


@main.command()
@click.argument("a")
@click.argument("b")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_results_option
def compare(a, b, as_json, results_dir) -> None:
    """Compare A and B (sweep ids, run ids or TAG=VALUE): change per matched configuration with a
    95 % confidence interval and a Mann-Whitney test on the repetition samples."""
    import json

    from jbench.analysis.compare import CompareError, compare as run_compare

    tracker = _results_tracker(results_dir)
    df_a, df_b = _selection(tracker, a), _selection(tracker, b)
    try:
        result = run_compare(df_a, df_b, _sample_loader(tracker))
    except CompareError as exc:
        raise _fail(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        console.print(result.to_markdown(), highlight=False)


@main.command()
@click.option("--experiment", default="nightly", show_default=True)
@click.option("--baseline", default="last", show_default=True, help="last | all | TAG (jbench.baseline) | sweep id | YYYY-MM-DD")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), default=None, help="Write JUnit XML here.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False), default=None, help="Write the markdown summary here.")
@_results_option
def regress(experiment, baseline, junit_path, md_path, results_dir) -> None:
    """Nightly regression gate: the newest sweep of each configuration against its baseline.
    Exit code 1 on a regression (p < 0.01 and a drop over max(3 %, 3 x noise))."""
    from jbench.analysis.regress import RegressError, regress as run_regress
    from jbench.tracking.reader import runs_frame, with_current_hashes

    tracker = _results_tracker(results_dir)
    try:
        df = with_current_hashes(runs_frame(tracker, [experiment]))
        result = run_regress(df, _sample_loader(tracker), baseline=baseline)
    except (LookupError, RegressError) as exc:
        raise _fail(str(exc)) from None
    md = result.to_markdown()
    console.print(md, highlight=False)
    if junit_path:
        Path(junit_path).write_text(result.to_junit_xml())
    if md_path:
        Path(md_path).write_text(md)
    raise click.exceptions.Exit(result.exit_code)


@main.command()
@click.option("--experiment", "experiments", multiple=True, help="Experiment(s) to export (default: all).")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="file.parquet or file.csv")
@click.option("--all-kinds", is_flag=True, help="Also export sweep (parent) runs.")
@_results_option
def export(experiments, out_path, all_kinds, results_dir) -> None:
    """Runs as a table (Parquet or CSV): flattened params, metrics and tags, one row per run."""
    from jbench.reporting.report import export_frame
    from jbench.tracking.reader import runs_frame

    tracker = _results_tracker(results_dir)
    try:
        df = runs_frame(tracker, list(experiments) or None, kinds=None if all_kinds else ("trial",))
        path = export_frame(df, out_path)
    except (LookupError, ValueError) as exc:
        raise _fail(str(exc)) from None
    console.print(f"{len(df)} runs, {len(df.columns)} columns -> {path}", highlight=False)


@main.command()
@click.option("--model", "model_name", required=True, help="Model config name (e.g. gemma3_270m) or a GGUF path.")
@click.option("--device", "device_name", default=None, help="Device entry whose profile gives the bandwidth.")
@click.option("--bandwidth-gbs", type=float, default=None, help="Memory bandwidth in GB/s (instead of a device).")
@click.option("--quant", default=None)
@click.option("--ctx", "depth", type=int, default=0, show_default=True, help="Context depth (tokens in the KV cache).")
@click.option("--kv", "kv_type", default="f16", show_default=True, help="KV cache type for K and V.")
@click.option("--json", "as_json", is_flag=True)
@_config_dir_option
def roofline(model_name, device_name, bandwidth_gbs, quant, depth, kv_type, as_json, config_dirs) -> None:
    """Bytes per decoded token and the bandwidth ceiling on tok/s for a model on a device."""
    import json

    from jbench.analysis.roofline import RooflineError
    from jbench.reporting.roofline import roofline_figures

    try:
        fig = roofline_figures(model_name, quant=quant, depth=depth, kv_type=kv_type, device_name=device_name,
                               bandwidth_gbs=bandwidth_gbs, config_dirs=list(config_dirs))
    except (RooflineError, ValueError) as exc:
        raise _fail(str(exc)) from None
    if as_json:
        click.echo(json.dumps(fig, indent=2))
        return
    table = Table(title=f"roofline: {fig['model']} {fig.get('quant') or ''}", title_justify="left")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for key, value in fig.items():
        if isinstance(value, float):
            value = f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
        elif isinstance(value, int):
            value = f"{value:,}"
        table.add_row(key, str(value))
    console.print(table)


@main.group()
def telemetry() -> None:
    """Telemetry tools."""


@telemetry.command("parse")
@click.argument("source", type=click.File("r"))
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv"]), default="jsonl", show_default=True)
@click.option("--rails", default=None, help="Comma list of rails whose sum is the total power (default: the documented rule).")
def telemetry_parse(source, fmt, rails) -> None:
    """Turn a tegrastats log (FILE or -) into JSON lines or CSV; unparseable lines are counted and skipped."""
    import csv
    import json

    from jbench.device.telemetry.tegrastats import parse_stream, sample_to_dict

    spec = rails.split(",") if rails else None
    samples, skipped = parse_stream(source)
    rows = [sample_to_dict(sample, spec) for sample in samples]
    if fmt == "jsonl":
        for row in rows:
            click.echo(json.dumps(row, default=str))
    else:
        cols: dict = {}
        for row in rows:
            cols.update(dict.fromkeys(row))
        writer = csv.DictWriter(sys.stdout, fieldnames=list(cols), restval="")
        writer.writeheader()
        writer.writerows(rows)
    err_console.print(f"{len(rows)} samples, {skipped} unparseable line(s) skipped", highlight=False)


@main.group()
def trace() -> None:
    """In-house engine traces."""


@trace.command("analyze")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--bandwidth-gbs", type=float, default=None, help="Memory bandwidth for the ceiling (GB/s).")
@click.option("--profile", default=None, help="Or a module profile whose datasheet bandwidth to use.")
@click.option("--decode-tps", type=float, default=None, help="Measured decode tok/s (default: from the log).")
@click.option("--prefill-tps", type=float, default=None)
@click.option("--tokens", "n_decode_tokens", type=int, default=None, help="Decoded tokens in the trace, if it cannot tell.")
@click.option("--json", "as_json", is_flag=True)
@_config_dir_option
def trace_analyze(path, bandwidth_gbs, profile, decode_tps, prefill_tps, n_decode_tokens, as_json, config_dirs) -> None:
    """GEMV launches and weight bytes per decoded token, implied bandwidth, ceiling and findings
    (QKV or gate/up not fused, per-token prefill, parked GPU) from an engine log with GEMV lines."""
    import json

    from jbench.backends.engine.trace import TraceError
    from jbench.backends.engine.backend import trace_analyze_command
    from jbench.config import user_config_dirs

    try:
        text, data = trace_analyze_command(path, bandwidth_gbs, decode_tps, prefill_tps=prefill_tps,
                                           n_decode_tokens=n_decode_tokens, profile=profile,
                                           config_dirs=user_config_dirs(list(config_dirs)))
    except TraceError as exc:
        raise _fail(str(exc)) from None
    click.echo(json.dumps(data, indent=2, default=str) if as_json else text)


@main.command()
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


@main.command()
@click.option("--port", default=5000, show_default=True)
@click.option("--results-dir", default=None, help="Results directory (default: $JBENCH_RESULTS_DIR or ./results).")
def ui(port: int, results_dir: Optional[str]) -> None:
    """Open the MLflow UI on jbench's results."""
    import os
    import subprocess

    from jbench.tracking.common import resolve_uri

    results = results_dir or os.environ.get("JBENCH_RESULTS_DIR", "results")
    uri = resolve_uri(None, results)
    console.print(f"MLflow UI on http://127.0.0.1:{port} for {uri} (Ctrl-C to stop)", highlight=False)
    argv = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port)]
    if uri.startswith("sqlite:"):
        argv += ["--default-artifact-root", (Path(results).resolve() / "artifacts").as_uri()]
    raise SystemExit(subprocess.call(argv))


if __name__ == "__main__":
    main()
