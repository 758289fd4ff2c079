"""The insight commands end to end on real sweeps: report, compare, regress, export, roofline, telemetry parse."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from .conftest import DATA, jbench_cli

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def two_sweeps(tmp_path_factory, bundled_model):
    results = tmp_path_factory.mktemp("results")
    env = {"JBENCH_RESULTS_DIR": str(results)}
    sweeps = []
    for _ in range(2):
        res = jbench_cli(["sweep", "+experiment=quant_ladder", "model.quant=Q4_0,Q8_0", "backend.n_prompt=16",
                          "backend.n_gen=4", "backend.repetitions=3", "sweep.rerun=true", "device.bandwidth_gbs=30",
                          # exactly 3 samples a side (no settle repetition that may or may not be set aside)
                          "quality.enabled=false", "backend.settle_repetitions=0"],
                         env_extra=env)
        assert res.returncode == 0, res.stdout + res.stderr
        sweeps.append(re.search(r"sweep (\d{8}-\d{6}-[0-9a-f]{6})", res.stdout).group(1))
    return results, env, sweeps


def test_roofline_metrics_on_every_trial(two_sweeps):
    results, env, _ = two_sweeps
    out = results / "runs.csv"
    res = jbench_cli(["export", "--experiment", "quant_ladder", "--out", str(out)], env_extra=env)
    assert res.returncode == 0, res.stderr
    df = pd.read_csv(out)
    assert len(df) == 4
    assert (df["metrics.roofline_decode_tps"] > 0).all() and (df["metrics.roofline_fraction"] > 0).all()
    assert set(df["tags.roofline.bandwidth_source"]) == {"device.bandwidth_gbs"}
    assert df["metrics.roofline_weight_bytes_per_token"].nunique() == 2  # Q4_0 and Q8_0 differ
    pq = results / "runs.parquet"
    assert jbench_cli(["export", "--experiment", "quant_ladder", "--out", str(pq)], env_extra=env).returncode == 0
    assert len(pd.read_parquet(pq)) == 4


def test_compare_two_sweeps(two_sweeps):
    _, env, (a, b) = two_sweeps
    res = jbench_cli(["compare", a, b, "--json"], env_extra=env)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    rows = data["rows"] if "rows" in data else data["table"]
    assert len({r["config_hash"] for r in rows}) == 2
    assert all("p_value" in r and "change_pct" in r for r in rows)
    res = jbench_cli(["compare", a, "jbench.kind=nothing"], env_extra=env)
    assert res.returncode == 2 and "selects no trial runs" in res.stderr


def _repetitions(results: Path, sweep: str, metric: str) -> dict[str, list[float]]:
    """{quant: the metric's per-repetition values} of a sweep's runs, read from MLflow itself."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    exp = client.get_experiment_by_name("quant_ladder")
    runs = client.search_runs([exp.experiment_id],
                              f"tags.`jbench.sweep_id` = '{sweep}' and tags.`jbench.kind` = 'trial'")
    return {r.data.params["model.quant"]: [m.value for m in sorted(client.get_metric_history(r.info.run_id, metric),
                                                                   key=lambda m: m.step)] for r in runs}


def test_compare_two_quants_of_one_sweep(two_sweeps):
    """The quant ladder's question on one sweep: Q4_0 against Q8_0 with everything else held equal (it was 'no
    configuration in common'). At the default 3 repetitions every verdict is its interval's, no bound reaches
    -100 % (0 tok/s), and the output says which change 3 vs 3 samples could have detected."""
    import numpy as np
    from scipy import stats

    results, env, (_, b) = two_sweeps
    res = jbench_cli(["compare", "model.quant=Q4_0", "model.quant=Q8_0", "--sweep", b, "--json"], env_extra=env)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["along"] == ["model.quant"] and data["not_held_equal"] == [] and data["only_in_a"] == []
    rows = {r["metric"]: r for r in data["rows"]}
    assert set(rows) == {"prefill_tps", "decode_tps"}
    for metric, r in rows.items():
        assert r["label"] == "Q4_0 → Q8_0" and r["config_hash"] != r["config_hash_b"]
        assert (r["n_a"], r["n_b"]) == (3, 3) and r["test"] == "welch-t-log"
        assert -100 < r["ci_low_pct"] <= r["change_pct"] <= r["ci_high_pct"]
        assert r["significant"] == (r["ci_low_pct"] > 0 or r["ci_high_pct"] < 0) == (r["p_value"] < 0.05)
        assert 0 < r["detectable_drop_pct"] < 100 and r["detectable_pct"] > 0
        # the figures are the recorded repetitions' own: Welch's t test on their logs
        reps = _repetitions(results, b, f"{metric}_rep")
        ref = stats.ttest_ind(np.log(reps["Q8_0"]), np.log(reps["Q4_0"]), equal_var=False)
        assert r["p_value"] == pytest.approx(ref.pvalue, rel=1e-9)
        ci = ref.confidence_interval(0.95)
        assert r["ci_low_pct"] == pytest.approx(100 * (np.exp(ci.low) - 1), rel=1e-9, abs=1e-9)
    # In a terminal 80 columns wide, said in words.
    res = jbench_cli(["compare", "model.quant=Q4_0", "model.quant=Q8_0", "--sweep", b],
                     env_extra={**env, "COLUMNS": "80"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Along model.quant: each configuration of A against the one of B")
    assert "Smallest detectable change at these sample sizes (3 vs 3) and the noise measured: -" in res.stdout
    assert "| Q4_0 → Q8_0 | local | decode_tps | 3 | 3 |" in res.stdout


def _in_tmux(args: list[str], env: dict, width: int = 80) -> tuple[list[str], list[str]]:
    """Run `jbench ARGS` in a detached tmux pane `width` columns wide, as a user at a terminal would; returns the
    pane's lines as shown and as printed (tmux joining the lines the terminal wrapped), without trailing blanks."""
    import os
    import shlex
    import subprocess
    import sys
    import time
    import uuid

    exe = str(Path(sys.executable).with_name("jbench"))
    wanted = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "HOME", "JBENCH_CACHE_DIR")}
    command = " ".join(["env", *(shlex.quote(f"{k}={v}") for k, v in {**wanted, **env}.items()), shlex.quote(exe),
                        *map(shlex.quote, args), "; echo __exit=$?; sleep 600"])
    socket = f"jbench-test-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", socket]
    subprocess.run([*tmux, "new-session", "-d", "-x", str(width), "-y", "200", "-s", "t", command], check=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            shown = subprocess.run([*tmux, "capture-pane", "-p", "-t", "t"], capture_output=True, text=True).stdout
            if "__exit=" in shown or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        joined = subprocess.run([*tmux, "capture-pane", "-p", "-J", "-t", "t"], capture_output=True, text=True).stdout
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    assert "__exit=0" in shown, shown
    return tuple([line.rstrip() for line in text.rstrip("\n").splitlines()] for text in (shown, joined))


def test_compare_at_80_columns_in_a_terminal(two_sweeps):
    """In a terminal 80 columns wide (tmux) the comparison is a table per rate whose every line fits, and notes
    wrapped at words: nothing for the terminal to break mid-word."""
    _, env, (_, b) = two_sweeps
    shown, joined = _in_tmux(["compare", "model.quant=Q4_0", "model.quant=Q8_0", "--sweep", b], env)
    assert shown == joined, "\n".join(shown)  # the terminal wrapped no line: each fits in 80 columns
    text = "\n".join(shown)
    assert shown[0].startswith("Along model.quant: each configuration of A against the one of B"), text
    rows = [line for line in shown if line.strip().startswith("Q4_0 → Q8_0")]
    cells = (r"Q4_0 → Q8_0\s+[\d.]+ → [\d.]+\s+[-+]\d+\.\d( \*)?\s+[-+]\d+\.\d…[-+]\d+\.\d\s+"
             r"(\d\.\d{3}|0\.000\d|\de-\d+)\s+-\d+\.\d/\+\d+\.\d$")  # configuration, A → B, change, interval, p, detectable: whole, on one line
    assert len(rows) == 2 and all(re.fullmatch(cells, r.strip()) for r in rows), text
    words = " ".join(line.strip() for line in shown)
    assert "Smallest detectable change at these sample sizes (3 vs 3) and the noise measured: -" in words, text


def test_rate_intervals_stay_above_zero(two_sweeps, tmp_path):
    results, env, _ = two_sweeps
    out = tmp_path / "runs.csv"
    assert jbench_cli(["export", "--experiment", "quant_ladder", "--out", str(out)], env_extra=env).returncode == 0
    df = pd.read_csv(out)
    for phase in ("prefill", "decode"):
        low, high, mean = (df[f"metrics.{phase}_tps_ci95_low"], df[f"metrics.{phase}_tps_ci95_high"],
                           df[f"metrics.{phase}_tps"])
        assert (low > 0).all() and (low < mean).all() and (mean < high).all(), df[[low.name, mean.name, high.name]]


def test_compare_refuses_what_it_cannot_compare(two_sweeps):
    """A sweep against itself, one-character 'prefixes' (the table's # column), a misspelt --along: one line,
    exit 2. Configurations only one side has are named by their labels."""
    results, env, (a, b) = two_sweeps
    res = jbench_cli(["compare", b, b], env_extra=env)
    assert res.returncode == 2 and "error: A and B select the same 2 run(s)" in res.stderr, res.stdout + res.stderr
    # KEY=VALUE of a config key recorded as a param only: the same four runs on both sides
    res = jbench_cli(["compare", "backend.n_prompt=16", "backend.n_prompt=16"], env_extra=env)
    assert res.returncode == 2 and "error: A and B select the same 4 run(s)" in res.stderr, res.stdout + res.stderr
    res = jbench_cli(["compare", "1", "2"], env_extra=env)
    assert res.returncode == 2 and "error: '1' is too short for a run id prefix" in res.stderr, res.stderr
    res = jbench_cli(["compare", a, b, "--along", "model.qaunt"], env_extra=env)
    assert res.returncode == 2 and "did you mean model.quant?" in res.stderr, res.stderr
    q4_b = jbench_cli(["compare", a, "model.quant=Q4_0", "--sweep", b], env_extra=env)
    assert q4_b.returncode == 2 and "selects no trial runs in sweep" in q4_b.stderr  # --sweep narrows both sides
    export = jbench_cli(["export", "--experiment", "quant_ladder", "--out", str(results / "ids.csv")], env_extra=env)
    assert export.returncode == 0, export.stderr
    ids = pd.read_csv(results / "ids.csv")
    q4 = ids[(ids["tags.jbench.sweep_id"] == b) & (ids["params.model.quant"] == "Q4_0")]["run_id"].iloc[0]
    res = jbench_cli(["compare", a, q4[:8]], env_extra=env)
    assert res.returncode == 0, res.stderr
    only = [line for line in res.stdout.splitlines() if line.startswith("Only in A")]
    assert only == ["Only in A (not compared): Q8_0"], res.stdout


def test_regress_reports_and_writes_junit(two_sweeps, tmp_path):
    _, env, _ = two_sweeps
    junit = tmp_path / "r.xml"
    res = jbench_cli(["regress", "--experiment", "quant_ladder", "--junit", str(junit)], env_extra=env)
    # 3 vs 3 repetitions cannot reach p < 0.01: no verdict (exit 3), never a silent pass.
    assert res.returncode == 3 and res.stdout.startswith("# jbench regress: NO VERDICT"), res.stdout + res.stderr
    xml = junit.read_text()
    assert xml.count("<testcase") == 2
    assert "insufficient data" in xml or "<failure" in xml or "testcase" in xml


def test_report_is_written_and_attached_to_the_sweep(two_sweeps, tmp_path):
    results, env, (_, b) = two_sweeps
    res = jbench_cli(["report", "--sweep", b, "--out", str(tmp_path / "rep")], env_extra=env)
    assert res.returncode == 0, res.stderr
    html = (tmp_path / "rep" / "report.html").read_text()
    assert "data:image/png;base64," in html
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    exp = client.get_experiment_by_name("quant_ladder")
    parent = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("jbench.sweep_id") == b
              and r.data.tags.get("jbench.kind") == "sweep"][0]
    assert "report" in {a.path for a in client.list_artifacts(parent.info.run_id)}


def test_roofline_command_reproduces_the_bundled_model(bundled_model):
    res = jbench_cli(["roofline", "--model", "gemma3_270m", "--bandwidth-gbs", "68", "--json"])
    assert res.returncode == 0, res.stderr
    fig = json.loads(res.stdout)
    assert fig["weight_bytes_per_token"] == 246_588_584
    assert fig["decode_ceiling_tok_s"] == pytest.approx(68e9 / 246_588_584)
    res = jbench_cli(["roofline", "--model", "gemma3_270m", "--device", "local"])
    assert res.returncode == 2 and "no device bandwidth" in res.stderr or res.returncode == 0


def test_telemetry_parse_command(tmp_path):
    src = DATA / "jetson-formats" / "tegrastats-orin-nano.txt"
    res = jbench_cli(["telemetry", "parse", str(src), "--format", "jsonl"])
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert any(r["total_power_mw"] == 12479 for r in rows)
    assert "unparseable line(s) skipped" in res.stderr
    res = jbench_cli(["telemetry", "parse", str(src), "--format", "csv"])
    assert res.stdout.splitlines()[0].startswith("timestamp")
