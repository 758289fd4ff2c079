"""The advisor (jbench.analysis.advice, pure) on run tables built here: estimates with the noise they were measured
with, probabilities of meeting constraints, the best, runners-up, the Pareto front and the outcomes that are no
answer. `jbench advise` on real runs: tests/test_advise_cli.py."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from jbench.analysis.advice import (FAILS, MEETS, UNDECIDED, AdviceError, Goal, advise, estimate, parse_constraint)


def runs(*configs: tuple[str, list[dict]]) -> pd.DataFrame:
    """One row per run: (config hash, [metrics of each run])."""
    rows = []
    for h, per_run in configs:
        for i, metrics in enumerate(per_run):
            rows.append({"run_id": f"{h}-{i}", "status": "FINISHED", "tags.jbench.kind": "trial",
                         "tags.jbench.config_hash": h, "tags.jbench.trial_label": f"cfg {h}",
                         "tags.device.name": "orin", **{f"metrics.{k}": v for k, v in metrics.items()}})
    return pd.DataFrame(rows)


def test_constraints_parse_and_refuse_what_is_not_one():
    c = parse_constraint(" decode_tps >= 20 ")
    assert (c.metric, c.sense, c.bound, str(c)) == ("decode_tps", 1, 20.0, "decode_tps >= 20")
    assert parse_constraint("memory_peak_rss_mib<6e3").sense == -1
    for bad in ("decode_tps = 20", "20 <= decode_tps", "decode_tps >= fast", ""):
        with pytest.raises(AdviceError, match="write METRIC>=VALUE"):
            parse_constraint(bad)


def test_an_estimate_uses_the_runs_then_the_repetitions_then_the_tools_error():
    two = runs(("a", [{"decode_tps": 10.0}, {"decode_tps": 12.0}]))
    e = estimate(two, "decode_tps")
    assert (e.mean, e.n, e.dof, e.basis) == (11.0, 2, 1, "runs") and e.se == pytest.approx(1.0)
    one = runs(("a", [{"decode_tps": 10.0, "quality_kld_mean": 0.04, "quality_kld_mean_err": 0.005}]))
    reps = lambda ids, metric: {ids[0]: [9.0, 10.0, 11.0]} if metric == "decode_tps_rep" else {}  # noqa: E731
    e = estimate(one, "decode_tps", reps)
    assert e.basis == "repetitions (one trial)" and e.n == 3 and e.se == pytest.approx(1 / math.sqrt(3))
    e = estimate(one, "quality_kld_mean", reps)
    assert e.basis == "tool error" and e.se == 0.005 and math.isinf(e.dof)
    e = estimate(one, "decode_tps")  # one value, nothing else
    assert e.basis == "one value" and not e.has_spread and math.isnan(e.prob_at_least(5))
    assert estimate(one, "decode_tokens_per_joule").basis == "missing"


def test_the_best_meets_every_constraint_and_the_runners_up_are_not_significantly_worse():
    df = runs(
        # fastest, but its memory is over the bound: fails
        ("fat", [{"decode_tps": 60.0, "memory_peak_rss_mib": 1500.0}, {"decode_tps": 61.0, "memory_peak_rss_mib": 1510.0}]),
        # meets; the best
        ("q4", [{"decode_tps": 50.0, "memory_peak_rss_mib": 400.0}, {"decode_tps": 51.0, "memory_peak_rss_mib": 405.0}]),
        # meets, within noise of the best
        ("q5", [{"decode_tps": 49.8, "memory_peak_rss_mib": 450.0}, {"decode_tps": 50.9, "memory_peak_rss_mib": 452.0}]),
        # meets, clearly slower
        ("q8", [{"decode_tps": 30.0, "memory_peak_rss_mib": 700.0}, {"decode_tps": 30.2, "memory_peak_rss_mib": 701.0}]),
    )
    goal = Goal("decode_tps", +1, (parse_constraint("memory_peak_rss_mib<=1024"),))
    a = advise(df, goal, pareto_metrics=("decode_tps", "memory_peak_rss_mib"), pareto_directions=(1, -1))
    assert a.outcome == "found" and a.best.config_hash == "q4"
    assert [c.config_hash for c in a.runners_up] == ["q5"]
    q8 = next(c for c in a.candidates if c.config_hash == "q8")
    assert q8.verdict == MEETS and q8.vs_best_p < 0.05
    fat = next(c for c in a.candidates if c.config_hash == "fat")
    assert fat.verdict == FAILS and fat.probabilities["memory_peak_rss_mib <= 1024"] < 0.01
    assert [c.verdict for c in a.candidates] == [MEETS, MEETS, MEETS, FAILS]  # ranked: meets first, by objective
    assert {c.config_hash for c in a.front} == {"fat", "q4"}  # nothing is both faster and smaller than these
    assert a.as_dict()["best"]["label"] == "cfg q4" and "cfg q4" in a.message


def test_a_configuration_near_a_bound_is_undecided_and_nothing_decided_is_no_verdict():
    df = runs(("near", [{"decode_tps": 20.5, "memory_peak_rss_mib": 500.0},
                        {"decode_tps": 19.0, "memory_peak_rss_mib": 500.0}]),
              ("slow", [{"decode_tps": 5.0, "memory_peak_rss_mib": 300.0},
                        {"decode_tps": 5.1, "memory_peak_rss_mib": 300.0}]))
    goal = Goal("memory_peak_rss_mib", -1, (parse_constraint("decode_tps>=20"),))
    a = advise(df, goal)
    near = next(c for c in a.candidates if c.config_hash == "near")
    assert near.verdict == UNDECIDED and 0.1 < near.probabilities["decode_tps >= 20"] < 0.9
    assert a.outcome == "undecided" and "cannot decide" in a.message and "too close to the bound" in a.message
    # A constrained metric measured once, without a spread: judged on its value alone, and said so.
    one = runs(("once", [{"decode_tps": 40.0, "memory_peak_rss_mib": 500.0}]))
    b = advise(one, goal)
    assert b.outcome == "found" and b.best.probabilities["decode_tps >= 20"] == 1.0
    assert b.best.notes == ["decode_tps judged on its one value (40): no spread measured"]


def test_constraints_met_by_nothing_name_the_closest():
    df = runs(("a", [{"decode_tps": 5.0}, {"decode_tps": 5.2}]), ("b", [{"decode_tps": 9.0}, {"decode_tps": 9.1}]))
    a = advise(df, Goal("decode_tps", 1, (parse_constraint("decode_tps>=50"),)))
    assert a.outcome == "none" and a.best is None and "met by nothing" in a.message and "cfg" in a.message


def test_an_unknown_metric_is_named_with_what_was_recorded():
    df = runs(("a", [{"decode_tps": 5.0}]))
    with pytest.raises(AdviceError, match="objective 'decode_tp' is not recorded.*did you mean decode_tps"):
        advise(df, Goal("decode_tp", 1))
    with pytest.raises(AdviceError, match="constraint metric 'watts'"):
        advise(df, Goal("decode_tps", 1, (parse_constraint("watts<=5"),)))
    with pytest.raises(AdviceError, match="no FINISHED trial runs"):
        advise(df.assign(status="FAILED"), Goal("decode_tps", 1))
    with pytest.raises(AdviceError, match="confidence 1.2"):
        advise(df, Goal("decode_tps", 1, confidence=1.2))


def test_stated_probabilities_are_calibrated_on_simulated_noise():
    """Reliability: configurations whose true value sits at known distances from a bound, measured as 3 runs with
    normal noise; among those given P(met) in a bin, the share that truly meets the bound lies near the bin's
    probability (t with 2 degrees of freedom from 3 runs)."""
    import random

    rng = random.Random(7)
    bins: dict[int, list[bool]] = {}
    for i in range(3000):
        true = 20 + rng.uniform(-3, 3)
        per_run = [{"decode_tps": rng.gauss(true, 1.0)} for _ in range(3)]
        a = advise(runs(("c", per_run)), Goal("decode_tps", 1, (parse_constraint("decode_tps>=20"),)))
        p = a.candidates[0].probabilities["decode_tps >= 20"]
        bins.setdefault(min(int(p * 5), 4), []).append(true >= 20)
    for b, hits in bins.items():
        observed = sum(hits) / len(hits)
        assert abs(observed - (b + 0.5) / 5) < 0.12, (b, observed, len(hits))


def test_welch_with_a_tools_error_on_one_side_keeps_the_other_sides_degrees_of_freedom():
    """A side with a normal error (a tool's standard error) adds no Welch-Satterthwaite term; the other side's few
    degrees of freedom still widen the test (two runs, se 2, against a tool error 0.1, 5 apart: p about 0.24, not the
    normal's 0.012)."""
    from jbench.analysis.advice import Estimate, _welch_p

    runs2 = Estimate(100.0, 2.0, 1, 2, "runs")
    tool = Estimate(95.0, 0.1, math.inf, 1, "tool error")
    assert 0.2 < _welch_p(runs2, tool) < 0.3
    assert _welch_p(Estimate(100.0, 2.0, math.inf, 1, "x"), Estimate(95.0, 0.1, math.inf, 1, "x")) < 0.02
