"""`jbench advise`: the best measured configuration for an objective under constraints (jbench.analysis.advice)."""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import click
from rich import box
from rich.markup import escape
from rich.table import Table

from jbench.cli.app import _fail, common_options, console, main
from jbench.core import metrics as M
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


def _load_goal(spec: str) -> dict[str, Any]:
    import yaml
    from importlib.resources import files

    path = Path(spec)
    if spec.endswith((".yaml", ".yml")) or path.is_file():
        if not path.is_file():
            raise _fail(f"--goal {spec}: no such file")
        text = path.read_text()
    else:
        shipped = files("jbench.conf").joinpath("advice", f"{spec}.yaml")
        if not shipped.is_file():
            names = sorted(p.name[:-5] for p in files("jbench.conf").joinpath("advice").iterdir()
                           if p.name.endswith(".yaml"))
            raise _fail(f"--goal {spec}: no shipped goal of that name. Shipped: {', '.join(names)} (or give a "
                        "YAML file)")
        text = shipped.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise _fail(f"--goal {spec}: not valid YAML: {str(exc).splitlines()[0]}") from None
    unknown = set(data) - {"maximize", "minimize", "constraints", "pareto", "confidence", "alpha"}
    if unknown:
        raise _fail(f"--goal {spec}: unknown key(s) {', '.join(sorted(unknown))}. Valid: maximize, minimize, "
                    "constraints, pareto, confidence, alpha")
    return data


def goal_from(goal_spec: Optional[str], maximize: Optional[str], minimize: Optional[str], requires: tuple[str, ...],
              pareto_spec: Optional[str] = None, confidence: Optional[float] = None,
              alpha: Optional[float] = None) -> tuple[Any, Optional[tuple[str, str]]]:
    """(Goal, Pareto metrics) from a goal file or name and the command line's additions (`advise`, `sweep --search`);
    bad input ends in one message (exit 2)."""
    from jbench.analysis.advice import AdviceError, Goal, parse_constraint

    goal_data = _load_goal(goal_spec) if goal_spec else {}
    if maximize and minimize:
        raise _fail("give --maximize or --minimize, not both")
    if maximize or minimize:
        goal_data.pop("maximize", None)
        goal_data.pop("minimize", None)
        goal_data["maximize" if maximize else "minimize"] = maximize or minimize
    objective = goal_data.get("maximize") or goal_data.get("minimize")
    if not objective:
        raise _fail("give the objective: --maximize METRIC or --minimize METRIC (or --goal NAME)")
    direction = 1 if goal_data.get("maximize") else -1
    try:
        constraints = [parse_constraint(str(c)) for c in [*goal_data.get("constraints", []), *requires]]
    except AdviceError as exc:
        raise _fail(str(exc)) from None
    pareto_metrics: Optional[tuple[str, str]] = None
    spec = pareto_spec or (",".join(goal_data["pareto"]) if goal_data.get("pareto") else None)
    if spec:
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        if len(parts) != 2:
            raise _fail(f"--pareto {spec}: give two metrics, X,Y")
        pareto_metrics = (parts[0], parts[1])
    goal = Goal(objective=objective, direction=direction, constraints=tuple(constraints),
                confidence=confidence if confidence is not None else float(goal_data.get("confidence", 0.9)),
                alpha=alpha if alpha is not None else float(goal_data.get("alpha", 0.05)))
    problems = goal.problems()
    if problems:
        raise _fail("; ".join(problems))
    return goal, pareto_metrics


def better(metric: str) -> int:
    """+1 when higher is better (the metric's declaration; undeclared: higher), -1 when lower."""
    decl = M.find(metric)
    return decl.sign if decl is not None and decl.sign else 1


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


def answer(tracker: Any, df: Any, goal: Any, pareto_metrics: Optional[tuple[str, str]]) -> Any:
    """The advice over a run table read from `tracker` (its repetition samples read once per run and metric);
    bad input ends in one message (exit 2)."""
    from jbench.analysis.advice import AdviceError, advise as run_advise
    from jbench.cli.stored import _sample_loader
    from jbench.tracking.reader import with_current_hashes

    df = with_current_hashes(df) if not df.empty else df
    loader = _sample_loader(tracker)
    cached = lru_cache(maxsize=None)(lambda ids, metric: loader(list(ids), metric))

    def samples(run_ids: list[str], metric: str):
        return cached(tuple(run_ids), metric)

    try:
        return run_advise(df, goal, samples, pareto_metrics,
                          (better(pareto_metrics[0]), better(pareto_metrics[1])) if pareto_metrics else None)
    except AdviceError as exc:
        raise _fail(str(exc)) from None


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


def _plot(result, path: str) -> None:
    """The Pareto plot of the two metrics: every configuration by verdict, the front joined, the best ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x, y = result.front_metrics
    fig, ax = plt.subplots(figsize=(7, 5))
    colours = {"meets": "tab:green", "undecided": "tab:orange", "fails": "tab:red"}
    points = {}
    for c in result.candidates:
        ex, ey = c.values.get(x), c.values.get(y)  # estimated for the front (jbench.analysis.advice.pareto)
        if ex is None or ey is None or not (ex.known and ey.known):
            continue
        points[c.config_hash] = (ex.mean, ey.mean)
        ax.errorbar(ex.mean, ey.mean, xerr=ex.se if ex.has_spread else None, yerr=ey.se if ey.has_spread else None,
                    fmt="o", color=colours.get(c.verdict, "grey"), alpha=0.8, capsize=2)
        ax.annotate(c.label, (ex.mean, ey.mean), fontsize=7, xytext=(3, 3), textcoords="offset points")
    front = [points[c.config_hash] for c in result.front if c.config_hash in points]
    if len(front) > 1:
        fx, fy = zip(*sorted(front))
        ax.plot(fx, fy, "--", color="black", linewidth=0.8, label="Pareto front")
    if result.best is not None and result.best.config_hash in points:
        bx, by = points[result.best.config_hash]
        ax.scatter([bx], [by], s=250, facecolors="none", edgecolors="black", label="best")
    for verdict, colour in colours.items():
        ax.scatter([], [], color=colour, label=verdict)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(f"{'max' if result.goal.direction > 0 else 'min'} {result.goal.objective}: {result.outcome}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
