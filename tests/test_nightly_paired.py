"""The nightly's same-night control (jbench.analysis.paired's night ratio, jbench.sweeps.control, `jbench nightly`):
a 2 % step at realistic within-night noise is found on its night while the night-to-night noise both builds share
is cancelled; no step gives no alarm; both builds slower is an environment change, never the build's; the plan is
counterbalanced; and on real llama.cpp runs (the cached build as the reference, the SIMD-less build as the build
under test) the paired nightly fails the slow build's first night and passes the same build."""

from __future__ import annotations

import math
import random
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient

from jbench.analysis.history import REGRESSION, history
from jbench.analysis.paired import (ENV_CHANGE, NO_CHANGE, control_verdict, night_ratio, reference_shift,
                                     repetitions_for, settle_by_control)
from jbench.core.exitcodes import ExitCode
from jbench.core.results import Result, Status
from jbench.core.schema import FarmConfig, SweepConfig, TrackingConfig
from jbench.core.trial import Trial
from jbench.sweeps import control as ctl
from jbench.sweeps.plan import Plan

from .conftest import jbench_cli
from .local_class import local_class_conf

# --- the paired ratio (pure, synthetic rates) ---------------------------------------------------------------------

REPS = 10  # per build and night: the shipped nightly's repetitions
WITHIN = 0.01  # per-repetition spread within a night (1 %: decode on a busy unit)
BETWEEN = 0.025  # night-to-night spread shared by both builds (the issue's 1.5-2.9 %)


def _night(rng: random.Random, test_factor: float, *, shared: Optional[float] = None, base: float = 60.0):
    """One night's per-repetition rates of (test, reference): a shared night factor (clocks, thermal state, load)
    times each repetition's own noise."""
    night = shared if shared is not None else math.exp(rng.gauss(0, BETWEEN))
    rep = lambda: math.exp(rng.gauss(0, WITHIN))  # noqa: E731
    return ([base * test_factor * night * rep() for _ in range(REPS)], [base * night * rep() for _ in range(REPS)])


def test_a_2_percent_step_is_found_on_its_night_at_realistic_noise():
    rng = random.Random(26)
    found = 0
    for _ in range(200):
        test, ref = _night(rng, 0.98)
        v = night_ratio(test, ref, +1, metric="decode_tps")
        found += v.verdict == REGRESSION
    # Night-to-night noise of 2.5 % would hide a 2 % step from any absolute series; the pair shares it.
    assert found / 200 >= 0.9
    test, ref = _night(random.Random(1), 0.98)
    v = night_ratio(test, ref, +1, metric="decode_tps")
    assert v.low <= v.ratio <= v.high and v.ratio == pytest.approx(0.98, abs=0.01)
    assert "test/reference" in v.describe() and "regression" in v.describe()


def test_no_step_gives_no_alarm():
    rng = random.Random(7)
    alarms = sum(night_ratio(*_night(rng, 1.0), +1).verdict == REGRESSION for _ in range(400))
    assert alarms / 400 <= 0.02  # alpha 0.01, one side
    # ... and a change below the threshold is no regression however significant.
    test, ref = [60.0 * (1 + 0.0001 * i) * 0.995 for i in range(10)], [60.0 * (1 + 0.0001 * i) for i in range(10)]
    v = night_ratio(test, ref, +1)
    assert v.p_value < 0.01 and v.verdict == NO_CHANGE and "threshold" in v.reason


def test_a_6x_slower_build_fails_its_first_night_and_lower_is_better_metrics():
    rng = random.Random(3)
    test, ref = _night(rng, 1 / 6)
    assert night_ratio(test, ref, +1).verdict == REGRESSION
    assert night_ratio([x * 1.1 for x in ref], ref, -1).verdict == REGRESSION  # a latency 10 % higher
    assert night_ratio([x * 1.1 for x in ref], ref, +1).verdict == "improvement"
    nothing = night_ratio([60.0], [60.0, 61.0], +1)
    assert nothing.verdict == "no verdict" and "at least 2" in nothing.reason


def test_both_builds_slower_is_an_environment_change_not_the_build():
    rng = random.Random(11)
    _, before = _night(rng, 1.0, shared=1.0)  # the reference's previous control night
    test, ref = _night(rng, 1.0, shared=0.94)  # a JetPack update: both builds 6 % slower tonight
    paired = night_ratio(test, ref, +1, metric="decode_tps")
    shift = reference_shift(before, ref, metric="decode_tps", previous_sweep="s1")
    assert paired.verdict == NO_CHANGE and shift.moved and shift.ratio == pytest.approx(0.94, abs=0.01)
    v = control_verdict("u1", "h1", "Q4_0", paired, shift)
    assert v.verdict == ENV_CHANGE and "not the build" in v.reason and "moved" in v.describe()
    # The build under test slower alone: the reference is steady, the build is blamed.
    test, ref = _night(rng, 0.95, shared=1.0)
    v = control_verdict("u1", "h1", "Q4_0", night_ratio(test, ref, +1), reference_shift(before, ref))
    assert v.verdict == REGRESSION and not v.shift.moved
    # A void control (the reference replaced in place) decides nothing.
    assert control_verdict("u1", "h1", "Q4_0", paired, shift, void="replaced").verdict == "no verdict"


def test_repetitions_from_a_noise_budget():
    n = repetitions_for(0.01, 0.01)  # +-1 % at 1 % spread
    assert n is not None and n > repetitions_for(0.005, 0.01) >= 3
    assert repetitions_for(0.0, 0.01) == 3 and repetitions_for(math.nan) is None and repetitions_for(0.2) is None
    # What it promises holds: at n repetitions per build the interval's half-width is about the target.
    rng = random.Random(5)
    widths = []
    for _ in range(50):
        t = [60 * math.exp(rng.gauss(0, 0.01)) for _ in range(n)]
        r = [60 * math.exp(rng.gauss(0, 0.01)) for _ in range(n)]
        v = night_ratio(t, r, +1)
        widths.append((v.high - v.low) / 2 / v.ratio)
    assert sorted(widths)[25] <= 0.0125


def test_the_noise_budget_grows_with_the_spread_is_bounded_and_falls_back_with_a_reason():
    from jbench.analysis.paired import Spread, noise_budget, within_night_spread

    rng = random.Random(8)

    def nights(cv: float, shifts=(1.0, 0.9, 1.1)) -> dict:
        # Each night's own level (and a 5 % faster reference) must not count: only the spread within a build.
        return {f"s{i}": [[60 * f * math.exp(rng.gauss(0, cv)) for _ in range(8)],
                          [63 * f * math.exp(rng.gauss(0, cv)) for _ in range(8)]] for i, f in enumerate(shifts)}

    quiet, noisy = within_night_spread(nights(0.004), what="decode_tps on u1"), within_night_spread(nights(0.012))
    assert quiet.nights == 3 and quiet.dof == 3 * 2 * 7 and quiet.sd == pytest.approx(0.004, rel=0.3)
    assert noisy.sd == pytest.approx(0.012, rel=0.3)
    small, large = (noise_budget([x], configured=10, half_width=0.01) for x in (quiet, noisy))
    assert small.chosen and large.chosen and 3 <= small.repetitions < large.repetitions <= 30
    assert large.half_width <= 0.01 and "decode_tps on u1" in small.reason and "99 %" in small.reason
    # The noisiest unit x rate decides: every one must reach the target.
    assert noise_budget([quiet, noisy], configured=10, half_width=0.01).repetitions == large.repetitions
    # Bounded: no spread at all is the floor; a spread no count within the bound resolves is the cap, with what
    # the cap reaches instead.
    floor = noise_budget([Spread("x", 0.0, 20, 2)], configured=10, half_width=0.01)
    assert floor.repetitions == 3 and "floor" in floor.reason
    capped = noise_budget([Spread("x", 0.05, 20, 2)], configured=10, half_width=0.01, at_most=30)
    assert capped.repetitions == 30 and "capped at 30" in capped.reason and capped.half_width > 0.01
    assert noise_budget([Spread("x", 0.0, 20, 2)], configured=10, half_width=0.01, at_least=5).repetitions == 5
    # No history, too little of it, or no target: the configured count, with the reason.
    for spreads, half, why in (([], 0.01, "no earlier night"), ([Spread("x", 0.01, 2, 1)], 0.01, "2 degree(s)"),
                               ([noisy], None, "target_interval_pct=null")):
        b = noise_budget(spreads, configured=10, half_width=half)
        assert (b.repetitions, b.chosen) == (10, False) and why in b.reason and b.reason.startswith("configured")
    assert within_night_spread({"s1": [[60.0], [61.0]]}).dof == 0  # one repetition a build: no spread


# --- the control settles the absolute report's alarms (pure) ------------------------------------------------------

T0 = pd.Timestamp("2026-10-01T02:00:00Z")


def _history_with_drop() -> pd.DataFrame:
    wiggle = [1.0, 1.003, 0.998, 1.001, 0.997, 1.002, 0.999, 1.0, 1.002, 0.998]
    values = [60.0 * w for w in wiggle[:8]] + [54.0, 54.1]
    return pd.DataFrame([{"run_id": f"r{i}", "status": "FINISHED", "start_time": T0 + pd.Timedelta(days=i),
                          "tags.jbench.kind": "trial", "tags.jbench.sweep_id": f"s{i:02d}",
                          "tags.jbench.config_hash": "h1", "tags.jbench.trial_label": "model.quant=Q4_0",
                          "tags.device.name": "@cpu", "tags.device.unit": "u1", "metrics.decode_tps": v}
                         for i, v in enumerate(values)])


def test_an_absolute_alarm_is_decided_by_the_pair():
    rng = random.Random(2)
    report = history(_history_with_drop(), metrics=("decode_tps",))
    [alarm] = report.alarms()
    assert report.exit_code == ExitCode.FAILED
    # Both builds dropped tonight: the pair holds, so the absolute drop is no regression of the build.
    paired = night_ratio(*_night(rng, 1.0), +1, metric="decode_tps")
    assert settle_by_control(report, [control_verdict("u1", "h1", "Q4_0", paired)]) == 1
    assert alarm.confirmed is False and "same-night control" in alarm.confirmation and report.exit_code == 0
    # A paired regression confirms it.
    report = history(_history_with_drop(), metrics=("decode_tps",))
    paired = night_ratio(*_night(rng, 0.9), +1, metric="decode_tps")
    settle_by_control(report, [control_verdict("u1", "h1", "Q4_0", paired)])
    assert report.alarms()[0].confirmed is True and report.exit_code == ExitCode.FAILED
    # Another unit's or configuration's verdict settles nothing: the re-measuring confirmation takes it.
    report = history(_history_with_drop(), metrics=("decode_tps",))
    assert settle_by_control(report, [control_verdict("u2", "h1", "Q4_0", paired)]) == 0
    from jbench.analysis.paired import alarms
    assert len(alarms(report)) == 1


# --- the plan and the store (pure) --------------------------------------------------------------------------------


def _trials(rounds: int) -> list[Trial]:
    out = []
    for r in range(1, rounds + 1):
        for quant, h in (("Q4_0", "h1"), ("Q8_0", "h2")):
            config = {"device": {"name": "@cpu"}, "backend": {"name": "llamacpp", "repetitions": 4 // rounds,
                                                               "binary_dir": "/b/test"}, "model": {"quant": quant}}
            out.append(Trial(index=len(out) + 1, config=config, choices={}, point={"model.quant": quant},
                             config_hash=h, round=r, rounds=rounds))
    return out


def test_the_control_plan_is_counterbalanced_with_a_reference_of_its_own():
    plan = Plan(trials=_trials(2), rounds=2, sweep=SweepConfig(rounds=2), tracking=TrackingConfig())
    setup = ctl.setup(plan, "cpu", FarmConfig(reference="/b/ref"), None)
    assert setup.on and setup.covered == ["h1", "h2"] and setup.reference.source == "declared"
    p = ctl.control_plan(plan, setup)
    order = [(t.round, t.config_hash, t.config["backend"]["binary_dir"]) for t in p.trials]
    assert order == [(1, "h1", "/b/test"), (1, "h1-reference", "/b/ref"), (1, "h2", "/b/test"),
                     (1, "h2-reference", "/b/ref"), (2, "h1-reference", "/b/ref"), (2, "h1", "/b/test"),
                     (2, "h2-reference", "/b/ref"), (2, "h2", "/b/test")]  # per configuration: T R R T
    assert [t.index for t in p.trials] == list(range(1, 9))
    assert {t.cfg.backend.binary_dir for t in p.trials if ctl.is_reference_hash(t.config_hash)} == {"/b/ref"}
    assert all(t.point.get("control") == "reference" for t in p.trials if ctl.is_reference_hash(t.config_hash))
    # One round: split into two, so that the pair is still T R R T; critical configurations only.
    plan1 = Plan(trials=_trials(1), rounds=1, sweep=SweepConfig(), tracking=TrackingConfig())
    only = ctl.setup(plan1, "cpu", FarmConfig(reference="/b/ref", control_only=[{"model.quant": "Q8_0"}]), None)
    p = ctl.control_plan(plan1, only)
    assert p.rounds == 2 and p.sweep.rounds == 2
    assert [(t.round, t.config_hash) for t in p.trials] == [(1, "h1"), (1, "h2"), (1, "h2-reference"),
                                                            (2, "h1"), (2, "h2-reference"), (2, "h2")]
    assert {t.config["backend"]["repetitions"] for t in p.trials} == {2}


def _parents(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{"run_id": f"p{i}", "start_time": T0 + pd.Timedelta(days=i),
                          "tags.jbench.sweep_id": f"s{i}", "tags.jbench.nightly.class": "cpu",
                          **{f"tags.{k}": v for k, v in r.items()}}
                         for i, r in enumerate(rows)])


def test_the_reference_is_the_last_accepted_build_and_the_control_runs_every_nth_night():
    plan = Plan(trials=_trials(2), rounds=2, sweep=SweepConfig(rounds=2))
    off = ctl.setup(plan, "cpu", FarmConfig(), None)
    assert not off.on and "--promote-reference" in off.why_off and ctl.control_plan(plan, off) is plan
    assert "farm.reference=null" in ctl.setup(plan, "cpu", FarmConfig(reference=None), None).why_off
    parents = _parents([{ctl.TAG_PROMOTED: "/b/v1", ctl.TAG_PROMOTED_COMMIT: "aaa"}, {ctl.TAG_CONTROL: "on"},
                        {ctl.TAG_PROMOTED: "/b/v2", ctl.TAG_PROMOTED_COMMIT: "bbb", ctl.TAG_CONTROL: "on"},
                        {ctl.TAG_CONTROL: "off: farm.control_every=3"}])
    ref = ctl.accepted_reference(parents, "cpu")
    assert (ref.binary_dir, ref.commit, ref.source, ref.sweep_id) == ("/b/v2", "bbb", "accepted", "s2")
    assert ctl.accepted_reference(parents, "other") is None
    assert ctl.control_due(parents, "cpu", 1) == (True, "")
    assert ctl.control_due(parents, "cpu", 2)[0] is True  # the last control night was 2 nights ago
    due, why = ctl.control_due(parents, "cpu", 3)
    assert not due and "2 night(s) ago" in why
    assert ctl.control_due(parents, "cpu", 0) == (False, "farm.control_every=0")
    assert ctl.control_due(_parents([{}]), "cpu", 5)[0] is True  # never a control night: tonight is the first
    with pytest.raises(ValueError, match="no build directory"):
        engine = [Trial(1, {"backend": {"name": "engine", "command": ["x"]}, "device": {}, "model": {}}, {}, {}, "h")]
        ctl.setup(Plan(trials=engine), "cpu", FarmConfig(reference="/b/ref"), None)


def _store(spreads: dict[str, float], nights: int = 2, reps: int = 5) -> tuple[pd.DataFrame, dict]:
    """Earlier nights' trial runs of configurations (hash -> within-night CV), both builds, and their series."""
    rng = random.Random(12)
    rows, series = [], {}
    for night in range(nights):
        for h, cv in spreads.items():
            for role_hash in (h, ctl.reference_hash(h)):
                run_id = f"{role_hash}-{night}"
                rows.append({"run_id": run_id, "status": "FINISHED", "start_time": T0 + pd.Timedelta(days=night),
                             "tags.jbench.sweep_id": f"s{night}", "tags.jbench.config_hash": role_hash,
                             "tags.device.unit": "u1"})
                series[run_id] = [60 * (1 + night / 10) * math.exp(rng.gauss(0, cv)) for _ in range(reps)]
    return pd.DataFrame(rows), series


def test_the_plan_carries_the_noise_budget_per_configuration():
    plan = Plan(trials=_trials(2), rounds=2, sweep=SweepConfig(rounds=2))
    runs, series = _store({"h1": 0.002, "h2": 0.015})
    asked = []

    def samples(ids, metric):
        asked.append(metric)
        return {i: series[i] for i in ids if i in series} if metric == "decode_tps_rep" else {}

    farm = FarmConfig(reference="/b/ref")
    setup = ctl.setup(plan, "cpu", farm, None)
    chosen = ctl.budgets(plan, setup, farm, runs, samples)
    quiet, noisy = chosen["h1"], chosen["h2"]
    assert quiet.chosen and noisy.chosen and quiet.repetitions < noisy.repetitions <= 30
    assert set(asked) == {"decode_tps_rep", "prefill_tps_rep"} and "decode_tps on u1" in noisy.reason
    p = ctl.control_plan(ctl.with_repetitions(plan, chosen), setup)
    per_trial = {(t.config_hash, t.round): t.cfg.backend.repetitions for t in p.trials}
    assert per_trial[("h2", 1)] == per_trial[("h2-reference", 2)] == math.ceil(noisy.repetitions / 2)
    assert {t.config["backend"]["repetitions"] for t in p.trials if t.config_hash.startswith("h1")} == \
        {math.ceil(quiet.repetitions / 2)}
    assert {t.config_hash for t in p.trials} == {"h1", "h2", "h1-reference", "h2-reference"}  # the series go on
    assert ctl.budget_tags(chosen) == f"h1={quiet.repetitions}; h2={noisy.repetitions}"
    # No earlier night: the configured 4 (2 rounds of 2), unchanged plan, the reason stated.
    fresh = ctl.budgets(plan, setup, farm, None, samples)
    assert {(b.repetitions, b.chosen) for b in fresh.values()} == {(4, False)}
    assert "no earlier night" in fresh["h1"].reason and ctl.with_repetitions(plan, fresh).trials == plan.trials
    assert "(configured)" in ctl.budget_tags(fresh)
    # Only control nights' covered configurations are sized (the budget sizes the paired ratio); null: off.
    only = FarmConfig(reference="/b/ref", control_only=[{"model.quant": "Q8_0"}])
    partial = ctl.budgets(plan, ctl.setup(plan, "cpu", only, None), only, runs, samples)
    assert partial["h2"].chosen and not partial["h1"].chosen and "not covered" in partial["h1"].reason
    off = ctl.budgets(plan, ctl.setup(plan, "cpu", FarmConfig(reference=None), None), farm, runs, samples)
    assert not off["h1"].chosen and "control is off" in off["h1"].reason
    null = FarmConfig(reference="/b/ref", target_interval_pct=None)
    assert "target_interval_pct=null" in ctl.budgets(plan, setup, null, runs, samples)["h2"].reason
    # A wider target needs fewer repetitions; contradictory bounds are refused.
    wide = FarmConfig(reference="/b/ref", target_interval_pct=3.0)
    assert ctl.budgets(plan, setup, wide, runs, samples)["h2"].repetitions < noisy.repetitions
    with pytest.raises(ValueError, match="min_repetitions"):
        ctl.budgets(plan, setup, FarmConfig(reference="/b/ref", min_repetitions=40), runs, samples)
    # Only the newest nights count: an old, noisy night is forgotten.
    old, old_series = _store({"h2": 0.05}, nights=1)
    older = pd.concat([old.assign(**{"tags.jbench.sweep_id": "s-old", "start_time": T0 - pd.Timedelta(days=30),
                                     "run_id": "old-" + old["run_id"]}), runs])
    both = {**{f"old-{k}": v for k, v in old_series.items()}, **series}
    both_samples = lambda ids, m: {i: both[i] for i in ids if i in both} if m == "decode_tps_rep" else {}  # noqa
    assert ctl.budgets(plan, setup, farm, older, both_samples)["h2"].repetitions > noisy.repetitions
    assert ctl.earlier_spreads(older, both_samples, "h2", nights=2)[0].nights == 2
    assert ctl.earlier_spreads(older, both_samples, "h2", nights=2)[0].sd == \
        ctl.earlier_spreads(runs, samples, "h2")[0].sd


@dataclass
class _Outcome:
    trial: Trial
    device: str
    decode: list
    status: Status = Status.FINISHED
    record: Result = field(init=False)
    run_id: str = ""

    def __post_init__(self):
        self.record = Result(stepped={"decode_tps_rep": self.decode})


def test_judging_a_night_from_its_outcomes_and_the_reference_replaced_in_place():
    plan = Plan(trials=_trials(2), rounds=2, sweep=SweepConfig(rounds=2))
    setup = ctl.setup(plan, "cpu", FarmConfig(reference="/b/ref", control_only=[{"model.quant": "Q4_0"}]), None)
    p = ctl.control_plan(plan, setup)
    rng = random.Random(9)
    outcomes = []
    for t in p.trials:
        slow = 0.5 if t.config_hash == "h1" else 1.0  # h1's test build is half as fast
        outcomes.append(_Outcome(t, "u1", [60 * slow * math.exp(rng.gauss(0, 0.01)) for _ in range(2)]))
    [v] = ctl.judge(outcomes, setup, sweep_id="s9")  # h2 is not covered; prefill has no series here
    assert (v.unit, v.config_hash, v.metric, v.verdict) == ("u1", "h1", "decode_tps", REGRESSION)
    assert v.paired.n_test == v.paired.n_reference == 4 and v.shift is not None and not v.shift.moved
    # The reference directory now holds another commit than the one accepted: no verdict, with the reason.
    runs = pd.DataFrame([{"run_id": "x", "status": "FINISHED", "start_time": T0, "tags.jbench.sweep_id": "s9",
                          "tags.jbench.config_hash": "h1-reference", "tags.device.unit": "u1",
                          "tags.backend.binary_dir": "/b/ref", "tags.backend.build_commit": "ccc"}])
    setup.reference = ctl.Reference("/b/ref", "aaa", "accepted", "s1")
    [v] = ctl.judge(outcomes, setup, sweep_id="s9", runs=runs)
    assert v.verdict == "no verdict" and "replaced in place" in v.reason
    # The promotion takes tonight's build under test (one directory for every unit).
    built, why = ctl.tonight_build(runs.assign(**{"tags.jbench.config_hash": "h1", "tags.backend.binary_dir": "/b/t"}))
    assert (built.binary_dir, built.commit, why) == ("/b/t", "ccc", "")
    two = pd.concat([runs.assign(**{"tags.jbench.config_hash": "h1", "tags.backend.binary_dir": d})
                     for d in ("/b/t", "/b/u")])
    assert ctl.tonight_build(two)[0] is None and "different builds" in ctl.tonight_build(two)[1]


def test_a_paired_regression_fails_a_night_without_a_baseline():
    from jbench.sweeps.nightly import NightlyResult, _with_control

    plan = Plan(trials=_trials(2), rounds=2, sweep=SweepConfig(rounds=2))
    setup = ctl.setup(plan, "cpu", FarmConfig(reference="/b/ref"), None)
    rng = random.Random(4)
    outcomes = [_Outcome(t, "u1", [60 * math.exp(rng.gauss(0, 0.01)) for _ in range(5)])
                for t in ctl.control_plan(plan, setup).trials]
    same = ctl.judge(outcomes, setup, sweep_id="s1")
    result = NightlyResult("cpu", "n", "s1", None, "", outcomes, 3, control_verdicts=same, no_verdict_reason="no baseline")
    assert _with_control(ExitCode.NO_VERDICT, result) == ExitCode.OK  # every pair decided: a verdict on night 1
    assert "same-night reference" in result.notes[0]
    for o in outcomes:
        if not ctl.is_reference_hash(o.trial.config_hash):
            o.record = Result(stepped={"decode_tps_rep": [v / 6 for v in o.decode]})
    slow = ctl.judge(outcomes, setup, sweep_id="s1")
    result = NightlyResult("cpu", "n", "s1", None, "", outcomes, 3, control_verdicts=slow)
    assert _with_control(ExitCode.NO_VERDICT, result) == ExitCode.FAILED and result.regressed_units == ["u1"]
    # The night's repetitions per build, and why, are in the markdown and on the parent run.
    from jbench.analysis.paired import NoiseBudget
    from jbench.sweeps.nightly import _control_tags, _markdown

    result.exit_code, result.control = ExitCode.FAILED, setup
    result.budgets = {"h1": NoiseBudget(14, True, "within-night spread 0.90 % ..."),
                      "h2": NoiseBudget(4, False, "configured: no earlier night")}
    assert "- Q4_0 [h1]: 14 repetitions per build (within-night spread 0.90 % ...)" in _markdown(result)
    assert _control_tags(result)[ctl.TAG_REPETITIONS] == "h1=14; h2=4 (configured)"


# --- `jbench nightly` with the control on real llama.cpp runs ------------------------------------------------------

CLASS = "cpu_host"
EXPERIMENT = "paired_nightly"
COMMON = ["telemetry.source=none", "thermal.start_below_c=null"]


def _conf(tmp_path: Path) -> Path:
    # One thread: least disturbed by the processes beside it on a small shared machine.
    return local_class_conf(tmp_path / "conf", CLASS, EXPERIMENT, "one small configuration", rounds=2,
                            backend={"n_prompt": 32, "n_gen": 16, "repetitions": 4, "threads": 1})


def _build_dir(tmp_path: Path, name: str, real_bin: str) -> str:
    d = tmp_path / "builds" / name
    d.mkdir(parents=True)
    (d / "llama-bench").symlink_to(Path(real_bin) / "llama-bench")
    return str(d)


def test_the_nightly_plans_the_control_before_any_device_and_refuses_a_reference_it_cannot_run(tmp_path):
    from jbench.sweeps.nightly import Nightly, NightlyError

    from .gguf_files import unloadable_gguf

    conf, results = _conf(tmp_path), tmp_path / "r"
    unloadable_gguf(tmp_path / "Q4_0.gguf")  # planning reads its header; nothing loads it
    common = [*COMMON, "model.source=files", f"model.path_template='{tmp_path}/{{quant}}.gguf'"]
    job = Nightly(CLASS, experiment=EXPERIMENT, config_dirs=[conf], results_dir=results,
                  overrides=[*common, "backend.binary_dir=/b/test", "farm.reference=/b/ref"])
    assert job.control.on and job.control.reference.binary_dir == "/b/ref"
    # A control night runs farm.control_rounds (4) rounds: T R R T T R R T, the configured repetitions spread.
    assert [(t.round, t.config["backend"]["binary_dir"]) for t in job.plan.trials] == \
        [(1, "/b/test"), (1, "/b/ref"), (2, "/b/ref"), (2, "/b/test"),
         (3, "/b/test"), (3, "/b/ref"), (4, "/b/ref"), (4, "/b/test")]
    assert sum(t.cfg.backend.repetitions for t in job.plan.trials if t.config_hash == job.control.covered[0]) >= 4
    two = Nightly(CLASS, experiment=EXPERIMENT, config_dirs=[conf], results_dir=results,
                  overrides=[*common, "backend.binary_dir=/b/test", "farm.reference=/b/ref", "farm.control_rounds=2"])
    assert [t.round for t in two.plan.trials] == [1, 1, 2, 2]
    off = Nightly(CLASS, experiment=EXPERIMENT, config_dirs=[conf], results_dir=results,
                  overrides=[*common, "farm.reference=/b/ref", "farm.control_every=0"])
    assert not off.control.on and len(off.plan.trials) == 2
    (conf / "experiment" / "engine_nightly.yaml").write_text("# @package _global_\n" + yaml.safe_dump({
        "experiment": {"name": "engine_nightly"}, "model": {"quant": "Q4_0"}}))
    with pytest.raises(NightlyError, match="has no build directory"):
        Nightly(CLASS, experiment="engine_nightly", config_dirs=[conf], results_dir=results,
                overrides=[*common, "backend=engine", "backend.binary=/bin/true", "farm.reference=/b/ref"])
    assert not (results / "mlflow.db").exists()  # nothing was recorded, no device touched


@pytest.mark.slow  # three plans and a SQLite MLflow store: several seconds
def test_the_nightly_sizes_each_configuration_from_its_earlier_nights_in_the_store(tmp_path):
    from mlflow.entities import Metric

    from jbench.sweeps.nightly import Nightly

    from .gguf_files import unloadable_gguf

    conf, results = _conf(tmp_path), tmp_path / "r"
    unloadable_gguf(tmp_path / "Q4_0.gguf")
    common = [*COMMON, "model.source=files", f"model.path_template='{tmp_path}/{{quant}}.gguf'",
              "backend.binary_dir=/b/test", "farm.reference=/b/ref", "farm.control_rounds=2"]
    first = Nightly(CLASS, experiment=EXPERIMENT, config_dirs=[conf], results_dir=results, overrides=common)
    [h] = first.budgets
    assert not first.budgets[h].chosen and "no earlier night" in first.budgets[h].reason
    assert [t.cfg.backend.repetitions for t in first.plan.trials] == [2, 2, 2, 2]  # 4 as configured, over 2 rounds
    # Two earlier nights of this configuration in the store, both builds, 2.5 % within-night spread.
    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    exp = client.create_experiment(EXPERIMENT)
    rng = random.Random(3)
    for night in range(2):
        for role_hash in (h, ctl.reference_hash(h)):
            run = client.create_run(exp, tags={"jbench.kind": "trial", "jbench.sweep_id": f"n{night}",
                                               "jbench.config_hash": role_hash, "jbench.hash_version": "2",
                                               "device.unit": "host1"})
            client.log_batch(run.info.run_id, metrics=[
                Metric("decode_tps_rep", 60 * math.exp(rng.gauss(0, 0.025)), 0, step) for step in range(6)])
            client.set_terminated(run.info.run_id)
    second = Nightly(CLASS, experiment=EXPERIMENT, config_dirs=[conf], results_dir=results, overrides=common)
    b = second.budgets[h]
    assert b.chosen and b.repetitions > 4 and "decode_tps on host1 over 2 night(s), 20 dof" in b.reason
    assert [t.cfg.backend.repetitions for t in second.plan.trials] == [math.ceil(b.repetitions / 2)] * 4
    assert [t.config_hash for t in second.plan.trials] == [h, ctl.reference_hash(h), ctl.reference_hash(h), h] == \
        [t.config_hash for t in first.plan.trials]
    off = Nightly(CLASS, experiment=EXPERIMENT, config_dirs=[conf], results_dir=results,
                  overrides=[*common, "farm.target_interval_pct=null"])
    assert not off.budgets[h].chosen and [t.cfg.backend.repetitions for t in off.plan.trials] == [2, 2, 2, 2]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.alone  # the speed difference of two real builds
def test_the_paired_nightly_fails_a_slow_builds_first_night_and_passes_the_same_build(
        tmp_path, llama_build, bundled_model, nosimd_build):
    from jbench.sweeps.nightly import run_nightly

    conf, results = _conf(tmp_path), tmp_path / "r"
    good, slow = _build_dir(tmp_path, "b-good", llama_build["bin_dir"]), _build_dir(tmp_path, "b-slow", nosimd_build)

    # Night 1: no reference accepted yet (no control); tonight's build is accepted as the reference.
    md = tmp_path / "n1.md"
    res = jbench_cli(["nightly", CLASS, "--experiment", EXPERIMENT, "--config-dir", str(conf), "--markdown", str(md),
                      "--promote-reference", *COMMON, "farm.control_rounds=2", f"backend.binary_dir={good}"],
                     env_extra={"JBENCH_RESULTS_DIR": str(results)})
    assert res.returncode == ExitCode.NO_VERDICT, res.stdout + res.stderr
    text = md.read_text()
    assert "Same-night control: off (no accepted reference build" in text and f"Reference promoted tonight: {good}" in text

    # Night 2: the SIMD-less build under test beside the accepted reference: it fails on its first night.
    junit = tmp_path / "n2.xml"
    night2 = run_nightly(CLASS, experiment=EXPERIMENT, config_dirs=[conf], results_dir=results, junit=junit,
                         overrides=[*COMMON, "farm.control_rounds=2", f"backend.binary_dir={slow}"], confirm=False)
    assert night2.exit_code == ExitCode.FAILED, night2.markdown
    assert night2.control.on and night2.control.reference.binary_dir == good
    decode = next(v for v in night2.control_verdicts if v.metric == "decode_tps")
    assert decode.verdict == REGRESSION and decode.paired.ratio < 0.5 and decode.paired.n_test >= 3, night2.markdown
    assert night2.regressed_units == ["host1"] and "Same-night control: reference build" in night2.markdown
    failed = [c for c in ET.fromstring(junit.read_text()).findall("testcase") if c.find("failure") is not None]
    assert any(c.get("name").endswith("decode_tps vs reference") for c in failed)

    # Night 3: the accepted build itself under test: the pair holds, and the night passes (the absolute series
    # sees a rise against night 2, no regression).
    night3 = run_nightly(CLASS, experiment=EXPERIMENT, config_dirs=[conf], results_dir=results,
                         overrides=[*COMMON, "farm.control_rounds=2", f"backend.binary_dir={good}"], confirm=False)
    assert night3.exit_code == ExitCode.OK, night3.markdown
    decode = next(v for v in night3.control_verdicts if v.metric == "decode_tps")
    assert decode.verdict in (NO_CHANGE, ENV_CHANGE) and 0.9 < decode.paired.ratio < 1.1, night3.markdown

    # The store tells the runs apart: the order T R R T, the reference's own configuration hash, the roles, the
    # promotion and the control on the parent runs.
    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = sorted(client.search_runs([exp.experiment_id], max_results=200), key=lambda r: r.info.start_time)
    trials = [r for r in runs if r.data.tags.get("jbench.kind") == "trial"
              and r.data.tags["jbench.sweep_id"] == night2.sweep_id]
    assert [(r.data.tags["jbench.control"], r.data.tags["backend.binary_dir"]) for r in trials] == \
        [("test", slow), ("reference", good), ("reference", good), ("test", slow)]
    assert {r.data.tags["jbench.config_hash"] for r in trials if r.data.tags["jbench.control"] == "reference"} == \
        {trials[0].data.tags["jbench.config_hash"] + "-reference"}
    parents = {r.data.tags["jbench.sweep_id"]: r.data.tags for r in runs if r.data.tags.get("jbench.kind") == "sweep"}
    first = next(tags for tags in parents.values() if ctl.TAG_PROMOTED in tags)
    assert first[ctl.TAG_PROMOTED] == good and first[ctl.TAG_PROMOTED_COMMIT] == llama_build["build_commit"]
    assert parents[night2.sweep_id][ctl.TAG_CONTROL] == "on" and parents[night2.sweep_id][ctl.TAG_REFERENCE] == good
    assert "decode_tps: regression" in parents[night2.sweep_id][ctl.TAG_VERDICTS]


def _trial_night(rng, *, trial_sd, rep_sd, trials=2, reps=6, test_scale=1.0):
    """One night's trials of each build: every trial has its own level (trial_sd) around the build's, and its
    repetitions scatter around that level (rep_sd)."""
    def build(scale):
        out = []
        for _ in range(trials):
            level = 1000 * scale * math.exp(rng.gauss(0, trial_sd))
            out.append([level * math.exp(rng.gauss(0, rep_sd)) for _ in range(reps)])
        return out
    return build(test_scale), build(1.0)


def test_the_trial_is_the_unit_so_correlated_repetitions_do_not_raise_false_alarms():
    from jbench.analysis.paired import night_ratio, trial_ratio, trial_spread

    rng = random.Random(26)
    history, per_rep, per_trial = [], 0, 0
    for _ in range(200):  # the same build on both sides: every alarm is a false one
        test, ref = _trial_night(rng, trial_sd=0.006, rep_sd=0.007)
        per_rep += night_ratio([v for t in test for v in t], [v for t in ref for v in t], +1).verdict != "no change"
        per_trial += trial_ratio(test, ref, +1, earlier=history[-14:]).verdict != "no change"
        history += [[sum(math.log(v) for v in t) / len(t) for t in side] for side in (test, ref)]
    # Repetitions that share a trial's level look like 12 independent samples to the Welch test.
    assert per_rep > 10 and per_trial <= 6
    sd, dof = trial_spread(history[-14:])
    assert dof == 14 and 0.003 < sd < 0.012


def test_a_trial_level_step_is_found_and_its_interval_uses_the_pooled_spread():
    from jbench.analysis.paired import trial_ratio

    rng = random.Random(5)
    history = []
    for _ in range(7):
        test, ref = _trial_night(rng, trial_sd=0.004, rep_sd=0.005)
        history += [[sum(math.log(v) for v in t) / len(t) for t in side] for side in (test, ref)]
    test, ref = _trial_night(rng, trial_sd=0.004, rep_sd=0.005, test_scale=0.96)
    r = trial_ratio(test, ref, +1, earlier=history)
    assert r.verdict == REGRESSION and r.k_test == r.k_reference == 2 and r.dof == 16
    assert r.low < r.ratio < r.high and r.high < 1
    assert "2+2 trials" in r.describe()
    # Tonight alone (one trial each, no earlier night): no spread to judge by, whatever the ratio.
    alone = trial_ratio(test[:1], ref[:1], +1)
    assert alone.verdict == "no verdict" and "no trial-to-trial spread" in alone.reason
