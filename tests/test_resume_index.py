"""The resume fast path (sqlite3, no MLflow import) answers exactly what MLflow's reader answers, or
declines (None) so that the reader decides."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from jbench.tracking.reader import finished_trials
from jbench.tracking.resume_index import finished_trials_sqlite

V1_STORE = Path(__file__).parent / "data" / "stores" / "v1" / "mlflow.db"


def _store(tmp_path: Path) -> str:
    from jbench.tracking.writer import Tracker

    tracker = Tracker(None, tmp_path)
    exp = tracker.experiment_id("ladder")
    parent = tracker.start_run(exp, "sweep", tags={"jbench.kind": "sweep"})
    for i, (ident, status, rnd) in enumerate([("aaa", "FINISHED", None), ("bbb", "FAILED", None),
                                              ("ccc", "FINISHED", 2), ("aaa", "FINISHED", None)]):
        tags = {"jbench.kind": "trial", "jbench.identity": ident, "jbench.config_hash": f"cfg-{ident}",
                "jbench.hash_version": "2"}
        if rnd:
            tags["jbench.round"] = rnd
        if i == 2:
            tags["jbench.noisy"] = "true"
        run = tracker.start_run(exp, f"t{i}", parent_run_id=parent, tags=tags)
        # A NaN metric is missing to both readers (MLflow's table stores it as 0 with is_nan set).
        tracker.log(run, metrics={"trial_wall_s": 10.0 + i, "decode_tps": 50.0 + i, "energy_j": float("nan")})
        tracker.end_run(run, status)
    tracker.end_run(parent, "FINISHED")
    return tracker.uri


@pytest.mark.slow  # creates a real MLflow store (~3 s)
def test_fast_path_equals_mlflows_reader(tmp_path):
    uri = _store(tmp_path)
    for key in ("identity", "config_hash"):
        fast = finished_trials_sqlite(uri, "ladder", key=key)
        slow = finished_trials(uri, "ladder", key=key)
        assert fast is not None and set(fast) == set(slow)
        # The same run with the same figures (a resumed trial's summary row shows them) and noisy flag.
        assert fast == slow
    fast = finished_trials_sqlite(uri, "ladder")
    assert set(fast) == {"aaa:1", "ccc:2"}  # the FAILED run does not count; round 2 is its own key
    assert fast["ccc:2"]["wall_s"] == 12.0 and fast["ccc:2"]["noisy"] and not fast["aaa:1"]["noisy"]
    assert fast["ccc:2"]["metrics"] == {"trial_wall_s": 12.0, "decode_tps": 52.0}
    assert finished_trials_sqlite(uri, "no-such-experiment") == {}


def test_fast_path_declines_what_it_cannot_answer_exactly(tmp_path):
    # Version-1 runs must be migrated from their params by MLflow's reader.
    assert finished_trials_sqlite(f"sqlite:///{V1_STORE}", "quant_ladder") is None
    # Not a local SQLite store, or not MLflow's schema.
    assert finished_trials_sqlite("http://127.0.0.1:5000", "x") is None
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE runs (x)").connection.commit()
    assert finished_trials_sqlite(f"sqlite:///{other}", "x") is None


def test_fast_path_never_writes_and_never_imports_mlflow(tmp_path):
    copy = tmp_path / "v1.db"
    shutil.copy(V1_STORE, copy)
    before = copy.read_bytes()
    code = ("import sys; from jbench.tracking.resume_index import finished_trials_sqlite as f; "
            f"print(f('sqlite:///{copy}', 'quant_ladder')); print('mlflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["None", "False"]
    assert copy.read_bytes() == before
