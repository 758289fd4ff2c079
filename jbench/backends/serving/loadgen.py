"""Running one serving load level: when each request is sent, by which worker thread, and what came of it.

No HTTP here: `send(spec, worker)` (a backend's client) sends one request and returns its record, or raises.

- Closed loop (`concurrency=N`, specs without arrival_s): N workers released together; each sends its next
  request as soon as its previous one finished, so exactly N are in flight while requests remain.
- Open loop (every spec has arrival_s): the calling thread dispatches each request at start + arrival_s, in
  arrival order, whether or not earlier ones finished, to a pool of up to `max_in_flight` workers (started as
  needed). When all are busy the request waits; its dispatch lag (picked up - due) shows that wait.

Waits are Event/Condition waits with timeouts (never a busy loop: the controller may have 2 cores). A send that
raises is a failed request and the level goes on; a KeyboardInterrupt/SystemExit (from a send or in the calling
thread) or the caller's `stop` event gives the level up: no more dispatches, `abort()` is called so blocked sends
return, workers are joined with a timeout, and run_level returns (the stop event) or re-raises (the exception).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from jbench.analysis.stats import percentile
from jbench.backends.serving.workload import RequestSpec

log = logging.getLogger(__name__)

THREAD_PREFIX = "jbench-serving-"
_POLL_S = 0.05  # how often a wait looks at the caller's stop event (a plain Event, which cannot wake us)
_PRESTART = 4  # open-loop workers started before the first dispatch, so early requests do not wait for a start

OVERHEAD_KEYS = ("dispatch_lag_ms_p50", "dispatch_lag_ms_p99", "client_cpu_s", "client_cpu_per_request_ms",
                 "max_in_flight", "workers")


class NotSent(Exception):
    """A request the level never sent (a watch or the caller stopped it first)."""


class GivenUp(Exception):
    """A request in flight when the level was given up (stop event, interrupt); its outcome is not used."""


@dataclass
class Sent:
    """What the generator keeps per request. Times are time.perf_counter() seconds."""

    spec: RequestSpec
    worker: int  # -1: never dispatched
    scheduled_s: Optional[float]  # when it was due (open loop), else None
    dispatched_s: float  # when a worker picked it up; NaN when it was never sent
    result: Any = None  # what send returned, None on failure
    error: Optional[BaseException] = None
    finished_s: Optional[float] = None  # when send returned or raised (or the moment it was given up)

    @property
    def dispatched(self) -> bool:
        return not math.isnan(self.dispatched_s)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished_s is not None


@dataclass
class LevelRun:
    sent: list[Sent]  # one per spec, in index order (never-sent ones included, with their error)
    start_epoch: float  # time.time() at the level's first dispatch ...
    end_epoch: float  # ... and last completion: the level's energy window
    start_perf: float
    end_perf: float
    stopped_early: Optional[str]  # why the level stopped before sending everything (watch reason, stop, timeout)
    overhead: dict[str, float] = field(default_factory=dict)  # the generator's own cost (OVERHEAD_KEYS)


class _Level:
    """State shared by the workers and the calling thread of one run_level call; guarded by `cond`."""

    def __init__(self, send: Callable[[RequestSpec, int], Any], n: int,
                 watch: Optional[Callable[[list[Sent]], Optional[str]]], watch_every: int):
        self.send, self.n, self.watch, self.watch_every = send, n, watch, max(1, watch_every)
        self.cond = threading.Condition()
        self.halt = threading.Event()  # no new dispatches
        self.by_index: dict[int, Sent] = {}
        self.completed: list[Sent] = []  # in completion order
        self.in_flight = 0
        self.max_in_flight = 0
        self.settled = 0  # requests taken off the queue: completed or dropped after a halt
        self.lags: list[float] = []
        self.stopped: Optional[str] = None
        self.fatal: Optional[BaseException] = None  # KeyboardInterrupt/SystemExit from a send, a watch's exception
        self.timed_out = False
        self.watch_lock = threading.Lock()
        self.go_perf = 0.0  # closed loop: when the workers were released
        self.idle = 0  # open loop: workers waiting for a request
        self.dispatch_count = 0  # open loop: requests handed to the workers
        self.dispatch_done = False  # open loop: the dispatcher has handed out all it will
        self.open_start: Optional[float] = None  # open loop: the perf_counter time arrival offsets count from

    def stop_with(self, reason: str) -> None:
        with self.cond:
            if self.stopped is None:
                self.stopped = reason
            self.halt.set()
            self.cond.notify_all()

    def run_one(self, spec: RequestSpec, worker: int, scheduled: Optional[float], free_since: float) -> None:
        """Send one request (unless the level halted) and record it."""
        dispatched = time.perf_counter()
        s = Sent(spec=spec, worker=worker, scheduled_s=scheduled, dispatched_s=dispatched)
        with self.cond:
            if self.halt.is_set():
                self.settled += 1
                self.cond.notify_all()
                return
            self.by_index[spec.index] = s
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.lags.append(dispatched - (scheduled if scheduled is not None else free_since))
        result, error = None, None
        try:
            result = self.send(spec, worker)
        except (KeyboardInterrupt, SystemExit) as exc:
            error = exc
            with self.cond:
                self.fatal = self.fatal or exc
            self.stop_with(f"interrupted ({type(exc).__name__})")
        except BaseException as exc:  # a failed request; the level goes on
            error = exc
        finished = time.perf_counter()
        with self.cond:
            self.in_flight -= 1
            self.settled += 1
            if s.finished_s is None:  # not already given up
                s.finished_s = finished
                s.result, s.error = result, error
                self.completed.append(s)
            done = len(self.completed)
            snapshot = list(self.completed) if self.watch and done % self.watch_every == 0 else None
            self.cond.notify_all()
        if snapshot is not None and not self.halt.is_set():
            self._watch(snapshot)

    def _watch(self, snapshot: list[Sent]) -> None:
        with self.watch_lock:  # one watch call at a time, whichever worker completed
            try:
                reason = self.watch(snapshot)
            except BaseException as exc:  # a broken watch is a bug: raised in the calling thread
                with self.cond:
                    self.fatal = self.fatal or exc
                self.stop_with(f"the watch raised {type(exc).__name__}")
                return
        if reason is not None:
            self.stop_with(str(reason))

    def give_up(self, error: BaseException, moment: float) -> None:
        """In-flight requests stop counting: each gets `error` and finishes now."""
        with self.cond:
            for s in self.by_index.values():
                if s.finished_s is None:
                    s.finished_s, s.result, s.error = moment, None, error


def run_level(send: Callable[[RequestSpec, int], Any], specs: Sequence[RequestSpec], *,
              concurrency: Optional[int] = None, max_in_flight: int = 256, timeout_s: float = 600.0,
              watch: Optional[Callable[[list[Sent]], Optional[str]]] = None, watch_every: int = 4,
              stop: Optional[threading.Event] = None, abort: Optional[Callable[[], None]] = None,
              join_timeout_s: float = 5.0, drain: bool = True) -> LevelRun:
    """Send `specs` as one load level and return what happened to each (module doc for the two loops).

    watch(completed so far, in completion order) is called every `watch_every` completions; a reason it returns
    stops dispatching and becomes `stopped_early`; in-flight requests then finish (within the level's timeout), or
    with drain=False are given up at once (a GivenUp error each, `abort()` called): far over capacity, the queue
    behind a verdict can take longer than everything before it.
    After `timeout_s` the level is given up: unsent requests get a TimeoutError, in-flight ones too.
    `abort()` (optional) is called once when the level is given up (stop, interrupt, timeout) so that blocked sends
    return; workers still running `join_timeout_s` later are left (daemon threads) with a warning."""
    specs = list(specs)
    open_loop = bool(specs) and all(s.arrival_s is not None for s in specs)
    if specs and not open_loop and any(s.arrival_s is not None for s in specs):
        raise ValueError("some requests have arrival times and some do not: a level is open or closed loop")
    if open_loop and concurrency is not None:
        raise ValueError("an open-loop level (requests with arrival times) takes no concurrency")
    if specs and not open_loop and (concurrency is None or concurrency < 1):
        raise ValueError(f"a closed-loop level needs concurrency >= 1, not {concurrency!r}")
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, not {max_in_flight!r}")
    if len({s.index for s in specs}) != len(specs):
        raise ValueError("request indexes must be unique within a level")

    lv = _Level(send, len(specs), watch, watch_every)
    threads: list[threading.Thread] = []
    cpu0 = time.process_time()
    anchor_epoch, anchor_perf = time.time(), time.perf_counter()
    deadline = anchor_perf + timeout_s
    pending: "queue.SimpleQueue[Optional[tuple[RequestSpec, float]]]" = queue.SimpleQueue()
    aborted = False
    try:
        if open_loop:
            threads = _open_loop(lv, specs, pending, max_in_flight, deadline, stop)
        elif specs:
            threads = _closed_loop(lv, specs, min(concurrency, len(specs)))
        _wait_settled(lv, deadline, stop, lambda: _over(lv, len(specs), open_loop) or
                      (not drain and lv.stopped is not None))
    except BaseException as exc:  # Ctrl-C in the calling thread: give the level up, then raise
        lv.fatal = lv.fatal or exc
        lv.stop_with(f"interrupted ({type(exc).__name__})")
    finally:
        lv.halt.set()
        now = time.perf_counter()
        if lv.timed_out:
            lv.give_up(TimeoutError(f"given up in flight: the level did not finish within {timeout_s:g} s"), now)
        given_up = lv.fatal is not None or (stop is not None and stop.is_set()) or \
            (not drain and lv.stopped is not None)
        if not lv.timed_out and given_up:
            lv.give_up(GivenUp(f"given up in flight: {lv.stopped or 'stopped'}"), now)
        if lv.timed_out or given_up:
            if abort is not None:
                aborted = True
                try:
                    abort()
                except Exception:  # the abort hook failing must not hide the level's outcome
                    log.exception("serving: the abort hook failed")
        for _ in threads:
            pending.put(None)  # open-loop workers waiting for work exit
        join_end = time.perf_counter() + join_timeout_s
        for t in threads:
            t.join(timeout=max(0.0, join_end - time.perf_counter()))
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            log.warning("serving: %d worker(s) still in a send %.1f s after the level was given up%s: %s",
                        len(alive), join_timeout_s, "" if aborted else " (no abort hook)", ", ".join(alive))
    if lv.fatal is not None:
        raise lv.fatal
    cpu = time.process_time() - cpu0
    return _finish(lv, specs, anchor_epoch, anchor_perf, timeout_s, cpu, len(threads))


def _over(lv: _Level, n: int, open_loop: bool) -> bool:
    """Nothing in flight and nothing more to send (everything sent, or dispatching halted). Under lv.cond."""
    if open_loop:  # every request handed to the workers settles once: completed, or dropped after a halt
        return lv.dispatch_done and lv.settled >= lv.dispatch_count
    return lv.in_flight == 0 and (lv.halt.is_set() or len(lv.by_index) == n)


def _wait_settled(lv: _Level, deadline: float, stop: Optional[threading.Event], done: Callable[[], bool]) -> None:
    with lv.cond:
        while not done():
            now = time.perf_counter()
            if stop is not None and stop.is_set():
                lv.stop_with("stopped by the caller")
                return
            if lv.fatal is not None:
                return
            if now >= deadline:
                lv.timed_out = True
                lv.stop_with("timeout")
                return
            lv.cond.wait(timeout=min(_POLL_S, deadline - now))


def _closed_loop(lv: _Level, specs: list[RequestSpec], n_workers: int) -> list[threading.Thread]:
    order = iter(specs)
    go = threading.Event()

    def worker(w: int) -> None:
        go.wait()
        free_since = lv.go_perf
        while not lv.halt.is_set():
            with lv.cond:
                spec = next(order, None)
            if spec is None:
                return
            lv.run_one(spec, w, None, free_since)
            free_since = time.perf_counter()

    threads = [threading.Thread(target=worker, args=(w,), name=f"{THREAD_PREFIX}{w}", daemon=True)
               for w in range(n_workers)]
    for t in threads:
        t.start()
    lv.go_perf = time.perf_counter()
    go.set()  # all workers released together
    return threads


def _open_loop(lv: _Level, specs: list[RequestSpec], pending: "queue.SimpleQueue", max_workers: int,
               deadline: float, stop: Optional[threading.Event]) -> list[threading.Thread]:
    """Dispatch in the calling thread; returns the workers it started (the caller joins them)."""
    threads: list[threading.Thread] = []

    def worker(w: int) -> None:
        while True:
            with lv.cond:
                lv.idle += 1
            item = pending.get()
            with lv.cond:
                lv.idle -= 1
            if item is None:
                return
            spec, due = item
            lv.run_one(spec, w, due, due)

    def start_worker() -> None:
        t = threading.Thread(target=worker, args=(len(threads),), name=f"{THREAD_PREFIX}{len(threads)}",
                             daemon=True)
        threads.append(t)
        t.start()

    order = sorted(specs, key=lambda s: (s.arrival_s, s.index))
    for _ in range(min(_PRESTART, max_workers, len(order))):
        start_worker()
    start = lv.open_start = time.perf_counter()
    try:
        for spec in order:
            due = start + spec.arrival_s
            while not lv.halt.is_set():
                now = time.perf_counter()
                if stop is not None and stop.is_set():
                    lv.stop_with("stopped by the caller")
                    break
                if now >= deadline:
                    lv.timed_out = True
                    lv.stop_with("timeout")
                    break
                if now >= due:
                    break
                wait = min(due - now, deadline - now)
                lv.halt.wait(min(wait, _POLL_S) if stop is not None else wait)
            if lv.halt.is_set():
                break
            with lv.cond:
                # Every idle worker may already be promised to a queued request: start one more if allowed.
                need = lv.idle <= pending.qsize() and len(threads) < max_workers
            if need:
                start_worker()
            pending.put((spec, due))
            lv.dispatch_count += 1
    finally:
        with lv.cond:
            lv.dispatch_done = True
            lv.cond.notify_all()
    return threads


def _finish(lv: _Level, specs: list[RequestSpec], anchor_epoch: float, anchor_perf: float, timeout_s: float, cpu_s: float, workers: int) -> LevelRun:
    stopped = lv.stopped
    if stopped == "timeout":
        stopped = f"timeout: the level did not finish within {timeout_s:g} s"
    if lv.timed_out:
        not_sent: BaseException = TimeoutError(f"not sent: the level did not finish within {timeout_s:g} s")
    else:
        not_sent = NotSent(f"not sent: {stopped}")
    sent: list[Sent] = []
    with lv.cond:
        for spec in sorted(specs, key=lambda s: s.index):
            s = lv.by_index.get(spec.index)
            if s is None:
                scheduled = lv.open_start + spec.arrival_s if lv.open_start is not None else None
                s = Sent(spec=spec, worker=-1, scheduled_s=scheduled, dispatched_s=math.nan, error=not_sent)
            sent.append(s)
        lags = list(lv.lags)
        max_flight = lv.max_in_flight
    dispatched = [s for s in sent if s.dispatched]
    start_perf = min((s.dispatched_s for s in dispatched), default=anchor_perf)
    end_perf = max((s.finished_s for s in dispatched if s.finished_s is not None), default=start_perf)
    overhead = {
        "dispatch_lag_ms_p50": percentile(lags, 50) * 1000.0 if lags else math.nan,
        "dispatch_lag_ms_p99": percentile(lags, 99) * 1000.0 if lags else math.nan,
        "client_cpu_s": cpu_s,
        "client_cpu_per_request_ms": cpu_s * 1000.0 / len(dispatched) if dispatched else math.nan,
        "max_in_flight": float(max_flight),
        "workers": float(workers),
    }
    return LevelRun(sent=sent, start_epoch=anchor_epoch + (start_perf - anchor_perf),
                    end_epoch=anchor_epoch + (end_perf - anchor_perf), start_perf=start_perf, end_perf=end_perf,
                    stopped_early=stopped, overhead=overhead)
