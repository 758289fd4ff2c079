"""A store written by a newer jbench is refused with one message, never reinterpreted (jbench.core.protocol's
STORE_FORMAT, the experiment tag jbench.store_format); every run records the measurement protocol's version."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from jbench.core.protocol import PROTOCOL_VERSION, STORE_FORMAT, STORE_FORMAT_TAG
from jbench.tracking.format import StoreFormatError, check
from jbench.tracking.writer import Tracker

from .conftest import jbench_cli


def _store(tmp_path, fmt=None, name="quant_ladder"):
    t = Tracker(None, tmp_path)
    exp = t.experiment_id(name)
    t.describe_experiment(exp, "")
    if fmt is not None:
        t.client.set_experiment_tag(exp, STORE_FORMAT_TAG, fmt)
    return t, exp


def test_jbench_marks_the_experiments_it_writes_with_its_store_format(tmp_path):
    t, exp = _store(tmp_path)
    assert t.client.get_experiment(exp).tags[STORE_FORMAT_TAG] == str(STORE_FORMAT)
    check(t.uri, "quant_ladder")  # its own format: readable
    check(t.uri, "no_such_experiment")  # nothing there yet: nothing to refuse


def test_a_newer_format_is_refused_for_reading_and_writing(tmp_path):
    t, exp = _store(tmp_path, str(STORE_FORMAT + 1))
    with pytest.raises(StoreFormatError, match="written by a newer jbench"):
        check(t.uri, "quant_ladder")
    with pytest.raises(StoreFormatError, match="upgrade jbench"):
        t.describe_experiment(exp, "")
    from jbench.tracking.reader import runs_frame

    with pytest.raises(StoreFormatError):
        runs_frame(t.uri, ["quant_ladder"])


@pytest.mark.e2e
def test_the_cli_refuses_a_newer_store_before_touching_the_device(tmp_path):
    t, exp = _store(tmp_path, str(STORE_FORMAT + 1), name="adhoc")
    env = {"JBENCH_RESULTS_DIR": str(tmp_path)}
    run = jbench_cli(["run", "backend.n_prompt=8", "backend.n_gen=2", "backend.repetitions=1"], env_extra=env)
    assert run.returncode == 2 and "written by a newer jbench" in run.stderr, run.stdout + run.stderr
    assert run.stderr.count("error:") == 1 and "Traceback" not in run.stderr
    assert MlflowClient(t.uri).search_runs([exp]) == []  # nothing recorded
    export = jbench_cli(["export", "--experiment", "adhoc", "--out", str(tmp_path / "x.csv")], env_extra=env)
    assert export.returncode == 2 and "written by a newer jbench" in export.stderr, export.stdout + export.stderr


@pytest.mark.e2e
def test_every_run_records_the_measurement_protocol(tmp_path, llama_build, bundled_model):
    env = {"JBENCH_RESULTS_DIR": str(tmp_path)}
    res = jbench_cli(["run", "backend.n_prompt=8", "backend.n_gen=2", "backend.repetitions=1", "telemetry.source=none"],
                     env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("adhoc").experiment_id])
    assert {r.data.tags["jbench.kind"] for r in runs} == {"sweep", "trial"}
    assert {r.data.tags["jbench.protocol_version"] for r in runs} == {str(PROTOCOL_VERSION)}


def test_a_store_is_created_whole_or_not_at_all(tmp_path, monkeypatch):
    """A controller killed while MLflow creates the SQLite store (with write-behind that can happen during the first
    trial) left a half-migrated mlflow.db on which every later command failed; now it leaves no store at all."""
    import mlflow.tracking._tracking_service.utils as mlflow_utils

    real = mlflow_utils._get_store

    def dies_midway(uri, artifact_uri=None):
        real(uri, artifact_uri)  # the tables exist in the temporary file...
        raise KeyboardInterrupt("killed while creating the store")  # ...then the controller dies

    monkeypatch.setattr(mlflow_utils, "_get_store", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        Tracker(None, tmp_path)
    assert not (tmp_path / "mlflow.db").exists() and not list(tmp_path.glob(".mlflow.db.*"))
    monkeypatch.setattr(mlflow_utils, "_get_store", real)
    t = Tracker(None, tmp_path)  # the next start creates it, whole
    assert t.client.get_experiment_by_name("Default") is not None
