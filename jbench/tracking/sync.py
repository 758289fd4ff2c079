"""`jbench sync`: upload the spool (results/spool/, a local MLflow store) to the tracking server exactly once.

Idempotent by run identity (tag jbench.run_uid): each spool run is looked up on the server; what is missing
is created, what is half there is completed (params it lacks, metric points it lacks, compared by step,
timestamp and value; tags and artifacts are overwritten with the same content), then the run gets its
original status and end time, and the spool run is marked synced (tag jbench.synced_to). Every step can be
repeated, so an interrupted sync is finished by running it again.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

import jbench.tracking.artifacts  # noqa: F401  (the spool's mlflow-artifacts:/ locations)
from jbench.tracking.common import (_BATCH, LOCAL_ARTIFACTS, RUN_UID_TAG, SYNCED_TAG, disk_full, disk_spool_dir,
                                    free_space, is_remote, local_uri, redact, server_problem, spool_dir)
from jbench.tracking.writer import PARENT_UID_TAG, SPOOLED_FOR_TAG, StoreError, unreachable


class SyncError(Exception):
    """Nothing can be uploaded now (no server given, server down); the spool is untouched."""


@dataclass
class SyncResult:
    uri: str
    uploaded: list[tuple[str, str]] = field(default_factory=list)  # (spool run id, server run id)
    already: int = 0  # spool runs synced before
    running: list[str] = field(default_factory=list)  # spool runs still open (a sweep writing to the spool)


def spool_store(results_dir: str | Path) -> Optional[str]:
    """The spool's URI, or None when there is no spool."""
    db = spool_dir(results_dir) / "mlflow.db"
    return local_uri(spool_dir(results_dir)) if db.exists() else None


def _all_runs(client: MlflowClient, exp_id: str, filter_string: str = "") -> list:
    runs, token = [], None
    while True:
        page = client.search_runs([exp_id], filter_string=filter_string, max_results=1000, page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            return runs


def target_uri(results_dir: str | Path, uri: Optional[str]) -> str:
    """The server to upload to: the one given, else the one the spool's runs were meant for."""
    if uri:
        return uri
    spool = spool_store(results_dir)
    targets: set[str] = set()
    if spool:
        local = MlflowClient(spool)
        for exp in local.search_experiments():
            targets |= {r.data.tags.get(SPOOLED_FOR_TAG) for r in _all_runs(local, exp.experiment_id)} - {None}
    if len(targets) == 1 and ":***@" not in next(iter(targets)):
        return targets.pop()
    if len(targets) == 1:  # the spool records a URI without its password
        raise SyncError(f"the spool's runs were meant for {targets.pop()}: give that server with its credentials, "
                        "`jbench sync --uri URI` or MLFLOW_TRACKING_URI (or MLFLOW_TRACKING_USERNAME and "
                        "MLFLOW_TRACKING_PASSWORD beside a URI without them)")
    raise SyncError("name the tracking server: `jbench sync --uri http://HOST:PORT` or set MLFLOW_TRACKING_URI"
                    + (f" (the spool holds runs for {', '.join(sorted(targets))})" if targets else ""))


def sync(results_dir: str | Path, uri: str, progress: Callable[[str], None] = lambda step: None, *,
         spool_at: Optional[Path] = None) -> SyncResult:
    """Upload every spool run not yet synced to the server at `uri`. `progress` is told each step. `spool_at`: another
    spool directory than the results directory's (a full disk's, disk_spool_dir)."""
    if spool_at is not None:
        spool = local_uri(spool_at) if (spool_at / "mlflow.db").exists() else None
    else:
        spool = spool_store(results_dir)
    result = SyncResult(uri)
    if spool is None:
        return result
    down = server_problem(uri)
    if down:
        raise SyncError(f"tracking server {redact(uri)}: {down}; nothing was uploaded and the spool "
                        f"{spool_dir(results_dir)} is untouched. Start the server and run `jbench sync` again")
    try:
        _sync(MlflowClient(spool), MlflowClient(uri), result, progress)
    except Exception as exc:
        if not unreachable(exc):
            raise
        # What was uploaded is marked; the run being uploaded is completed by the next sync (by run identity).
        raise SyncError(f"tracking server {redact(uri)} stopped answering after {len(result.uploaded)} run(s); "
                        "run `jbench sync` again once it is back") from None
    return result


def _sync(local: MlflowClient, server: MlflowClient, result: SyncResult, progress: Callable[[str], None]) -> None:
    uid_to_server: dict[str, str] = {}
    for exp in local.search_experiments():
        runs = _all_runs(local, exp.experiment_id)
        if not runs:
            continue
        server_exp = server.get_experiment_by_name(exp.name)
        # Into a local store (a full disk's spool going home): artifacts beside that store, as the writer makes them.
        location = None if is_remote(server.tracking_uri) else LOCAL_ARTIFACTS + exp.name
        exp_id = server_exp.experiment_id if server_exp else server.create_experiment(exp.name, location)
        for key, value in exp.tags.items():
            server.set_experiment_tag(exp_id, key, value)
        # Parents before children, so a child links to its parent's run id on the server.
        runs.sort(key=lambda r: (MLFLOW_PARENT_RUN_ID in r.data.tags, r.info.start_time))
        by_id = {r.info.run_id: r for r in runs}
        for run in runs:
            if run.data.tags.get(SYNCED_TAG):
                result.already += 1
                uid_to_server[run.data.tags[RUN_UID_TAG]] = run.data.tags[SYNCED_TAG]
                continue
            if run.info.status == "RUNNING":
                result.running.append(run.info.run_id)
                continue
            server_id = _upload(local, server, exp_id, run, by_id, uid_to_server, progress)
            local.set_tag(run.info.run_id, SYNCED_TAG, server_id)
            result.uploaded.append((run.info.run_id, server_id))
            progress(f"synced {run.info.run_name}")


def _server_run(server: MlflowClient, exp_id: str, uid: str):
    found = server.search_runs([exp_id], filter_string=f"tags.`{RUN_UID_TAG}` = '{uid}'", max_results=2)
    return found[0] if found else None


def _upload(local: MlflowClient, server: MlflowClient, exp_id: str, run, by_id: dict, uid_to_server: dict,
            progress: Callable[[str], None]) -> str:
    tags = dict(run.data.tags)
    uid = tags[RUN_UID_TAG]
    parent_uid = tags.get(PARENT_UID_TAG) or (
        by_id[tags[MLFLOW_PARENT_RUN_ID]].data.tags.get(RUN_UID_TAG) if tags.get(MLFLOW_PARENT_RUN_ID) in by_id else None)
    tags.pop(SPOOLED_FOR_TAG, None)
    tags.pop(MLFLOW_PARENT_RUN_ID, None)
    if parent_uid:
        if parent_uid not in uid_to_server:
            parent = _server_run(server, exp_id, parent_uid)
            if parent is not None:
                uid_to_server[parent_uid] = parent.info.run_id
        if parent_uid in uid_to_server:
            tags[MLFLOW_PARENT_RUN_ID] = uid_to_server[parent_uid]
    existing = _server_run(server, exp_id, uid)
    if existing is None:
        created = server.create_run(exp_id, start_time=run.info.start_time, run_name=run.info.run_name,
                                    tags={RUN_UID_TAG: uid})
        server_id, have_params, have_metrics = created.info.run_id, {}, set()
        progress(f"created {run.info.run_name}")
    else:
        server_id, have_params, have_metrics = existing.info.run_id, existing.data.params, set(existing.data.metrics)
    uid_to_server[uid] = server_id
    params = [Param(k, v) for k, v in run.data.params.items() if k not in have_params]
    tag_list = [RunTag(k, v) for k, v in tags.items()]
    while params or tag_list:
        server.log_batch(server_id, params=params[:_BATCH], tags=tag_list[:_BATCH])
        params, tag_list = params[_BATCH:], tag_list[_BATCH:]
    progress(f"params and tags of {run.info.run_name}")
    points: list[Metric] = []
    for key in run.data.metrics:
        have = {(m.step, m.timestamp, m.value) for m in server.get_metric_history(server_id, key)} \
            if key in have_metrics else set()
        points += [m for m in local.get_metric_history(run.info.run_id, key)
                   if (m.step, m.timestamp, m.value) not in have]
    for i in range(0, len(points), 1000):
        server.log_batch(server_id, metrics=points[i:i + 1000])
    progress(f"metrics of {run.info.run_name}")
    if local.list_artifacts(run.info.run_id):
        with tempfile.TemporaryDirectory(prefix="jbench-sync-") as tmp:
            path = local.download_artifacts(run.info.run_id, "", tmp)
            server.log_artifacts(server_id, path)
    progress(f"artifacts of {run.info.run_name}")
    server.set_terminated(server_id, status=run.info.status, end_time=run.info.end_time)
    return server_id


def sync_disk_spool(results_dir: str | Path, progress: Callable[[str], None] = lambda step: None
                    ) -> Optional[SyncResult]:
    """Upload what a full disk sent to the spool in jbench's cache (disk_spool_dir) into the local store it was meant
    for, once there is room again; the spool is removed when everything in it is uploaded. None: no such spool.
    Raises StoreError (one line) when the disk is still full."""
    spool = disk_spool_dir(results_dir)
    if not (spool / "mlflow.db").exists():
        return None
    uri = local_uri(results_dir)
    try:
        result = sync(results_dir, uri, progress, spool_at=spool)
    except Exception as exc:
        if not disk_full(exc):
            raise
        raise StoreError(f"disk full: the runs measured while {uri} had no space left wait in the spool {spool}, and "
                         f"there is still no room for them ({free_space(results_dir)}). Free some space and run "
                         "again") from None
    if not result.running:
        shutil.rmtree(spool, ignore_errors=True)
    return result
