"""Writing results to MLflow: experiments, parent and child runs, params, metrics, tags, artifacts.

Layout in MLflow: one experiment per jbench experiment name; one parent run per sweep (tag
jbench.sweep_id); one child run per trial (tag mlflow.parentRunId). Everything is written through
MlflowClient batches, so a trial costs a handful of store round trips.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from jbench.tracking.common import _BATCH, _finite, param_value, resolve_uri


class Tracker:
    def __init__(self, uri: Optional[str] = None, results_dir: str | Path = "results"):
        self.results_dir = Path(results_dir).expanduser().resolve()
        self.uri = resolve_uri(uri, self.results_dir)
        if self.uri.startswith("sqlite:"):
            self.results_dir.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.uri)
        self._local_store = self.uri.startswith(("sqlite:", "file:")) or "://" not in self.uri

    # -- experiments and runs ------------------------------------------------------------------

    def experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            return exp.experiment_id
        location = None
        if self._local_store:
            # Artifacts beside the store under results/, not in ./mlruns of whatever the cwd is.
            location = (self.results_dir / "artifacts" / name).as_uri()
        return self.client.create_experiment(name, artifact_location=location)

    def start_run(
        self,
        experiment_id: str,
        name: str,
        *,
        parent_run_id: Optional[str] = None,
        params: Optional[dict[str, Any]] = None,
        tags: Optional[dict[str, Any]] = None,
    ) -> str:
        run_tags = {MLFLOW_RUN_NAME: name}
        if parent_run_id:
            run_tags[MLFLOW_PARENT_RUN_ID] = parent_run_id
        run = self.client.create_run(experiment_id, run_name=name, tags=run_tags)
        run_id = run.info.run_id
        self.log(run_id, params=params, tags=tags)
        return run_id

    def log(
        self,
        run_id: str,
        *,
        params: Optional[dict[str, Any]] = None,
        tags: Optional[dict[str, Any]] = None,
        metrics: Optional[dict[str, float]] = None,
        stepped: Optional[dict[str, Iterable[float]]] = None,
    ) -> None:
        """Params, tags and metrics in as few batches as MLflow allows. NaN metrics are skipped:
        a missing measurement stays missing (its reason is a tag), it is never logged as a number."""
        now = int(time.time() * 1000)
        p = [Param(k, param_value(v)) for k, v in (params or {}).items()]
        t = [RunTag(k, param_value(v)) for k, v in (tags or {}).items()]
        m = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items() if _finite(v)]
        for key, values in (stepped or {}).items():
            m += [Metric(key, float(v), now, step) for step, v in enumerate(values) if _finite(v)]
        while p or t or m:
            self.client.log_batch(run_id, metrics=m[:1000], params=p[:_BATCH], tags=t[:_BATCH])
            p, t, m = p[_BATCH:], t[_BATCH:], m[1000:]

    def log_series(self, run_id: str, series: dict[str, list[tuple[float, float]]]) -> None:
        """Time series as metrics with their own timestamps (epoch seconds), one step per sample,
        so the MLflow UI charts them against wall time (e.g. system/device/power_w)."""
        metrics = [Metric(key, float(v), int(t * 1000), step)
                   for key, points in series.items() for step, (t, v) in enumerate(points) if _finite(v)]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(run_id, metrics=metrics[i:i + 1000])

    def log_files(self, run_id: str, files: Iterable[tuple[str, Path]]) -> None:
        """Existing files as artifacts: (artifact dir, '' for the root; local path) pairs."""
        for artifact_dir, path in files:
            self.client.log_artifact(run_id, str(path), artifact_path=artifact_dir or None)

    def log_texts(self, run_id: str, files: dict[str, str]) -> None:
        """Artifacts given as {relative path: text}, uploaded in one call."""
        if not files:
            return
        with tempfile.TemporaryDirectory(prefix="jbench-artifacts-") as tmp:
            for rel, text in files.items():
                path = Path(tmp) / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            self.client.log_artifacts(run_id, tmp)

    def running_runs(self, experiment_id: str) -> list[tuple[str, dict[str, str], dict[str, str]]]:
        """(run id, tags, params) of the experiment's runs still marked RUNNING."""
        runs = self.client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'",
                                       max_results=10000)
        return [(r.info.run_id, dict(r.data.tags), dict(r.data.params)) for r in runs]

    def end_run(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status=RunStatus.to_string(RunStatus.from_string(status)))


    # -- the record as MLflow users read it (run id first) -----------------------------------------

    def describe_experiment(self, experiment_id: str, description: str) -> None:
        """The experiment's description (the UI's About panel) and its kind: MLflow 3 opens an experiment
        on its GenAI pages ("Traces 0") unless `mlflow.experimentKind` says it holds model runs."""
        tags = {"mlflow.experimentKind": "custom_model_development"}
        if description:
            tags["mlflow.note.content"] = description
        exp = self.client.get_experiment(experiment_id)
        for key, value in tags.items():
            if exp.tags.get(key) != value:
                self.client.set_experiment_tag(experiment_id, key, value)

    def log_table(self, run_id: str, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Rows as an MLflow table artifact (the UI's artifact view and Evaluation tab show it as a table)."""
        import pandas as pd

        self.client.log_table(run_id, data=pd.DataFrame(rows), artifact_file=artifact_file)

    def run_record(self, run_id: str) -> dict[str, Any]:
        """{"status", "params", "tags", "metrics"} of a run."""
        run = self.client.get_run(run_id)
        return {"status": run.info.status, "params": dict(run.data.params), "tags": dict(run.data.tags),
                "metrics": dict(run.data.metrics)}

    def reopen_run(self, run_id: str) -> None:
        """A KILLED sweep's parent back to RUNNING: a resumed sweep records its trials under it. Its failure
        reason goes (the caller records what it was as jbench.resumed_after)."""
        self.client.update_run(run_id, status="RUNNING")
        if "jbench.failure_reason" in self.client.get_run(run_id).data.tags:
            self.client.delete_tag(run_id, "jbench.failure_reason")


def runs_view_url(server_url: str, experiment_id: str) -> str:
    """The link that opens an experiment on its runs table in the MLflow UI. MLflow 3.17's UI picks GenAI
    pages or model-training pages from its `workflowType` (URL parameter, else the browser's last choice,
    GenAI by default), not from the experiment's `mlflow.experimentKind` tag, so the link names it."""
    return f"{server_url.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
