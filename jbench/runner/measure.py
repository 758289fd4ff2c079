"""One trial's measurement with telemetry: idle baseline, the backend's speed pass, energy passes
for phases the sensor cannot resolve in the speed pass, cooldown; then energy metrics and findings.

Lean by design: a phase takes its energy from the speed pass whenever the sensor resolves that window
within energy.max_edge_error (jbench.analysis.sensor); an energy pass is sized to exactly the window
the sensor needs and repeated only when a repeat can come out otherwise; with telemetry.adaptive the
idle baseline and the cooldown end as soon as the power readings settle.

Phase windows and samples are on the device's clock. Without a working sampler the speed pass
runs alone (no idle wait) and energy.status says why.
"""

from __future__ import annotations

import io
import json
import math
import statistics
import time
from typing import Optional

from jbench.analysis.energy import SpeedMatch, speed_match, withhold_per_token_energy
from jbench.analysis.memory import telemetry_memory
from jbench.analysis.telemetry import (EnergySettings, PhaseWindow, energy_metrics, energy_pass_needed, findings,
                                       load_window_energy, mlflow_series, power_settled)
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
MAX_GROWTHS = 2  # an energy pass whose window fell short runs again, grown, at most this many times
# An energy pass is sized this much over the window it needs: repetitions vary and llama-bench's gaps between them
# are not in the window.
PASS_MARGIN = 1.1
# A pass run again because its window fell short is sized on the fastest repetition seen so far, this much more
# margin each time: on a loaded controller the rate moves between passes (CI: three passes in a row, each sized
# from the one before it, came out short, the last at 0.71 s of a 1 s minimum). A longer window costs seconds;
# one too short gives no energy at all.
GROWTH_MARGIN = 1.5
# How often an adaptive idle or cooldown wait looks at the readings.
SETTLE_POLL_S = 0.05


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
    stage_start = time.monotonic()  # measure_wall_s: from the sampler's start (its first samples) on
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
    energy = _energy_settings(ctx)
    windows: list[PhaseWindow] = []
    load_windows: list[PhaseWindow] = []
    artifacts: dict[str, str] = {}
    matches: dict[str, SpeedMatch] = {}  # phase -> how its energy pass's speed compares with the speed pass
    sources: dict[str, str] = {}  # phase -> where its energy window came from, in words
    waits: dict[str, str] = {}
    try:
        wall_interval = wall.sampler.interval if wall is not None and wall.sampler is not None else 0.0
        idle = _idle_window(ctx, sampler, wall_interval, waits)
        if idle is not None:
            windows.append(idle)
        result = ctx.backend_result = backend.run(trial, ctx.conn, log)
        phase_windows = {p: _phase_window(result, p, "speed") for p in ("prefill", "decode")}
        first = min((w.start for w in phase_windows.values() if w), default=None)
        if result.start_time is not None and first is not None and first > result.start_time:
            windows.append(PhaseWindow("load", result.start_time, first))
        for phase, w in phase_windows.items():
            pr = result.phases.get(phase)
            if w is None or pr is None:
                continue
            needed, why = _needs_energy_pass(ctx, sampler, w, energy, wall)
            if needed is None:
                sources[phase] = why
            elif not tele.energy_pass:
                sources[phase] = f"the speed pass's window ({why}; telemetry.energy_pass is off)"
            elif why == "no power readings":
                sources[phase] = "no energy pass: the telemetry has no power readings"
            else:
                w, match = _energy_pass(ctx, sampler, wall, phase, pr, w, needed, why, energy, artifacts, sources)
                if match is not None:
                    matches[phase] = match
            windows.append(w)
        # The serving scenario's levels: each a window of its own, priced after the run (Serving stage).
        load_windows = [PhaseWindow(lw.name, lw.start, lw.end, tokens=lw.output_tokens, source="load")
                        for lw in result.load_windows]
        last_end = max((w.end for w in windows + load_windows), default=None)
        if last_end is not None:
            # The window must end inside the samples: wait for one sample past its end.
            sampler.wait_past(last_end, timeout_s=2.0 + 3 * tele.interval_ms / 1000)
            cooldown = _cooldown_window(ctx, sampler, last_end, waits)
            if cooldown is not None:
                windows.append(cooldown)
    finally:
        samples = sampler.stop()
        _stop_wall(wall, windows)
    metrics, tags = energy_metrics(samples, windows, energy, sampler.problem if not samples else None)
    if load_windows:
        ctx.load_energy = load_window_energy(samples, load_windows, energy)
    mem_metrics, mem_tags = telemetry_memory(samples, windows)  # RAM, swap, GPU memory over idle
    metrics.update(mem_metrics)
    tags.update(mem_tags)
    found_speed = _speed_match_record(metrics, tags, matches)
    metrics["measure_wall_s"] = time.monotonic() - stage_start
    tags.update({f"energy.{phase}.window": how for phase, how in sources.items()})
    tags.update(waits)
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


def _needs_energy_pass(ctx: TrialContext, sampler: Sampler, w: PhaseWindow, energy: EnergySettings,
                       wall: Optional["_Wall"]) -> tuple[Optional[float], str]:
    """energy_pass_needed over the readings so far, once they reach past the window's end; with a wall meter, the
    longer of the board's and the meter's (on the device's clock): a pass sized for the board alone would leave a
    slower meter without the phase's energy."""
    sampler.wait_past(w.end, timeout_s=2.0 + 3 * ctx.cfg.telemetry.interval_ms / 1000)
    needed, why = energy_pass_needed(list(sampler.samples), w, energy)
    if wall is None or wall.sampler is None or wall.before is None:
        return needed, why
    offset = wall.before.offset_s
    wall.sampler.wait_past(w.end - offset, timeout_s=2.0 + 3 * wall.sampler.interval)
    wall_needed, wall_why = energy_pass_needed(wall.sampler.shifted(offset), w, energy)
    if wall_why == "no power readings":
        return needed, why
    if wall_needed is not None and (needed is None or why == "no power readings" or wall_needed > needed):
        return wall_needed, f"the wall meter: {wall_why}"
    return needed, why


def pass_repetitions(needed_s: float, rep_times: list[float], grown: int) -> int:
    """Repetitions for an energy pass whose window must reach `needed_s`. The first pass (grown=0) is sized on the
    latest per-repetition time (the speed pass's settled median); a pass run again because its window fell short
    on the fastest repetition seen in any pass, with GROWTH_MARGIN more margin each time, so a rate that sped up
    between passes cannot leave it short again."""
    rep_s = rep_times[-1] if grown == 0 else min(rep_times)
    margin = PASS_MARGIN * GROWTH_MARGIN ** grown
    return min(MAX_ENERGY_REPETITIONS, max(1, math.ceil(needed_s * margin / rep_s)))


def _energy_pass(ctx: TrialContext, sampler: Sampler, wall: Optional["_Wall"], phase: str, speed: PhaseResult,
                 speed_window: PhaseWindow, needed_s: float, why: str, energy: EnergySettings,
                 artifacts: dict[str, str], sources: dict[str, str]) -> tuple[PhaseWindow, Optional[SpeedMatch]]:
    """Run `phase` alone for the window the sensor needs, at the speed the speed pass measured.

    Sized from the speed pass's settled repetition time to `needed_s` (energy_pass_needed), so the pass is as long
    as the sensor needs and no longer. A pass runs again only when it can come out otherwise: up to MAX_GROWTHS more
    times (grown) when repetitions sped up and its window still fell short, and up to energy.speed_match_retries times when its
    speed missed the speed pass's while its own repetitions had not settled; a settled pass at another speed would
    measure the same again, so its tokens/J are withheld (its window still grows when too short to measure).
    """
    cfg, log = ctx.cfg.energy, ctx.log
    w: Optional[PhaseWindow] = None
    pr, match = speed, None
    grown = retries = 0
    # Seconds per repetition: the speed pass's settled median first, then as each energy pass ran, from its tokens
    # (a backend may report a whole pass as one sample, so its samples say nothing about one repetition).
    rep_times = [max(1e-6, statistics.median(speed.samples_ns) / 1e9 if speed.samples_ns else speed_window.duration)]
    while True:
        reps = pass_repetitions(needed_s, rep_times, grown)
        log.info("energy pass: %s (%s): %d repetitions for a %.3g s window", phase, why, reps, needed_s)
        extra = ctx.backend.run(ctx.trial, ctx.conn, log, only_phase=phase, repetitions=reps)
        artifacts[f"raw/energy-pass-{phase}.txt"] = extra.raw_output
        pr = extra.phases.get(phase, pr)
        got = _phase_window(extra, phase, "energy")
        if got is None:
            break
        w = got
        if w.tokens > 0 and w.duration > 0 and speed.n_tokens > 0:
            rep_times.append(max(1e-6, w.duration * speed.n_tokens / w.tokens))
        match = speed_match(speed.tokens_in_window, sum(speed.samples_ns) / 1e9, w.tokens, w.duration,
                            cfg.speed_tolerance)
        sources[phase] = f"an energy pass of {reps} repetitions ({why} in the speed pass)"
        if not match.ok and pr.settled is False and retries < cfg.speed_match_retries:
            retries += 1
            log.info("energy pass: %s %s, its repetitions still settling; running it again", phase, match.reason)
            continue
        # Settled at another speed (or unknown after the retries), another pass would measure the same speed; but a
        # window left too short for the sensor gives no energy at all, so it still grows, sized from the pass's own
        # repetitions (its power is real even where its tokens/J are withheld). MAX_GROWTHS times at most: on a loaded
        # machine a grown pass ran at another rate again and came out at 0.53 s of a 1 s minimum (CI).
        again, why_again = _needs_energy_pass(ctx, sampler, w, energy, wall)
        if again is None or grown >= MAX_GROWTHS or reps >= MAX_ENERGY_REPETITIONS:
            break
        grown += 1
        needed_s, why = again, why_again
    if w is None:  # the pass printed no window: the speed pass's stands (energy_metrics says why it gives none)
        return speed_window, None
    return w, match


def _idle_window(ctx: TrialContext, sampler: Sampler, wall_interval: float,
                 waits: dict[str, str]) -> Optional[PhaseWindow]:
    """The idle baseline before the run. The window is the last part before the newest board sample, which lags
    the clock by a sampling interval or more on a loaded controller: the wait is that much longer, so the window
    starts after the wall meter's first reading too. Adaptive: it ends once power has settled over
    telemetry.settle_window_s (at most telemetry.idle_s)."""
    tele = ctx.cfg.telemetry
    if tele.idle_s <= 0:
        return None
    lag = 2 * max(tele.interval_ms / 1000, wall_interval)
    if not tele.adaptive:
        time.sleep(tele.idle_s + lag)
        t_end = sampler.latest_time()
        return PhaseWindow("idle", t_end - tele.idle_s, t_end) if t_end is not None else None
    span = min(tele.idle_s, tele.settle_window_s)
    start = time.monotonic()
    time.sleep(span + lag)
    while True:
        t_end = sampler.latest_time()
        waited = time.monotonic() - start
        if t_end is not None and power_settled(list(sampler.samples), t_end, span, tele.settle_tolerance):
            waits["telemetry.idle_wait"] = f"settled after {waited:.2f} s (a {span:g} s window)"
            return PhaseWindow("idle", t_end - span, t_end)
        if waited >= tele.idle_s + lag:
            waits["telemetry.idle_wait"] = (f"not settled within telemetry.idle_s={tele.idle_s:g} s: the window is "
                                            f"the last {tele.idle_s:g} s")
            return PhaseWindow("idle", t_end - tele.idle_s, t_end) if t_end is not None else None
        time.sleep(SETTLE_POLL_S)


def _cooldown_window(ctx: TrialContext, sampler: Sampler, last_end: float,
                     waits: dict[str, str]) -> Optional[PhaseWindow]:
    """After the last phase: telemetry.cooldown_s, or (adaptive) until power has settled over
    telemetry.settle_window_s after the run, at most cooldown_s."""
    tele = ctx.cfg.telemetry
    if tele.cooldown_s <= 0:
        return None
    if not tele.adaptive:
        time.sleep(tele.cooldown_s)
        t_end = sampler.latest_time()
    else:
        span = min(tele.cooldown_s, tele.settle_window_s)
        start = time.monotonic()
        while True:
            t_end = sampler.latest_time()
            waited = time.monotonic() - start
            if (t_end is not None and t_end - last_end >= span
                    and power_settled(list(sampler.samples), t_end, span, tele.settle_tolerance)):
                waits["telemetry.cooldown_wait"] = f"settled after {waited:.2f} s"
                break
            if waited >= tele.cooldown_s:
                waits["telemetry.cooldown_wait"] = f"not settled within telemetry.cooldown_s={tele.cooldown_s:g} s"
                break
            time.sleep(SETTLE_POLL_S)
    if t_end is None or t_end <= last_end:
        return None
    return PhaseWindow("cooldown", last_end, t_end)


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
    e = ctx.cfg.energy
    return EnergySettings(e.min_window_s, e.min_samples, e.min_coverage, e.max_edge_error)


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
