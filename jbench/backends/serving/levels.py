"""A serving trial's load levels, whatever the server: warm-up, the levels one after another (a grid, or the
SLO-capacity search choosing the next), each level's window on the device's clock, every request's record.

A backend brings a started server and `send(spec, worker) -> ServedRequest` (its client: how a RequestSpec becomes
a request to that server); this module brings the rest, so llama-server and any OpenAI-compatible server are
measured the same way. Each level's stretch, mapped onto the device's clock by a clock-offset read through the
connection, is a LoadWindow whose energy the Measure stage takes from the device's rails.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from jbench.analysis.serving import CapacitySearch, Level, RequestOutcome, oversaturated, slo_from
from jbench.backends.base import BackendError
from jbench.backends.serving import loadgen, workload
from jbench.core.results import LoadWindow
from jbench.core.schema import ServingConfig
from jbench.device.connection import Connection
from jbench.device.telemetry.wall import ClockOffset, measure_clock_offset

LOADS = ("concurrency", "rate")
ARRIVALS = ("constant", "poisson")
SEARCHES = ("grid", "slo")
LENGTH_KINDS = ("fixed", "uniform", "normal")
# Open-loop requests in flight at most (client threads); beyond it a request waits and its lag is recorded.
MAX_IN_FLIGHT = 128


class ServedRequest(Protocol):
    """What a backend's client returns for one completed request (controller clock, seconds)."""

    sent_at: float  # time.perf_counter() when it was sent
    ttft_s: float
    e2e_s: float
    output_tokens: int  # as the server counted them
    prompt_tokens: Optional[int]  # as the server counted them; None: it did not say

    def token_gaps(self) -> tuple[float, ...]:
        """Seconds between consecutive output tokens; empty when the stream does not show single tokens."""

    def to_json(self) -> str:
        """The record as one JSON line (raw/stdout.txt)."""


Send = Callable[[workload.RequestSpec, int], ServedRequest]


def length_dist(section) -> workload.LengthDist:
    return workload.LengthDist(kind=section.kind, mean=section.mean, low=section.low, high=section.high,
                               std=section.std)


def validate(cfg: ServingConfig) -> list[str]:
    """Every problem of a serving section, one message each (before any device is touched)."""
    problems = []
    for key, value, valid in (("load", cfg.load, LOADS), ("arrival", cfg.arrival, ARRIVALS),
                              ("search", cfg.search, SEARCHES)):
        if value not in valid:
            problems.append(f"serving.{key} '{value}' is not valid. Valid: {', '.join(valid)}")
    if not cfg.levels:
        problems.append("serving.levels is empty: give at least one load level")
    for level in cfg.levels:
        if not (isinstance(level, (int, float)) and math.isfinite(level) and level > 0):
            problems.append(f"serving.levels: {level!r} is not a positive number")
        elif cfg.load == "concurrency" and float(level) != int(level):
            problems.append(f"serving.levels: concurrency {level} is not a whole number of requests in flight")
    if cfg.search == "slo":
        if cfg.load != "concurrency":
            problems.append("serving.search=slo searches concurrency: set serving.load=concurrency")
        if not any(v is not None for v in (cfg.slo.ttft_ms, cfg.slo.tpot_ms, cfg.slo.e2e_ms)):
            problems.append("serving.search=slo needs a target: set serving.slo.ttft_ms, tpot_ms or e2e_ms")
        if cfg.levels and cfg.levels[0] > cfg.max_load:
            problems.append(f"serving.levels[0]={cfg.levels[0]:g} (the search's start) is above "
                            f"serving.max_load={cfg.max_load}")
    for name, section in (("input", cfg.input), ("output", cfg.output)):
        if section.kind not in LENGTH_KINDS:
            problems.append(f"serving.{name}.kind '{section.kind}' is not valid. Valid: {', '.join(LENGTH_KINDS)}")
        else:
            problems += length_dist(section).validate(f"serving.{name}")
    if cfg.output.kind == "fixed" and cfg.output.mean < 2 and cfg.trace is None:
        problems.append("serving.output.mean must be >= 2: time per output token is undefined below 2 tokens")
    if cfg.trace is not None:
        try:
            workload.load_trace(cfg.trace)
        except (OSError, ValueError) as exc:
            problems.append(f"serving.trace: {exc}")
    return problems


def server_slots(cfg: ServingConfig) -> int:
    """The server's parallel slots (llama-server --parallel, {slots} of a command template): serving.slots, else the most requests the load profile keeps in flight (the
    highest concurrency level, or max_load for the search); 4 for a rate load, whose in-flight count is not set."""
    if cfg.slots:
        return cfg.slots
    if cfg.load == "rate":
        return 4
    if cfg.search == "slo":
        return cfg.max_load
    return max(1, int(max(cfg.levels)))


def context_size(cfg: ServingConfig, slots: int, multiple: int = 256) -> int:
    """The context (llama-server -c, {context} of a command template) for the longest request the profile can send,
    per slot, times the slots. A trace's text prompt counts as its UTF-8 bytes plus 8: a byte-level tokenizer's token
    covers at least one byte, and the 8 leave room for the special tokens and a chat template's few (an upper bound
    known before the server and its tokenizer are)."""
    if cfg.trace is not None:
        specs = workload.load_trace(cfg.trace)
        longest = max((s.prefix_tokens + s.input_tokens + s.output_tokens
                       + (len(s.text.encode("utf-8")) + 8 if s.text is not None else 0) for s in specs), default=1)
    else:
        longest = max_length(cfg.input) + max_length(cfg.output)
    per_slot = ((longest + 1 + multiple - 1) // multiple) * multiple
    return per_slot * max(1, slots)


def max_length(section) -> int:
    if section.kind == "fixed":
        return section.mean
    return int(section.high if section.high is not None else section.mean + 4 * section.std + 1)


def outcome(sent: loadgen.Sent) -> RequestOutcome:
    """The analysis's view of one request the load generator sent (a failure keeps its error)."""
    r: Optional[ServedRequest] = sent.result
    if r is None:
        err = sent.error
        return RequestOutcome(index=sent.spec.index, sent_s=sent.dispatched_s, ttft_s=math.nan, e2e_s=math.nan,
                              output_tokens=0, prompt_tokens=sent.spec.prefix_tokens + sent.spec.input_tokens,
                              error=f"{type(err).__name__}: {err}" if err else "not sent",
                              scheduled_s=sent.scheduled_s)
    gaps = r.token_gaps()
    prompt = r.prompt_tokens if r.prompt_tokens is not None else sent.spec.prefix_tokens + sent.spec.input_tokens
    return RequestOutcome(index=sent.spec.index, sent_s=r.sent_at, ttft_s=r.ttft_s, e2e_s=r.e2e_s,
                          output_tokens=r.output_tokens, prompt_tokens=prompt, token_gaps_s=gaps,
                          scheduled_s=sent.scheduled_s)


def _specs(cfg: ServingConfig, load: float, first_index: int, level_no: int) -> list[workload.RequestSpec]:
    """The level's requests: the trace's (replayed from its start; its own arrivals under a rate load scaled to the
    level's rate) or synthetic lengths drawn from serving.seed and the level's number (so a replicate differs)."""
    n = cfg.requests_per_level
    seed = cfg.seed * 1000 + level_no
    trace_times = False
    if cfg.trace is not None:
        trace = workload.load_trace(cfg.trace)
        specs = [trace[i % len(trace)] for i in range(n)]
        trace_times = len(trace) >= n >= 2 and all(s.arrival_s is not None for s in specs)
    else:
        specs = workload.synthetic_requests(n, length_dist(cfg.input), length_dist(cfg.output), seed)
    if cfg.load == "rate" and trace_times:
        # The trace's own arrival pattern (its bursts), its clock scaled so its mean rate is the level's.
        span = specs[-1].arrival_s - specs[0].arrival_s
        scale = (n - 1) / (float(load) * span) if span > 0 else 0.0
        specs = workload.with_arrivals(specs, [(s.arrival_s - specs[0].arrival_s) * scale for s in specs])
    elif cfg.load == "rate":
        specs = workload.with_arrivals(specs, workload.arrival_offsets(n, float(load), cfg.arrival, seed))
    else:
        specs = [workload.RequestSpec(index=s.index, input_tokens=s.input_tokens, output_tokens=s.output_tokens,
                                      text=s.text, session=s.session, prefix_tokens=s.prefix_tokens) for s in specs]
    return [workload.RequestSpec(index=first_index + i, input_tokens=s.input_tokens, output_tokens=s.output_tokens,
                                 arrival_s=s.arrival_s, text=s.text, session=s.session, prefix_tokens=s.prefix_tokens)
            for i, s in enumerate(specs)]


def _watch(stop_on_saturation: bool) -> Optional[Callable[[list], Optional[str]]]:
    if not stop_on_saturation:
        return None
    return lambda done: oversaturated([outcome(s) for s in done])


@dataclass
class LevelsRun:
    levels: list[Level]
    windows: list[LoadWindow]
    records_jsonl: str
    overhead: list[dict[str, float]]  # the load generator's own cost per level
    level_records: list[list]  # each level's completed requests (ServedRequest), as the client recorded them
    clock: Optional[ClockOffset]


def warm_up(cfg: ServingConfig, send: Send) -> None:
    """serving.warmup_requests sent one at a time and not measured: first-request costs stay out of level 1."""
    warmup = workload.synthetic_requests(cfg.warmup_requests, length_dist(cfg.input), length_dist(cfg.output),
                                         cfg.seed)
    for i, spec in enumerate(warmup):
        send(workload.RequestSpec(index=-1 - i, input_tokens=spec.input_tokens, output_tokens=spec.output_tokens), 0)


def run_levels(conn: Connection, cfg: ServingConfig, send: Send, abort: Callable[[], None], *,
               log: logging.Logger, stop: Optional[threading.Event] = None,
               server_log: Callable[[], str] = lambda: "") -> LevelsRun:
    """The levels against a ready, warmed-up server (module doc). BackendError when a level completes no request
    (its raw output: server_log())."""
    slo = slo_from(cfg.slo)
    levels: list[Level] = []
    windows: list[LoadWindow] = []
    overhead: list[dict[str, float]] = []
    lines: list[str] = []
    level_records: list[list] = []
    # Controller -> device clock, so each level's stretch is a window in the device's telemetry.
    before = measure_clock_offset(conn, rounds=4)
    search = CapacitySearch(slo, start=int(cfg.levels[0]), max_load=cfg.max_load,
                            replicates=cfg.replicates) if cfg.search == "slo" else None
    grid = list(cfg.levels)
    next_index = 0
    while True:
        if stop is not None and stop.is_set():
            raise KeyboardInterrupt
        if search is not None:
            load = search.next_load(levels)
            if load is None:
                break
        else:
            if len(levels) >= len(grid):
                break
            load = grid[len(levels)]
        specs = _specs(cfg, float(load), next_index, len(levels) + 1)
        next_index += len(specs)
        log.info("serving level %d: %s %g, %d request(s)", len(levels) + 1, cfg.load, load, len(specs))
        run = loadgen.run_level(send, specs, concurrency=int(load) if cfg.load == "concurrency" else None,
                                max_in_flight=MAX_IN_FLIGHT, timeout_s=cfg.level_timeout_s,
                                watch=_watch(cfg.stop_on_saturation), stop=stop, abort=abort,
                                drain=False)  # an over-saturated level's queue is given up, not waited for
        outcomes = tuple(outcome(s) for s in run.sent)
        done = [o for o in outcomes if o.error is None]
        level = Level(load=float(load), outcomes=outcomes, wall_s=run.end_perf - run.start_perf,
                      stopped_early=run.stopped_early)
        levels.append(level)
        overhead.append(dict(run.overhead))
        level_records.append([s.result for s in run.sent if s.result is not None])
        name = f"level{len(levels)}"
        windows.append(LoadWindow(name, run.start_epoch + before.offset_s, run.end_epoch + before.offset_s,
                                  output_tokens=sum(o.output_tokens for o in done),
                                  total_tokens=sum(o.output_tokens + o.prompt_tokens for o in done)))
        for s in run.sent:
            rec = json.loads(s.result.to_json()) if s.result is not None else {
                "index": s.spec.index, "error": f"{type(s.error).__name__}: {s.error}"}
            lines.append(json.dumps({"level": len(levels), "load": float(load), **rec}, sort_keys=True))
        log.info("serving level %d: %d of %d request(s) completed in %.2f s%s", len(levels), len(done),
                 len(outcomes), level.wall_s, f"; stopped early: {run.stopped_early}" if run.stopped_early
                 else "")
        if not done:
            raise BackendError("backend_crash", f"serving level {len(levels)} ({cfg.load} {load:g}): no request "
                               f"completed; first error: {outcomes[0].error}", raw_output=server_log())
    try:
        clock = ClockOffset.combine(before, measure_clock_offset(conn, rounds=4))
    except Exception:  # the clock was read before; the after-read only widens its uncertainty
        clock = before
    return LevelsRun(levels=levels, windows=windows, records_jsonl="\n".join(lines) + "\n", overhead=overhead,
                     level_records=level_records, clock=clock)


def overhead_series(overhead: list[dict[str, float]]) -> dict[str, list[float]]:
    """The load generator's own cost per level, as stepped series (step = level in run order)."""
    keys = ("dispatch_lag_ms_p99", "client_cpu_per_request_ms")
    return {f"serving_loadgen_{k}": [o.get(k, float("nan")) for o in overhead] for k in keys
            if any(k in o for o in overhead)}
