"""`jbench advise`: the best measured configuration for an objective under constraints (jbench.analysis.advice)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import click
from rich import box
from rich.markup import escape
from rich.table import Table

from jbench.cli.app import _fail, common_options, console, main
from jbench.cli.goals import answer, goal_from
from jbench.core.exitcodes import ExitCode

HELP = """Answer from what is already measured: the configuration with the best OBJECTIVE among those that meet
every constraint, with the probability that it meets each one given the measured noise of its runs, the runners-up
that are not significantly worse, and the Pareto front of two metrics.

\b
Select runs by experiment name(s) (default: every experiment), --sweep, --device or --device-class. Give the goal
on the command line (--maximize/--minimize METRIC, --require 'METRIC>=VALUE' ...) or as --goal NAME (a shipped
goal, conf/advice/NAME.yaml: fast_within_quality, edge_efficiency) or --goal FILE.yaml; the command line adds to
and overrides a goal file.

\b
Exit codes:
  0  an answer: the best configuration
  2  bad input (an unknown metric, a malformed constraint, nothing selected)
  3  no verdict: the constraints are met by nothing, or the data cannot decide (too few repetitions)

\b
Examples:
  jbench advise quant_ladder --goal fast_within_quality
  jbench advise --maximize decode_tokens_per_joule --require 'decode_tps>=20' --require 'decode_avg_power_w<=15' \\
      --device orin --pareto decode_tps,decode_tokens_per_joule --plot advice.png
"""


@main.command(help=HELP)
@click.argument("experiments", nargs=-1)
@click.option("--goal", "goal_spec", default=None, help="A shipped goal name or a YAML file.")
@click.option("--maximize", default=None, metavar="METRIC")
@click.option("--minimize", default=None, metavar="METRIC")
@click.option("--require", "requires", multiple=True, metavar="'METRIC>=VALUE'",
              help="A constraint (repeatable): METRIC>=VALUE or METRIC<=VALUE.")
@click.option("--sweep", "sweep_ids", multiple=True, metavar="ID", help="Only runs of this sweep (repeatable).")
@click.option("--device", "device", default=None, help="Only runs on this device (its name).")
@click.option("--device-class", "device_class", default=None, help="Only runs on units of this device class.")
@click.option("--pareto", "pareto_spec", default=None, metavar="X,Y", help="The Pareto front of these two metrics.")
@click.option("--confidence", type=float, default=None,
              help="The probability of meeting the constraints a configuration needs (default 0.9).")
@click.option("--alpha", type=float, default=None,
              help="Significance of 'worse than the best' for the runners-up (default 0.05).")
@click.option("-o", "--output", "fmt", type=click.Choice(["table", "json"]), default="table")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Write the Pareto plot (PNG) here (needs --pareto or a goal's pareto).")
@common_options
def advise(experiments: tuple[str, ...], goal_spec: Optional[str], maximize: Optional[str], minimize: Optional[str],
           requires: tuple[str, ...], sweep_ids: tuple[str, ...], device: Optional[str], device_class: Optional[str],
           pareto_spec: Optional[str], confidence: Optional[float], alpha: Optional[float], fmt: str,
           plot_path: Optional[str], results_dir: Optional[str]) -> None:
    from jbench.cli.stored import _results_tracker
    from jbench.tracking.reader import runs_frame

    goal, pareto_metrics = goal_from(goal_spec, maximize, minimize, requires, pareto_spec, confidence, alpha)
    if plot_path and not pareto_metrics:
        raise _fail("--plot draws the Pareto front: give --pareto X,Y (or a goal with pareto)")

    tracker = _results_tracker(results_dir)
    try:
        df = runs_frame(tracker, list(experiments) or None, sweep_ids=list(sweep_ids) or None)
    except LookupError as exc:
        raise _fail(str(exc).strip("'\"")) from None
    for value, col, what in ((device, "tags.device.name", "--device"), (device_class, "tags.device.class",
                                                                          "--device-class")):
        if value and not df.empty:
            df = df[df[col] == value] if col in df.columns else df.iloc[0:0]
            if df.empty:
                raise _fail(f"{what} {value}: no trial run of the selection ran there")
    result = answer(tracker, df, goal, pareto_metrics)
    if plot_path:
        _plot(result, plot_path)
    if fmt == "json":
        click.echo(json.dumps(result.as_dict(), indent=2))
    else:
        print_advice(result, plot_path)
    if result.outcome != "found":
        raise click.exceptions.Exit(ExitCode.NO_VERDICT)


def _g(v: float, digits: int = 4) -> str:
    return f"{v:.{digits}g}" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def print_advice(result: Any, plot_path: Optional[str] = None) -> None:
    goal = result.goal
    head = f"{'maximise' if goal.direction > 0 else 'minimise'} {goal.objective}"
    if goal.constraints:
        head += " subject to " + ", ".join(str(c) for c in goal.constraints)
    console.print(head + f" (P >= {goal.confidence:g} each configuration)", highlight=False, soft_wrap=True)
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("")
    table.add_column("configuration", no_wrap=True)
    table.add_column("device")
    table.add_column("runs", justify="right")
    table.add_column(escape(goal.objective), justify="right")
    for i, _ in enumerate(goal.constraints, 1):
        table.add_column(f"c{i}", justify="right")
    table.add_column("verdict")
    front = {c.config_hash for c in result.front}
    runners = {c.config_hash for c in result.runners_up}
    for c in result.candidates:
        mark = "BEST" if result.best is c else ("~" if c.config_hash in runners else "")
        if c.config_hash in front:
            mark += "*"
        obj = c.objective
        objective = f"{_g(obj.mean)} ± {_g(obj.se, 2)}" if obj.has_spread else _g(obj.mean)
        probs = []
        for k in goal.constraints:
            p = c.probabilities.get(str(k), math.nan)
            probs.append(f"{'-' if not math.isfinite(p) else f'{p:.2f}'} ({_g(c.values[k.metric].mean)})")
        table.add_row(mark, escape(c.label), escape(c.device), str(c.runs), objective, *probs, c.verdict)
    # In a pipe rich assumes 80 columns; the table is never hard-wrapped there (a terminal keeps its width).
    from rich.console import Console

    (console if console.is_terminal else Console(width=200, soft_wrap=True)).print(table)
    for i, k in enumerate(goal.constraints, 1):
        console.print(f"c{i}: P({k}) (its mean)", highlight=False)
    console.print("± the standard error of the mean (runs of the configuration, else its repetitions); BEST the "
                  f"answer, ~ not significantly worse than it (Welch, alpha {goal.alpha:g})"
                  + (f", * on the Pareto front of {', '.join(result.front_metrics)}" if result.front else ""),
                  highlight=False)
    notes = sorted({n for c in result.candidates for n in c.notes if c is result.best or c.verdict == "meets"})
    for n in notes[:5]:
        console.print(f"note: {n}", highlight=False)
    if result.outcome == "found":
        click.echo(f"BEST: {result.message}")
    else:
        click.echo(f"NO VERDICT: {result.message}", err=True)
    if plot_path:
        console.print(f"Pareto plot: {plot_path}", highlight=False)


def _plot(result: Any, path: str) -> None:
    from jbench.reporting.advice import pareto_png

    Path(path).write_bytes(pareto_png(result))
