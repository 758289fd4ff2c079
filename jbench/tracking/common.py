"""MLflow access shared by the writer and the reader: the store's URI and value conversions.

The `jbench.tracking` package is the only place that imports mlflow.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional

# MLflow 3 sends usage telemetry of its own by default; jbench does not phone home for its users.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

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

def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def store_exists(uri: str) -> bool:
    """False for a local SQLite or file store that was never created (reading must not create one);
    True for anything else (a server is asked, not guessed)."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):]).exists()
    if uri.startswith("file:"):
        from urllib.parse import urlparse

        return Path(urlparse(uri).path).exists()
    if "://" not in uri:
        return Path(uri).exists()
    return True
