"""Sweep options through the real CLI, on the local device with the real llama.cpp build and the bundled model:
`sweep.rerun_noisy` (a noisy trial runs once more, each attempt its own run) and `sweep.skip_unavailable_backends`
(a trial whose backend is not on the device is dropped with a note instead of stopping the sweep). Kept cheap: tiny
prompt and generation sizes, the fewest repetitions that measure what is asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from .conftest import jbench_cli

pytestmark = pytest.mark.e2e

TINY = ["backend.n_prompt=8", "backend.n_gen=2", "telemetry.source=none", "thermal.start_below_c=null",
        "model.quant=Q4_0"]


def _trial_runs(results: Path) -> list:
    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    exp = client.get_experiment_by_name("adhoc")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    return [r for r in runs if r.data.tags.get("jbench.kind") == "trial"]


def _sweep_json(args: list[str], results: Path):
    res = jbench_cli(["sweep", *args, "-o", "json"], env_extra={"JBENCH_RESULTS_DIR": str(results)})
    rows = json.loads(res.stdout) if res.returncode in (0, 4) and res.stdout.strip() else None
    return res, rows


# -- sweep.rerun_noisy ---------------------------------------------------------------------------------------------
# Two repetitions give a coefficient of variation; sweep.max_cv=0 makes any real spread noisy, a huge one none.

def test_a_noisy_trial_is_not_run_again_without_rerun_noisy(tmp_path, llama_build, bundled_model):
    res, rows = _sweep_json([*TINY, "backend.repetitions=2", "sweep.max_cv=0"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = _trial_runs(tmp_path)
    assert len(runs) == 1 and runs[0].data.tags["jbench.noisy"] == "true", [r.data.tags for r in runs]
    assert [(r["index"], r["noisy"], r["run_id"]) for r in rows] == [(1, True, runs[0].info.run_id)]


def test_rerun_noisy_runs_a_noisy_trial_once_more_and_reports_each_attempt(tmp_path, llama_build, bundled_model):
    res, rows = _sweep_json([*TINY, "backend.repetitions=2", "sweep.max_cv=0", "sweep.rerun_noisy=true"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = _trial_runs(tmp_path)
    # Two attempts of the one trial, each a FINISHED run of its own with its own measurement; no third one (the
    # rerun is noisy as well, and is kept).
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"], [r.info.run_name for r in runs]
    assert len({r.data.tags["jbench.config_hash"] for r in runs}) == 1
    assert all(r.data.tags["jbench.noisy"] == "true" and r.data.metrics["decode_tps"] > 0 for r in runs)
    # `-o json` is the summary the table shows (docs/cli.md), and the table shows each attempt of a rerun trial: each
    # attempt's row carries its own run and its own numbers, as MLflow recorded them (not the rerun's twice).
    assert [r["index"] for r in rows] == [1, 1], rows
    assert [r["run_id"] for r in rows] == [r.info.run_id for r in runs], rows
    for row, run in zip(rows, runs):
        assert row["status"] == "FINISHED" and row["noisy"] is True
        assert row["decode_tps"] == pytest.approx(run.data.metrics["decode_tps"]), (row, run.data.metrics)
        assert row["prefill_tps"] == pytest.approx(run.data.metrics["prefill_tps"]), (row, run.data.metrics)


def test_rerun_noisy_leaves_a_quiet_trial_alone(tmp_path, llama_build, bundled_model):
    res, rows = _sweep_json([*TINY, "backend.repetitions=2", "sweep.max_cv=1000", "sweep.rerun_noisy=true"],
                            tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = _trial_runs(tmp_path)
    assert len(runs) == 1 and "jbench.noisy" not in runs[0].data.tags, runs[0].data.tags
    assert [(r["index"], r["noisy"]) for r in rows] == [(1, False)]


# -- sweep.skip_unavailable_backends -------------------------------------------------------------------------------


def _absent_engine(tmp_path: Path) -> Path:
    """A user config dir with an engine backend whose executable is not on the device."""
    conf = tmp_path / "conf"
    (conf / "backend").mkdir(parents=True)
    (conf / "backend" / "absent_engine.yaml").write_text(
        "defaults: [engine_schema, _self_]\nname: engine\nbinary: /nonexistent/engine/run\n"
        'command: ["{binary}", "--model", "{model}", "--prompt-tokens", "{prompt_tokens}", "--gen-tokens", '
        '"{gen_tokens}"]\n')
    return conf


def test_an_unavailable_backend_stops_the_sweep_before_anything_runs(tmp_path, llama_build, bundled_model):
    conf = _absent_engine(tmp_path)
    res = jbench_cli(["sweep", "--config-dir", str(conf), "backend=llamacpp,absent_engine", *TINY,
                      "backend.repetitions=1"], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 2, res.stdout + res.stderr
    assert "engine binary /nonexistent/engine/run not found on device 'local'" in res.stderr
    assert not (tmp_path / "r" / "mlflow.db").exists() or _trial_runs(tmp_path / "r") == []


def test_skip_unavailable_backends_drops_them_with_a_note_and_runs_the_rest(tmp_path, llama_build, bundled_model):
    conf = _absent_engine(tmp_path)
    res, rows = _sweep_json(["--config-dir", str(conf), "backend=llamacpp,absent_engine", *TINY,
                             "backend.repetitions=1", "sweep.skip_unavailable_backends=true"], tmp_path / "r")
    assert res.returncode == 0, res.stdout + res.stderr
    assert ("note: dropped backend=absent_engine: backend engine not available on 'local': engine binary "
            "/nonexistent/engine/run not found") in res.stderr
    assert [(r["label"], r["status"]) for r in rows] == [("llamacpp", "FINISHED")]
    runs = _trial_runs(tmp_path / "r")
    assert [(r.data.params["backend.name"], r.info.status) for r in runs] == [("llamacpp", "FINISHED")]
    assert runs[0].data.metrics["decode_tps"] > 0 and rows[0]["run_id"] == runs[0].info.run_id
