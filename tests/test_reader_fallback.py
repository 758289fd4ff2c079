"""runs_frame's SQL fast path is only an optimisation: any doubt or error falls back to MLflow's search API."""

from __future__ import annotations

import logging
import math
import sqlite3

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from jbench.tracking import reader
from jbench.tracking.reader import runs_frame


@pytest.fixture(autouse=True)
def _fresh_capability_cache(monkeypatch):
    monkeypatch.setattr(reader, "_sql_checked", {})


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A small real SQLite store: trial runs (one deleted, one failed), a sweep run, two experiments
    (module-scoped: creating an MLflow database takes seconds; the tests only read it)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('store')}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("study")
    other = client.create_experiment("other")
    sweep = client.create_run(exp, tags={"jbench.kind": "sweep", "jbench.sweep_id": "s1"}, run_name="sweep")
    for i, quant in enumerate(("Q4_0", "Q8_0", "F16")):
        run = client.create_run(exp, tags={"jbench.kind": "trial", "jbench.sweep_id": "s1", "model.quant": quant,
                                           "mlflow.parentRunId": sweep.info.run_id}, run_name=f"{i:03d}")
        rid = run.info.run_id
        client.log_param(rid, "model.quant", quant)
        client.log_param(rid, "backend.n_gen", str(64 * (i + 1)))
        client.log_metric(rid, "decode_tps", 10.0 * (i + 1))
        client.log_metric(rid, "decode_tps", 11.0 * (i + 1))  # latest value wins
        client.log_metric(rid, "energy_j", math.nan)
        client.set_terminated(rid, "FAILED" if quant == "F16" else "FINISHED")
    gone = client.create_run(exp, tags={"jbench.kind": "trial", "jbench.sweep_id": "s1"})
    client.delete_run(gone.info.run_id)
    client.create_run(other, tags={"jbench.kind": "trial", "jbench.sweep_id": "s2"})  # still RUNNING
    client.set_terminated(sweep.info.run_id, "FINISHED")
    return uri


SELECTIONS = [dict(), dict(kinds=None), dict(sweep_ids=["s1"]), dict(tag_filters={"model.quant": "Q8_0"})]


@pytest.mark.parametrize("sel", SELECTIONS)
def test_fast_path_and_search_give_the_same_frame(store, sel):
    fast = runs_frame(store, None, method="sql", **sel)
    assert not fast.empty
    pd.testing.assert_frame_equal(fast, runs_frame(store, None, method="search", **sel))
    pd.testing.assert_frame_equal(fast, runs_frame(store, None, **sel))


@pytest.mark.parametrize("sel", SELECTIONS)
def test_an_error_mid_query_falls_back_to_search(store, sel, monkeypatch, caplog):
    fast = runs_frame(store, None, method="sql", **sel)

    def broken(*a, **k):
        raise RuntimeError("no such column: latest_metrics.is_nan")

    monkeypatch.setattr(reader, "_runs_via_sql", broken)
    with caplog.at_level(logging.DEBUG, logger="jbench"):
        got = runs_frame(store, None, **sel)
    pd.testing.assert_frame_equal(got, fast)
    lines = [r for r in caplog.records if "search API" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG and "no such column" in lines[0].getMessage()
    with pytest.raises(RuntimeError):  # asked for by name: the error is the caller's to see
        runs_frame(store, None, method="sql", **sel)


def test_a_schema_without_the_columns_the_fast_path_reads_uses_search(store, monkeypatch, caplog):
    fast = runs_frame(store, ["study"], method="sql")
    # As if a future MLflow had renamed a column the fast path reads: never even tried.
    needs = {**reader._SQL_NEEDS, "latest_metrics": reader._SQL_NEEDS["latest_metrics"] | {"value_double"}}
    monkeypatch.setattr(reader, "_SQL_NEEDS", needs)
    called = []
    monkeypatch.setattr(reader, "_runs_via_sql", lambda *a, **k: called.append(1) or [])
    with caplog.at_level(logging.DEBUG, logger="jbench"):
        got = runs_frame(store, ["study"])
    assert called == [] and "lacks column(s) value_double" in caplog.text
    pd.testing.assert_frame_equal(got, fast)


def test_capability_check_reads_the_real_database(tmp_path):
    from sqlalchemy import create_engine

    db = tmp_path / "odd.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE runs (run_uuid TEXT, experiment_id INT, status TEXT)")  # an older/odd schema
    con.close()

    class Store:
        engine = create_engine(f"sqlite:///{db}")

    assert "runs lacks column(s) end_time, lifecycle_stage, start_time" in reader._sql_capable(Store())
    assert "no SQL engine" in reader._sql_capable(object())  # not an SQLAlchemy store


def test_a_non_sql_store_uses_search(store, monkeypatch):
    fast = runs_frame(store, ["study"], method="sql")
    monkeypatch.setattr(reader, "_sql_store", lambda client: None)  # e.g. an MLflow server (REST store)
    pd.testing.assert_frame_equal(runs_frame(store, ["study"]), fast)
    with pytest.raises(ValueError, match="needs MLflow's SQL store"):
        runs_frame(store, ["study"], method="sql")
