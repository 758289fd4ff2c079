"""One trial's measurement with telemetry: idle baseline, the backend's speed pass, energy passes
for phases too short to integrate, cooldown; then energy metrics and findings.

Phase windows and samples are on the device's clock. Without a working sampler the speed pass
runs alone (no idle wait) and energy.status says why.
"""

from __future__ import annotations

import io
import json
import math
import time
from typing import Optional

from jbench.analysis.energy import SpeedMatch, speed_match, withhold_per_token_energy
from jbench.analysis.telemetry import EnergySettings, PhaseWindow, energy_metrics, findings, mlflow_series
from jbench.device.telemetry.samplers import NoSampler, Sampler
from jbench.device.telemetry.sources import make_sampler
from jbench.results import BackendResult, Finding, PhaseResult, Result
from jbench.sweeps.context import TrialContext

# An energy pass never runs more repetitions than this, however short one repetition is.
MAX_ENERGY_REPETITIONS = 100_000


def _phase_window(result: BackendResult, phase: str, source: str) -> Optional[PhaseWindow]:
    pr = result.phases.get(phase)
    if pr is None or pr.window is None:
        return None
    start, end = pr.window
    return PhaseWindow(phase, start, end, tokens=pr.tokens_in_window, source=source)


def _start_sampler(ctx: TrialContext) -> Sampler:
    tele = ctx.cfg.telemetry
    sampler = make_sampler(tele.source, ctx.conn, ctx.trial.config["device"], ctx.trial.config.get("profile"),
                           int(tele.interval_ms))
    if isinstance(sampler, NoSampler):
        return sampler
    sampler.start()
    if not sampler.wait_for_samples(2, timeout_s=15):
        sampler.stop()
        return NoSampler(sampler.problem or f"{sampler.source} gave no samples within 15 s")
    return sampler


def measure(ctx: TrialContext) -> None:
    """Run the backend with telemetry; leaves ctx.backend_result and adds energy to ctx.record."""
    tele, backend, trial, log = ctx.cfg.telemetry, ctx.backend, ctx.trial, ctx.log
    sampler = _start_sampler(ctx)
    if isinstance(sampler, NoSampler):
        log.info("telemetry: none (%s)", sampler.problem)
        ctx.backend_result = backend.run(trial, ctx.conn, log)
        ctx.record.tags.update({"telemetry.source": "none", "energy.status": f"not measured: {sampler.problem}"})
        if tele.source != "none":  # the user asked for no telemetry: nothing to warn about
            ctx.notes.append(sampler.problem)
        return
    log.info("telemetry: %s at %d ms", sampler.source, tele.interval_ms)
    energy = EnergySettings(ctx.cfg.energy.min_window_s, ctx.cfg.energy.min_samples, ctx.cfg.energy.min_coverage)
    windows: list[PhaseWindow] = []
    artifacts: dict[str, str] = {}
    matches: dict[str, SpeedMatch] = {}  # phase -> how its energy pass's speed compares with the speed pass
    try:
        if tele.idle_s > 0:
            time.sleep(tele.idle_s)
            t_end = sampler.latest_time()
            if t_end is not None:
                windows.append(PhaseWindow("idle", t_end - tele.idle_s, t_end))
        result = ctx.backend_result = backend.run(trial, ctx.conn, log)
        phase_windows = {p: _phase_window(result, p, "speed") for p in ("prefill", "decode")}
        first = min((w.start for w in phase_windows.values() if w), default=None)
        if result.start_time is not None and first is not None and first > result.start_time:
            windows.append(PhaseWindow("load", result.start_time, first))
        for phase, w in phase_windows.items():
            pr = result.phases.get(phase)
            if w is None or pr is None:
                continue
            if w.duration < energy.min_window_s and tele.energy_pass:
                w, match = _energy_pass(ctx, phase, pr, w, energy, artifacts)
                if match is not None:
                    matches[phase] = match
            windows.append(w)
        last_end = max((w.end for w in windows), default=None)
        if last_end is not None:
            # The window must end inside the samples: wait for one sample past its end.
            sampler.wait_past(last_end, timeout_s=2.0 + 3 * tele.interval_ms / 1000)
        if tele.cooldown_s > 0 and last_end is not None:
            time.sleep(tele.cooldown_s)
            t_end = sampler.latest_time()
            if t_end is not None and t_end > last_end:
                windows.append(PhaseWindow("cooldown", last_end, t_end))
    finally:
        samples = sampler.stop()
    metrics, tags = energy_metrics(samples, windows, energy, sampler.problem if not samples else None)
    found_speed = _speed_match_record(metrics, tags, matches)
    tags["telemetry.source"] = sampler.source
    tags["telemetry.samples"] = str(len(samples))
    tags["telemetry.skipped_lines"] = str(sampler.skipped_lines)
    if getattr(sampler, "power_field", None):
        tags["telemetry.power_field"] = sampler.power_field
    found = findings(samples, windows, profile=trial.config.get("profile"), requested_mode=ctx.cfg.power.mode,
                     actual_mode=ctx.actual_mode) + found_speed
    artifacts["telemetry/samples.csv"] = samples_csv(samples)
    artifacts["telemetry/windows.json"] = json.dumps([w.__dict__ for w in windows], indent=2)
    if not samples and sampler.problem:
        ctx.notes.append(sampler.problem)
    ctx.record.merge(Result(metrics=metrics, tags=tags, findings=found, artifacts=artifacts,
                            series=mlflow_series(samples)))


def _energy_pass(ctx: TrialContext, phase: str, speed: PhaseResult, window: PhaseWindow, energy: EnergySettings,
                 artifacts: dict[str, str]) -> tuple[PhaseWindow, Optional[SpeedMatch]]:
    """Run `phase` alone, long enough to integrate, at the speed the speed pass measured.

    Returns the window to take energy from and how its tok/s compares with the speed pass (None when
    no energy pass ran). A pass whose speed is off by more than energy.speed_tolerance is run again
    (energy.speed_match_retries times); the last one is kept either way and the caller withholds its
    tokens/J when it still does not match.
    """
    tele, cfg, log = ctx.cfg.telemetry, ctx.cfg.energy, ctx.log
    w, pr, match = window, speed, None
    attempts = retries = 0
    # Repetitions can get faster once caches are warm: grow the pass until the window is long enough.
    while attempts < 3 + retries:
        if w.duration >= energy.min_window_s and (match is None or match.ok):
            break
        if w.duration >= energy.min_window_s:  # long enough but at another speed: the one rerun allowed
            if retries >= cfg.speed_match_retries:
                break
            retries += 1
            log.info("energy pass: %s %s; running it again", phase, match.reason)
        attempts += 1
        rep_s = max(1e-6, w.duration / max(1, len(pr.samples_ns)))
        reps = min(MAX_ENERGY_REPETITIONS, max(1, math.ceil(energy.min_window_s * 1.25 / rep_s)))
        if match is None or match.ok:
            log.info("energy pass: %s window %.2f s < %.1f s; running %d repetitions", phase, w.duration,
                     energy.min_window_s, reps)
        extra = ctx.backend.run(ctx.trial, ctx.conn, log, only_phase=phase, repetitions=reps)
        artifacts[f"raw/energy-pass-{phase}.txt"] = extra.raw_output
        pr = extra.phases.get(phase, pr)
        w = _phase_window(extra, phase, "energy") or w
        if w.source == "energy":
            match = speed_match(speed.tokens_in_window, sum(speed.samples_ns) / 1e9, w.tokens, w.duration,
                                cfg.speed_tolerance)
    return w, match


def _speed_match_record(metrics: dict[str, float], tags: dict[str, str],
                        matches: dict[str, SpeedMatch]) -> list[Finding]:
    """Each energy pass's speed next to the speed pass's; tokens/J of a phase whose energy window ran
    at another speed become NaN, with the reason (tag and finding)."""
    found: list[Finding] = []
    for phase, match in matches.items():
        metrics[f"{phase}_energy_window_tps"] = match.window_tps
        metrics[f"{phase}_energy_speed_difference_pct"] = 100 * match.difference
        if match.ok:
            continue
        withhold_per_token_energy(metrics, phase)
        reason = f"tokens/J not published: {match.reason}"
        status = tags.get(f"energy.{phase}.status")
        tags[f"energy.{phase}.status"] = reason if status in (None, "ok") else f"{status}; {reason}"
        bad = [f"{p}: {tags[f'energy.{p}.status']}" for p in ("idle", "load", "prefill", "decode", "cooldown")
               if tags.get(f"energy.{p}.status", "ok") != "ok"]
        tags["energy.status"] = "; ".join(bad) if bad else "ok"
        found.append(Finding("energy_speed_mismatch", f"{phase}: {reason}",
                             {"speed_tps": match.speed_tps, "energy_window_tps": match.window_tps,
                              "difference_pct": 100 * match.difference, "tolerance_pct": 100 * match.tolerance}))
    return found


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
