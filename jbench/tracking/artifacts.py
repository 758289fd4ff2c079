"""`mlflow-artifacts:/` URIs of a local SQLite store resolve to `artifacts/` beside the database.

Experiments jbench creates in a local store get the artifact location `mlflow-artifacts:/<name>`, never an
absolute path, so a store can be moved: in this process MLflow's client finds the artifacts under the
store's current directory (this module re-registers the scheme), and `jbench ui` serves them with
`mlflow server --artifacts-destination <results>/artifacts`. With a server's URI the scheme means what it
always meant (the server's proxied artifacts). jbench's package declares `repository` in MLflow's
`mlflow.artifact_repository` entry-point group, so any MlflowClient in the same environment (a notebook,
a script) reads a local store's artifacts too; the registration below covers a checkout that is not installed.
"""

from __future__ import annotations

from typing import Optional

from mlflow.store.artifact.artifact_repository_registry import _artifact_repository_registry
from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository
from mlflow.store.artifact.mlflow_artifacts_repo import MlflowArtifactsRepository

from jbench.tracking.common import LOCAL_ARTIFACTS, artifacts_root


def repository(artifact_uri: str, tracking_uri: Optional[str] = None, registry_uri: Optional[str] = None):
    root = artifacts_root(tracking_uri or "")
    if root is not None and artifact_uri.startswith(LOCAL_ARTIFACTS) and not artifact_uri.startswith("mlflow-artifacts://"):
        return LocalArtifactRepository((root / artifact_uri[len(LOCAL_ARTIFACTS):].lstrip("/")).as_uri())
    return MlflowArtifactsRepository(artifact_uri, tracking_uri=tracking_uri, registry_uri=registry_uri)


_artifact_repository_registry.register("mlflow-artifacts", repository)
