"""The serving load generator (jbench/backends/serving): seeded workloads, traces, and running one level closed or
open loop against a stand-in OpenAI-compatible server (tests/fixtures/stub_openai_server.py) or plain Python sends.
No wall-clock assertions: counts, order and invariants only (the stub counts what it serves)."""

from __future__ import annotations

import math
import statistics
import threading

import pytest

from jbench.backends.serving import (OVERHEAD_KEYS, GivenUp, LengthDist, NotSent, RequestSpec, arrival_offsets,
                                     load_trace, run_level, synthetic_requests, with_arrivals)
from jbench.backends.serving.loadgen import THREAD_PREFIX

from .fixtures.stub_openai_server import StubClient, StubServer


def _serving_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive()]


@pytest.fixture(autouse=True)
def no_thread_left():
    yield
    assert _serving_threads() == []


def _specs(n: int, out: int = 4) -> list[RequestSpec]:
    return [RequestSpec(index=i, input_tokens=8, output_tokens=out) for i in range(n)]


# --- workload -----------------------------------------------------------------------------------------------


def test_synthetic_requests_are_seeded_and_lengths_follow_their_distributions():
    inp = LengthDist("normal", mean=100, low=20, high=150, std=40.0)
    out = LengthDist("uniform", mean=64, low=10, high=20)
    a = synthetic_requests(3000, inp, out, seed=7)
    assert a == synthetic_requests(3000, inp, out, seed=7)
    assert a != synthetic_requests(3000, inp, out, seed=8)
    assert [s.index for s in a] == list(range(3000)) and all(s.arrival_s is None for s in a)
    ins, outs = [s.input_tokens for s in a], [s.output_tokens for s in a]
    assert min(ins) == 20 and max(ins) == 150  # clipped at both ends (40 is a wide std)
    assert abs(statistics.mean(ins) - 100) < 5
    assert set(outs) == set(range(10, 21))  # every value of the uniform range, nothing outside it
    # Changing one distribution leaves the other's draws alone.
    b = synthetic_requests(3000, inp, LengthDist("fixed", mean=5), seed=7)
    assert [s.input_tokens for s in b] == ins and {s.output_tokens for s in b} == {5}


def test_length_dist_validation_names_each_problem():
    assert LengthDist().validate("serving.input") == []
    assert LengthDist("uniform", low=1, high=4).validate("x") == []
    problems = LengthDist("uniform", mean=0, low=0, high=None).validate("serving.input")
    assert "serving.input.mean must be an integer >= 1, not 0" in problems
    assert "serving.input.low must be an integer >= 1, not 0" in problems
    assert "serving.input.high is required for a uniform distribution" in problems
    assert LengthDist("normal", low=9, high=3, std=-1).validate("o") == [
        "o.low (9) must be <= o.high (3)", "o.std must be a finite number >= 0, not -1"]
    assert LengthDist("zipf").validate("o") == ["o.kind must be one of fixed, uniform, normal, not 'zipf'"]
    assert LengthDist("fixed", std=3).validate("o") == ["o.std applies to a normal distribution only (o.kind is fixed)"]
    with pytest.raises(ValueError, match="input.mean"):
        synthetic_requests(2, LengthDist(mean=0), LengthDist(), seed=1)


def test_arrival_offsets_constant_and_poisson():
    assert arrival_offsets(4, 2.0, "constant", seed=1) == [0.0, 0.5, 1.0, 1.5]
    p = arrival_offsets(4000, 50.0, "poisson", seed=3)
    assert p == arrival_offsets(4000, 50.0, "poisson", seed=3) != arrival_offsets(4000, 50.0, "poisson", seed=4)
    gaps = [b - a for a, b in zip(p, p[1:])]
    assert p[0] == 0.0 and all(g >= 0 for g in gaps)
    assert abs(statistics.mean(gaps) - 0.02) < 0.002  # mean gap 1/rate
    assert abs(statistics.stdev(gaps) / statistics.mean(gaps) - 1.0) < 0.1  # exponential: CV 1
    with pytest.raises(ValueError, match="arrival process"):
        arrival_offsets(3, 1.0, "bursty", seed=1)
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets(3, 0.0, "constant", seed=1)
    specs = with_arrivals(_specs(3), [0.0, 0.1, 0.2])
    assert [s.arrival_s for s in specs] == [0.0, 0.1, 0.2]
    with pytest.raises(ValueError, match="3 requests but 2"):
        with_arrivals(_specs(3), [0.0, 0.1])


def test_trace_times_lengths_text_and_multi_turn_prefixes(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 1000, "input_tokens": 100, "output_tokens": 20, "session": "a"}\n'
        '\n'
        '{"timestamp": 1250, "prompt": "hello there", "output_tokens": 5}\n'
        '{"timestamp": 1500, "input_tokens": 150, "output_tokens": 30, "session": "a"}\n'
        '{"timestamp": 1500, "input_tokens": 40, "output_tokens": 8, "session": "b"}\n'
        '{"timestamp": 2000, "input_tokens": 260, "output_tokens": 10, "session": "a"}\n')
    specs = load_trace(trace)
    assert [s.index for s in specs] == [0, 1, 2, 3, 4]
    assert [s.arrival_s for s in specs] == [0.0, 0.25, 0.5, 0.5, 1.0]
    assert specs[1].text == "hello there" and specs[1].input_tokens == 0 and specs[1].session is None
    # A turn resends its history: the previous turn's input + output is shared.
    assert [s.prefix_tokens for s in specs] == [0, 0, 120, 0, 180]
    assert [s.session for s in specs] == ["a", None, "a", "b", "a"]
    seconds = tmp_path / "s.jsonl"
    seconds.write_text('{"arrival_s": 0.5, "input_tokens": 3, "output_tokens": 2}\n')
    assert load_trace(seconds)[0].arrival_s == 0.5


@pytest.mark.parametrize("lines, line, message", [
    (['{"arrival_s": 0, "input_tokens": 3, "output_tokens": 2', ], 1, "not valid JSON"),
    (['{"arrival_s": 0, "input_tokens": 3, "output_tokens": 2}', '[1, 2]'], 2, "must be a JSON object"),
    (['{"input_tokens": 3, "output_tokens": 2}'], 1, 'missing "arrival_s" (seconds) or "timestamp" (ms)'),
    (['{"arrival_s": 0, "output_tokens": 2}'], 1, 'missing "input_tokens" or "prompt"'),
    (['{"arrival_s": 0, "input_tokens": 3}'], 1, 'missing "output_tokens"'),
    (['{"arrival_s": 0, "input_tokens": -3, "output_tokens": 2}'], 1, '"input_tokens" must be >= 1, not -3'),
    (['{"arrival_s": 0, "input_tokens": 3, "output_tokens": -1}'], 1, '"output_tokens" must be >= 1, not -1'),
    (['{"arrival_s": 0, "input_tokens": 3.5, "output_tokens": 2}'], 1, '"input_tokens" must be an integer'),
    (['{"arrival_s": -1, "input_tokens": 3, "output_tokens": 2}'], 1, '"arrival_s" must be >= 0'),
    (['{"arrival_s": 1, "input_tokens": 3, "output_tokens": 2}',
      '{"arrival_s": 0.5, "input_tokens": 3, "output_tokens": 2}'], 2, "arrivals go backwards"),
    (['{"timestamp": 900, "input_tokens": 3, "output_tokens": 2}',
      '{"timestamp": 800, "input_tokens": 3, "output_tokens": 2}'], 2, "arrivals go backwards (timestamp 800 ms"),
    (['{"arrival_s": 0, "input_tokens": 3, "output_tokens": 2}',
      '{"timestamp": 5, "input_tokens": 3, "output_tokens": 2}'], 2, 'mixes "arrival_s" and "timestamp"'),
    (['{"arrival_s": 0, "prompt": "a b", "output_tokens": 2, "session": "s"}',
      '{"arrival_s": 1, "input_tokens": 9, "output_tokens": 2, "session": "s"}'], 2, "mixes prompt text and"),
    (['{"arrival_s": 0, "prompt": "", "output_tokens": 2}'], 1, '"prompt" must be a non-empty string'),
])
def test_trace_errors_name_the_file_line_and_problem(tmp_path, lines, line, message):
    trace = tmp_path / "bad.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as err:
        load_trace(trace)
    assert str(err.value).startswith(f"{trace}:{line}: ")
    assert message in str(err.value)


def test_an_empty_trace_is_an_error(tmp_path):
    trace = tmp_path / "empty.jsonl"
    trace.write_text("\n")
    with pytest.raises(ValueError, match="holds no request"):
        load_trace(trace)


# --- closed loop --------------------------------------------------------------------------------------------


def test_closed_loop_keeps_exactly_n_in_flight_against_the_stub():
    n, requests = 4, 40
    with StubServer(slots=8, token_delay_s=0.005) as srv:
        client = StubClient(srv.address)
        run = run_level(client.send, _specs(requests, out=8), concurrency=n)
        st = srv.stats()
    assert [s.spec.index for s in run.sent] == list(range(requests))
    assert all(s.ok and s.result["tokens"] == 8 and s.result["completion_tokens"] == 8 for s in run.sent)
    assert st["requests"] == requests
    assert st["max_generating"] == n  # never more than N at the server (it has 8 free slots)
    # ... and N kept busy: every request but the last round's shared the server with N-1 others at some point.
    assert len(st["peaks"]) == requests and max(st["peaks"]) == n
    assert sum(peak == n for peak in st["peaks"]) >= requests - n
    assert {s.worker for s in run.sent} == set(range(n))
    assert run.overhead["max_in_flight"] == n and run.overhead["workers"] == n
    assert run.stopped_early is None
    assert run.start_perf == min(s.dispatched_s for s in run.sent)
    assert run.end_perf == max(s.finished_s for s in run.sent)
    assert run.end_epoch - run.start_epoch == pytest.approx(run.end_perf - run.start_perf)
    assert set(run.overhead) == set(OVERHEAD_KEYS)
    assert all(math.isfinite(run.overhead[k]) for k in OVERHEAD_KEYS)
    assert run.overhead["client_cpu_s"] > 0 and run.overhead["dispatch_lag_ms_p99"] >= 0


def test_failures_are_recorded_and_the_level_goes_on():
    def send(spec, worker):
        if spec.index % 3 == 0:
            raise ConnectionResetError(f"request {spec.index} refused")
        return spec.index * 10

    run = run_level(send, _specs(12), concurrency=2)
    assert len(run.sent) == 12 and run.stopped_early is None
    assert [s.spec.index for s in run.sent if s.error is not None] == [0, 3, 6, 9]
    assert all(isinstance(s.error, ConnectionResetError) and s.result is None for s in run.sent if s.error)
    assert [s.result for s in run.sent if s.ok] == [i * 10 for i in range(12) if i % 3]


def test_the_watch_stops_dispatching_and_lets_in_flight_requests_finish():
    release = threading.Event()
    seen: list[int] = []

    def send(spec, worker):
        if spec.index >= 4:
            release.wait(5)  # held in flight until the watch has spoken
        return spec.index

    def watch(done):
        seen.append(len(done))
        release.set()
        return "too slow" if len(done) >= 4 else None

    run = run_level(send, _specs(30), concurrency=3, watch=watch, watch_every=2)
    assert run.stopped_early == "too slow"
    assert seen[:2] == [2, 4]
    sent = [s for s in run.sent if s.dispatched]
    assert 4 <= len(sent) <= 4 + 3  # the 4 that completed, and at most one per worker in flight
    assert all(s.ok for s in sent)  # in-flight ones finished, were not given up
    unsent = [s for s in run.sent if not s.dispatched]
    assert len(unsent) == 30 - len(sent)
    assert all(isinstance(s.error, NotSent) and "too slow" in str(s.error) and s.worker == -1 for s in unsent)


def test_without_drain_the_watch_gives_in_flight_requests_up_at_once():
    """Far over capacity a level's queue can outlast everything before the verdict: with drain=False the requests in
    flight when the watch speaks are given up (GivenUp) and abort() breaks their sends."""
    release, aborted = threading.Event(), []
    blocked = threading.Semaphore(0)

    def send(spec, worker):
        if spec.index >= 2:
            blocked.release()
            release.wait(30)  # would hold the level for 30 s were it drained
        return spec.index

    def watch(done):
        # Called by the worker that completed the second request: the other two are in a blocked send by now.
        assert blocked.acquire(timeout=10) and blocked.acquire(timeout=10)
        return "over-saturated"

    def abort():
        aborted.append(1)
        release.set()

    run = run_level(send, _specs(30), concurrency=3, watch=watch, watch_every=2, abort=abort, drain=False)
    assert run.stopped_early == "over-saturated" and aborted == [1]
    in_flight = [s for s in run.sent if s.dispatched and not s.ok]
    assert len(in_flight) == 2 and all(isinstance(s.error, GivenUp) for s in in_flight)
    assert [s.spec.index for s in run.sent if s.ok] == [0, 1]


def test_a_level_timeout_records_unsent_and_in_flight_requests_as_timeouts():
    gate = threading.Event()

    def send(spec, worker):
        if spec.index >= 2:
            gate.wait(10)  # blocks until aborted
        return spec.index

    run = run_level(send, _specs(10), concurrency=2, timeout_s=0.3, abort=gate.set)
    assert run.stopped_early == "timeout: the level did not finish within 0.3 s"
    assert [s.ok for s in run.sent[:2]] == [True, True]
    in_flight = [s for s in run.sent if s.dispatched and not s.ok]
    assert len(in_flight) == 2 and all(isinstance(s.error, TimeoutError) for s in in_flight)
    unsent = [s for s in run.sent if not s.dispatched]
    assert len(unsent) == 6 and all(isinstance(s.error, TimeoutError) for s in unsent)


def test_the_stop_event_gives_the_level_up_and_joins_every_worker():
    stop = threading.Event()
    with StubServer(slots=2, token_delay_s=0.05) as srv:
        client = StubClient(srv.address)

        def send(spec, worker):
            if spec.index == 1:
                stop.set()  # the caller's Ctrl-C, while requests are in flight
            return client.send(spec, worker)

        # 200 tokens at 50 ms: 10 s a request, far longer than giving up takes.
        run = run_level(send, _specs(20, out=200), concurrency=2, stop=stop, abort=client.abort)
        assert _serving_threads() == []
    assert run.stopped_early == "stopped by the caller"
    given_up = [s for s in run.sent if s.dispatched]
    assert 1 <= len(given_up) <= 2 and all(isinstance(s.error, GivenUp) for s in given_up)
    assert all(isinstance(s.error, NotSent) for s in run.sent if not s.dispatched)


def test_an_interrupt_from_a_send_stops_the_level_and_is_raised():
    gate = threading.Event()

    def send(spec, worker):
        if spec.index == 3:
            raise KeyboardInterrupt
        gate.wait(10)
        return spec.index

    with pytest.raises(KeyboardInterrupt):
        run_level(send, _specs(50), concurrency=4, abort=gate.set)
    assert _serving_threads() == []


def test_a_broken_watch_is_raised():
    def watch(done):
        raise RuntimeError("watch bug")

    with pytest.raises(RuntimeError, match="watch bug"):
        run_level(lambda spec, w: spec.index, _specs(8), concurrency=2, watch=watch, watch_every=1)


# --- open loop ----------------------------------------------------------------------------------------------


def test_open_loop_dispatches_in_arrival_order_without_waiting_for_completions():
    # 8 arrivals 5 ms apart, each needing 8 x 30 ms of a 2-slot server: arrivals outrun the service.
    offsets = [0.005 * i for i in range(8)]
    order = [5, 2, 7, 0, 1, 6, 3, 4]  # specs listed out of arrival order: dispatch follows arrival_s
    specs = [RequestSpec(index=i, input_tokens=4, output_tokens=8, arrival_s=offsets[order.index(i)])
             for i in range(8)]
    with StubServer(slots=2, token_delay_s=0.03) as srv:
        client = StubClient(srv.address)
        run = run_level(client.send, specs)
        st = srv.stats()
    assert all(s.ok for s in run.sent) and [s.spec.index for s in run.sent] == list(range(8))
    by_dispatch = sorted(run.sent, key=lambda s: s.dispatched_s)
    assert [s.spec.arrival_s for s in by_dispatch] == sorted(offsets)
    assert [s.scheduled_s for s in by_dispatch] == sorted(s.scheduled_s for s in run.sent)
    first_done = min(s.finished_s for s in run.sent)
    assert sum(s.dispatched_s < first_done for s in run.sent) > 2  # more than the slots before any completion
    assert st["max_in_flight"] > 2 and st["max_generating"] == 2  # a real queue at the server
    assert run.overhead["max_in_flight"] > 2
    assert all(s.dispatched_s >= s.scheduled_s for s in run.sent)  # never early
    assert math.isfinite(run.overhead["dispatch_lag_ms_p99"]) and run.overhead["dispatch_lag_ms_p50"] >= 0


def test_open_loop_is_bounded_by_max_in_flight_and_the_wait_shows_as_lag():
    gate = threading.Event()
    inside = []
    lock = threading.Lock()
    peak = [0]

    def send(spec, worker):
        with lock:
            inside.append(spec.index)
            peak[0] = max(peak[0], len(inside))
        gate.wait(0.2)
        with lock:
            inside.remove(spec.index)
        return spec.index

    specs = with_arrivals(_specs(9), [0.0] * 9)  # all due at once
    run = run_level(send, specs, max_in_flight=3)
    assert all(s.ok for s in run.sent)
    assert peak[0] == 3 and run.overhead["workers"] == 3 and run.overhead["max_in_flight"] == 3
    assert {s.worker for s in run.sent} == {0, 1, 2}
    # The six that waited for a worker show it: dispatched at least one send (0.2 s) after they were due.
    waited = sorted(s.dispatched_s - s.scheduled_s for s in run.sent)[3:]
    assert all(w > 0.1 for w in waited)


def test_open_loop_stop_event_and_failures():
    stop = threading.Event()

    def send(spec, worker):
        if spec.index == 2:
            raise ValueError("bad answer")
        if spec.index == 4:
            stop.set()
        return spec.index

    specs = with_arrivals(_specs(40), [0.002 * i for i in range(40)])
    run = run_level(send, specs, stop=stop)
    assert run.stopped_early == "stopped by the caller"
    assert isinstance(run.sent[2].error, ValueError)
    unsent = [s for s in run.sent if not s.dispatched]
    assert unsent and all(isinstance(s.error, NotSent) and s.scheduled_s is not None for s in unsent)


def test_mixed_or_missing_loop_settings_are_refused():
    with pytest.raises(ValueError, match="open or closed loop"):
        run_level(lambda s, w: None, [RequestSpec(0, 1, 1, arrival_s=0.0), RequestSpec(1, 1, 1)], concurrency=1)
    with pytest.raises(ValueError, match="takes no concurrency"):
        run_level(lambda s, w: None, [RequestSpec(0, 1, 1, arrival_s=0.0)], concurrency=2)
    with pytest.raises(ValueError, match="concurrency >= 1"):
        run_level(lambda s, w: None, _specs(2))
    empty = run_level(lambda s, w: None, [], concurrency=2)
    assert empty.sent == [] and empty.overhead["workers"] == 0


def test_a_text_prompt_of_a_trace_sizes_the_context_by_its_bytes(tmp_path):
    """The context must hold a trace's longest request before any tokenizer is at hand: a text prompt counts as its
    UTF-8 bytes + 8 (a byte-level token covers at least a byte)."""
    from jbench.backends.serving.levels import context_size
    from jbench.core.schema import ServingConfig

    trace = tmp_path / "t.jsonl"
    long_text = "word " * 120  # 600 bytes
    trace.write_text(f'{{"arrival_s": 0, "prompt": "{long_text}", "output_tokens": 16}}\n'
                     '{"arrival_s": 1, "input_tokens": 40, "output_tokens": 8}\n')
    cfg = ServingConfig(trace=str(trace))
    assert context_size(cfg, slots=2) == 2 * 768  # 600 + 8 + 16 + 1 rounded up to 256, per slot
