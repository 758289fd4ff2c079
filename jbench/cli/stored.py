"""Commands over stored results: `report`, `compare`, `regress`, `export`, `ui`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import click

from jbench.cli.app import _fail, common_options, console, err_console, main
from jbench.core.exitcodes import ExitCode
from jbench.tracking.common import (artifacts_root, database_problem, is_remote, local_path, redact, resolve_uri,
                                    runs_view_url, server_problem, spool_dir, store_exists, writable_problem,
                                    disk_spool_dir)


def _results_dir(results_dir: Optional[str]) -> str:
    import os

    return results_dir or os.environ.get("JBENCH_RESULTS_DIR", "results")


def _results_tracker(results_dir: Optional[str]):
    """The store to read, never created here: none at the results directory (or a server that does not
    answer) is one message and exit 2."""

    results = _results_dir(results_dir)
    uri = resolve_uri(None, results)
    problem = database_problem(uri, "$MLFLOW_TRACKING_URI")
    if problem:
        raise _fail(problem)
    if not store_exists(uri):
        raise _fail(f"no results store in {Path(results).resolve()} ({uri} does not exist): run a sweep first, "
                    "or point --results-dir / $JBENCH_RESULTS_DIR at the directory that holds mlflow.db")
    down = server_problem(uri)
    if down:
        raise _fail(f"tracking server {redact(uri)}: {down}. Start it, or unset MLFLOW_TRACKING_URI to read the local store")
    from jbench.tracking.writer import Tracker

    return Tracker(None, results)


def check_output(path: str, *, directory: bool, option: str = "--out") -> None:
    """An output path that cannot be written: one message, exit 2, before anything is read or made."""

    problem = writable_problem(path, directory=directory)
    if problem:
        raise _fail(f"cannot write {path}: {problem}. Give a writable {option} path")


def _sample_loader(tracker):
    from jbench.tracking.reader import repetition_samples

    return lambda run_ids, metric: repetition_samples(tracker, list(run_ids), metric)


def _selection(tracker, spec: str):
    """A sweep id, a run id or a unique prefix of one (as the sweep summary prints it), or TAG=VALUE ->
    the trial runs it names."""
    from jbench.tracking.reader import runs_frame, with_current_hashes

    if "=" in spec:
        tag, _, value = spec.partition("=")
        df = runs_frame(tracker, tag_filters={tag: value})
    else:
        df = runs_frame(tracker, sweep_ids=[spec])
        if df.empty:
            df = runs_frame(tracker, run_ids=[spec])
        if df.empty and spec:
            every = runs_frame(tracker)
            df = every[every["run_id"].str.startswith(spec.lower())] if not every.empty else every
            if len(df) > 1:
                shown = ", ".join(str(r)[:12] for r in df["run_id"][:5])
                raise _fail(f"run id prefix '{spec}' is ambiguous: it matches {len(df)} runs ({shown}"
                            f"{', ...' if len(df) > 5 else ''}); give more characters")
    if df.empty:
        raise _fail(f"'{spec}' selects no trial runs: give a sweep id (tag jbench.sweep_id), a run id or its "
                    "prefix, or TAG=VALUE")
    return with_current_hashes(df)  # runs recorded under an older hash scheme match today's


def _experiment_names(tracker) -> list[str]:
    """Names of the experiments that hold jbench runs (for an error message)."""
    from jbench.tracking.reader import runs_frame

    try:
        df = runs_frame(tracker, kinds=None)
    except Exception:  # only a hint for an error message: never a second error
        return []
    return sorted(set(df["experiment"].dropna())) if not df.empty else []


def _unknown_experiment(tracker, exc: LookupError) -> "click.exceptions.Exit":
    names = _experiment_names(tracker)
    return _fail(f"{exc}. Existing experiments: {', '.join(names)}" if names
                 else f"{exc}; the store holds no experiments yet: run a sweep first")


@main.command()
@click.option("--experiment", "experiment", default=None, help="Experiment name (default: the newest sweep's).")
@click.option("--sweep", "sweep_id", default=None, help="One sweep (jbench.sweep_id) instead of the whole experiment.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--no-log", is_flag=True, help="Do not attach the report to the sweep's parent MLflow run.")
@common_options
def report(experiment, sweep_id, out_dir, no_log, results_dir) -> None:
    """HTML and markdown report with plots: quant ladder, context scaling, power modes, telemetry, findings."""
    from jbench.reporting.report import build_report
    from jbench.tracking.reader import runs_frame, telemetry_frame

    if out_dir:
        check_output(out_dir, directory=True)
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
    if no_log:
        return
    if sweep_id is None:
        # A whole-experiment report belongs to no one sweep: it is not attached to any parent run.
        console.print("not attached to MLflow (a report of one sweep is: `jbench report --sweep ID`)", highlight=False)
        return
    parents = runs_frame(tracker, [df["experiment"].iloc[0]], kinds=("sweep",), sweep_ids=[sweep_id])
    # The PNGs go beside report.md: its relative image links then show in MLflow's markdown preview.
    attached = [("report", files.html_path), ("report", files.markdown_path),
                *(("report", png) for png in files.pngs.values())]
    for run_id in parents["run_id"]:
        tracker.log_files(run_id, attached)
    console.print(f"attached to the parent run of sweep {sweep_id} in MLflow" if len(parents)
                  else f"sweep {sweep_id} has no parent run: the report is not attached", highlight=False)


@main.command()
@click.argument("a")
@click.argument("b")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@common_options
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
        click.echo(result.to_markdown(), nl=False)  # never hard-wrapped, in a pipe either


@main.command()
@click.option("--experiment", default="nightly", show_default=True)
@click.option("--mode", type=click.Choice(["auto", "history", "pairwise"]), default="auto", show_default=True,
              help="history: change points over every night (docs/regress.md); pairwise: the newest sweep against "
                   "--baseline; auto: history once some configuration has enough nights, else pairwise.")
@click.option("--baseline", default=None,
              help="Pairwise baseline: last | all | TAG (jbench.baseline) | sweep id | YYYY-MM-DD (implies "
                   "--mode pairwise; default last).")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), default=None, help="Write JUnit XML here.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False), default=None, help="Write the markdown summary here.")
@click.option("--report-dir", type=click.Path(file_okay=False), default=None,
              help="History mode: write the HTML report (series, change points, noise band) here.")
@common_options
def regress(experiment, mode, baseline, junit_path, md_path, report_dir, results_dir) -> None:
    """Nightly regression gate over the stored history (docs/regress.md).

    \b
    history:  per unit x configuration x metric, change points (ruptures) tested with a t-test;
              regression when a standing drop starts within the newest nights.
    pairwise: the newest sweep of each configuration against --baseline (Mann-Whitney, p < 0.01,
              a drop over max(3 %, 3 x noise)).
    \b
    Exit codes: 0 clean; 1 regression; 2 bad input; 3 no verdict (a configuration with too few
    nights or samples: never green).
    """
    from jbench.analysis.history import DEFAULT_SETTINGS, HistoryError, history, max_nights
    from jbench.analysis.regress import NoData, RegressError, regress as run_regress
    from jbench.tracking.reader import runs_frame, with_current_hashes

    if mode == "history" and baseline is not None:
        raise _fail("--baseline chooses the pairwise comparison; drop it or use --mode pairwise")
    if report_dir and mode == "pairwise":
        raise _fail("--report-dir writes the history report; with --mode pairwise use `jbench report`")
    for path, option in ((junit_path, "--junit"), (md_path, "--markdown")):
        if path:  # before the store is read: a CI job learns of a bad path at once
            check_output(path, directory=False, option=option)
    if report_dir:
        check_output(report_dir, directory=True, option="--report-dir")
    tracker = _results_tracker(results_dir)
    try:
        df = with_current_hashes(runs_frame(tracker, [experiment]))
    except LookupError as exc:
        raise _unknown_experiment(tracker, exc) from None
    if mode == "auto":
        nights = max_nights(df)
        mode = "pairwise" if baseline is not None or nights < DEFAULT_SETTINGS.min_nights else "history"
        if baseline is None:
            err_console.print(f"mode: {mode} (the longest history has {nights} night(s); history from "
                              f"{DEFAULT_SETTINGS.min_nights})", highlight=False)
    try:
        if mode == "history":
            result = history(df)
            if not result.results:
                raise NoData("no finished trial runs to check")
        else:
            result = run_regress(df, _sample_loader(tracker), baseline=baseline or "last")
    except NoData as exc:  # the experiment exists but holds no finished trial run: nothing was tested
        click.echo(f"NO VERDICT: {exc} in experiment '{experiment}'", err=True)
        raise click.exceptions.Exit(ExitCode.NO_VERDICT) from None
    except (RegressError, HistoryError) as exc:
        raise _fail(str(exc)) from None
    md = result.to_markdown()
    click.echo(md, nl=False)  # never hard-wrapped, in a pipe either
    for path, text in ((junit_path, result.to_junit_xml() if junit_path else ""), (md_path, md)):
        if path:
            try:
                Path(path).write_text(text)
            except OSError as exc:
                raise _fail(f"cannot write {path}: {exc.strerror or exc}; give a writable path") from None
    if report_dir and mode == "history":
        from jbench.reporting.history import build_history_report

        files = build_history_report(result, out_dir=report_dir, title=f"jbench regress: {experiment} history")
        err_console.print(f"report: {files.html_path}", highlight=False)
    if result.exit_code == ExitCode.NO_VERDICT:
        click.echo(f"NO VERDICT: {result.verdict_reason}", err=True)
    raise click.exceptions.Exit(result.exit_code)


@main.command()
@click.option("--experiment", "experiments", multiple=True, help="Experiment(s) to export (default: all).")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="file.parquet or file.csv")
@click.option("--all-kinds", is_flag=True, help="Also export sweep (parent) runs.")
@common_options
def export(experiments, out_path, all_kinds, results_dir) -> None:
    """Runs as a table (Parquet or CSV): flattened params, metrics and tags, one row per run."""
    from jbench.reporting.report import export_frame
    from jbench.tracking.reader import runs_frame

    check_output(out_path, directory=False)
    tracker = _results_tracker(results_dir)
    try:
        df = runs_frame(tracker, list(experiments) or None, kinds=None if all_kinds else ("trial",))
    except LookupError as exc:
        raise _unknown_experiment(tracker, exc) from None
    if df.empty:  # an empty file would look like a successful export
        raise _fail(f"no {'runs' if all_kinds else 'trial runs'} to export in {tracker.shown_uri}; run a sweep first")
    try:
        path = export_frame(df, out_path)
    except (ValueError, OSError) as exc:
        raise _fail(f"cannot write {out_path}: {exc}" if isinstance(exc, OSError) else str(exc)) from None
    console.print(f"{len(df)} runs, {len(df.columns)} columns -> {path}", highlight=False)



def _port_in_use(host: str, port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _newest_experiment(db: Path) -> Optional[str]:
    """The id of the newest active experiment of a local store, read-only without MLflow."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            row = con.execute("SELECT experiment_id FROM experiments WHERE lifecycle_stage = 'active' "
                              "AND experiment_id != '0' ORDER BY creation_time DESC LIMIT 1").fetchone()
        finally:
            con.close()
    except sqlite3.Error:
        return None
    return str(row[0]) if row else None


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", default=5000, show_default=True)
@common_options
def ui(host: str, port: int, results_dir: Optional[str]) -> None:
    """Open the MLflow UI on jbench's results (an `mlflow server` serving the store and its artifacts)."""
    import signal
    import subprocess

    results = _results_dir(results_dir)
    uri = resolve_uri(None, results)
    problem = database_problem(uri, "$MLFLOW_TRACKING_URI")
    if problem:
        raise _fail(problem)
    if is_remote(uri):
        console.print(f"results are on the tracking server: open {redact(uri)}", highlight=False)
        return
    if not store_exists(uri):
        raise _fail(f"no results store in {Path(results).resolve()} ({uri} does not exist): run a sweep first, "
                    "or point --results-dir / $JBENCH_RESULTS_DIR at the directory that holds mlflow.db")
    if _port_in_use(host, port):
        raise _fail(f"port {port} on {host} is in use: give another one with --port")
    argv = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", host, "--port", str(port),
            "--workers", "1"]
    root = artifacts_root(uri)
    if root is not None:  # mlflow-artifacts:/ locations served from the store's own directory, wherever it is
        argv += ["--artifacts-destination", str(root)]
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    exp = _newest_experiment(local_path(uri)) if uri.startswith("sqlite:") else None
    link = runs_view_url(f"http://{shown}:{port}", exp) if exp else f"http://{shown}:{port}"
    # The server and its workers are one process group of their own: stopped together, without tracebacks.
    server = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)  # also when started in the background, where SIGINT starts out ignored
    console.print(f"MLflow UI: {link}  ({uri}; Ctrl-C to stop)", highlight=False)
    try:
        _, err = server.communicate()
    except KeyboardInterrupt:
        import os

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        except ProcessLookupError:
            pass
        console.print("MLflow UI stopped", highlight=False)
        return
    if server.returncode:
        lines = [ln for ln in (err or "").splitlines() if ln.strip()]
        raise _fail(f"mlflow server exited with code {server.returncode}: {lines[-1] if lines else 'no message'}")


@main.command()
@click.option("--uri", default=None, help="The tracking server (default: $MLFLOW_TRACKING_URI, else the server "
                                          "the spooled runs were meant for).")
@common_options
def sync(uri: Optional[str], results_dir: Optional[str]) -> None:
    """Upload the spool (runs measured while the tracking server did not answer) to the server, exactly once."""
    import os

    given = uri or os.environ.get("MLFLOW_TRACKING_URI")
    problem = database_problem(given, "--uri" if uri else "$MLFLOW_TRACKING_URI") if given else None
    if problem:
        raise _fail(problem)
    results = _results_dir(results_dir)
    home = None
    if (disk_spool_dir(results) / "mlflow.db").exists() and not given:  # what a full disk sent to jbench's cache
        from jbench.tracking.sync import sync_disk_spool

        home = sync_disk_spool(results)
        if home is not None:
            console.print(f"uploaded {len(home.uploaded)} run(s) measured while the disk was full into "
                          f"{redact(home.uri)}", highlight=False)
    if not (spool_dir(results) / "mlflow.db").exists():
        if home is None:
            console.print(f"nothing to sync: no spool in {spool_dir(results)}", highlight=False)
        return
    from jbench.tracking.sync import SyncError, sync as run_sync, target_uri

    try:
        target = target_uri(results, given)
        result = run_sync(results, target)
    except SyncError as exc:
        raise _fail(str(exc)) from None
    console.print(f"synced {len(result.uploaded)} run(s) to {redact(target)}"
                  + (f"; {result.already} synced before" if result.already else ""), highlight=False)
    if result.running:
        err_console.print(f"[yellow]{len(result.running)} spool run(s) still RUNNING were left for a later sync[/]",
                          highlight=False)
