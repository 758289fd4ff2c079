"""Regression detection over history (jbench.analysis.history): series per unit x configuration x metric from a run
table, change points found by ruptures and tested, environment changes attributed to the fingerprint, no verdict
with too few nights, lower-is-better TTFT, and the JUnit / markdown / HTML outputs. Pure and seeded."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import numpy as np
import pandas as pd
import pytest

from jbench.analysis.history import (CHANGED_ENV, DEFAULT_SETTINGS, IMPROVEMENT, NO_CHANGE, NO_VERDICT, REGRESSION,
                                     DetectorSettings, HistoryError, build_series, detect_changes, history, judge,
                                     max_nights)
from jbench.core.exitcodes import ExitCode

T0 = pd.Timestamp("2026-10-01T02:00:00Z")


def _frame(nights: int, levels: dict, *, cv: float = 0.003, seed: int = 0, tags_at: dict | None = None,
           rounds: int = 1) -> pd.DataFrame:
    """`nights` nightly sweeps; levels {(unit, config): f(night) -> {metric: value}}; each value gets N(0, cv)
    noise; tags_at {night: {tag: value}} from that night on (every unit and configuration)."""
    rng = np.random.default_rng(seed)
    rows = []
    tags = {"jetson.jetpack": "6.2", "backend.build_commit": "abc123", "model.sha256": "f00d"}
    for night in range(nights):
        tags.update((tags_at or {}).get(night, {}))
        sweep = f"sweep{night:02d}"
        for j, ((unit, config), f) in enumerate(sorted(levels.items())):
            for r in range(rounds):
                row = {"run_id": f"{sweep}-{unit}-{config}-{r}", "experiment": "nightly", "status": "FINISHED",
                       "start_time": T0 + pd.Timedelta(days=night, minutes=j * rounds + r),
                       "tags.jbench.kind": "trial", "tags.jbench.sweep_id": sweep,
                       "tags.jbench.config_hash": config, "tags.jbench.trial_label": f"cfg {config}",
                       "tags.device.name": "@orin", "tags.device.unit": unit,
                       **{f"tags.{k}": v for k, v in tags.items()}}
                for metric, value in f(night).items():
                    row[f"metrics.{metric}"] = value * (1 + cv * rng.standard_normal())
                rows.append(row)
    return pd.DataFrame(rows)


def flat(decode: float = 40.0, prefill: float = 800.0):
    return lambda n: {"decode_tps": decode, "prefill_tps": prefill}


def test_series_per_unit_configuration_and_metric_in_night_order():
    df = _frame(5, {("u1", "h1"): flat(40), ("u1", "h2"): flat(20), ("u2", "h1"): flat(35)}, rounds=2)
    df = df.sample(frac=1.0, random_state=1)  # the frame's order must not matter
    series = build_series(df, metrics=("decode_tps", "prefill_tps", "ttft_ms_p50"))
    keys = sorted((s.unit, s.config_hash, s.metric) for s in series)
    # TTFT was never measured: no series, so no verdict is expected of it.
    assert keys == sorted((u, h, m) for u, h in (("u1", "h1"), ("u1", "h2"), ("u2", "h1"))
                          for m in ("decode_tps", "prefill_tps"))
    s = next(s for s in series if (s.unit, s.config_hash, s.metric) == ("u2", "h1", "decode_tps"))
    assert [n.sweep_id for n in s.nights] == [f"sweep{i:02d}" for i in range(5)]
    assert all(n.n_runs == 2 for n in s.nights)  # two rounds a night: one point, their mean
    assert s.values == pytest.approx([35] * 5, rel=0.02)
    assert max_nights(df) == 5
    # current: only the configurations measured in that sweep, their history up to it.
    upto = build_series(df, metrics=("decode_tps",), current="sweep02")
    assert {len(s.nights) for s in upto} == {3}
    with pytest.raises(HistoryError, match="nope"):
        build_series(df, current="nope")
    with pytest.raises(HistoryError, match="unknown metric"):
        build_series(df, metrics=("decode_tokens",))


def test_a_real_step_is_found_on_its_night_and_unit_with_effect_ci_and_p():
    levels = {("u1", "h1"): flat(40), ("u2", "h1"): lambda n: {"decode_tps": 40.0 if n < 12 else 38.0,
                                                                "prefill_tps": 800.0}}
    rep = history(_frame(14, levels, cv=0.003, seed=3))
    by = {(r.series.unit, r.series.metric): r for r in rep.results}
    hit = by[("u2", "decode_tps")]
    assert hit.verdict == REGRESSION
    c = hit.deciding
    assert c.sweep_id == "sweep12" and c.date == "2026-10-13" and c.index == 12
    assert c.effect == pytest.approx(-0.05, abs=0.01) and c.ci_low < c.effect < c.ci_high < 0
    assert c.p_value < DEFAULT_SETTINGS.alpha and c.fingerprint_changes == ()
    assert all(r.verdict == NO_CHANGE for k, r in by.items() if k != ("u2", "decode_tps"))
    assert rep.exit_code == ExitCode.FAILED and rep.regressed_units == ["u2"]
    assert [r.series.unit for r in rep.alarms()] == ["u2"]
    # A confirmation step that does not confirm it clears the alarm (the later confirmation plugs in here).
    hit.confirmed = False
    assert rep.exit_code == 0


def test_no_alarm_on_pure_noise_seeded():
    rng = np.random.default_rng(15)
    alarms = evaluations = 0
    for _ in range(40):
        y = 40 * (1 + 0.01 * rng.standard_normal(30))
        for k in range(DEFAULT_SETTINGS.min_nights, 31):
            verdict, _, _ = judge(y[:k])
            evaluations += 1
            alarms += verdict in (REGRESSION, IMPROVEMENT)
    assert evaluations == 40 * (31 - DEFAULT_SETTINGS.min_nights)
    assert alarms / evaluations <= 0.01, alarms


def test_an_environment_change_is_reported_as_such_not_blamed_on_code():
    levels = {("u1", "h1"): lambda n: {"decode_tps": 40.0 if n < 10 else 36.0, "prefill_tps": 800.0}}
    rep = history(_frame(12, levels, seed=4, tags_at={10: {"jetson.jetpack": "6.1", "power.mode_actual": "15W"}}))
    r = next(r for r in rep.results if r.series.metric == "decode_tps")
    assert r.verdict == CHANGED_ENV
    assert any(f.startswith("jetson.jetpack 6.2 -> 6.1") for f in r.deciding.fingerprint_changes)
    assert any(f.startswith("power.mode_actual (none) -> 15W") for f in r.deciding.fingerprint_changes)
    assert rep.exit_code == 0  # reported, not a code regression
    md = rep.to_markdown()
    assert "| changed-environment | u1 |" in md and "fingerprint changed: jetson.jetpack 6.2 -> 6.1" in md
    # The same drop without the fingerprint change is a regression.
    plain = history(_frame(12, levels, seed=4))
    assert next(r for r in plain.results if r.series.metric == "decode_tps").verdict == REGRESSION


def test_too_few_nights_is_no_verdict_with_how_many_more():
    rep = history(_frame(5, {("u1", "h1"): flat()}))
    assert {r.verdict for r in rep.results} == {NO_VERDICT}
    need = DEFAULT_SETTINGS.min_nights - 5
    assert {r.needs_nights for r in rep.results} == {need}
    assert rep.exit_code == ExitCode.NO_VERDICT
    assert f"needs {need} more" in rep.results[0].message
    assert f"up to {need} more night(s)" in rep.verdict_reason
    assert history(_frame(DEFAULT_SETTINGS.min_nights, {("u1", "h1"): flat()})).exit_code == 0


def test_ttft_is_lower_is_better():
    def f(n):
        return {"decode_tps": 40.0, "ttft_ms_p50": 120.0 if n < 10 else 132.0}  # TTFT up 10 %: worse

    rep = history(_frame(12, {("u1", "h1"): f}, seed=5), metrics=("decode_tps", "ttft_ms_p50"))
    ttft = next(r for r in rep.results if r.series.metric == "ttft_ms_p50")
    assert ttft.verdict == REGRESSION and ttft.deciding.effect == pytest.approx(0.10, abs=0.02)

    def g(n):
        return {"decode_tps": 40.0 if n < 10 else 44.0, "ttft_ms_p50": 120.0 if n < 10 else 108.0}

    better = history(_frame(12, {("u1", "h1"): g}, seed=6), metrics=("decode_tps", "ttft_ms_p50"))
    assert {r.series.metric: r.verdict for r in better.results} == {"decode_tps": IMPROVEMENT,
                                                                     "ttft_ms_p50": IMPROVEMENT}
    assert better.exit_code == 0


def test_detector_settings_and_old_changes():
    # A change long ago is listed but does not decide tonight's verdict.
    y = [40.0] * 8 + [36.0] * 12
    y = list(np.array(y) * (1 + 0.003 * np.random.default_rng(7).standard_normal(20)))
    verdict, changes, _ = judge(y)
    assert verdict == NO_CHANGE and [c.index for c in changes] == [8] and changes[0].direction == REGRESSION
    assert detect_changes([40.0] * 20) == []  # identical nights: nothing
    with pytest.raises(HistoryError):
        DetectorSettings(test="z")
    with pytest.raises(HistoryError):
        DetectorSettings(min_size=3, min_nights=4)


def test_junit_and_markdown_shape():
    levels = {("u1", "h1"): flat(40), ("u2", "h1"): lambda n: {"decode_tps": 40.0 if n < 10 else 37.0,
                                                                "prefill_tps": 800.0}}
    df = _frame(12, levels, seed=8)
    young = _frame(3, {("u3", "h9"): flat()}, seed=9).assign(
        start_time=lambda d: d["start_time"] + pd.Timedelta(days=9),
        **{"tags.jbench.sweep_id": lambda d: d["tags.jbench.sweep_id"].str.replace("sweep", "late")})
    rep = history(pd.concat([df, young], ignore_index=True))
    suite = ET.fromstring(rep.to_junit_xml("jbench.nightly.orin"))
    cases = suite.findall("testcase")
    assert len(cases) == 3 * 2  # unit x configuration x metric
    assert suite.get("tests") == "6" and suite.get("failures") == "1" and suite.get("skipped") == "2"
    failed = [c for c in cases if c.find("failure") is not None]
    assert [(c.get("classname"), c.get("name")) for c in failed] == [("jbench.nightly.orin.u2",
                                                                       "cfg h1 [h1] decode_tps")]
    assert "regression from night 11 (sweep10" in failed[0].find("failure").get("message")
    skipped = [c for c in cases if c.find("skipped") is not None]
    assert {c.get("classname") for c in skipped} == {"jbench.nightly.orin.u3"}
    assert rep.exit_code == ExitCode.FAILED  # a regression wins over no verdict
    md = rep.to_markdown().splitlines()
    assert md[0] == "# jbench regress (history): FAIL: performance regression on u2"
    rows = [line for line in md if line.startswith("| ")][1:]  # after the header
    assert len(rows) == 6 and rows[0].startswith("| regression | u2 | cfg h1 `h1` | decode_tps | 12 |")
    assert any(r.startswith("| no verdict | u3 |") and "needs" in r for r in rows)
    d = rep.to_dict()
    assert d["exit_code"] == 1 and d["counts"] == {"regression": 1, "no change": 3, "no verdict": 2}


def test_html_report_plots_series_change_points_and_noise_band(tmp_path):
    from jbench.reporting.history import build_history_report

    levels = {("u1", "h1"): lambda n: {"decode_tps": 40.0 if n < 10 else 37.0, "prefill_tps": 800.0}}
    rep = history(_frame(12, levels, seed=10))
    files = build_history_report(rep, out_dir=tmp_path / "h")
    assert files.html_path.read_text().count("data:image/png;base64,") == 1  # one unit x configuration
    assert "regression from night 11" in files.html_path.read_text()
    png = next(iter(files.pngs.values()))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.e2e  # a jbench CLI subprocess
def test_regress_history_mode_refuses_a_baseline_before_reading_anything(tmp_path):
    from .conftest import jbench_cli

    res = jbench_cli(["regress", "--mode", "history", "--baseline", "last"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "none")})
    assert res.returncode == 2 and "--baseline chooses the pairwise comparison" in res.stderr, res.stderr
    assert not (tmp_path / "none").exists()
