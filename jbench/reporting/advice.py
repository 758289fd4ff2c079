"""The advisor's answer in a report (jbench.analysis.advice.Advice): its section and its Pareto plot."""

from __future__ import annotations

import io
import math

import pandas as pd

from jbench.analysis.advice import Advice


def pareto_png(result: Advice) -> bytes:
    """The Pareto plot of the advice's two metrics (PNG): every configuration by verdict with its error bars, the front
    joined, the best ringed."""
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
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return buf.getvalue()


def advice_table(result: Advice) -> pd.DataFrame:
    """One row per configuration: the mark, its estimate of the objective, P(met) per constraint, the verdict."""
    rows = []
    for c in result.candidates:
        mark = "BEST" if result.best is c else ("~" if c in result.runners_up else "")
        row = {"": mark, "configuration": c.label, "device": c.device, "runs": c.runs,
               result.goal.objective: c.objective.mean,
               "± se": c.objective.se if math.isfinite(c.objective.se) else float("nan")}
        for k in result.goal.constraints:
            row[f"P({k})"] = c.probabilities.get(str(k), float("nan"))
        row["verdict"] = c.verdict
        rows.append(row)
    return pd.DataFrame(rows)
