"""`sweep --search`'s choice of trials (jbench.sweeps.search.Search) against oracles built here: the sweep's loop is
played by the test (each yielded trial gets an outcome, observed before the next is asked for). The whole command on
real runs: tests/test_advise_cli.py."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from jbench.analysis.advice import Goal, parse_constraint
from jbench.core.results import Status
from jbench.core.trial import Trial
from jbench.sweeps.search import Search, SearchSettings


@dataclasses.dataclass
class Outcome:
    trial: Trial
    status: Status
    metrics: dict
    earlier_run_id: str | None = None


DIMS = {"model.quant": ["Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16"], "backend.threads": [1, 2, 4, 8],
        "backend.cache_type_k": ["f16", "q8_0", "q4_0"], "backend.flash_attn": ["on", "off"]}
BITS = {"Q4_0": 4.5, "Q4_K_M": 4.8, "Q5_K_M": 5.7, "Q6_K": 6.6, "Q8_0": 8.5, "F16": 16}


def grid() -> list[Trial]:
    out = []
    for i, values in enumerate(itertools.product(*DIMS.values()), 1):
        point = dict(zip(DIMS, values))
        out.append(Trial(i, {}, {}, point, f"h{i:03d}"))
    return out


def truth(point: dict) -> dict:
    """A smooth landscape: speed falls with bits, rises with threads (then saturates), a small KV/flash-attention
    effect; memory grows with bits. The constrained best: the fastest with memory <= 500."""
    speed = 400 / BITS[point["model.quant"]] * min(point["backend.threads"], 4) ** 0.5
    speed *= {"f16": 1.0, "q8_0": 0.97, "q4_0": 0.95}[point["backend.cache_type_k"]]
    speed *= 1.03 if point["backend.flash_attn"] == "on" else 1.0
    memory = 60 * BITS[point["model.quant"]] + 20 * point["backend.threads"]
    return {"decode_tps": speed, "memory_peak_rss_mib": memory}


GOAL = Goal("decode_tps", +1, (parse_constraint("memory_peak_rss_mib<=500"),))


def play(search: Search, trials: list[Trial], rng: random.Random, noise: float = 0.01,
         fail: set[str] = frozenset()) -> list[Trial]:
    ran = []
    for t in search.order(trials):
        ran.append(t)
        if t.config_hash in fail:
            search.observe(Outcome(t, Status.FAILED, {}))
            continue
        m = {k: v * (1 + rng.gauss(0, noise)) for k, v in truth(t.point).items()}
        search.observe(Outcome(t, Status.FINISHED, m))
    return ran


def true_best(trials: list[Trial]) -> float:
    return max(truth(t.point)["decode_tps"] for t in trials if truth(t.point)["memory_peak_rss_mib"] <= 500)


def test_the_search_finds_the_constrained_best_with_a_fraction_of_the_grid():
    trials = grid()  # 144 configurations
    best = true_best(trials)
    found, used = 0, []
    for seed in range(10):
        s = Search(GOAL, SearchSettings(seed=seed, budget_trials=40), dims=DIMS)
        play(s, trials, random.Random(seed))
        inc = s._incumbent()
        used.append(s.runs)
        if inc is not None and truth(s.measured[inc].trial.point)["decode_tps"] >= 0.97 * best:
            found += 1
    assert found >= 8, (found, used)
    assert max(used) <= 40 and sum(used) / len(used) < 0.3 * len(trials)


def test_the_local_model_ranks_an_interaction_an_additive_model_misses():
    """Flash attention pays only with a quantized K cache (as on the replayed grid of docs/PERFORMANCE.md): over the
    measured cells "on" is slower on average, yet the pair (on, q8_0) is the fastest wherever it was measured. The
    local phase's model ranks the unmeasured cell holding that pair first; an additive model ranks it below its rival."""
    quants = ["A", "B", "C", "D", "E", "F"]
    dims = {"backend.flash_attn": ["on", "off"], "backend.cache_type_k": ["f16", "q8_0"], "model.quant": quants}
    speed = {("on", "f16"): 60.0, ("on", "q8_0"): 90.0, ("off", "f16"): 80.0, ("off", "q8_0"): 82.0}
    measured = [(fa, k, q) for fa in ("on", "off") for k in ("f16", "q8_0") for q in quants
                if k == "f16" or q != "F"]
    s = Search(Goal("decode_tps", +1, ()), SearchSettings(), dims=dims)
    cell_of = {}
    for i, cell in enumerate(measured):
        t = Trial(i + 1, {}, {}, dict(zip(dims, cell)), f"h{i}")
        s.observe(Outcome(t, Status.FINISHED, {"decode_tps": speed[cell[:2]]}))
        cell_of[t.config_hash] = cell
    model = s._model(list(dims), cell_of)
    target, rival = ("on", "q8_0", "F"), ("off", "q8_0", "F")
    assert model(target) > model(rival) > model(("on", "f16", "F"))

    def additive(cell):
        overall = sum(speed[c[:2]] for c in measured) / len(measured)
        effect = 0.0
        for i, v in enumerate(cell):
            values = [speed[c[:2]] for c in measured if c[i] == v]
            effect += sum(values) / len(values) - overall
        return overall + effect

    assert additive(target) < additive(rival)  # what the pairs correct


def test_a_budget_a_ruled_out_cell_and_a_failed_trial():
    trials = grid()
    # Ruled out before running: anything over 6 bits cannot reach 70 tok/s here (a stand-in for the decode ceiling).
    goal = Goal("decode_tps", +1, (parse_constraint("decode_tps>=70"),))
    ceiling = lambda t, metric: 1000.0 / BITS[t.point["model.quant"]] if metric == "decode_tps" else None  # noqa: E731
    s = Search(goal, SearchSettings(seed=1, budget_trials=12), dims=DIMS, upper_bound=ceiling)
    fail = {t.config_hash for t in trials if t.point["backend.threads"] == 8}
    ran = play(s, trials, random.Random(1), fail=fail)
    assert len(ran) == 12 and s.stop_reason == "the trial budget (12 runs) is spent"
    assert all(BITS[t.point["model.quant"]] <= 1000 / 70 for t in ran)
    assert {t.point["model.quant"] for t, _ in s.pruned} == {"F16"}  # 1000 / 16 < 70
    assert all("cannot reach 70" in why for _, why in s.pruned)
    assert sum(m.failed for m in s.measured.values()) == sum(t.config_hash in fail for t in ran)


def test_no_cell_left_can_beat_the_incumbent_by_its_ceiling():
    trials = grid()
    ceiling = lambda t, metric: truth(t.point)["decode_tps"] * 1.05 if metric == "decode_tps" else None  # noqa: E731
    s = Search(GOAL, SearchSettings(seed=3, patience=1000), dims=DIMS, upper_bound=ceiling)
    play(s, trials, random.Random(3), noise=0.0)
    assert s.stop_reason.startswith("no configuration left unmeasured can beat the incumbent")
    assert len(s.measured) < len(trials)


def test_an_undecided_configuration_is_measured_again_up_to_max_runs():
    """A run reports its repetitions' spread (decode_tps_std over decode_repetitions); a configuration whose decode
    rate sits on the bound stays undecided and is measured again, as runs 2 and 3 of it, then no more."""
    trials = grid()[:6]
    on_bound = truth(trials[0].point)["decode_tps"]
    goal = Goal("memory_peak_rss_mib", -1, (parse_constraint(f"decode_tps>={on_bound}"),))
    s = Search(goal, SearchSettings(seed=0, max_runs=3), dims=DIMS)
    rng = random.Random(0)
    ran = []
    for t in s.order(trials):
        ran.append(t)
        m = truth(t.point)
        s.observe(Outcome(t, Status.FINISHED, {**m, "decode_tps": m["decode_tps"] * (1 + rng.gauss(0, 0.001)),
                                               "decode_tps_std": 0.05 * m["decode_tps"], "decode_repetitions": 3.0}))
    rounds = [t.round for t in ran if t.config_hash == trials[0].config_hash]
    assert rounds == [1, 2, 3]  # the same configuration, as runs 2 and 3 of it
    assert len(s.measured[trials[0].config_hash].runs) == 3


def test_a_resumed_search_reads_the_earlier_runs_metrics():
    trials = grid()
    first = Search(GOAL, SearchSettings(seed=5, budget_trials=6), dims=DIMS)
    seen: dict[str, dict] = {}
    first_order = []
    for t in first.order(trials):
        m = truth(t.point)
        seen[f"run-{t.config_hash}-{t.round}"] = m
        first_order.append((t.config_hash, t.round))
        first.observe(Outcome(t, Status.FINISHED, m))
    again = Search(GOAL, SearchSettings(seed=5, budget_trials=6), dims=DIMS, earlier_metrics=lambda rid: seen[rid])
    order = []
    for t in again.order(trials):  # every trial is FINISHED earlier: skipped, its metrics read from the store
        order.append((t.config_hash, t.round))
        again.observe(Outcome(t, Status.SKIPPED, {}, earlier_run_id=f"run-{t.config_hash}-{t.round}"))
    assert order == first_order  # the same questions, answered from the store
    assert {h: len(m.runs) for h, m in again.measured.items()} == {h: len(m.runs) for h, m in first.measured.items()}


def test_bad_settings_are_named():
    assert SearchSettings(budget_trials=0, max_runs=0).problems() == [
        "--budget-trials 0: give at least 1", "--max-runs 0: give at least 1"]
    with pytest.raises(AssertionError):
        assert SearchSettings(patience=0).problems() == []


def test_a_fully_measured_grid_with_a_near_tie_ends_without_a_budget():
    """Two cells, measured, their objectives within noise of each other: the search repeats the tie up to max_runs
    and ends (it once asked for an unmeasured cell of an empty grid)."""
    dims = {"model.quant": ["Q4_0", "Q8_0"]}
    trials = [Trial(1, {}, {}, {"model.quant": "Q4_0"}, "a"), Trial(2, {}, {}, {"model.quant": "Q8_0"}, "b")]
    s = Search(Goal("decode_tps", 1), SearchSettings(seed=0, max_runs=2), dims=dims)
    ran = []
    for t in s.order(trials):
        ran.append((t.config_hash, t.round))
        rate = 100.0 if t.config_hash == "a" else 99.0
        s.observe(Outcome(t, Status.FINISHED, {"decode_tps": rate, "decode_tps_std": 2.0, "decode_repetitions": 5.0}))
    assert {("a", 1), ("b", 1)} <= set(ran) and all(r <= 2 for _, r in ran)
    assert ("b", 2) in ran  # the runner-up, not told apart from the best by one run each, measured again
    assert s.stop_reason == "every configuration of the grid was measured or ruled out"


def test_a_metric_the_trials_never_record_is_not_repeated_for():
    trials = grid()[:4]
    goal = Goal("decode_tps", 1, (parse_constraint("quality_kld_mean<=0.05"),))
    s = Search(goal, SearchSettings(seed=0, max_runs=3), dims=DIMS)
    ran = play(s, trials, random.Random(0))
    assert len(ran) == 4 and all(t.round == 1 for t in ran)  # each once: a repeat cannot produce the metric


@pytest.mark.e2e  # plans on the bundled model
def test_the_decode_ceiling_comes_from_the_profiles_bandwidth_and_the_model_file(bundled_model):
    from jbench.sweeps.plan import plan
    from jbench.sweeps.search import decode_ceiling

    jetson = plan(["model.quant=Q4_0", "device.profile=orin_nano_super"], use_grid=False).trials[0]
    ceiling = decode_ceiling(jetson, "decode_tps")
    # 102 GB/s over the Q4_0 file's bytes per token (about 0.24 GB): a few hundred tokens per second at most.
    assert 200 < ceiling < 1000
    assert decode_ceiling(jetson, "prefill_tps") is None  # no ceiling but decode's
    assert decode_ceiling(plan(["model.quant=Q4_0"], use_grid=False).trials[0], "decode_tps") is None  # no profile
