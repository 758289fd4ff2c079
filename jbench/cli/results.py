"""Commands over stored results: `report`, `compare`, `regress`, `export`, `ui`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import click

from jbench.cli import _fail, console, main


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

