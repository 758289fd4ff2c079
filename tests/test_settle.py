"""Settled speed: the leading repetitions whose rate had not settled are set aside, bounded and said; measured
per-repetition rates from a CUDA build on an H100 (llama-bench -o jsonl samples_ts) are the cases."""

from __future__ import annotations

import math

import pytest

from jbench.analysis.settle import settle_phase, settle_point
from jbench.core.results import BackendResult, PhaseResult
from jbench.runner.analyses import phase_metrics

# H100, CUDA build 0c1e57098, Gemma-3-270M-shaped Q4_0, `llama-bench -p 128 -n 0 -r 10` (after its own warm-up).
H100_PREFILL_Q4_0 = [9768, 28111, 28581, 28730, 28888, 29015, 29004, 28933, 29173, 28777]
# The same with --no-warmup: two cold repetitions.
H100_PREFILL_NO_WARMUP = [2709, 13747, 30137, 30860, 31114, 31096, 31279, 31260, 31254, 31210]
# The shipped -p 128 -n 64 -r 3: decode's first repetition 4 % low.
H100_DECODE_Q4_0 = [971, 1014, 1018]


def test_a_cold_first_repetition_is_set_aside_and_the_rest_is_the_figure():
    s = settle_point(H100_PREFILL_Q4_0, allowed=1)
    assert (s.cold, s.settled) == (1, True)
    assert s.reference_tps == pytest.approx(28_933, rel=0.01)
    # Two allowed: the second repetition is within the threshold, so only one is cold.
    assert settle_point(H100_PREFILL_Q4_0, allowed=2).cold == 1


def test_the_bound_is_a_bound_and_a_rate_still_moving_is_said():
    s = settle_point(H100_PREFILL_NO_WARMUP, allowed=1)
    assert s.cold == 1 and not s.settled  # 13,747 after the bound is still far from 31,000
    assert "not settled within 1 warm-up repetition" in s.describe()
    # Three allowed: 30,137 is still 3.4 % under the settled 31,200, so it is the third cold one.
    s = settle_point(H100_PREFILL_NO_WARMUP, allowed=3)
    assert (s.cold, s.settled) == (3, True)


def test_a_small_decode_warm_up_counts_where_the_settled_spread_is_smaller():
    # 971 against ~1016: 4.4 % off, over the 3 % floor.
    assert settle_point([*H100_DECODE_Q4_0, 1016, 1015], allowed=1).cold == 1


def test_on_a_noisy_machine_only_what_stands_out_of_its_own_noise_is_cold():
    noisy = [100.0, 112.0, 90.0, 105.0, 95.0, 108.0]  # ~8 % spread: a first repetition 10 % off is not cold
    s = settle_point(noisy, allowed=1)
    assert s.cold == 0 and s.threshold > 0.1
    # Only a slow repetition is cold: a fast first one is kept.
    assert settle_point([150.0, 100.0, 101.0, 99.0], allowed=1).cold == 0


def test_few_repetitions_after_the_bound_never_let_a_slow_outlier_discard_a_good_one():
    # -r 1 plus one settle repetition on a loaded CPU: the good first repetition, then a stall. Nothing is cold.
    assert settle_point([544.0, 27.8], allowed=1).cold == 0
    # One repetition after the bound: no spread to measure, only a repetition more than 25 % slower is cold.
    assert settle_point([80.0, 100.0], allowed=1).cold == 0
    assert settle_point([9768.0, 28111.0], allowed=1).cold == 1
    # Two after the bound: their own spread sets the threshold (100 and 120: SD 14 %, so 3 SD is 42 %).
    assert settle_point([70.0, 100.0, 120.0], allowed=1).cold == 0
    assert settle_point([40.0, 100.0, 120.0], allowed=1).cold == 1


def test_no_check_without_settle_repetitions_or_with_a_single_repetition():
    assert settle_point(H100_PREFILL_Q4_0, allowed=0).cold == 0
    assert settle_point([5.0], allowed=1).cold == 0


def test_the_window_of_a_settled_phase_starts_after_the_cold_repetitions():
    ns = [round(128 / r * 1e9) for r in H100_PREFILL_Q4_0[:4]]
    pr = PhaseResult("prefill", n_tokens=128, samples_ns=ns, end_time=1000.0)
    settled, decision = settle_phase(pr, 1)
    assert settled.cold_samples_ns == ns[:1] and settled.samples_ns == ns[1:]
    assert settled.window == pytest.approx((1000.0 - sum(ns[1:]) / 1e9, 1000.0))
    assert settled.tokens_in_window == 3 * 128 and settled.settled is True
    m = phase_metrics(BackendResult(phases={"prefill": settled}))
    assert m.metrics["prefill_repetitions"] == 3 and m.metrics["prefill_cold_repetitions"] == 1
    assert m.metrics["prefill_cold_tps"] == pytest.approx(9768, rel=1e-3)
    assert m.metrics["prefill_tps"] == pytest.approx(sum(H100_PREFILL_Q4_0[1:4]) / 3, rel=1e-3)
    assert "1 cold repetition(s) set aside (9,768 tok/s" in m.tags["prefill.settle"]
    # Nothing cold: no cold rate, the count says zero.
    calm, _ = settle_phase(PhaseResult("decode", 64, [round(64 / r * 1e9) for r in (1014, 1018, 1016)]), 1)
    m = phase_metrics(BackendResult(phases={"decode": calm}))
    assert m.metrics["decode_cold_repetitions"] == 0 and "decode_cold_tps" not in m.metrics
    assert m.tags["decode.settle"].startswith("settled from the first repetition")
    # A backend without the check: no settle figures at all.
    plain = phase_metrics(BackendResult(phases={"decode": PhaseResult("decode", 64, [10**9, 10**9])}))
    assert "decode_cold_repetitions" not in plain.metrics and "decode.settle" not in plain.tags
    assert not math.isnan(plain.metrics["decode_tps"])
