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
                          "backend.n_gen=4", "backend.repetitions=3", "sweep.rerun=true", "device.bandwidth_gbs=30"],
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
