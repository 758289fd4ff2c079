"""`jbench sweep`, `run` and `setup`: plan, execute, progress and the summary table."""

from __future__ import annotations

import math
import time
from typing import Optional

import click
from rich.table import Table

from jbench.cli import EXIT_FAILED_TRIALS, EXIT_USER_ERROR, _OVERRIDES, _config_dir_option, _fail, console, err_console, main


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


def _check_store(plan_) -> bool:
    """Before anything touches a device: the results directory and store can be written, and a tracking
    server answers (else tracking.unreachable decides: stop, exit 2; or spool). True: spool from the start."""
    from jbench.tracking.common import resolve_uri, server_problem, spool_dir, store_problem

    results_dir = plan_.tracking["results_dir"]
    uri = resolve_uri(plan_.tracking.get("uri"), results_dir)
    problem = store_problem(uri, results_dir)
    if problem:
        raise _fail(f"cannot write results: {problem}. Set tracking.results_dir (or $JBENCH_RESULTS_DIR) "
                    "to a writable directory")
    choice = plan_.tracking.get("unreachable") or "stop"
    if choice not in ("stop", "spool"):
        raise _fail(f"tracking.unreachable={choice}: use stop or spool")
    down = server_problem(uri)
    if down is None:
        return False
    if choice == "stop":
        raise _fail(f"tracking server {uri}: {down}. Start it, fix tracking.uri / $MLFLOW_TRACKING_URI, or add "
                    "tracking.unreachable=spool to measure into a local spool and upload it later with `jbench sync`")
    console.print(f"[yellow]tracking server {uri}: {down}; measuring into the spool {spool_dir(results_dir)} "
                  f"(`jbench sync` uploads it once the server is back)[/]", highlight=False)
    return True


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

    spool_from_start = _check_store(plan_)

    def tracker():
        from jbench.tracking.writer import Tracker  # mlflow: only once the runner asks for a store

        def say(message: str) -> None:
            progress.console.print(f"[yellow]{message}[/]", highlight=False)

        t = Tracker(plan_.tracking.get("uri"), plan_.tracking["results_dir"], spool=spool_from_start, notify=say)
        if not spool_from_start:
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

