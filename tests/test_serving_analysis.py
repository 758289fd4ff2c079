"""jbench.analysis.serving: level metrics by hand, over-saturation, knee, SLO capacity and its search, on outcomes
from a small queueing model of a server written here (S slots, first come first served, a prefill then one token
per decode step), closed loop (c clients) or open loop (arrivals due at a constant rate)."""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import replace

import pytest

from jbench.analysis.serving import (CapacitySearch, Estimate, Level, RequestOutcome, Slo, knee, level_figures,
                                     level_table, oversaturated, slo_capacity)

SLOTS = 8
PREFILL_S = 0.05
TOKEN_S = 0.015


# --------------------------------------------------------------------------------------------
# The model server


def _request(rng: random.Random, index: int, sent: float, start: float,
             due: float | None = None) -> tuple[RequestOutcome, float]:
    """One request sent at `sent` that gets a slot at `start`: (its outcome, when its slot frees)."""
    n_out = rng.randint(32, 64)  # the output length varies, so resampling requests moves throughput
    prefill = PREFILL_S * rng.uniform(0.9, 1.1)
    gaps = tuple(TOKEN_S * rng.uniform(0.8, 1.2) for _ in range(n_out - 1))
    ttft = start - sent + prefill
    e2e = ttft + sum(gaps)
    return RequestOutcome(index=index, sent_s=sent, ttft_s=ttft, e2e_s=e2e, output_tokens=n_out, prompt_tokens=100,
                          token_gaps_s=gaps, scheduled_s=due), sent + e2e


def closed_loop(concurrency: int, n_requests: int, seed: int) -> Level:
    """c clients, each sending its next request when its last one ends; SLOTS slots, FCFS."""
    rng = random.Random(seed)
    sends = [(0.0, client) for client in range(concurrency)]  # (when, client)
    heapq.heapify(sends)
    free = [0.0] * SLOTS
    outcomes = []
    for index in range(n_requests):
        sent, client = heapq.heappop(sends)
        start = max(sent, heapq.heappop(free))
        o, end = _request(rng, index, sent, start)
        heapq.heappush(free, end)
        heapq.heappush(sends, (end, client))
        outcomes.append(o)
    wall = max(o.sent_s + o.e2e_s for o in outcomes) - min(o.sent_s for o in outcomes)
    return Level(load=concurrency, outcomes=tuple(outcomes), wall_s=wall)


def open_loop(rate_rps: float, n_requests: int, seed: int) -> tuple[RequestOutcome, ...]:
    """Arrivals due every 1/rate s, sent a little late; SLOTS slots, FCFS."""
    rng = random.Random(seed)
    free = [0.0] * SLOTS
    outcomes = []
    for index in range(n_requests):
        due = index / rate_rps
        sent = due + rng.uniform(0.0, 0.002)
        start = max(sent, heapq.heappop(free))
        o, end = _request(rng, index, sent, start, due=due)
        heapq.heappush(free, end)
        outcomes.append(o)
    return tuple(outcomes)


def requests_at(concurrency: int) -> int:
    return max(32, 4 * concurrency)


# A request takes about PREFILL_S + 47 * TOKEN_S = 0.75 s of a slot; a TTFT within 1.5 prefills means no wait.
SLO = Slo(ttft_ms=75.0, attainment=0.9)
CAPACITY_RPS = SLOTS / (PREFILL_S + 47 * TOKEN_S)


# --------------------------------------------------------------------------------------------
# Level metrics


def _o(index, sent, ttft, e2e, out, prompt=10, gaps=(), error=None, due=None) -> RequestOutcome:
    return RequestOutcome(index, sent, ttft, e2e, out, prompt, tuple(gaps), error, due)


def test_level_metrics_by_hand():
    outs = (
        _o(0, 0.0, 0.1, 0.5, 5, gaps=(0.1, 0.1, 0.1, 0.1)),          # TPOT (0.5 - 0.1) / 4 = 100 ms
        _o(1, 0.0, 0.3, 1.3, 11, prompt=20, gaps=(0.1,) * 10),      # TPOT 1.0 / 10 = 100 ms
        _o(2, 0.5, 0.2, 0.2, 1, prompt=30),                          # one token: no TPOT, no gaps
        _o(3, 0.6, math.nan, math.nan, 0, prompt=40, error="HTTP 503"),
    )
    level = Level(load=2, outcomes=outs, wall_s=2.0)
    m = level_figures(level, Slo(ttft_ms=250.0, tpot_ms=150.0))
    assert m["requests"] == 4 and m["failed_requests"] == 1
    assert m["request_throughput_rps"] == pytest.approx(3 / 2.0)
    assert m["output_tps"] == pytest.approx((5 + 11 + 1) / 2.0)
    assert m["total_tps"] == pytest.approx((5 + 11 + 1 + 10 + 20 + 30) / 2.0)  # the failed request's prompt is not
    assert m["ttft_ms_p50"] == pytest.approx(200.0)
    assert m["ttft_ms_mean"] == pytest.approx(200.0)
    assert m["ttft_ms_p90"] == pytest.approx(280.0)  # linear: 200 + 0.8 * (300 - 200)
    assert m["e2e_ms_p50"] == pytest.approx(500.0)
    assert m["e2e_ms_mean"] == pytest.approx(2000.0 / 3)
    assert m["tpot_ms_p50"] == pytest.approx(100.0) and m["tpot_ms_mean"] == pytest.approx(100.0)
    assert m["itl_ms_mean"] == pytest.approx(100.0) and m["itl_ms_p99"] == pytest.approx(100.0)
    # Requests 0 (TTFT 100) and 2 (TTFT 200, one token: TPOT does not apply) meet; 1 is late (300 ms), 3 failed.
    assert m["goodput_rps"] == pytest.approx(2 / 2.0)
    assert m["slo_attainment"] == pytest.approx(2 / 4)
    assert "send_lag_ms_p50" not in m  # closed loop


def test_level_metrics_absent_never_zero():
    failed = tuple(_o(i, 0.1 * i, math.nan, math.nan, 0, error="timeout") for i in range(3))
    m = level_figures(Level(load=4, outcomes=failed, wall_s=1.0), Slo())
    for prefix in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert not any(k.startswith(prefix) for k in m), m
    assert "slo_attainment" not in m  # the SLO sets no target
    assert m["requests"] == 3 and m["failed_requests"] == 3
    assert m["request_throughput_rps"] == 0.0 and m["goodput_rps"] == 0.0  # counted over a measured wall: a real 0
    # No wall: no rates at all; one-token requests only: no TPOT and no ITL, but TTFT and E2E.
    one = (_o(0, 0.0, 0.1, 0.1, 1),)
    m = level_figures(Level(load=1, outcomes=one, wall_s=math.nan), Slo(ttft_ms=50.0))
    assert not {"request_throughput_rps", "output_tps", "total_tps", "goodput_rps"} & set(m)
    assert "tpot_ms_p50" not in m and "itl_ms_p50" not in m and m["ttft_ms_p50"] == pytest.approx(100.0)
    assert m["slo_attainment"] == 0.0  # 100 ms > 50 ms: a real 0 share


def test_send_lag_only_in_open_loop():
    outs = (_o(0, 0.010, 0.1, 0.5, 4, due=0.0), _o(1, 1.030, 0.1, 0.5, 4, due=1.0))
    m = level_figures(Level(load=1.0, outcomes=outs, wall_s=1.6), Slo())
    assert m["send_lag_ms_p50"] == pytest.approx(20.0)
    assert m["send_lag_ms_p99"] == pytest.approx(10.0 + 0.99 * 20.0)
    table = level_table([closed_loop(2, 8, 1), Level(load=1.0, outcomes=outs, wall_s=1.6)], SLO)
    assert [row["load"] for row in table] == [2.0, 1.0]
    assert "send_lag_ms_p50" not in table[0] and "send_lag_ms_p50" in table[1]


def test_slo_meets_each_target_and_never_a_failure():
    o = _o(0, 0.0, 0.1, 1.1, 11)  # TTFT 100 ms, TPOT 100 ms, E2E 1100 ms
    assert Slo(ttft_ms=100.0, tpot_ms=100.0, e2e_ms=1100.0).meets(o)
    assert not Slo(ttft_ms=99.0).meets(o)
    assert not Slo(tpot_ms=99.0).meets(o)
    assert not Slo(e2e_ms=1099.0).meets(o)
    assert not Slo().meets(replace(o, error="reset"))
    assert not Slo().defined and Slo(e2e_ms=1.0).defined
    with pytest.raises(ValueError):
        Slo(ttft_ms=0.0)
    with pytest.raises(ValueError):
        Slo(attainment=1.5)


# --------------------------------------------------------------------------------------------
# Over-saturation


def test_oversaturation_fires_on_a_growing_queue():
    overloaded = open_loop(2.0 * CAPACITY_RPS, 48, seed=3)
    reason = oversaturated(overloaded)
    assert reason is not None and "queue grows" in reason and "over" in reason
    comfortable = open_loop(0.5 * CAPACITY_RPS, 48, seed=3)
    assert oversaturated(comfortable) is None
    # Too few requests to judge: None, even while growing.
    assert oversaturated(overloaded[:7]) is None


def test_oversaturation_reason_has_the_numbers():
    outs = tuple(_o(i, float(i), 0.04 + 0.012 * i, 1.0 + 0.012 * i, 8) for i in range(24))
    reason = oversaturated(outs)
    assert reason is not None
    assert reason.startswith("TTFT grew from ") and "over" in reason and " ms to " in reason and "requests" in reason


def test_oversaturation_not_on_flat_noise_nor_one_spike():
    rng = random.Random(5)
    flat = [_o(i, float(i), rng.lognormvariate(math.log(0.05), 0.4), 1.0, 8) for i in range(32)]
    assert oversaturated(flat) is None
    spiked_end = flat[:-1] + [replace(flat[-1], ttft_s=5.0)]
    spiked_mid = flat[:16] + [replace(flat[16], ttft_s=5.0)] + flat[17:]
    assert oversaturated(spiked_end) is None
    assert oversaturated(spiked_mid) is None
    # Eight requests judged (the first, sent before any stream ended, is the ramp), the last a spike: the last
    # quarter's median doubles, but the slope's lower bound is not > 0.
    short = [_o(i, float(i), ms / 1000.0, 1.0, 8) for i, ms in enumerate((50, 52, 48, 51, 49, 50, 53, 51, 500))]
    assert oversaturated(short) is None
    # A steady drift (50 -> 63 ms) has a significant slope but is no queue growing: the last quarter is not 2x.
    drift = [replace(o, ttft_s=0.05 + 0.0004 * o.index + 0.002 * rng.random()) for o in flat]
    assert oversaturated(drift) is None
    # The same series with a real trend fires: the rule can say yes.
    trend = [replace(o, ttft_s=o.ttft_s + 0.02 * o.index) for o in flat]
    assert oversaturated(trend) is not None


def test_a_closed_loops_bounded_queue_is_not_growth():
    # Two and four clients per slot: every request waits, but the wait is bounded by the concurrency; the first
    # burst's ramp (requests sent before the first stream end, which wait behind each other once) is not growth.
    assert oversaturated(closed_loop(2 * SLOTS, 48, seed=2).outcomes) is None
    assert oversaturated(closed_loop(4 * SLOTS, 64, seed=2).outcomes) is None


# --------------------------------------------------------------------------------------------
# The knee


LADDER = (1, 2, 4, 8, 16, 32)


def test_knee_at_the_slot_count_with_its_interval():
    levels = [closed_loop(c, requests_at(c), seed=c) for c in LADDER]
    est = knee(levels, n_boot=300, seed=1)
    assert est.value == SLOTS, est.reason
    assert est.low <= SLOTS <= est.high, est
    assert est.low in LADDER and est.high in LADDER
    assert "knee at load 8" in est.reason


def test_knee_pools_replicates_and_is_deterministic():
    levels = [closed_loop(c, requests_at(c), seed=c) for c in LADDER]
    levels += [closed_loop(c, requests_at(c), seed=100 + c) for c in (4, 8, 16)]
    a = knee(levels, n_boot=200, seed=7)
    assert a == knee(levels, n_boot=200, seed=7)
    assert a.value == SLOTS


def _fixed_level(load: int, tps: float) -> Level:
    """16 requests of 50 tokens each (resampling them changes nothing) over the wall that gives `tps`."""
    outs = tuple(_o(i, 0.0, 0.05, 1.0, 50) for i in range(16))
    return Level(load=load, outcomes=outs, wall_s=16 * 50 / tps)


def test_knee_interval_resamples_replicates():
    # Replicate A saturates at 4, replicate B at 8: pooled, the knee is at one of them, and resampling which
    # replicates fill each load puts both in the interval. Requests alone (all alike) would give a point.
    a = [_fixed_level(c, 100.0 * min(c, 4)) for c in (1, 2, 4, 8, 16)]
    b = [_fixed_level(c, 100.0 * min(c, 8)) for c in (1, 2, 4, 8, 16)]
    est = knee(a + b, n_boot=400, seed=0)
    assert est.value in (4, 8)
    assert est.low == 4 and est.high == 8, est
    alone = knee(a, n_boot=50)
    assert alone.value == alone.low == alone.high == 4


def test_knee_needs_three_loads_and_a_bend():
    two = [closed_loop(c, 16, seed=c) for c in (1, 2)]
    est = knee(two, n_boot=10)
    assert math.isnan(est.value) and ">= 3 distinct loads" in est.reason
    # Below the slot count throughput grows linearly: no knee, said so.
    linear = [closed_loop(c, requests_at(c), seed=c) for c in (1, 2, 4, 8)]
    est = knee(linear, n_boot=10)
    assert math.isnan(est.value) and math.isnan(est.low) and "still rises" in est.reason, est


# --------------------------------------------------------------------------------------------
# SLO capacity


def _level(load: float, meeting: int, n: int = 20, stopped: str | None = None) -> Level:
    """n requests of which `meeting` have a 50 ms TTFT and the rest 500 ms."""
    outs = tuple(_o(i, 0.1 * i, 0.05 if i < meeting else 0.5, 1.0, 8) for i in range(n))
    return Level(load=load, outcomes=outs, wall_s=2.0 + 0.1 * n, stopped_early=stopped)


TTFT_100 = Slo(ttft_ms=100.0, attainment=0.9)


def test_slo_capacity_bracketed_on_the_model():
    levels = [closed_loop(c, requests_at(c), seed=c) for c in LADDER]
    est = slo_capacity(levels, SLO, n_boot=300)
    assert est.value == SLOTS and est.reason.startswith("highest tested load meeting the SLO: 8"), est
    assert est.low <= SLOTS and (math.isnan(est.high) or est.high >= SLOTS)
    assert est == slo_capacity(levels, SLO, n_boot=300)  # seeded


def test_slo_capacity_unbracketed_and_never_met():
    passing = [_level(c, 20) for c in (1, 2, 4)]
    est = slo_capacity(passing, TTFT_100, n_boot=100)
    assert est.value == 4 and est.reason.startswith("not bracketed: at least 4") and math.isnan(est.high)
    failing = [_level(c, 10) for c in (1, 2, 4)]
    est = slo_capacity(failing, TTFT_100, n_boot=100)
    assert math.isnan(est.value) and "not met even at the lowest tested load 1" in est.reason
    est = slo_capacity(passing, Slo(), n_boot=10)
    assert math.isnan(est.value) and "no latency target" in est.reason


def test_slo_capacity_fits_a_non_monotone_series():
    # Raw attainment 1.0, 0.85, 1.0, 0.7, 0.95, 0.3: the first raw failure says 1, the highest raw pass says 5;
    # the non-increasing fit pools 2-3 (37/40 = 0.925, passes) and 4-5 (33/40 = 0.825, fails): 3.
    levels = [_level(1, 20), _level(2, 17), _level(3, 20), _level(4, 14), _level(5, 19), _level(6, 6)]
    est = slo_capacity(levels, TTFT_100, n_boot=200)
    assert est.value == 3, est.reason
    assert "isotonic" in est.reason


def test_slo_capacity_pools_replicates_and_fails_a_stopped_level():
    # Load 2 alone (17/20) fails; with its replicate (20/20) the pool is 37/40 and passes.
    levels = [_level(1, 20), _level(2, 17), _level(3, 5), _level(2, 20)]
    assert slo_capacity(levels, TTFT_100, n_boot=50).value == 2
    # A level stopped early fails whatever its few requests said.
    levels = [_level(1, 20), _level(2, 20), _level(3, 4, n=4, stopped="TTFT grew ...")]
    est = slo_capacity(levels, TTFT_100, n_boot=50)
    assert est.value == 2 and "stopped early" in est.reason
    assert est.high == 2  # no resample lets the stopped load pass


def test_slo_capacity_interval_widens_with_noise_near_the_target():
    # Attainments right at the target: some resamples fail at load 2, some pass at load 3.
    levels = [_level(1, 20), _level(2, 18), _level(3, 18), _level(4, 2)]
    est = slo_capacity(levels, TTFT_100, n_boot=500, seed=3)
    assert est.value == 3
    assert est.low < 3 or math.isnan(est.low)
    assert isinstance(est, Estimate) and est == slo_capacity(levels, TTFT_100, n_boot=500, seed=3)


# --------------------------------------------------------------------------------------------
# The search


def _drive(search: CapacitySearch, run, limit: int = 200) -> list[Level]:
    levels: list[Level] = []
    while (load := search.next_load(levels)) is not None:
        levels.append(run(load, sum(1 for lv in levels if lv.load == load)))
        assert len(levels) < limit, "the search does not end"
    return levels


def _model_run(load: int, replicate: int) -> Level:
    return closed_loop(load, requests_at(load), seed=1000 * replicate + load)


def test_search_finds_the_grid_capacity_with_fewer_levels():
    search = CapacitySearch(SLO, start=1, max_load=32, growth=2.0, replicates=2)
    used = _drive(search, _model_run)
    grid = [_model_run(c, 0) for c in range(1, search.max_load + 1)]
    assert search.grid_size() == 32
    on_grid = slo_capacity(grid, SLO, n_boot=100)
    found = slo_capacity(used, SLO, n_boot=100)
    assert on_grid.value == found.value == SLOTS
    assert len(used) < search.grid_size()
    # Bracket 1 2 4 8 16, bisect 12 10 9, then the boundary 8 and 9 each twice.
    assert [int(lv.load) for lv in used] == [1, 2, 4, 8, 16, 12, 10, 9, 8, 9]


def test_search_replicates_the_boundary_and_redecides_on_a_flip():
    # Load 5 passes alone (18/20), but its replicate (14/20) pools to 32/40 = 0.8: fails; the boundary moves to 4/5.
    table = {1: [20], 2: [20], 3: [20], 4: [20, 19], 5: [18, 14], 6: [5], 8: [2]}

    def run(load: int, replicate: int) -> Level:
        return _level(load, table[load][min(replicate, len(table[load]) - 1)])

    search = CapacitySearch(TTFT_100, start=1, max_load=8, replicates=2)
    used = _drive(search, run)
    loads = [int(lv.load) for lv in used]
    # Bracket 1 2 4 8, bisect 6 then 5 (18/20 = 0.9 meets 0.9); 5's replicate flips it, so 4 is replicated.
    assert loads == [1, 2, 4, 8, 6, 5, 5, 4]
    assert slo_capacity(used, TTFT_100, n_boot=50).value == 4


def test_search_ends_when_never_met_or_not_bracketed():
    never = CapacitySearch(TTFT_100, start=1, max_load=16, replicates=2)
    used = _drive(never, lambda load, r: _level(load, 5))
    assert [int(lv.load) for lv in used] == [1, 1]
    always = CapacitySearch(TTFT_100, start=2, max_load=10, replicates=2)
    used = _drive(always, lambda load, r: _level(load, 20))
    assert [int(lv.load) for lv in used] == [2, 4, 8, 10, 10]
    assert slo_capacity(used, TTFT_100, n_boot=20).reason.startswith("not bracketed: at least 10")


def test_search_counts_a_stopped_level_as_failing():
    def run(load: int, replicate: int) -> Level:
        return _level(load, 20, stopped="the queue grows" if load >= 3 else None)

    used = _drive(CapacitySearch(TTFT_100, start=1, max_load=8, replicates=1), run)
    assert [int(lv.load) for lv in used] == [1, 2, 4, 3]


def test_search_refuses_what_it_cannot_search():
    with pytest.raises(ValueError):
        CapacitySearch(Slo())
    with pytest.raises(ValueError):
        CapacitySearch(TTFT_100, start=0)
    with pytest.raises(ValueError):
        CapacitySearch(TTFT_100).next_load([_level(1.5, 20)])
