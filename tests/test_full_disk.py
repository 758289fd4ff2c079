"""A full disk loses nothing and leaves nothing broken: a results directory without room is refused before anything
runs, a store whose creation stopped part way is completed or refused in one line, and a disk that fills mid-sweep
keeps what was measured (in the spool) and the next run uploads it and resumes the same sweep. Real small tmpfs
mounts (jbench's tests run as root: .ci/run), the real `jbench` CLI and MLflow."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from .conftest import finished_trial_runs, jbench_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# The ladder's speed and store writes are what a full disk tests; its quality stage is not (tests/test_quality.py).
# One llama.cpp thread: llama-bench's spinning threads stall each other on cores that other tests share.
SWEEP = ["sweep", "+experiment=quant_ladder", "backend.n_prompt=16", "backend.n_gen=32", "backend.repetitions=3",
         "backend.threads=1", "device.lease_wait_s=600", "quality.enabled=false"]


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` at `where`, unmounted whatever happens in the test."""
    if os.geteuid() != 0:
        pytest.fail("the full-disk tests mount a small tmpfs and need root (.ci/run runs the suite as root)")
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True)  # still busy: detach it now, freed when idle


def _fill(mount: Path) -> None:
    subprocess.run(["dd", "if=/dev/zero", f"of={mount}/filler", "bs=4k"], capture_output=True)


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    return errors[0]


def _schema(db: Path) -> str:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute("SELECT version_num FROM alembic_version").fetchone()[0]
    finally:
        con.close()


def test_a_results_directory_without_room_is_refused_before_anything_runs(tmp_path, llama_build, bundled_model):
    with tmpfs(tmp_path / "mnt", "400k") as mnt:
        res = jbench_cli([*SWEEP, "model.quant=Q4_0", "--results-dir", str(mnt / "results")])
        assert res.returncode == 2, res.stdout + res.stderr
        line = _one_error_line(res.stderr)
        assert "cannot write results: only" in line and "free on the filesystem" in line, line
        assert list(mnt.iterdir()) == []  # nothing created: no results directory, no half store


def test_a_store_whose_creation_stopped_on_a_full_disk_is_refused_then_completed(tmp_path):
    """MLflow itself (as jbench before, or any MLflow user) creating a store on a full disk leaves a half-migrated
    mlflow.db; jbench refuses it in one line while there is no room, and completes it once there is."""
    with tmpfs(tmp_path / "mnt", "400k") as mnt:
        made = subprocess.run([sys.executable, "-c", "from mlflow.tracking._tracking_service.utils import _get_store\n"
                               f"_get_store('sqlite:///{mnt}/mlflow.db')"], capture_output=True, text=True)
        assert made.returncode != 0 and "database or disk is full" in made.stderr, made.stderr[-2000:]
        db = mnt / "mlflow.db"
        half, before = _schema(db), db.read_bytes()

        res = jbench_cli(["report", "--results-dir", str(mnt)])
        assert res.returncode == 2, res.stdout + res.stderr
        line = _one_error_line(res.stderr)
        assert f"the results store {db} is incomplete" in line and "no space left" in line, line
        assert db.read_bytes() == before and sorted(p.name for p in mnt.iterdir()) == ["mlflow.db"]  # untouched

        subprocess.run(["mount", "-o", "remount,size=4m", str(mnt)], check=True)  # room again
        res = jbench_cli(["report", "--results-dir", str(mnt)])
        assert "Traceback" not in res.stderr and "completed the results store" in res.stderr, res.stderr
        assert res.returncode == 2 and "no trial runs" in res.stderr  # an empty store, read as one
        from mlflow.store.db.utils import _get_latest_schema_revision

        assert half != _get_latest_schema_revision() == _schema(db)
        assert sorted(p.name for p in mnt.iterdir()) == ["mlflow.db"]  # no copy left beside it


def test_a_disk_that_fills_mid_sweep_keeps_what_was_measured_and_the_rerun_resumes(tmp_path, llama_build,
                                                                                   bundled_model):
    from mlflow.tracking import MlflowClient

    from jbench.tracking.common import disk_spool_dir

    argv = [*SWEEP, "model.quant=Q4_0,Q4_K_M,Q5_K_M,Q8_0"]
    with tmpfs(tmp_path / "mnt", "1400k") as mnt:
        results = mnt / "results"
        env = dict(os.environ, JBENCH_RESULTS_DIR=str(results), COLUMNS="80")
        proc = subprocess.Popen([str(Path(sys.executable).with_name("jbench")), *argv], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            end = time.monotonic() + 300
            while finished_trial_runs(results / "mlflow.db") < 1 and proc.poll() is None and time.monotonic() < end:
                time.sleep(0.2)
            _fill(mnt)  # the disk fills while the sweep goes on
            out, err = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 2, out + err
        line = _one_error_line(err)
        spool = disk_spool_dir(results)
        assert line.startswith("error: disk full:") and str(spool) in line, line
        assert (spool / "mlflow.db").exists()
        measured = set(re.findall(r"^trial \d+/\d+ (\S+): FINISHED", out, re.M))  # the progress lines
        assert 0 < len(measured) < 4, out  # stopped: at least the last trial was not started

        (mnt / "filler").unlink()
        res = jbench_cli(argv, env_extra={"JBENCH_RESULTS_DIR": str(results)})
        assert res.returncode == 0, res.stdout + res.stderr
        assert "measured while the disk was full were uploaded" in res.stdout, res.stdout
        assert not spool.exists()  # uploaded, then removed

        client = MlflowClient(f"sqlite:///{results}/mlflow.db")
        exp = client.get_experiment_by_name("quant_ladder")
        runs = client.search_runs([exp.experiment_id], max_results=1000)
        parents = [r for r in runs if r.data.tags.get("jbench.kind") == "sweep"]
        trials = [r for r in runs if r.data.tags.get("jbench.kind") == "trial"]
        # One sweep, nothing left RUNNING, every trial FINISHED once with its numbers.
        assert len(parents) == 1 and parents[0].info.status == "FINISHED", [p.info.status for p in parents]
        assert not [r for r in runs if r.info.status == "RUNNING"]
        assert {r.data.tags["jbench.sweep_id"] for r in trials} == {parents[0].data.tags["jbench.sweep_id"]}
        finished = [r for r in trials if r.info.status == "FINISHED"]
        assert sorted(r.info.run_name for r in finished) == ["Q4_0", "Q4_K_M", "Q5_K_M", "Q8_0"]
        assert all(r.data.metrics.get("decode_tps", 0) > 0 for r in finished)
        # The trials measured before the stop were not measured again: the rerun shows them as EARLIER (resumed).
        skipped = {ln.split()[1] for ln in res.stdout.splitlines() if "EARLIER" in ln and ln.split()[0].isdigit()}
        assert measured <= skipped, (measured, skipped)
