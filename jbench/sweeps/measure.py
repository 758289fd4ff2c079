"""One trial's measurement with telemetry: idle baseline, the backend's speed pass, energy passes
for phases too short to integrate, cooldown; then energy metrics and findings.

Phase windows and samples are on the device's clock. Without a working sampler the speed pass
runs alone (no idle wait) and energy.status says why.
"""

from __future__ import annotations

import io
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Optional

from jbench.analysis.telemetry import EnergySettings, Finding, PhaseWindow, energy_metrics, findings, mlflow_series
from jbench.backends.base import Backend
from jbench.device.connection import Connection
from jbench.device.telemetry.samplers import NoSampler, Sampler, make_sampler
from jbench.trial import BackendResult, Trial

# An energy pass never runs more repetitions than this, however short one repetition is.
MAX_ENERGY_REPETITIONS = 100_000


@dataclass
class Measured:
    result: BackendResult
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    series: dict[str, list] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    sensor_problem: Optional[str] = None


def _phase_window(result: BackendResult, phase: str, source: str) -> Optional[PhaseWindow]:
    pr = result.phases.get(phase)
    if pr is None or pr.window is None:
        return None
    start, end = pr.window
    return PhaseWindow(phase, start, end, tokens=pr.tokens_in_window, source=source)


def measure(trial: Trial, backend: Backend, conn: Connection, log: logging.Logger,
            power_actual: Optional[str] = None) -> Measured:
    cfg = trial.config
    tele = cfg.get("telemetry") or {"source": "none"}
    energy = EnergySettings(**(cfg.get("energy") or {}))
    sampler: Sampler = make_sampler(tele["source"], conn, cfg["device"], cfg.get("profile"),
                                    int(tele.get("interval_ms", 100)))
    windows: list[PhaseWindow] = []
    if not isinstance(sampler, NoSampler):
        sampler.start()
        if not sampler.wait_for_samples(2, timeout_s=15):
            sampler.stop()
            problem = sampler.problem or f"{sampler.source} gave no samples within 15 s"
            sampler = NoSampler(problem)
    if isinstance(sampler, NoSampler):
        log.info("telemetry: none (%s)", sampler.problem)
        result = backend.run(trial, conn, log)
        chosen = tele["source"] == "none"  # the user asked for no telemetry: nothing to warn about
        return Measured(result, tags={"telemetry.source": "none", "energy.status": f"not measured: {sampler.problem}"},
                        sensor_problem=None if chosen else sampler.problem)
    log.info("telemetry: %s at %d ms", sampler.source, tele.get("interval_ms", 100))
    extra_raw: dict[str, str] = {}
    try:
        idle_s = float(tele.get("idle_s", 3.0))
        if idle_s > 0:
            time.sleep(idle_s)
            t_end = sampler.latest_time()
            if t_end is not None:
                windows.append(PhaseWindow("idle", t_end - idle_s, t_end))
        result = backend.run(trial, conn, log)
        phase_windows = {p: _phase_window(result, p, "speed") for p in ("prefill", "decode")}
        first = min((w.start for w in phase_windows.values() if w), default=None)
        if result.start_time is not None and first is not None and first > result.start_time:
            windows.append(PhaseWindow("load", result.start_time, first))
        for phase, w in phase_windows.items():
            pr = result.phases.get(phase)
            if w is None or pr is None:
                continue
            # Repetitions can get faster once caches are warm: grow the pass until the window is long enough.
            attempts = 0
            while w.duration < energy.min_window_s and tele.get("energy_pass", True) and attempts < 3:
                attempts += 1
                rep_s = max(1e-6, w.duration / max(1, len(pr.samples_ns)))
                reps = min(MAX_ENERGY_REPETITIONS, max(1, math.ceil(energy.min_window_s * 1.25 / rep_s)))
                log.info("energy pass: %s window %.2f s < %.1f s; running %d repetitions", phase, w.duration,
                         energy.min_window_s, reps)
                extra = backend.run(trial, conn, log, only_phase=phase, repetitions=reps)
                extra_raw[f"raw/energy-pass-{phase}.txt"] = extra.raw_output
                pr = extra.phases.get(phase, pr)
                w = _phase_window(extra, phase, "energy") or w
            windows.append(w)
        cooldown_s = float(tele.get("cooldown_s", 0))
        last_end = max((w.end for w in windows), default=None)
        if last_end is not None:
            # The window must end inside the samples: wait for one sample past its end.
            sampler.wait_past(last_end, timeout_s=2.0 + 3 * float(tele.get("interval_ms", 100)) / 1000)
        if cooldown_s > 0 and last_end is not None:
            time.sleep(cooldown_s)
            t_end = sampler.latest_time()
            if t_end is not None and t_end > last_end:
                windows.append(PhaseWindow("cooldown", last_end, t_end))
    finally:
        samples = sampler.stop()
    metrics, tags = energy_metrics(samples, windows, energy, sampler.problem if not samples else None)
    tags["telemetry.source"] = sampler.source
    tags["telemetry.samples"] = str(len(samples))
    tags["telemetry.skipped_lines"] = str(sampler.skipped_lines)
    if getattr(sampler, "power_field", None):
        tags["telemetry.power_field"] = sampler.power_field
    found = findings(samples, windows, profile=cfg.get("profile"), requested_mode=(cfg.get("power") or {}).get("mode"),
                     actual_mode=power_actual)
    for f in found:
        tags[f"finding.{f.code}"] = f.message
    files = dict(extra_raw)
    files["telemetry/samples.csv"] = samples_csv(samples)
    files["telemetry/windows.json"] = json.dumps([w.__dict__ for w in windows], indent=2)
    if found:
        files["findings.json"] = json.dumps([f.__dict__ for f in found], indent=2, default=str)
    return Measured(result, metrics, tags, files, mlflow_series(samples), found,
                    sampler.problem if not samples else None)


def samples_csv(samples: list[dict]) -> str:
    """Samples as CSV, one column per signal any sample has (empty where a sample lacks it)."""
    import csv

    columns: dict[str, None] = {}
    for s in samples:
        columns.update(dict.fromkeys(s))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), restval="")
    writer.writeheader()
    writer.writerows(samples)
    return buf.getvalue()
