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
from jbench.analysis.memory import telemetry_memory
from jbench.analysis.telemetry import EnergySettings, PhaseWindow, energy_metrics, findings, mlflow_series
from jbench.analysis.wall import board_coverage_metrics, wall_energy_metrics
from jbench.device.connection import ConnectionLost, DeviceError
from jbench.device.telemetry.samplers import NoSampler, Sampler
from jbench.device.telemetry.sources import make_sampler
from jbench.device.telemetry.wall import (ClockOffset, PtdSampler, WallMeterError, WallSampler, make_wall_sampler,
                                          measure_clock_offset)
from jbench.core.results import BackendResult, Finding, PhaseResult, Result
from jbench.runner.context import TrialContext

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
    sampler = make_sampler(tele.source, ctx.conn, ctx.cfg.device, ctx.cfg.profile,
                           int(tele.interval_ms), hwmon_interval_ms=int(tele.hwmon_interval_ms))
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
    try:
        wall = _start_wall(ctx)
    except BaseException:  # a link lost (or Ctrl-C) while the meter starts: the device's sampler stops too
        sampler.stop()
        raise
    if isinstance(sampler, NoSampler):
        log.info("telemetry: none (%s)", sampler.problem)
        try:
            ctx.backend_result = backend.run(trial, ctx.conn, log)
        finally:
            _stop_wall(wall, [])
        ctx.record.tags.update({"telemetry.source": "none", "energy.status": f"not measured: {sampler.problem}"})
        if tele.source != "none":  # the user asked for no telemetry: nothing to warn about
            ctx.notes.append(sampler.problem)
        # Without board telemetry the wall meter still has the speed pass's phase windows.
        speed = [w for w in (_phase_window(ctx.backend_result, p, "speed") for p in ("prefill", "decode")) if w]
        ctx.record.merge(_wall_result(ctx, wall, speed))
        return
    log.info("telemetry: %s at %d ms", sampler.source, tele.interval_ms)
    energy = EnergySettings(ctx.cfg.energy.min_window_s, ctx.cfg.energy.min_samples, ctx.cfg.energy.min_coverage)
    windows: list[PhaseWindow] = []
    artifacts: dict[str, str] = {}
    matches: dict[str, SpeedMatch] = {}  # phase -> how its energy pass's speed compares with the speed pass
    try:
        if tele.idle_s > 0:
            # The idle window is the last idle_s seconds before the newest board sample, which lags the clock by a
            # sampling interval or more on a loaded controller: wait that much longer, so the window starts after
            # the wall meter's first reading too (else the wall's idle figure is "not fully inside samples").
            wall_interval = wall.sampler.interval if wall is not None and wall.sampler is not None else 0.0
            time.sleep(tele.idle_s + 2 * max(tele.interval_ms / 1000, wall_interval))
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
        _stop_wall(wall, windows)
    metrics, tags = energy_metrics(samples, windows, energy, sampler.problem if not samples else None)
    mem_metrics, mem_tags = telemetry_memory(samples, windows)  # RAM, swap, GPU memory over idle
    metrics.update(mem_metrics)
    tags.update(mem_tags)
    found_speed = _speed_match_record(metrics, tags, matches)
    tags["telemetry.source"] = sampler.source
    tags["telemetry.samples"] = str(len(samples))
    tags["telemetry.skipped_lines"] = str(sampler.skipped_lines)
    if getattr(sampler, "power_field", None):
        tags["telemetry.power_field"] = sampler.power_field
    tags.update(sampler.telemetry_tags())  # which rails made the total, and the sensor's own settings
    found = findings(samples, windows, profile=ctx.cfg.profile, requested_mode=ctx.cfg.power.mode,
                     actual_mode=ctx.actual_mode) + found_speed
    artifacts["telemetry/samples.csv"] = samples_csv(samples)
    artifacts["telemetry/windows.json"] = json.dumps([w.__dict__ for w in windows], indent=2)
    if not samples and sampler.problem:
        ctx.notes.append(sampler.problem)
    ctx.record.merge(Result(metrics=metrics, tags=tags, findings=found, artifacts=artifacts,
                            series=mlflow_series(samples)))
    if wall is not None:
        ctx.record.merge(Result(metrics={k: v for k, v in board_coverage_metrics(samples, windows, energy).items()
                                         if k not in ctx.record.metrics}))
    wall_result = _wall_result(ctx, wall, windows)
    for phase, match in matches.items():  # wall tokens/J of a mismatched window are withheld like the board's
        if not match.ok:
            withhold_per_token_energy(wall_result.metrics, phase)
    ctx.record.merge(wall_result)


def _energy_pass(ctx: TrialContext, phase: str, speed: PhaseResult, window: PhaseWindow, energy: EnergySettings,
                 artifacts: dict[str, str]) -> tuple[PhaseWindow, Optional[SpeedMatch]]:
    """Run `phase` alone, long enough to integrate, at the speed the speed pass measured.

    Returns the window to take energy from and how its tok/s compares with the speed pass (None when
    no energy pass ran). A pass whose speed is off by more than energy.speed_tolerance is run again
    (energy.speed_match_retries times); the last one is kept either way and the caller withholds its
    tokens/J when it still does not match.
    """
    cfg, log = ctx.cfg.energy, ctx.log
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


# --------------------------------------------------------------------------------------------
# Wall power (jbench/device/telemetry/wall.py): a meter read on the controller, shifted onto the
# device's clock by the offset measured before and after the trial.


class _Wall:
    def __init__(self, source: str, sampler: Optional[WallSampler] = None,
                 before: Optional[ClockOffset] = None, problem: str = ""):
        self.source, self.sampler, self.before, self.problem = source, sampler, before, problem


def _energy_settings(ctx: TrialContext) -> EnergySettings:
    return EnergySettings(ctx.cfg.energy.min_window_s, ctx.cfg.energy.min_samples, ctx.cfg.energy.min_coverage)


def _start_wall(ctx: TrialContext) -> Optional[_Wall]:
    """Start the wall meter (after a ranging run for PTDaemon); a meter that fails never fails the trial."""
    section = ctx.cfg.wall_power
    source = section.source
    if source == "none":
        return None
    sampler: Optional[WallSampler] = None
    try:
        sampler = make_wall_sampler(section)
        assert sampler is not None
        before = measure_clock_offset(ctx.conn, section.clock_rounds)
        sampler.probe()
        if isinstance(sampler, PtdSampler) and section.ranging:
            ctx.log.info("wall power: PTDaemon ranging run (auto ranges, one run of the workload)")
            sampler.ranging_run(lambda: ctx.backend.run(ctx.trial, ctx.conn, ctx.log))
        sampler.start()
        wait_s = 3.0 + 3 * sampler.interval
        if not sampler.wait_for_samples(1, timeout_s=wait_s):
            raise WallMeterError(sampler.problem or f"no reading within {wait_s:g} s ({sampler.last_error})")
    except ConnectionLost:
        _close_wall(sampler)
        raise
    except (WallMeterError, DeviceError, OSError, ValueError) as exc:
        _close_wall(sampler)
        problem = f"wall power ({source}): {exc}"
        ctx.log.warning("%s", problem)
        ctx.notes.append(problem)
        return _Wall(source, problem=f"not measured: {exc}")
    ctx.log.info("wall power: %s (%s) every %d ms, clock offset %+.6f s +/- %.6f s", source, sampler.meter,
                 int(sampler.interval * 1000), before.offset_s, before.uncertainty_s)
    return _Wall(source, sampler, before)


def _close_wall(sampler: Optional[WallSampler]) -> None:
    if sampler is None:
        return
    sampler.stop()
    if isinstance(sampler, PtdSampler):
        sampler.finish()


def _stop_wall(wall: Optional[_Wall], windows: list[PhaseWindow]) -> None:
    """Stop the meter once it has a reading past the last window (device times, shifted to its clock)."""
    if wall is None or wall.sampler is None or wall.before is None:
        return
    last_end = max((w.end for w in windows), default=None)
    if last_end is not None:
        wall.sampler.wait_past(last_end - wall.before.offset_s, timeout_s=2.0 + 3 * wall.sampler.interval)
    _close_wall(wall.sampler)


def _wall_result(ctx: TrialContext, wall: Optional[_Wall], windows: list[PhaseWindow]) -> Result:
    """Wall energy per window and the wall.* tags that say how it was measured."""
    if wall is None:
        return Result()
    tags = {"wall.source": wall.source}
    sampler, before = wall.sampler, wall.before
    if sampler is None or before is None:
        tags["wall.status"] = wall.problem
        return Result(tags=tags)
    section = ctx.cfg.wall_power
    try:
        after: Optional[ClockOffset] = measure_clock_offset(ctx.conn, section.clock_rounds)
    except ConnectionLost:
        raise
    except DeviceError as exc:
        after = None
        tags["wall.clock_offset_after"] = f"not measured: {exc}"
    offset = ClockOffset.combine(before, after)
    samples = sampler.shifted(offset.offset_s)
    metrics, energy_tags = wall_energy_metrics(samples, windows, _energy_settings(ctx), sampler.counter_resolution_j)
    tags.update(energy_tags)
    tags.update({
        "wall.status": "ok" if samples else f"not measured: {sampler.problem or 'no readings'}",
        "wall.meter": sampler.meter,
        "wall.samples": str(len(samples)),
        "wall.failed_polls": str(sampler.failed_polls),
        "wall.clock_offset_s": repr(offset.offset_s),
        "wall.clock_offset_uncertainty_s": repr(offset.uncertainty_s),
        "wall.clock_offset_before_s": repr(before.offset_s),
    })
    if after is not None:
        tags["wall.clock_offset_after_s"] = repr(after.offset_s)
        tags["wall.clock_drift_s"] = repr(after.offset_s - before.offset_s)
    if isinstance(sampler, PtdSampler):
        tags["wall.ranging"] = sampler.ranging
        if sampler.uncertainty:
            tags["wall.ptd.uncertainty"] = sampler.uncertainty[:250]
    if sampler.counter_resolution_j:
        tags["wall.counter_resolution_j"] = f"{sampler.counter_resolution_j:g}"
    return Result(metrics=metrics, tags=tags, artifacts={"telemetry/wall_samples.csv": samples_csv(samples)})
