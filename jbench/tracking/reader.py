"""Reading results back from MLflow (report, compare, regress, export, resume)."""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

import jbench.tracking.artifacts  # noqa: F401  (local stores' mlflow-artifacts:/ locations)
from jbench.core.protocol import STORE_FORMAT_TAG
from jbench.tracking.format import StoreFormatError, check_tag
from jbench.tracking.common import is_remote, redact, resolve_uri, server_problem
from jbench.core.trial import resume_key
from jbench.core.identity import HASH_VERSION, RUN_TAGS, identity_sections, run_hashes


# The trial's identity keys that every reader selects and groups on (`tags.model.quant` ...). Trials record
# them as params only (MLflow's Compare charts params); runs_frame shows them as tags too, so frames of
# older runs (which had both) and newer ones read alike.
TAGS_FROM_PARAMS = ("device.name", "backend.name", "model.name", "model.quant")

log = logging.getLogger("jbench")

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
    if isinstance(getattr(uri_or_tracker, "client", None), MlflowClient):  # a tracking.writer.Tracker
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


def _sql_store(client: MlflowClient):
    """The client's store when it is MLflow's plain SQLAlchemy store (SQLite, PostgreSQL, MySQL), else None."""
    try:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    except ImportError:  # pragma: no cover - mlflow-skinny without SQL support
        return None
    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    return store if type(store) is SqlAlchemyStore else None


# Tables and columns the SQL fast path reads (MLflow's own schema, which MLflow may change).
_SQL_NEEDS = {
    "runs": {"run_uuid", "experiment_id", "status", "start_time", "end_time", "lifecycle_stage"},
    "tags": {"run_uuid", "key", "value"},
    "params": {"run_uuid", "key", "value"},
    "latest_metrics": {"run_uuid", "key", "value", "is_nan"},
}
_sql_checked: dict[str, Optional[str]] = {}


def _sql_capable(store) -> Optional[str]:
    """None when the store's database has every table and column the SQL fast path reads (checked once
    per database), else why not: the reader then uses the public search API."""
    try:
        engine = store.engine
        url = str(engine.url)
    except Exception as exc:  # not an SQLAlchemy store after all
        return f"no SQL engine ({type(exc).__name__}: {exc})"
    if url in _sql_checked:
        return _sql_checked[url]
    why: Optional[str] = None
    try:
        from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlParam, SqlRun, SqlTag
        from sqlalchemy import inspect

        models = {"runs": SqlRun, "tags": SqlTag, "params": SqlParam, "latest_metrics": SqlLatestMetric}
        inspector = inspect(engine)
        for table, columns in _SQL_NEEDS.items():
            if models[table].__table__.name != table:
                why = f"MLflow's {models[table].__name__} is no longer table {table}"
                break
            have = {c["name"] for c in inspector.get_columns(table)}
            if not have:
                why = f"table {table} is missing"
                break
            if columns - have:
                why = f"table {table} lacks column(s) {', '.join(sorted(columns - have))}"
                break
    except Exception as exc:  # ImportError after an MLflow change, a database error, ...
        why = f"{type(exc).__name__}: {exc}"
    _sql_checked[url] = why
    return why


def _runs_via_sql(store, exp_ids: list[str], keep, *, kinds=None, sweep_ids=None, run_ids=None) -> list[tuple]:
    """(run_id, experiment_id, status, start_time, end_time, params, metrics, tags) of the active runs
    of the experiments that pass keep(run_id, tags), read with SQLAlchemy Core selects over MLflow's
    own table definitions: the rows search_runs reads (metrics = latest_metrics, as Run.data.metrics),
    without building ORM objects (what makes search_runs take ~3-5 ms a run) or Row objects (plain
    DBAPI tuples from the cursor)."""
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlParam, SqlRun, SqlTag
    from sqlalchemy import select

    runs_t, tags_t = SqlRun.__table__, SqlTag.__table__
    params_t, metrics_t = SqlParam.__table__, SqlLatestMetric.__table__
    ids = [int(e) if str(e).isdigit() else e for e in exp_ids]
    active = (runs_t.c.experiment_id.in_(ids)) & (runs_t.c.lifecycle_stage == "active")
    # Narrow in the database where a criterion names values (keep() still checks every run).
    for key, values in (("jbench.kind", kinds), ("jbench.sweep_id", sweep_ids)):
        if values is not None and len(values) <= 500:
            active &= runs_t.c.run_uuid.in_(select(tags_t.c.run_uuid).where(
                (tags_t.c.key == key) & tags_t.c.value.in_(list(values))))
    if run_ids is not None and len(run_ids) <= 500:
        active &= runs_t.c.run_uuid.in_(list(run_ids))
    with store.engine.connect() as conn:
        info = {r[0]: r for r in conn.execute(select(runs_t.c.run_uuid, runs_t.c.experiment_id, runs_t.c.status,
                                                     runs_t.c.start_time, runs_t.c.end_time).where(active)).cursor.fetchall()}
        tags: dict[str, dict[str, str]] = {run_id: {} for run_id in info}
        for run_id, key, value in conn.execute(
                select(tags_t.c.run_uuid, tags_t.c.key, tags_t.c.value)
                .select_from(tags_t.join(runs_t, tags_t.c.run_uuid == runs_t.c.run_uuid)).where(active)).cursor.fetchall():
            tags[run_id][key] = value
        chosen = {run_id for run_id in info if keep(run_id, tags[run_id])}
        params: dict[str, dict[str, str]] = {run_id: {} for run_id in chosen}
        metrics: dict[str, dict[str, float]] = {run_id: {} for run_id in chosen}
        if chosen:
            if len(chosen) * 2 >= len(info):  # most runs: one pass over the experiments, filtered here
                where_p = where_m = active
                join_p = params_t.join(runs_t, params_t.c.run_uuid == runs_t.c.run_uuid)
                join_m = metrics_t.join(runs_t, metrics_t.c.run_uuid == runs_t.c.run_uuid)
                batches = [(where_p, where_m, join_p, join_m)]
            else:  # a few runs: by run id, in chunks the database accepts
                ordered = sorted(chosen)
                batches = [(params_t.c.run_uuid.in_(ordered[i:i + 500]), metrics_t.c.run_uuid.in_(ordered[i:i + 500]),
                            params_t, metrics_t) for i in range(0, len(ordered), 500)]
            for where_p, where_m, from_p, from_m in batches:
                for run_id, key, value in conn.execute(
                        select(params_t.c.run_uuid, params_t.c.key, params_t.c.value).select_from(from_p)
                        .where(where_p)).cursor.fetchall():
                    if run_id in chosen:
                        params[run_id][key] = value
                for run_id, key, value, is_nan in conn.execute(
                        select(metrics_t.c.run_uuid, metrics_t.c.key, metrics_t.c.value, metrics_t.c.is_nan)
                        .select_from(from_m).where(where_m)).cursor.fetchall():
                    if run_id in chosen:
                        metrics[run_id][key] = math.nan if is_nan else float(value)
    return [(run_id, str(info[run_id][1]), info[run_id][2], info[run_id][3], info[run_id][4],
             params[run_id], metrics[run_id], tags[run_id]) for run_id in chosen]


def _runs_via_search(client: MlflowClient, exp_ids: list[str], keep, *, kinds=None, sweep_ids=None, run_ids=None,
                     tag_filters: Optional[dict[str, str]] = None) -> list[tuple]:
    """The same rows as _runs_via_sql, through MlflowClient.search_runs (any store, MLflow servers included).

    Filters go to the server where MLflow's search syntax allows (IN only for run_id, so several sweep ids
    mean one search each); everything is checked again here by keep()."""
    tag_filters = tag_filters or {}
    base: list[str] = [f"tags.`{k}` = '{v}'" for k, v in tag_filters.items() if _quotable(k) and _quotable(v)]
    if kinds is not None and len(kinds) == 1 and _quotable(kinds[0]):
        base.append(f"tags.`jbench.kind` = '{kinds[0]}'")
    sweep_clauses: list[Optional[str]] = [None]
    if sweep_ids is not None:
        sweep_clauses = [f"tags.`jbench.sweep_id` = '{s}'" for s in sweep_ids if _quotable(s)]
    id_clauses: list[Optional[str]] = [None]
    if run_ids is not None:
        id_clauses = [
            "attributes.run_id IN (" + ", ".join(f"'{r}'" for r in run_ids[i:i + _RUN_ID_CHUNK]) + ")"
            for i in range(0, len(run_ids), _RUN_ID_CHUNK)
            if all(_quotable(r) for r in run_ids[i:i + _RUN_ID_CHUNK])
        ]
    found: dict[str, Any] = {}
    for sweep_clause in sweep_clauses:
        for id_clause in id_clauses:
            clauses = base + [c for c in (sweep_clause, id_clause) if c]
            for run in _search_all(client, exp_ids, " and ".join(clauses)):
                found.setdefault(run.info.run_id, run)
    return [(r.info.run_id, r.info.experiment_id, r.info.status, r.info.start_time, r.info.end_time,
             r.data.params, r.data.metrics, r.data.tags)
            for r in found.values() if keep(r.info.run_id, r.data.tags)]


def runs_frame(
    uri_or_tracker: Any,
    experiment_names: Optional[list[str]] = None,
    *,
    sweep_ids: Optional[Iterable[str]] = None,
    run_ids: Optional[Iterable[str]] = None,
    tag_filters: Optional[dict[str, Any]] = None,
    kinds: Optional[Iterable[str]] = ("trial",),
    method: str = "auto",
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

    method: "search" reads through MlflowClient.search_runs (5000 runs a page; any store, MLflow
    servers included); "sql" reads the same rows of an SQL store (MLflow's SQLAlchemy store) with
    plain SELECTs over MLflow's table definitions, ~10x faster on 10,000 runs because no ORM
    objects are built; "auto" (default): "sql" where the store is MLflow's SQLAlchemy store and its
    database has the tables and columns the fast path reads (checked once per database), else
    "search"; any error of the SQL path falls back to "search" (one debug log line says why), so
    a change of MLflow's schema costs speed, never results. Tests check that both give the same frame.
    """
    import pandas as pd

    if method not in ("auto", "search", "sql"):
        raise ValueError(f"method must be 'auto', 'search' or 'sql', not {method!r}")
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
        readable = []
        for exp in experiments:  # one written by a newer jbench is left out, never reinterpreted
            try:
                check_tag(exp.tags.get(STORE_FORMAT_TAG), f"experiment '{exp.name}' in {redact(client.tracking_uri)}")
                readable.append(exp)
            except StoreFormatError as exc:
                log.warning("%s", exc)
        experiments = readable
    else:
        experiments = []
        for name in experiment_names:
            exp = client.get_experiment_by_name(name)
            if exp is None or exp.lifecycle_stage == "deleted":
                raise LookupError(f"no experiment named '{name}' in {client.tracking_uri}")
            check_tag(exp.tags.get(STORE_FORMAT_TAG), f"experiment '{name}' in {redact(client.tracking_uri)}")
            experiments.append(exp)
    exp_names = {e.experiment_id: e.name for e in experiments}

    kinds = None if kinds is None else list(dict.fromkeys(kinds))
    tag_filters = {k: str(v) for k, v in (tag_filters or {}).items()}
    # Keys a trial records as params (not also as tags) are selected on their params.
    param_filters = {k: tag_filters.pop(k) for k in list(tag_filters) if k in TAGS_FROM_PARAMS}
    sweep_list = None if sweep_ids is None else [str(s) for s in dict.fromkeys(sweep_ids)]
    id_list = None if run_ids is None else [str(r) for r in dict.fromkeys(run_ids)]
    sweep_set = None if sweep_list is None else set(sweep_list)
    id_set = None if id_list is None else set(id_list)

    def keep(run_id: str, tags: dict) -> bool:
        return ((kinds is None or tags.get("jbench.kind") in kinds)
                and (sweep_set is None or tags.get("jbench.sweep_id") in sweep_set)
                and (id_set is None or run_id in id_set)
                and all(tags.get(k) == v for k, v in tag_filters.items()))

    store = _sql_store(client) if method in ("auto", "sql") else None
    if method == "sql" and store is None:
        raise ValueError(f"method='sql' needs MLflow's SQL store; {client.tracking_uri} is not one")
    rows: Optional[list[tuple]] = None
    if not exp_names:
        rows = []
    elif method == "sql":  # asked for explicitly: errors are the caller's to see
        rows = _runs_via_sql(store, list(exp_names), keep, kinds=kinds, sweep_ids=sweep_list, run_ids=id_list)
    elif store is not None:
        # The fast path reads MLflow's tables directly, so it runs only where they look as expected and
        # any error (a schema change, a database hiccup mid-query) falls back to the public search API.
        why = _sql_capable(store)
        if why is None:
            try:
                rows = _runs_via_sql(store, list(exp_names), keep, kinds=kinds, sweep_ids=sweep_list,
                                     run_ids=id_list)
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
        if rows is None:
            log.debug("reading runs through MLflow's search API, not SQL (%s)", why)
    if rows is None:
        rows = _runs_via_search(client, list(exp_names), keep, kinds=kinds, sweep_ids=sweep_list, run_ids=id_list,
                                tag_filters=tag_filters)

    records = []
    keys: dict[str, set] = {"params": set(), "metrics": set(), "tags": set()}
    for run_id, exp_id, status, start, end, params, metrics, tags in rows:
        tags = {**{k: params[k] for k in TAGS_FROM_PARAMS if k in params}, **tags}
        if any(tags.get(k) != v for k, v in param_filters.items()):
            continue
        rec = {"run_id": run_id, "experiment": exp_names.get(exp_id, exp_id), "status": status,
               "start_time": start, "end_time": end}
        for group, values in (("params", params), ("metrics", metrics), ("tags", tags)):
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


def telemetry_frame(uri_or_tracker: Any, run_ids: Iterable[str], *, limit: Optional[int] = 12):
    """Telemetry of runs as one DataFrame for jbench.reporting.report.build_report: the runner's artifacts
    telemetry/samples.csv (columns t, power_w, gpu_freq_mhz, temp_max_c, ...) with a run_id column,
    and telemetry/windows.json as frame.attrs["phases"] = [{run_id, phase, t0, t1}].

    One artifact download per run, so at most `limit` runs (None: all) that have telemetry are read,
    in the order given; runs without telemetry artifacts are skipped."""
    import pandas as pd

    client = _reading_client(uri_or_tracker)
    frames, phases = [], []
    for run_id in dict.fromkeys(str(r) for r in run_ids):
        if limit is not None and len(frames) >= limit:
            break
        with tempfile.TemporaryDirectory(prefix="jbench-telemetry-") as tmp:
            try:
                local = Path(client.download_artifacts(run_id, "telemetry", tmp))
            except Exception:  # no telemetry artifacts for this run (the error type depends on the store)
                continue
            csv = local / "samples.csv"
            if not csv.is_file() or csv.stat().st_size == 0:
                continue
            samples = pd.read_csv(csv)
            if "t" not in samples.columns or samples.empty:
                continue
            samples.insert(0, "run_id", run_id)
            frames.append(samples)
            windows = local / "windows.json"
            if windows.is_file():
                for w in json.loads(windows.read_text()):
                    phases.append({"run_id": run_id, "phase": w["phase"], "t0": float(w["start"]), "t1": float(w["end"])})
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["run_id", "t"])
    out.attrs["phases"] = phases
    return out

def with_current_hashes(df):
    """A copy of a runs_frame with `tags.jbench.config_hash` and `tags.jbench.identity` under the current
    hash scheme (jbench.identity.HASH_VERSION) for every row: runs recorded under an older scheme (version 1:
    no `jbench.hash_version` tag) are identified again from their params and tags (jbench.identity.run_hashes).
    A row that cannot be recomputed (no params) keeps its recorded config hash; its identity is missing.
    What a run recorded is kept in `tags.jbench.config_hash_recorded`."""
    from jbench.models.digest import unchanged_local_digest

    out = df.copy()
    hashes = out["tags.jbench.config_hash"] if "tags.jbench.config_hash" in out else None
    out["tags.jbench.config_hash_recorded"] = hashes if hashes is not None else None
    config = list(hashes) if hashes is not None else [None] * len(out)
    identity = list(out["tags.jbench.identity"]) if "tags.jbench.identity" in out else [None] * len(out)
    versions = list(out["tags.jbench.hash_version"]) if "tags.jbench.hash_version" in out else [None] * len(out)
    need = [i for i, version in enumerate(versions) if version != str(HASH_VERSION)]
    if need:
        sub = out.iloc[need]
        sections = tuple(f"params.{name}." for name in identity_sections())
        # Column by column (only what identity reads): much faster than row records on wide frames.
        param_cols = {c[len("params."):]: sub[c].tolist() for c in out.columns if c.startswith(sections)}
        tag_cols = {t: sub[f"tags.{t}"].tolist() for t in RUN_TAGS if f"tags.{t}" in out.columns}
        starts = _epoch_ms(sub["start_time"]) if "start_time" in sub else [None] * len(need)
        for j, i in enumerate(need):
            params = {k: v[j] for k, v in param_cols.items() if isinstance(v[j], str)}
            tags = {k: v[j] for k, v in tag_cols.items() if isinstance(v[j], str)}
            chash, ident = run_hashes(params, tags, start_time_ms=starts[j], local_digest=unchanged_local_digest)
            if chash is not None:
                config[i] = chash
            identity[i] = ident
    out["tags.jbench.config_hash"] = config
    out["tags.jbench.identity"] = identity
    return out


def _epoch_ms(series) -> list[Optional[float]]:
    """Datetimes (UTC) as epoch milliseconds; None where missing."""
    return [None if t is None or t != t else t.value / 1e6 for t in series]


def finished_trials(uri_or_tracker: Any, experiment_name: str, *, key: str = "config_hash") -> dict[str, dict]:
    """FINISHED trial runs of an experiment keyed by `<hash>:<round>`, with their wall time and figures
    (resume, its summary rows and duration estimates): {key: {"run_id", "wall_s", "metrics", "noisy",
    "quality_identity", "quality_ok"}}.

    key="identity": the trial identity (jbench.identity.trial_identity: identity fields, backend build and
    model digest), what resume must match on (tag `jbench.identity`). key="config_hash": the configuration
    alone (Trial.config_hash), e.g. for duration estimates. Runs recorded under an older hash scheme
    (version 1) are identified again from their params and tags (with_current_hashes), so stores written
    by earlier versions still resume. Reads through runs_frame, which uses plain SQL on MLflow's SQL store
    (a few seconds for 10,000 runs where search_runs takes half a minute)."""
    if key not in ("identity", "config_hash"):
        raise ValueError(f"key must be 'identity' or 'config_hash', not {key!r}")
    uri = str(uri_or_tracker) if isinstance(uri_or_tracker, str) else ""
    if is_remote(uri) and server_problem(uri):
        # The sweep measures into the spool (tracking.unreachable=spool): nothing can be resumed from a dead server.
        log.info("tracking server %s does not answer: no trial is skipped as already FINISHED", uri)
        return {}
    exp = _reading_client(uri_or_tracker).get_experiment_by_name(experiment_name)
    if exp is None:
        return {}
    check_tag(exp.tags.get(STORE_FORMAT_TAG), f"experiment '{experiment_name}'")
    df = runs_frame(uri_or_tracker, [experiment_name], kinds=("trial",))
    found: dict[str, dict] = {}
    if df.empty:
        return found
    done = with_current_hashes(df[df["status"] == "FINISHED"].reset_index(drop=True))
    column = "tags.jbench.identity" if key == "identity" else "tags.jbench.config_hash"
    rounds = done["tags.jbench.round"] if "tags.jbench.round" in done else None
    metric_columns = [c for c in done.columns if c.startswith("metrics.")]
    noisy = done["tags.jbench.noisy"] if "tags.jbench.noisy" in done else None
    quality = done["tags.quality.identity"] if "tags.quality.identity" in done else None
    quality_status = done["tags.quality.status"] if "tags.quality.status" in done else None
    for i, (run_id, h) in enumerate(zip(done["run_id"], done[column])):
        if not isinstance(h, str) or not h:
            continue
        r = rounds.iloc[i] if rounds is not None and isinstance(rounds.iloc[i], str) else "1"
        # The run's figures (a resumed trial's summary row shows them); a metric the run lacks is left out.
        metrics = {c[len("metrics."):]: float(v) for c in metric_columns
                   if (v := done[c].iloc[i]) is not None and v == v}
        found.setdefault(resume_key(h, r), {"run_id": run_id, "wall_s": metrics.get("trial_wall_s"),
                                            "metrics": metrics,
                                            "noisy": noisy is not None and noisy.iloc[i] == "true",
                                            "quality_identity": _text(quality, i),
                                            "quality_ok": _text(quality_status, i) == "ok"})
    return found


def _text(column: Any, i: int) -> Optional[str]:
    """A tag column's value in row i, None where the column or the value is missing."""
    if column is None:
        return None
    value = column.iloc[i]
    return value if isinstance(value, str) and value else None
