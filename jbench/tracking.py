"""The only module that talks to MLflow.

Layout in MLflow: one experiment per jbench experiment name; one parent run per sweep (tag
jbench.sweep_id); one child run per trial (tag mlflow.parentRunId). Everything is written through
MlflowClient batches, so a trial costs a handful of store round trips.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

# MLflow's limits on a param value and on batch sizes.
_MAX_PARAM_LEN = 6000
_BATCH = 100

STATUS_FINISHED = "FINISHED"
STATUS_FAILED = "FAILED"
STATUS_KILLED = "KILLED"


def resolve_uri(uri: Optional[str], results_dir: str | Path) -> str:
    """tracking.uri if set, else $MLFLOW_TRACKING_URI, else SQLite in results_dir."""
    if uri:
        return uri
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    db = Path(results_dir).expanduser().resolve() / "mlflow.db"
    return f"sqlite:///{db}"


def param_value(value: Any) -> str:
    if value is None:
        text = "null"
    elif isinstance(value, (list, dict)):
        text = json.dumps(value, sort_keys=True)
    else:
        text = str(value)
    return text if len(text) <= _MAX_PARAM_LEN else text[: _MAX_PARAM_LEN - 3] + "..."


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

    def log_files(self, run_id: str, files: dict[str, Path]) -> None:
        """Existing files as artifacts: {artifact dir ('' for the root): local path}."""
        for artifact_dir, path in files.items():
            self.client.log_artifact(run_id, str(path), artifact_path=artifact_dir or None)

    def finished_config_hashes(self, experiment_id: str) -> dict[str, str]:
        """config hash -> run id of FINISHED trial runs in the experiment (for resuming sweeps)."""
        found: dict[str, str] = {}
        token = None
        while True:
            page = self.client.search_runs(
                [experiment_id], filter_string="attributes.status = 'FINISHED' and tags.`jbench.kind` = 'trial'",
                max_results=5000, page_token=token,
            )
            for run in page:
                h = run.data.tags.get("jbench.config_hash")
                if h:
                    found.setdefault(h, run.info.run_id)
            token = page.token
            if not token:
                return found

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

    def end_run(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status=RunStatus.to_string(RunStatus.from_string(status)))


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


# --- reading results (report, compare, regress, export) ---------------------------------------
# Reading is batched like writing: runs come from paginated search_runs calls (5000 runs a page,
# never one call per run) and repetition series from one bulk metric-history query per chunk of runs
# where the store offers it (SQL stores), else one history call per run.

_SEARCH_PAGE = 5000
_RUN_ID_CHUNK = 100  # run ids per `attributes.run_id IN (...)` filter
_HISTORY_CHUNK = 500  # run ids per bulk metric-history query


def _reading_client(uri_or_tracker: Any) -> MlflowClient:
    """A client for a tracking URI, a Tracker, an MlflowClient, or None (the default local store:
    $MLFLOW_TRACKING_URI, else SQLite in $JBENCH_RESULTS_DIR or ./results)."""
    if isinstance(uri_or_tracker, Tracker):
        return uri_or_tracker.client
    if isinstance(uri_or_tracker, MlflowClient):
        return uri_or_tracker
    if uri_or_tracker is None:
        return MlflowClient(tracking_uri=resolve_uri(None, os.environ.get("JBENCH_RESULTS_DIR", "results")))
    return MlflowClient(tracking_uri=str(uri_or_tracker))


def _quotable(value: Any) -> bool:
    text = str(value)
    return not any(ch in text for ch in "'\"\\`")


def _search_all(client: MlflowClient, experiment_ids: list[str], filter_string: str) -> list:
    runs: list = []
    token = None
    while True:
        page = client.search_runs(experiment_ids, filter_string=filter_string, max_results=_SEARCH_PAGE,
                                  page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def runs_frame(
    uri_or_tracker: Any,
    experiment_names: Optional[list[str]] = None,
    *,
    sweep_ids: Optional[Iterable[str]] = None,
    run_ids: Optional[Iterable[str]] = None,
    tag_filters: Optional[dict[str, Any]] = None,
    kinds: Optional[Iterable[str]] = ("trial",),
):
    """Runs as a pandas DataFrame, one row per run.

    Columns: run_id, experiment (name), status, start_time, end_time (pandas datetimes in UTC; NaT
    while a run has not ended), then `params.<key>` (strings, as MLflow stores them),
    `metrics.<key>` (floats: the latest value of each metric) and `tags.<key>`, each group sorted
    by key. A value a run does not have is missing (NaN/None), never 0.

    Selection (all given criteria must hold): experiment_names (None: every active experiment;
    an unknown name raises LookupError), sweep_ids (tag jbench.sweep_id), run_ids, tag_filters
    ({tag: exact value}), kinds (tag jbench.kind; None: every run, e.g. also runs without the tag).
    Deleted runs are not read. Rows are ordered by start_time, then run_id.
    """
    import pandas as pd

    client = _reading_client(uri_or_tracker)
    if experiment_names is None:
        experiments = []
        token = None
        while True:
            page = client.search_experiments(max_results=1000, page_token=token)
            experiments.extend(page)
            token = page.token
            if not token:
                break
    else:
        experiments = []
        for name in experiment_names:
            exp = client.get_experiment_by_name(name)
            if exp is None or exp.lifecycle_stage == "deleted":
                raise LookupError(f"no experiment named '{name}' in {client.tracking_uri}")
            experiments.append(exp)
    exp_names = {e.experiment_id: e.name for e in experiments}

    kinds = None if kinds is None else list(dict.fromkeys(kinds))
    tag_filters = {k: str(v) for k, v in (tag_filters or {}).items()}
    base: list[str] = []
    client_side_tags: dict[str, str] = {}
    for key, value in tag_filters.items():
        if _quotable(key) and _quotable(value):
            base.append(f"tags.`{key}` = '{value}'")
        else:
            client_side_tags[key] = value
    if kinds is not None and len(kinds) == 1 and _quotable(kinds[0]):
        base.append(f"tags.`jbench.kind` = '{kinds[0]}'")
    # MLflow accepts IN only for run_id, so several sweep ids mean one search each.
    sweep_list = None if sweep_ids is None else [str(s) for s in dict.fromkeys(sweep_ids)]
    sweep_clauses: list[Optional[str]] = [None]
    if sweep_list is not None:
        sweep_clauses = [f"tags.`jbench.sweep_id` = '{s}'" for s in sweep_list if _quotable(s)]
    id_list = None if run_ids is None else [str(r) for r in dict.fromkeys(run_ids)]
    id_clauses: list[Optional[str]] = [None]
    if id_list is not None:
        id_clauses = [
            "attributes.run_id IN (" + ", ".join(f"'{r}'" for r in id_list[i:i + _RUN_ID_CHUNK]) + ")"
            for i in range(0, len(id_list), _RUN_ID_CHUNK)
            if all(_quotable(r) for r in id_list[i:i + _RUN_ID_CHUNK])
        ]

    found: dict[str, Any] = {}
    if exp_names:
        for sweep_clause in sweep_clauses:
            for id_clause in id_clauses:
                clauses = base + [c for c in (sweep_clause, id_clause) if c]
                for run in _search_all(client, list(exp_names), " and ".join(clauses)):
                    found.setdefault(run.info.run_id, run)

    records = []
    keys: dict[str, set] = {"params": set(), "metrics": set(), "tags": set()}
    for run in found.values():
        tags = run.data.tags
        if kinds is not None and tags.get("jbench.kind") not in kinds:
            continue
        if sweep_list is not None and tags.get("jbench.sweep_id") not in sweep_list:
            continue
        if id_list is not None and run.info.run_id not in id_list:
            continue
        if any(tags.get(k) != v for k, v in client_side_tags.items()):
            continue
        rec = {
            "run_id": run.info.run_id,
            "experiment": exp_names.get(run.info.experiment_id, run.info.experiment_id),
            "status": run.info.status,
            "start_time": run.info.start_time,
            "end_time": run.info.end_time,
        }
        for group, values in (("params", run.data.params), ("metrics", run.data.metrics), ("tags", tags)):
            for k, v in values.items():
                rec[f"{group}.{k}"] = v
            keys[group].update(values)
        records.append(rec)

    base_cols = ["run_id", "experiment", "status", "start_time", "end_time"]
    columns = base_cols + [f"{g}.{k}" for g in ("params", "metrics", "tags") for k in sorted(keys[g])]
    df = pd.DataFrame.from_records(records, columns=columns)
    for col in ("start_time", "end_time"):
        df[col] = pd.to_datetime(pd.to_numeric(df[col], errors="coerce"), unit="ms", utc=True)
    metric_cols = [c for c in df.columns if c.startswith("metrics.")]
    if metric_cols:
        df[metric_cols] = df[metric_cols].astype(float)
    return df.sort_values(["start_time", "run_id"], kind="stable", na_position="last").reset_index(drop=True)


def repetition_samples(uri_or_tracker: Any, run_ids: Iterable[str], metric: str = "decode_tps_rep") -> dict[str, list[float]]:
    """Per-repetition values of a stepped metric for each run: {run_id: [value at step 0, 1, ...]}.

    One value per step (the latest logged at that step), ordered by step. Runs without the metric
    are absent from the result. SQL stores answer in one query per chunk of runs; other stores
    (e.g. an MLflow server) get one history call per run.
    """
    client = _reading_client(uri_or_tracker)
    ids = [str(r) for r in dict.fromkeys(run_ids)]
    # (timestamp, value) per (run, step): the latest value at a step wins.
    points: dict[str, dict[int, tuple[int, float]]] = {}

    def add(run_id: str, m: Metric) -> None:
        steps = points.setdefault(run_id, {})
        prev = steps.get(m.step)
        if prev is None or m.timestamp >= prev[0]:
            steps[m.step] = (m.timestamp, float(m.value))

    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    bulk = getattr(store, "get_metric_history_bulk", None)
    if bulk is not None and callable(bulk):
        for i in range(0, len(ids), _HISTORY_CHUNK):
            chunk = ids[i:i + _HISTORY_CHUNK]
            # max_results bounds rows over the whole chunk; one repetition series is short.
            for item in bulk(chunk, metric, max_results=1_000_000):
                add(item.run_id, item)  # MetricWithRunId is a Metric with its run id
    else:
        for run_id in ids:
            for m in client.get_metric_history(run_id, metric):
                add(run_id, m)
    return {run_id: [v for _, (_, v) in sorted(points[run_id].items())] for run_id in ids if run_id in points}
