"""`jbench memory RUN_ID`: the memory audit of one stored trial run (jbench.analysis.memory.audit)."""

from __future__ import annotations

import json
import math
from typing import Any

import click

from jbench.analysis.memory import audit, audit_markdown
from jbench.cli.app import _fail, common_options, main
from jbench.cli.stored import _results_tracker, _selection


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


@main.command("memory")
@click.argument("run_id")
@click.option("-o", "--output", "fmt", type=click.Choice(["md", "json"]), default="md", show_default=True,
              help="md (a markdown table) or json (the audit's lines).")
@common_options
def memory(run_id: str, fmt: str, results_dir) -> None:
    """Where one trial's memory went: OS and other processes at idle, CMA, weights, KV cache, compute and output
    buffers, the unexplained remainder, the measured totals and the planner's prediction. RUN_ID: a trial run's id
    or a unique prefix of it (the summary's run id column)."""
    tracker = _results_tracker(results_dir)
    df = _selection(tracker, run_id)
    if len(df) != 1:
        raise _fail(f"'{run_id}' selects {len(df)} trial runs: give one trial run's id (or a unique prefix of it)")
    row = df.iloc[0]
    metrics = {c[len("metrics."):]: row[c] for c in df.columns if c.startswith("metrics.") and _present(row[c])}
    tags = {c[len("tags."):]: row[c] for c in df.columns if c.startswith("tags.") and _present(row[c])}
    rid = str(row["run_id"])
    if not any(k.startswith("memory_") for k in metrics):
        why = tags.get("memory.status") or ("recorded without a memory stage: a run older than it, or one whose "
                                            "measurement failed")
        raise _fail(f"run {rid[:12]} has no memory figures: {why}")
    lines = audit(metrics, tags)
    if fmt == "json":
        click.echo(json.dumps({"run_id": rid, "run_name": tags.get("mlflow.runName"), "status": tags.get("memory.status"),
                               "lines": [{"label": ln.label, "mib": ln.mib, "source": ln.source} for ln in lines]},
                              indent=2))
        return
    name = tags.get("mlflow.runName")
    click.echo(f"Memory of run {rid[:12]}" + (f" ({name})" if name else "") + "\n")
    click.echo(audit_markdown(lines), nl=False)  # never wrapped, in a pipe either
