"""Goals of the advisor (`advise --goal`, `sweep --search`, `report --goal`): read, checked, and answered over runs."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from jbench.cli.app import _fail
from jbench.core import metrics as M


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


def answer(tracker: Any, df: Any, goal: Any, pareto_metrics: Optional[tuple[str, str]]) -> Any:
    """The advice over a run table read from `tracker` (its repetition samples read once per run and metric);
    bad input ends in one message (exit 2)."""
    from jbench.analysis.advice import AdviceError, advise as run_advise
    from jbench.tracking.reader import repetition_samples, with_current_hashes

    df = with_current_hashes(df) if not df.empty else df
    cached = lru_cache(maxsize=None)(lambda ids, metric: repetition_samples(tracker, list(ids), metric))

    def samples(run_ids: list[str], metric: str):
        return cached(tuple(run_ids), metric)

    try:
        return run_advise(df, goal, samples, pareto_metrics,
                          (better(pareto_metrics[0]), better(pareto_metrics[1])) if pareto_metrics else None)
    except AdviceError as exc:
        raise _fail(str(exc)) from None
