"""Confirmation of a nightly alarm (jbench.analysis.paired, jbench.confirm): which builds are interleaved, the
paired test that decides, and `jbench nightly` confirming on real llama.cpp runs -- a real regression (the cached
build followed by the SIMD-less build, about 5x slower) is confirmed and fails the night; a drop that came from load
on the machine, not from the new build, is measured again without the load and cleared."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from jbench.analysis.paired import ConfirmSettings, paired_change, targets
from jbench.analysis.history import CHANGED_ENV, DEFAULT_SETTINGS, REGRESSION, history

from .local_class import local_class_conf
from .conftest import jbench_cli

# --- the paired test (pure) -----------------------------------------------------------------------------------


def test_a_clear_drop_is_confirmed_with_its_interval():
    a = [60.0, 61.0, 59.5, 60.5, 60.2, 59.8]
    b = [x * 0.95 for x in a]
    c = paired_change(a, b, +1, metric="decode_tps")
    assert c.confirmed and c.worse and c.n_pairs == 6
    assert c.change == pytest.approx(-0.05) and c.ci_low <= -0.05 <= c.ci_high and c.p_value < 0.01
    assert "confirmed" in c.describe() and "-5.00 %" in c.describe()


def test_no_difference_small_difference_and_better_are_not_confirmed():
    a = [60.0, 61.0, 59.5, 60.5, 60.2, 59.8]
    same = paired_change(a, [59.7, 60.6, 59.6, 60.9, 59.9, 59.5], +1)  # a little lower, within the noise
    assert not same.confirmed and "not significant" in same.reason
    tiny = paired_change(a, [x * 0.995 for x in a], +1, min_effect=0.01)  # significant, below the threshold
    assert not tiny.confirmed and tiny.p_value < 0.01 and "threshold" in tiny.reason
    better = paired_change(a, [x * 1.1 for x in a], +1)
    assert not better.confirmed and not better.worse and "not worse" in better.reason


def test_lower_is_better_metrics_and_incomplete_pairs():
    # TTFT: higher is worse.
    assert paired_change([100.0, 102, 99, 101], [120.0, 121, 119, 122], -1).confirmed
    assert not paired_change([100.0, 102, 99, 101], [80.0, 81, 79, 82], -1).confirmed
    # A round that lost one side is left out; fewer than 3 complete pairs decide nothing.
    c = paired_change([60.0, math.nan, 61.0], [30.0, 31.0, math.nan], +1)
    assert c.n_pairs == 1 and not c.confirmed and "at least 3" in c.reason


def test_settings_are_checked():
    assert ConfirmSettings().problems() == []
    assert len(ConfirmSettings(pairs=2, alpha=0.7, min_effect=-1, repetitions=0).problems()) == 4


# --- which builds (pure) --------------------------------------------------------------------------------------

T0 = pd.Timestamp("2026-10-01T02:00:00Z")


def _runs(dirs: list[str], commits: list[str], decode: list[float], *, jetpack: list[str] | None = None) -> pd.DataFrame:
    rows = []
    for i, (d, c, v) in enumerate(zip(dirs, commits, decode)):
        rows.append({"run_id": f"r{i}", "status": "FINISHED", "start_time": T0 + pd.Timedelta(days=i),
                     "tags.jbench.kind": "trial", "tags.jbench.sweep_id": f"s{i:02d}", "tags.jbench.config_hash": "h1",
                     "tags.jbench.trial_label": "model.quant=Q4_0", "tags.device.name": "@cpu", "tags.device.unit": "u1",
                     "tags.backend.binary_dir": d, "tags.backend.build_commit": c,
                     "tags.jetson.jetpack": (jetpack or ["6.2"] * len(dirs))[i], "metrics.decode_tps": v})
    return pd.DataFrame(rows)


def _drop(n_good: int = 8, n_bad: int = 2) -> list[float]:
    wiggle = [1.0, 1.003, 0.998, 1.001, 0.997, 1.002, 0.999, 1.0, 1.002, 0.998]
    return [60.0 * wiggle[i % 10] for i in range(n_good)] + [30.0 * wiggle[i % 10] for i in range(n_bad)]


def test_targets_take_the_build_of_the_night_before_the_change_and_the_newest():
    dirs = ["/b/old"] * 8 + ["/b/new"] * 2
    df = _runs(dirs, ["aaa"] * 8 + ["bbb"] * 2, _drop())
    report = history(df, metrics=("decode_tps",))
    [alarm] = report.alarms()
    # A new build alone is the code under test: a regression, with the build named as the suspect.
    assert alarm.verdict == REGRESSION and "build is the suspect" in alarm.message
    found, skipped = targets(report, df)
    assert skipped == [] and len(found) == 1
    t = found[0]
    assert (t.unit, t.config_hash, t.metrics) == ("u1", "h1", ["decode_tps"])
    assert (t.previous.binary_dir, t.previous.commit, t.previous.sweep_id) == ("/b/old", "aaa", "s07")
    assert (t.new.binary_dir, t.new.commit, t.new.sweep_id) == ("/b/new", "bbb", "s09")


def test_no_target_when_the_build_did_not_change_or_was_replaced_in_place():
    same = _runs(["/b/x"] * 10, ["aaa"] * 10, _drop())
    _, [skip] = targets(history(same, metrics=("decode_tps",)), same)
    assert "did not change" in skip.reason
    replaced = _runs(["/b/x"] * 10, ["aaa"] * 8 + ["bbb"] * 2, _drop())
    _, [skip] = targets(history(replaced, metrics=("decode_tps",)), replaced)
    assert "replaced in place" in skip.reason and "one directory per build" in skip.reason
    unknown = _runs([""] * 10, ["aaa"] * 10, _drop())
    _, [skip] = targets(history(unknown, metrics=("decode_tps",)), unknown)
    assert "backend.binary_dir" in skip.reason


def test_two_sweep_alarms_are_confirmed_per_configuration():
    """The two-sweep gate (a configuration's first nights): its regression is confirmed when any alarmed rate is,
    and one that is not confirmed leaves the exit code and the JUnit failures."""
    from jbench.analysis.paired import alarms, settle
    from jbench.analysis.regress import regress

    df = _runs(["/b/old"] * 3 + ["/b/new"], ["aaa"] * 3 + ["bbb"], [60.0, 60.2, 59.9, 30.0])
    reps = {r: [v * f for f in (0.99, 1.0, 1.01, 1.005, 0.995, 0.998)]
            for r, v in zip(df["run_id"], df["metrics.decode_tps"])}
    report = regress(df, {"decode_tps_rep": reps}, baseline="last", metrics=("decode_tps",))
    assert report.exit_code == 1
    [alarm] = alarms(report)
    assert (alarm.unit, alarm.before_sweep, alarm.newest_sweep, alarm.metrics) == ("u1", "s02", "s03", ["decode_tps"])
    [target], _ = targets(report, df)
    assert (target.previous.binary_dir, target.new.binary_dir) == ("/b/old", "/b/new")
    a = [60.0, 60.5, 59.5, 60.2]
    settle(alarm, [paired_change(a, [x * 1.001 for x in a], +1, metric="decode_tps")])
    [r] = report.results
    assert r.confirmed is False and report.exit_code == 0 and "not confirmed" in r.message
    assert ET.fromstring(report.to_junit_xml()).get("failures") == "0"
    settle(alarm, [paired_change(a, [x * 0.5 for x in a], +1, metric="decode_tps")])
    assert r.confirmed is True and report.exit_code == 1


def test_an_environment_change_is_no_alarm_to_confirm():
    df = _runs(["/b/old"] * 8 + ["/b/new"] * 2, ["aaa"] * 8 + ["bbb"] * 2, _drop(),
               jetpack=["6.2"] * 8 + ["6.1"] * 2)
    report = history(df, metrics=("decode_tps",))
    assert [r.verdict for r in report.results] == [CHANGED_ENV] and report.alarms() == []
    assert targets(report, df) == ([], [])


def test_the_confirmation_sweep_is_a_b_a_b_on_the_alarmed_unit_alone():
    from jbench.analysis.paired import Alarm, BuildRef, Target
    from jbench.sweeps.confirm import BUILD_KEY, confirmation_plan
    from jbench.runner.units import Pool
    from jbench.core.schema import SweepConfig, TrackingConfig
    from jbench.core.trial import Trial
    from jbench.sweeps.plan import Plan

    config = {"device": {"name": "@orin"}, "backend": {"name": "llamacpp", "repetitions": 5}, "model": {}}
    trials = [Trial(index=i + 1, config=config, choices={}, point={"model.quant": "Q4_0"}, config_hash="h1", round=r,
                    rounds=2) for i, r in enumerate((1, 2))]
    farm = Pool("orin", coordinator="127.0.0.1:20408", selector={"class": "orin"}, count=None)
    nightly = Plan(trials=trials, tracking=TrackingConfig(experiment_name="nightly"), sweep=SweepConfig(rounds=2),
                   rounds=2, pool=farm)
    alarm = Alarm("u2", "h1", "Q4_0", ["decode_tps"], "s1", "s2")
    target = Target(alarm, BuildRef("/b/a", "aaa", "s1"), BuildRef("/b/b", "bbb", "s2"), "place-u2")
    p = confirmation_plan(nightly, target, ConfirmSettings(pairs=3), "nightly-confirm")
    assert [(t.round, t.point[BUILD_KEY], t.config["backend"]["binary_dir"]) for t in p.trials] == \
        [(r, w, d) for r in (1, 2, 3) for w, d in (("previous", "/b/a"), ("new", "/b/b"))]
    # The nightly split 5 repetitions over 2 rounds: each confirmation trial measures all of them.
    assert {t.config["backend"]["repetitions"] for t in p.trials} == {10} and {t.config_hash for t in p.trials} == {"h1"}
    assert p.pool.selector == {"class": "orin", "name": "place-u2"} and p.pool.count == 1
    assert p.tracking.experiment_name == "nightly-confirm" and p.sweep.rerun is True and p.sweep.rounds == 3
    with pytest.raises(LookupError, match="farm place"):  # never another unit of the class
        confirmation_plan(nightly, Target(alarm, target.previous, target.new, None),
                          ConfirmSettings(), "x")
    entries = Pool("orin", members=[{"name": "u1"}, {"name": "u2"}])
    p = confirmation_plan(Plan(trials=trials, pool=entries), target, ConfirmSettings(), "x")
    assert p.pool.members == [{"name": "u2"}]


# --- `jbench nightly` confirming on real llama.cpp runs -------------------------------------------------------

CLASS = "cpu_host"
EXPERIMENT = "confirm_nightly"
COMMON = ["telemetry.source=none", "thermal.start_below_c=null"]


def _conf(tmp_path: Path) -> Path:
    # This machine as a unit of a device class (the nightly runs device=@cpu_host); one thread: on a small shared
    # machine one thread is least disturbed by the processes beside it.
    return local_class_conf(tmp_path / "conf", CLASS, EXPERIMENT, "one small configuration",
                            backend={"n_prompt": 16, "n_gen": 16, "repetitions": 3, "threads": 1})


def _build_dir(tmp_path: Path, name: str, real_bin: str) -> str:
    """A build directory of its own (what a lab keeps per build) holding the real llama-bench."""
    d = tmp_path / "builds" / name
    d.mkdir(parents=True)
    (d / "llama-bench").symlink_to(Path(real_bin) / "llama-bench")
    return str(d)


class _Load:
    """Busy loops, four per core, while started: the machine is loaded during the measurement (llama-bench gets
    about a quarter of a core)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        # Each in a session of its own, as other programs on a machine are: with the kernel's autogroup
        # scheduling, CPU time is shared between sessions, and llama-bench runs in a session of its own.
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                      for _ in range(4 * (os.cpu_count() or 2))]

    def stop(self, *_: object) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
        self.procs = []


def _nights(conf: Path, results: Path, builds: list[str], load_from: int | None = None, **kwargs) -> list:
    from jbench.sweeps.nightly import run_nightly

    load, out = _Load(), []
    try:
        for night, build in enumerate(builds, start=1):
            if load_from is not None and night >= load_from:
                load.start()
            # The load ends with the night's trial, before the confirmation measures again.
            out.append(run_nightly(CLASS, experiment=EXPERIMENT, config_dirs=[conf], results_dir=results,
                                   overrides=[*COMMON, f"backend.binary_dir={build}"], on_trial_end=load.stop,
                                   **kwargs))
    finally:
        load.stop()
    return out


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.alone  # the speed difference of two real builds
def test_nightly_confirms_a_real_regression_on_real_builds(tmp_path, llama_build, bundled_model, nosimd_build):
    conf, results = _conf(tmp_path), tmp_path / "r"
    good, slow = _build_dir(tmp_path, "b-good", llama_build["bin_dir"]), _build_dir(tmp_path, "b-new", nosimd_build)
    n = DEFAULT_SETTINGS.min_nights
    first = _nights(conf, results, [good] * n)
    assert first[-1].mode == "history" and first[-1].exit_code == 0, first[-1].markdown
    # Two nights with the new (SIMD-less) build: the drop has lasted long enough to be a change; the nightly
    # CLI is the second one.
    _nights(conf, results, [slow])
    junit, md = tmp_path / "n.xml", tmp_path / "n.md"
    res = jbench_cli(["nightly", CLASS, "--experiment", EXPERIMENT, "--config-dir", str(conf), "--junit", str(junit),
                      "--markdown", str(md), "--confirm-pairs", "4", *COMMON, f"backend.binary_dir={slow}"],
                     env_extra={"JBENCH_RESULTS_DIR": str(results)})
    assert res.returncode == 1, res.stdout + res.stderr
    text = md.read_text()
    assert text.splitlines()[0] == f"# jbench nightly {CLASS}: FAIL: performance regression on host1", text
    assert "Confirmation (" in text and "host1 " in text
    line = next(x for x in text.splitlines() if x.startswith("- host1"))
    assert ": confirmed (previous " in line and good in line and slow in line and "decode_tps: previous" in line
    assert "over 4 pairs" in line and ": confirmed" in line.split("decode_tps:")[1]
    failed = [c for c in ET.fromstring(junit.read_text()).findall("testcase") if c.find("failure") is not None]
    assert {c.get("name").rsplit(" ", 1)[1] for c in failed} >= {"decode_tps"}
    assert all("confirmation: decode_tps" in c.find("system-out").text or "prefill" in c.get("name") for c in failed)

    # The confirmation's runs: their own experiment, A B A B on the unit, each with its build directory.
    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    exp = client.get_experiment_by_name(f"{EXPERIMENT}-confirm")
    runs = sorted(client.search_runs([exp.experiment_id], max_results=100), key=lambda r: r.info.start_time)
    trials = [r for r in runs if r.data.tags.get("jbench.kind") == "trial"]
    assert [r.data.tags["backend.binary_dir"] for r in trials] == [good, slow] * 4
    assert all(r.data.tags["device.unit"] == "host1" and r.info.status == "FINISHED" for r in trials)
    decode = [r.data.metrics["decode_tps"] for r in trials]
    assert all(b < a / 2 for a, b in zip(decode[::2], decode[1::2]))  # the SIMD-less build is much slower
    parent = next(r for r in runs if r.data.tags.get("jbench.kind") == "sweep")
    assert parent.data.tags["confirm.status"] == "confirmed" and parent.data.tags["confirm.unit"] == "host1"
    # ... and none of them is a night of the nightly's history.
    nightly = client.get_experiment_by_name(EXPERIMENT)
    sweeps = [r for r in client.search_runs([nightly.experiment_id], max_results=1000)
              if r.data.tags.get("jbench.kind") == "sweep"]
    assert len(sweeps) == n + 2
    newest = max(sweeps, key=lambda r: r.info.start_time)
    assert "confirmed" in newest.data.tags["jbench.nightly.confirmations"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.alone  # a drop from the load it makes, which the unloaded confirmation must not see
def test_a_drop_from_load_is_cleared_by_the_confirmation(tmp_path, llama_build, bundled_model):
    conf, results = _conf(tmp_path), tmp_path / "r"
    good = _build_dir(tmp_path, "b-good", llama_build["bin_dir"])
    new = _build_dir(tmp_path, "b-new", llama_build["bin_dir"])  # another build, as fast as the first
    n = DEFAULT_SETTINGS.min_nights
    # The new build's first two nights run while the machine is loaded: the history sees a drop.
    out = _nights(conf, results, [good] * n + [new] * 2, load_from=n + 1, confirm_settings=ConfirmSettings(pairs=4))
    last = out[-1]
    assert last.mode == "history"
    regressions = [r for r in last.regress.results if r.verdict == REGRESSION]
    assert regressions, last.markdown  # detection saw the loaded nights as a regression ...
    [c] = last.confirmations
    assert c.status == "not confirmed", last.markdown  # ... which the unloaded A B A B does not reproduce
    assert all(r.confirmed is False for r in regressions)
    assert last.exit_code == 0 and last.regressed_units == [], last.markdown
    assert "OK: no regression" in last.markdown.splitlines()[0]
    assert "not confirmed" in last.markdown and "confirmation: " in last.junit_xml
