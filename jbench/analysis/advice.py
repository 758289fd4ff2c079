"""The advisor (pure): over measured configurations, the best one for an objective under constraints, and how sure.

Input: a run table (`jbench.tracking.runs_frame`: FINISHED trial runs, `tags.jbench.config_hash`, `metrics.<name>`)
and optionally each run's repetition samples. A configuration is one config hash on one device (the hash holds the
device, so the same settings on two units are two candidates).

**Each configuration's estimate of a metric, with the noise it was measured with** (`Estimate`):
  * two or more runs of it: the mean of the runs' values, its standard error from their spread (the trial as the
    unit: repetitions of one trial share its process and moment, and two trials of one build differ by more than
    their repetitions say), Student t with runs − 1 degrees of freedom;
  * one run with repetition samples (`<metric>_rep`): their mean and standard error, t with n − 1 degrees of freedom;
    marked "within one trial", an optimistic spread;
  * one run and a standard error the tool printed (`<metric>_err`, e.g. llama-perplexity's KL divergence): that,
    as a normal;
  * one value and nothing else (a memory pass runs once per trial): no spread. A constraint on it is judged on the
    value alone (P = 1 or 0), and the candidate's notes say so; more runs of the configuration give it a spread.

**A constraint** (`metric >= bound` or `<=`): P(met) = the t (or normal) probability that the configuration's true
value is on the right side, from its estimate. The configuration **meets** the constraints when the product of its
probabilities (the constraints taken as independent) is at least `confidence` (default 0.9), **fails** when one of
them is below 1 − confidence, and is **undecided** otherwise (its figures cannot say: more repetitions would), and
also when a constrained metric was not recorded.

**The answer**: among the configurations that meet the constraints, the best by the objective's mean (maximise or
minimise any recorded metric). The runners-up are the others that meet them and are not significantly worse: a
Welch t test of the objective (from their estimates: means, standard errors, degrees of freedom) against the best
at `alpha` (default 0.05). Outcome: `found`; `undecided` (nothing meets, something is undecided: the data cannot
decide); `none` (everything fails: the constraints are met by nothing, the closest configuration is named);
`empty` (no configuration recorded the objective).

**The Pareto front** of two metrics (each with its declared better direction, or the one given): the configurations
no other beats on both, over all candidates (those that meet the constraints are marked).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import pandas as pd

from jbench.analysis.compare import CONFIG_HASH, config_label, finished_trials

__all__ = ["Constraint", "Goal", "Estimate", "Candidate", "Advice", "AdviceError", "parse_constraint", "estimate",
           "advise", "pareto", "MEETS", "FAILS", "UNDECIDED"]

MEETS, FAILS, UNDECIDED = "meets", "fails", "undecided"
_OPS = {">=": 1, ">": 1, "<=": -1, "<": -1}
_CONSTRAINT = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(>=|<=|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")

Samples = Callable[[list[str], str], Mapping[str, Sequence[float]]]


class AdviceError(ValueError):
    """Bad input: one message naming the fix."""


@dataclass(frozen=True)
class Constraint:
    metric: str
    sense: int  # +1: metric >= bound; -1: metric <= bound
    bound: float

    def __str__(self) -> str:
        return f"{self.metric} {'>=' if self.sense > 0 else '<='} {self.bound:g}"


def parse_constraint(text: str) -> Constraint:
    """`decode_tps>=20`, `memory_peak_rss_mib <= 6000` (> and < read as >= and <=: a measured value is never exactly
    on a bound)."""
    m = _CONSTRAINT.match(text)
    if not m:
        raise AdviceError(f"constraint '{text}': write METRIC>=VALUE or METRIC<=VALUE, e.g. decode_tps>=20")
    return Constraint(m.group(1), _OPS[m.group(2)], float(m.group(3)))


@dataclass(frozen=True)
class Goal:
    objective: str
    direction: int  # +1 maximise, -1 minimise
    constraints: tuple[Constraint, ...] = ()
    confidence: float = 0.9
    alpha: float = 0.05

    def problems(self) -> list[str]:
        out = []
        if self.direction not in (1, -1):
            out.append("the objective needs a direction: maximise or minimise")
        if not 0.5 <= self.confidence < 1:
            out.append(f"confidence {self.confidence}: give a probability in [0.5, 1), e.g. 0.9")
        if not 0 < self.alpha < 0.5:
            out.append(f"alpha {self.alpha}: give a significance level in (0, 0.5), e.g. 0.05")
        return out


@dataclass(frozen=True)
class Estimate:
    mean: float
    se: float  # standard error of the mean; NaN: no spread measured
    dof: float  # degrees of freedom of its t distribution; inf: normal
    n: int  # values it comes from (runs or repetitions)
    basis: str  # "runs" | "repetitions (one trial)" | "tool error" | "one value" | "missing"

    @property
    def known(self) -> bool:
        return math.isfinite(self.mean)

    @property
    def has_spread(self) -> bool:
        return math.isfinite(self.se)

    def prob_at_least(self, bound: float) -> float:
        """P(true value >= bound); NaN without a spread."""
        if not self.known or not self.has_spread:
            return math.nan
        if self.se == 0:
            return 1.0 if self.mean >= bound else 0.0
        from scipy import stats

        z = (self.mean - bound) / self.se
        return float(stats.norm.cdf(z) if math.isinf(self.dof) else stats.t.cdf(z, self.dof))


MISSING = Estimate(math.nan, math.nan, math.nan, 0, "missing")


def _finite(values: Any) -> list[float]:
    out = []
    for v in values:
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out.append(f)
    return out


def estimate(rows: pd.DataFrame, metric: str, samples: Optional[Samples] = None) -> Estimate:
    """A configuration's estimate of one metric from its runs (module doc)."""
    col = f"metrics.{metric}"
    values = _finite(rows[col]) if col in rows.columns else []
    if len(values) >= 2:
        mean = sum(values) / len(values)
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        return Estimate(mean, sd / math.sqrt(len(values)), len(values) - 1, len(values), "runs")
    if samples is not None and "run_id" in rows.columns:
        reps = _finite(v for series in samples(list(rows["run_id"]), f"{metric}_rep").values() for v in series)
        if len(reps) >= 2:
            mean = sum(reps) / len(reps)
            sd = math.sqrt(sum((v - mean) ** 2 for v in reps) / (len(reps) - 1))
            # The run's own mean is the figure shown (the same repetitions, or fewer when some were set aside).
            shown = values[0] if values else mean
            return Estimate(shown, sd / math.sqrt(len(reps)), len(reps) - 1, len(reps), "repetitions (one trial)")
    err_col = f"metrics.{metric}_err"
    if values and err_col in rows.columns:
        errs = _finite(rows[err_col])
        if errs:
            return Estimate(values[0], errs[0], math.inf, 1, "tool error")
    if values:
        return Estimate(values[0], math.nan, math.nan, 1, "one value")
    return MISSING


@dataclass
class Candidate:
    config_hash: str
    label: str
    device: str
    runs: int
    objective: Estimate
    values: dict[str, Estimate] = field(default_factory=dict)  # each constrained metric
    probabilities: dict[str, float] = field(default_factory=dict)  # str(constraint) -> P(met); NaN: cannot say
    joint: float = math.nan
    verdict: str = UNDECIDED
    why: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how a figure was judged (one value, no spread)
    # Against the best (runners-up): the objective's difference (candidate - best) and its test.
    vs_best_diff: float = math.nan
    vs_best_p: float = math.nan
    run_ids: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        def est(e: Estimate) -> dict[str, Any]:
            return {"mean": _json(e.mean), "se": _json(e.se), "n": e.n, "basis": e.basis}

        return {"config_hash": self.config_hash, "label": self.label, "device": self.device, "runs": self.runs,
                "objective": est(self.objective), "values": {k: est(v) for k, v in self.values.items()},
                "probabilities": {k: _json(v) for k, v in self.probabilities.items()}, "joint": _json(self.joint),
                "verdict": self.verdict, "why": list(self.why), "notes": list(self.notes), "vs_best_diff": _json(self.vs_best_diff),
                "vs_best_p": _json(self.vs_best_p), "run_ids": list(self.run_ids)}


def _json(v: float) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


@dataclass
class Advice:
    goal: Goal
    outcome: str  # found | undecided | none | empty
    candidates: list[Candidate]  # ranked: meets (best first), undecided, fails; each by the objective
    best: Optional[Candidate] = None
    runners_up: list[Candidate] = field(default_factory=list)
    message: str = ""
    front: list[Candidate] = field(default_factory=list)
    front_metrics: tuple[str, str] = ("", "")

    def as_dict(self) -> dict[str, Any]:
        g = self.goal
        return {"objective": g.objective, "direction": "maximise" if g.direction > 0 else "minimise",
                "constraints": [str(c) for c in g.constraints], "confidence": g.confidence, "alpha": g.alpha,
                "outcome": self.outcome, "message": self.message,
                "best": self.best.as_dict() if self.best else None,
                "runners_up": [c.as_dict() for c in self.runners_up],
                "pareto": {"metrics": list(self.front_metrics), "front": [c.config_hash for c in self.front]},
                "candidates": [c.as_dict() for c in self.candidates]}


def _welch_p(a: Estimate, b: Estimate) -> float:
    """Two-sided p of mean(a) = mean(b) from two estimates (Welch-Satterthwaite degrees of freedom)."""
    if not (a.has_spread and b.has_spread):
        return math.nan
    var = a.se ** 2 + b.se ** 2
    if var == 0:
        return 0.0 if a.mean != b.mean else 1.0
    from scipy import stats

    t = (a.mean - b.mean) / math.sqrt(var)
    # Welch-Satterthwaite: a side with infinite degrees of freedom (a normal: a tool's error) adds no term.
    terms = [(e.se ** 2) ** 2 / e.dof for e in (a, b) if e.se > 0 and e.dof and not math.isinf(e.dof)]
    dof = var ** 2 / sum(terms) if terms else math.inf
    return float(2 * (stats.norm.sf(abs(t)) if math.isinf(dof) else stats.t.sf(abs(t), dof)))


def available_metrics(df: pd.DataFrame) -> list[str]:
    return sorted(c[len("metrics."):] for c in df.columns if c.startswith("metrics."))


def _check_metric(name: str, known: list[str], what: str) -> Optional[str]:
    if name in known:
        return None
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else (
        f"; these runs recorded: {', '.join(known[:12])}{', ...' if len(known) > 12 else ''}")
    return f"{what} '{name}' is not recorded by any selected run{hint}"


def advise(df: pd.DataFrame, goal: Goal, samples: Optional[Samples] = None,
           pareto_metrics: Optional[tuple[str, str]] = None,
           pareto_directions: Optional[tuple[int, int]] = None) -> Advice:
    """The advice over a run table (module doc). AdviceError for a goal the runs cannot be asked about."""
    problems = goal.problems()
    trials = finished_trials(df)
    if trials.empty:
        raise AdviceError("no FINISHED trial runs selected: run a sweep first, or select other experiments/sweeps")
    known = available_metrics(trials)
    problems += [p for p in (_check_metric(goal.objective, known, "objective"),
                             *(_check_metric(c.metric, known, "constraint metric") for c in goal.constraints),
                             *((_check_metric(m, known, "Pareto metric") for m in pareto_metrics)
                               if pareto_metrics else ())) if p]
    if problems:
        raise AdviceError("; ".join(problems))
    candidates = []
    for config_hash, rows in trials.groupby(CONFIG_HASH, sort=False):
        c = Candidate(config_hash=str(config_hash), label=config_label(rows), device=_device(rows), runs=len(rows),
                      objective=estimate(rows, goal.objective, samples),
                      run_ids=[str(r) for r in rows["run_id"]] if "run_id" in rows.columns else [])
        _judge(c, rows, goal, samples)
        candidates.append(c)

    def rank(c: Candidate) -> tuple:
        order = {MEETS: 0, UNDECIDED: 1, FAILS: 2}[c.verdict]
        obj = c.objective.mean if c.objective.known else -math.inf * goal.direction
        return (order, -goal.direction * obj, c.label)

    candidates.sort(key=rank)
    advice = Advice(goal, "", candidates)
    measured = [c for c in candidates if c.objective.known]
    meeting = [c for c in measured if c.verdict == MEETS]
    if not measured:
        advice.outcome = "empty"
        advice.message = f"no configuration recorded the objective {goal.objective}"
    elif meeting:
        best = advice.best = meeting[0]
        advice.outcome = "found"
        for c in meeting[1:]:
            c.vs_best_diff = c.objective.mean - best.objective.mean
            c.vs_best_p = _welch_p(c.objective, best.objective)
            if not (c.vs_best_p < goal.alpha):  # NaN (no spread) counts as "cannot say it is worse"
                advice.runners_up.append(c)
        direction = "highest" if goal.direction > 0 else "lowest"
        advice.message = (f"{best.label}{f' on {best.device}' if best.device else ''}: the {direction} {goal.objective}"
                          f" ({_g(best.objective.mean)}) of {len(meeting)} configuration(s) meeting "
                          f"{_constraints_text(goal)} with probability >= {goal.confidence:g}")
    elif any(c.verdict == UNDECIDED for c in measured):
        undecided = [c for c in measured if c.verdict == UNDECIDED]
        advice.outcome = "undecided"
        advice.message = (f"the data cannot decide: no configuration meets {_constraints_text(goal)} with probability "
                          f">= {goal.confidence:g}; {len(undecided)} cannot be told apart from the bounds ("
                          + "; ".join(f"{c.label}: {', '.join(c.why)}" for c in undecided[:3])
                          + ("; ..." if len(undecided) > 3 else "") + "). Measure them again (more repetitions or runs)")
    else:
        closest = max(measured, key=lambda c: (c.joint if math.isfinite(c.joint) else -1.0))
        advice.outcome = "none"
        advice.message = (f"the constraints are met by nothing: every configuration fails {_constraints_text(goal)}; "
                          f"the closest is {closest.label} ({', '.join(closest.why)})")
    if pareto_metrics:
        advice.front_metrics = pareto_metrics
        advice.front = pareto(candidates, trials, pareto_metrics, pareto_directions or (1, 1), samples)
    return advice


def _constraints_text(goal: Goal) -> str:
    return " and ".join(str(c) for c in goal.constraints) or "no constraint"


def _g(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else "-"


def _device(rows: pd.DataFrame) -> str:
    for col in ("tags.device.name", "params.device.name"):
        if col in rows.columns:
            v = rows[col].dropna()
            if len(v):
                return str(v.iloc[-1])
    return ""


def _judge(c: Candidate, rows: pd.DataFrame, goal: Goal, samples: Optional[Samples]) -> None:
    joint, undecided, fails = 1.0, False, False
    low = 1.0 - goal.confidence
    for con in goal.constraints:
        e = estimate(rows, con.metric, samples)
        c.values[con.metric] = e
        key = str(con)
        if not e.known:
            c.probabilities[key] = math.nan
            c.why.append(f"{con.metric} not recorded")
            undecided = True
            continue
        p_up = e.prob_at_least(con.bound)
        p = p_up if con.sense > 0 else (1.0 - p_up if math.isfinite(p_up) else math.nan)
        if not math.isfinite(p):
            # One value, no spread (a memory pass runs once per trial): judged on the value alone, and said so.
            p = 1.0 if (e.mean - con.bound) * con.sense >= 0 else 0.0
            c.notes.append(f"{con.metric} judged on its one value ({_g(e.mean)}): no spread measured")
        c.probabilities[key] = p
        joint *= p
        if p < low:
            fails = True
            c.why.append(f"P({con}) = {p:.2f} ({con.metric} {_g(e.mean)} ± {_g(e.se)})")
        elif p < goal.confidence:
            c.why.append(f"P({con}) = {p:.2f}: {con.metric} {_g(e.mean)} ± {_g(e.se)} is too close to the bound")
    c.joint = joint if not undecided else math.nan
    if fails:
        c.verdict = FAILS
    elif undecided or joint < goal.confidence:
        c.verdict = UNDECIDED
        if not undecided and not c.why:
            c.why.append(f"P(all) = {joint:.2f} < {goal.confidence:g}")
    else:
        c.verdict = MEETS


def pareto(candidates: list[Candidate], trials: pd.DataFrame, metrics: tuple[str, str], directions: tuple[int, int],
           samples: Optional[Samples] = None) -> list[Candidate]:
    """The candidates no other one beats on both metrics (by their means, each in its better direction)."""
    x, y = metrics
    means: dict[str, tuple[float, float]] = {}
    by_hash = {h: rows for h, rows in trials.groupby(CONFIG_HASH, sort=False)}
    for c in candidates:
        rows = by_hash.get(c.config_hash)
        if rows is None:
            continue
        ex = c.values.get(x) or estimate(rows, x, samples)
        ey = c.values.get(y) or estimate(rows, y, samples)
        c.values.setdefault(x, ex)
        c.values.setdefault(y, ey)
        if ex.known and ey.known:
            means[c.config_hash] = (directions[0] * ex.mean, directions[1] * ey.mean)
    front = []
    for c in candidates:
        if c.config_hash not in means:
            continue
        a = means[c.config_hash]
        dominated = any(b[0] >= a[0] and b[1] >= a[1] and b != a for h, b in means.items() if h != c.config_hash)
        if not dominated:
            front.append(c)
    return sorted(front, key=lambda c: -means[c.config_hash][0])
