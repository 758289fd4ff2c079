"""The serving scenario's answers, after the Measure stage priced each level's window: the per-level table (speed,
latency percentiles, goodput, energy per token), the knee of throughput vs load, the SLO capacity and the tokens per
joule at it, each with its interval (jbench.analysis.serving). A Stage registered in the `jbench.analyses` group."""

from __future__ import annotations

import csv
import io
import json
import math
from typing import Optional

from jbench.analysis.energy import WindowEnergy
from jbench.analysis.serving import Estimate, Level, knee, level_figures, slo_capacity, slo_from
from jbench.core import metrics
from jbench.core.results import Finding, LoadWindow, Result
from jbench.core.schema import ServingConfig
from jbench.runner.context import TrialContext
from jbench.runner.stages import Stage

# Per-level figures recorded as stepped metrics (step = level in run order), from level_figures' keys.
LEVEL_SERIES = ("request_throughput_rps", "output_tps", "total_tps", "goodput_rps", "slo_attainment",
                *(f"{m}_ms_p{q}" for m in ("ttft", "tpot", "itl", "e2e") for q in (50, 90, 99)))

# Speculative decoding per level (backend.draft / spec_type), from the server's own counters; absent without them.
DRAFT_SERIES = ("draft_acceptance", "draft_tokens_per_output_token")


def level_energy(window: LoadWindow, energy: Optional[WindowEnergy]) -> dict[str, float]:
    """Energy figures of one level's window: J per output token and per total token, tok/J, average power; absent
    (with the window's status elsewhere) when the window gave no energy."""
    if energy is None or not energy.ok or not energy.energy_j > 0:
        return {}
    out = {"energy_j": energy.energy_j, "avg_power_w": energy.avg_power_w}
    if window.output_tokens > 0:
        out["output_tokens_per_joule"] = window.output_tokens / energy.energy_j
        out["joules_per_output_token"] = energy.energy_j / window.output_tokens
    if window.total_tokens > 0:
        out["total_tokens_per_joule"] = window.total_tokens / energy.energy_j
    return out


def _estimate(out: Result, name: str, est: Estimate) -> None:
    if not math.isnan(est.value):
        out.metrics[name] = est.value
    if not math.isnan(est.low) and not math.isnan(est.high):
        out.metrics[f"{name}_low"], out.metrics[f"{name}_high"] = est.low, est.high
    out.tags[f"serving.{name.removeprefix('serving_')}"] = est.reason


def serving_result(cfg: ServingConfig, levels: list[Level], windows: list[LoadWindow],
                   energy: dict[str, WindowEnergy], energy_problem: Optional[str] = None,
                   draft: Optional[list[dict[str, float]]] = None) -> Result:
    """Everything the serving scenario records beyond the trial's phase speeds (pure over its inputs). draft: each
    level's speculative-decoding figures as the backend read them from the server (DRAFT_SERIES keys; a level
    without them has an empty dict)."""
    out = Result()
    slo = slo_from(cfg.slo)
    rows: list[dict[str, float]] = []
    for i, (level, window) in enumerate(zip(levels, windows), start=1):
        row = {"level": float(i), "load": level.load, **level_figures(level, slo)}
        row.update(level_energy(window, energy.get(window.name)))
        if draft and i <= len(draft):
            row.update({k: float(v) for k, v in draft[i - 1].items() if k in DRAFT_SERIES})
        rows.append(row)
        if level.stopped_early:
            out.findings.append(Finding("serving_oversaturated", f"level {i} ({cfg.load} {level.load:g}): "
                                        f"{level.stopped_early}", {"level": i, "load": level.load}))
        status = energy.get(window.name)
        if status is not None and not status.ok:
            out.tags[f"energy.{window.name}.status"] = status.status
    out.stepped["serving_level_load"] = [r["load"] for r in rows]
    for key in (*LEVEL_SERIES, "output_tokens_per_joule", "total_tokens_per_joule", "joules_per_output_token",
                "avg_power_w", *DRAFT_SERIES):
        if any(key in r for r in rows):
            out.stepped[f"serving_{key}"] = [r.get(key, math.nan) for r in rows]
    out.metrics["serving_levels_run"] = float(len(levels))
    speeds = [r["output_tps"] for r in rows if "output_tps" in r]
    if speeds:
        out.metrics["serving_max_output_tps"] = max(speeds)
    if energy_problem:
        out.tags["serving.energy"] = f"not measured: {energy_problem}"
    k = knee(levels)
    _estimate(out, "serving_knee_load", k)
    cap = slo_capacity(levels, slo) if slo.defined else None
    if cap is not None:
        _estimate(out, "serving_slo_capacity", cap)
        if not math.isnan(cap.value):
            at = [r for r in rows if r["load"] == cap.value]
            for key, name in (("output_tps", "serving_capacity_output_tps"),
                              ("goodput_rps", "serving_capacity_goodput_rps"),
                              ("output_tokens_per_joule", "serving_capacity_output_tokens_per_joule")):
                vals = [r[key] for r in at if key in r and not math.isnan(r[key])]
                if vals:
                    out.metrics[name] = sum(vals) / len(vals)
        else:
            out.findings.append(Finding("serving_slo_not_met", f"no level met the SLO: {cap.reason}",
                                        {"attainment_target": slo.attainment}))
    out.artifacts["serving/levels.csv"] = _csv(rows)
    out.artifacts["serving/summary.json"] = json.dumps({
        "load": cfg.load, "search": cfg.search, "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms,
                                                        "e2e_ms": slo.e2e_ms, "attainment": slo.attainment},
        "levels": rows, "knee": k.__dict__,
        "slo_capacity": cap.__dict__ if cap is not None else None,
    }, indent=2, default=float)
    return out


def _csv(rows: list[dict[str, float]]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=keys)
    writer.writeheader()
    for r in rows:
        writer.writerow({k: r.get(k, "") for k in keys})
    return buf.getvalue()


class Serving(Stage):
    """Per-level table, knee, SLO capacity and tokens/J at it, for a trial of the serving scenario."""

    NAME = metrics.SERVING
    PROVIDES = tuple(metrics.provided_by(NAME))

    def applies(self, ctx: TrialContext) -> bool:
        return ctx.backend_result is not None and bool(ctx.backend_result.serving_levels)

    def run(self, ctx: TrialContext) -> None:
        result = ctx.backend_result
        assert result is not None
        problem = None
        if not ctx.load_energy:
            problem = ctx.record.tags.get("energy.status", "no telemetry").removeprefix("not measured: ")
        ctx.record.merge(serving_result(ctx.cfg.serving, list(result.serving_levels), list(result.load_windows),
                                        ctx.load_energy, problem, draft=result.info.get("serving_draft")))
