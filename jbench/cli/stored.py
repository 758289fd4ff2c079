"""Commands over stored results: `report`, `compare`, `regress`, `export`, `ui`."""

from __future__ import annotations

import sys
import time
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


# The summary prints 8 characters of a run id; fewer than 6 is a typo or the table's # column, never a run id
# (one character matches some run in any store).
MIN_PREFIX = 6


def _selection(tracker, spec: str, sweep_ids: tuple[str, ...] = ()):
    """A sweep id, a run id or a unique prefix of one (as the sweep summary prints it), or KEY=VALUE (a tag, else
    a param: a config key; KEY=null: the runs that do not record it) -> the trial runs it names (only those of
    sweep_ids when given)."""
    import re

    from jbench.tracking.reader import runs_frame, with_current_hashes

    if "=" in spec:
        tag, _, value = spec.partition("=")
        df = runs_frame(tracker, tag_filters={tag: value})
        if df.empty:  # a config key recorded as a param only (power.mode, backend.n_gen, ...)
            every = runs_frame(tracker)
            col = f"params.{tag}"
            df = every[every[col] == value] if col in every.columns else every.iloc[0:0]
            if df.empty and value.lower() in ("null", "none") and col in every.columns:
                # A key set to null is not logged: KEY=null selects the runs without it (no draft, no env), among
                # runs of a store where some run has it (else the key is a typo, and nothing is selected).
                df = every[every[col].isna()]
    else:
        df = runs_frame(tracker, sweep_ids=[spec])
        if df.empty:
            df = runs_frame(tracker, run_ids=[spec])
        if df.empty and re.fullmatch(r"[0-9a-fA-F]+", spec):
            if len(spec) < MIN_PREFIX:
                raise _fail(f"'{spec}' is too short for a run id prefix: give at least {MIN_PREFIX} characters (the "
                            "summary's run id column shows 8; its # column is not a run id), a sweep id or KEY=VALUE")
            every = runs_frame(tracker)
            df = every[every["run_id"].str.startswith(spec.lower())] if not every.empty else every
            if len(df) > 1:
                shown = ", ".join(str(r)[:12] for r in df["run_id"][:5])
                raise _fail(f"run id prefix '{spec}' is ambiguous: it matches {len(df)} runs ({shown}"
                            f"{', ...' if len(df) > 5 else ''}); give more characters")
    if sweep_ids and not df.empty:
        df = df[df["tags.jbench.sweep_id"].isin(sweep_ids)] if "tags.jbench.sweep_id" in df.columns else df.iloc[0:0]
        if df.empty:
            raise _fail(f"'{spec}' selects no trial runs in sweep {', '.join(sweep_ids)}: check the sweep id "
                        "(the summary's first line) or drop --sweep")
    if df.empty:
        raise _fail(f"'{spec}' selects no trial runs: give a sweep id (tag jbench.sweep_id), a run id or its "
                    "prefix, or KEY=VALUE (a tag or a config key)")
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
@click.option("--goal", "goal_spec", default=None,
              help="Add the advisor's answer for this goal (a shipped name or a YAML file, as `jbench advise --goal`): "
                   "its table and Pareto plot.")
@common_options
def report(experiment, sweep_id, out_dir, no_log, goal_spec, results_dir) -> None:
    """HTML and markdown report with plots: quant ladder, context scaling, power modes, telemetry, findings (and with
    --goal the advisor's answer)."""
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
    advice = None
    if goal_spec:
        from jbench.cli.goals import answer, goal_from

        goal, pareto = goal_from(goal_spec, None, None, ())
        advice = answer(tracker, df, goal, pareto)
    tel = telemetry_frame(tracker, list(df["run_id"]))
    files = build_report(df, _sample_loader(tracker), tel if tel is not None and len(tel) else None,
                         out_dir=out, title=f"jbench report: {sweep_id or experiment}", advice=advice)
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


def _compare_tables(result) -> list:
    """The comparison on a terminal: one table per rate that fits 80 columns, percentages with one decimal, the
    geometric means as A → B; the markdown (`-o md`) keeps every digit."""
    import math

    from rich import box
    from rich.markup import escape
    from rich.table import Table

    def pct(v: float) -> str:
        return "n/a" if not math.isfinite(v) else f"{v:+.1f}"

    def rate(v: float) -> str:
        return "n/a" if not math.isfinite(v) else f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"

    t = result.table
    several = t["device"].nunique() > 1
    sizes = len(set(zip(t["n_a"], t["n_b"]))) > 1  # one size for all rows: the footer states it
    tables = []
    for metric, rows in t.groupby("metric", sort=False):
        unit = "tok/J" if "joule" in metric else "tok/s"
        table = Table(title=f"{metric}: geometric means A → B in {unit}; change, interval, detectable drop/rise in %",
                      title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        table.add_column("configuration", overflow="fold")
        if several:
            table.add_column("device", overflow="fold")
        if sizes:
            table.add_column("n", justify="right", no_wrap=True)
        table.add_column("A → B", justify="right", no_wrap=True)
        table.add_column("change", justify="right", no_wrap=True)
        table.add_column(f"{100 * result.confidence:g} % CI", justify="right", no_wrap=True)
        table.add_column("p", justify="right", no_wrap=True)
        table.add_column("detectable", justify="right", no_wrap=True)
        for r in rows.itertuples(index=False):
            ci = "n/a" if not math.isfinite(r.ci_low_pct) else f"{pct(r.ci_low_pct)}…{pct(r.ci_high_pct)}"
            det = ("n/a" if not math.isfinite(r.detectable_pct)
                   else f"-{r.detectable_drop_pct:.1f}/+{r.detectable_pct:.1f}")
            p = ("n/a" if not math.isfinite(r.p_value)
                 else f"{r.p_value:.1g}" if r.p_value < 0.001 else f"{r.p_value:.3f}")
            table.add_row(escape(r.label), *([escape(r.device)] if several else []),
                          *([f"{r.n_a}/{r.n_b}"] if sizes else []), f"{rate(r.gmean_a)} → {rate(r.gmean_b)}",
                          pct(r.change_pct) + (" *" if r.significant else ""), ci, p, det)
        tables.append(table)
    return tables


@main.command()
@click.argument("a")
@click.argument("b")
@click.option("--along", "along", multiple=True, metavar="KEY",
              help="Compare along this config key (model.quant, power.mode, backend.name, ...): each configuration "
                   "of A against the one of B that differs only there. Implied by A and B that are KEY=VALUE of "
                   "one config key.")
@click.option("--sweep", "sweep_ids", multiple=True, metavar="ID",
              help="Only runs of this sweep (repeatable): e.g. two quants of one sweep.")
@click.option("-o", "--output", "fmt", type=click.Choice(["table", "md", "json"]), default=None,
              help="table (default on a terminal), md (markdown, never wrapped: the default in a pipe) or json.")
@click.option("--json", "as_json", is_flag=True, help="Same as -o json.")
@common_options
def compare(a, b, along, sweep_ids, fmt, as_json, results_dir) -> None:
    """Compare A and B (sweep ids, run ids or KEY=VALUE of a tag or config key): change per matched configuration with a
    95 % confidence interval and the test it comes from (Welch t on ln(rate)), and the smallest change
    the samples could detect.

    \b
    Examples:
      jbench compare SWEEP_A SWEEP_B       # the same configurations
      jbench compare model.quant=Q4_0 model.quant=Q8_0 --sweep ID
      jbench compare SWEEP_A SWEEP_B --along backend.name
    """
    import json

    from jbench.analysis.compare import CompareError, compare as run_compare, identity_rows

    tracker = _results_tracker(results_dir)
    df_a, df_b = _selection(tracker, a, sweep_ids), _selection(tracker, b, sweep_ids)
    key_a, _, value_a = a.partition("=")
    key_b, _, value_b = b.partition("=")
    # Two values of one config key (a param, not a tag such as backend.build_commit): compared along that key.
    if (not along and value_a and key_a == key_b and value_a != value_b
            and any(key_a in it for df in (df_a, df_b) for it in identity_rows(df))):
        along = (key_a,)
    try:
        result = run_compare(df_a, df_b, _sample_loader(tracker), along=along)
    except CompareError as exc:
        raise _fail(str(exc)) from None
    fmt = "json" if as_json else fmt or ("table" if console.is_terminal else "md")
    if fmt == "json":
        click.echo(json.dumps(result.to_dict(), indent=2, default=str))
    elif fmt == "md":
        click.echo(result.to_markdown(), nl=False)  # never hard-wrapped, in a pipe either
    else:
        # wrapped at words, never mid-word, at the terminal's width
        if result.heading():
            console.print(result.heading(), soft_wrap=False, highlight=False, markup=False)
        devices = sorted(set(result.table["device"]) - {""})
        if len(devices) == 1:
            console.print(f"device: {devices[0]}", soft_wrap=False, highlight=False, markup=False)
        for table in _compare_tables(result):
            console.print(table, soft_wrap=False)
        for note in result.notes():
            console.print(note, soft_wrap=False, highlight=False, markup=False)


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



def _listen_problem(host: str, port: int) -> Optional[str]:
    """Why the UI cannot listen on host:port (one line naming the fix), or None."""
    import errno
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        return (f"--host {host}: not an address of this machine nor a name it can resolve "
                f"({getattr(exc, 'strerror', None) or exc}): give 127.0.0.1 (this machine only) or 0.0.0.0 "
                "(every interface)")
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is in use: give another one with --port"
            if exc.errno == errno.EADDRNOTAVAIL:
                return (f"--host {host}: no interface of this machine has that address: give 127.0.0.1 (this "
                        "machine only) or 0.0.0.0 (every interface)")
            if exc.errno == errno.EACCES:
                return f"port {port} needs root (a port below 1024): give --port 1024 or above"
            return f"cannot listen on {host} port {port}: {exc.strerror}: give another --host or --port"
    return None


def _last_run_experiment(db: Path) -> Optional[str]:
    """The id of the experiment whose run started or ended last (the sweep just run), else the newest experiment;
    read-only without MLflow."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            row = con.execute(
                "SELECT r.experiment_id FROM runs r JOIN experiments e ON e.experiment_id = r.experiment_id "
                "WHERE e.lifecycle_stage = 'active' AND r.lifecycle_stage = 'active' "
                "ORDER BY MAX(COALESCE(r.end_time, 0), r.start_time) DESC LIMIT 1").fetchone()
            if row is None:
                row = con.execute("SELECT experiment_id FROM experiments WHERE lifecycle_stage = 'active' "
                                  "AND experiment_id != '0' ORDER BY creation_time DESC LIMIT 1").fetchone()
        finally:
            con.close()
    except sqlite3.Error:
        return None
    return str(row[0]) if row else None


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", default=5000, show_default=True, type=click.IntRange(1, 65535))
@common_options
def ui(host: str, port: int, results_dir: Optional[str]) -> None:
    """Open the MLflow UI on jbench's results (an `mlflow server` serving the store and its artifacts)."""
    import signal
    import subprocess
    import tempfile

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
    problem = _listen_problem(host, port)
    if problem:
        raise _fail(problem)
    argv = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", host, "--port", str(port),
            "--workers", "1"]
    root = artifacts_root(uri)
    if root is not None:  # mlflow-artifacts:/ locations served from the store's own directory, wherever it is
        argv += ["--artifacts-destination", str(root)]
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host
    base = f"http://{shown}:{port}"
    exp = _last_run_experiment(local_path(uri)) if uri.startswith("sqlite:") else None
    link = runs_view_url(base, exp) if exp else base
    # The server's messages go to a file (a pipe nobody reads while it starts could fill and stop it); its last
    # line is the reason when it exits.
    errors = tempfile.TemporaryFile(mode="w+")
    # The server and its workers are one process group of their own: stopped together, without tracebacks.
    server = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=errors, text=True)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)  # also when started in the background, where SIGINT starts out ignored
    err_console.print(f"starting the MLflow UI on {base} ...", highlight=False)
    try:
        # The link is printed once the server answers: opened earlier, a browser shows an error page.
        while server.poll() is None and not _answers(f"{base}/health"):
            time.sleep(0.25)
        if server.poll() is None:
            console.print(f"MLflow UI: {link}  ({uri}; Ctrl-C to stop)", highlight=False)
        server.wait()
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
        errors.seek(0)
        lines = [ln for ln in errors.read().splitlines() if ln.strip()]
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
