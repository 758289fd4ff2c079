"""The memory stage: after the measurement, one more run of the trial's workload that accounts for its memory (the
backend's `memory_pass`: the process's peak RSS and the backend's own buffer sizes), beside the planner's prediction
and the CMA in use before it. Figures and their reasons: docs/metrics.md, "Memory"; the arithmetic:
jbench.analysis.memory.

A failed memory pass never fails the trial (its speed and energy are measured already): the memory metrics are
absent and `memory.status` says why, out of memory by name. A lost connection is not a failed pass: it propagates,
and the trial runner retries the trial as it does for any stage.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any, Optional

from jbench.analysis.memory import Prediction, log_excerpt, memory_metrics, predict
from jbench.analysis.roofline import RooflineError, kv_bytes_per_token
from jbench.backends.base import BackendError
from jbench.core import metrics
from jbench.core.results import Result
from jbench.core.trial import context_tokens
from jbench.device.connection import Connection, ConnectionLost, DeviceError
from jbench.models.facts import model_facts
from jbench.models.gguf import GGUFMetaError
from jbench.models.memory_facts import MeasuredBuffers, MemoryKey, lookup, now, store
from jbench.models.store import ModelError, resolve_model_file
from jbench.runner.context import TrialContext
from jbench.runner.stages import Stage

ARTIFACT = "raw/memory-pass-stderr.txt"


def cma_in_use(conn: Connection) -> tuple[Optional[float], str]:
    """(CmaTotal − CmaFree in MiB, status) from the device's /proc/meminfo; None where the kernel has no CMA."""
    res = conn.run(["cat", "/proc/meminfo"], timeout=30)
    if not res.ok:
        return None, f"not measured: cat /proc/meminfo exited {res.returncode}: {res.stderr.strip()[-200:]}"
    kib: dict[str, int] = {}
    for line in res.stdout.splitlines():
        name, _, rest = line.partition(":")
        if name in ("CmaTotal", "CmaFree") and rest.split():
            kib[name] = int(rest.split()[0])  # kB in /proc/meminfo are KiB
    if len(kib) < 2:
        return None, "not measured: /proc/meminfo has no CmaTotal/CmaFree (a kernel without CMA)"
    return (kib["CmaTotal"] - kib["CmaFree"]) / 1024, "ok"


def _kv_types(backend: Any) -> tuple[str, str]:
    """The KV-cache types a backend's config sets; a backend without the setting keeps its cache in F16 (as the
    planner's memory check counts it)."""
    if hasattr(backend, "cache_type_k"):
        return backend.cache_type_k, backend.cache_type_v
    return "f16", "f16"


def buffer_key(ctx: TrialContext) -> Optional[MemoryKey]:
    """This trial's configuration in the measured-buffer cache (jbench.models.memory_facts), or None when the
    backend keeps no buffer account or its build is unknown."""
    cfg = ctx.cfg
    settings = type(ctx.backend).buffer_settings(cfg.backend)
    build = ctx.session.build_id(cfg.backend)
    if settings is None or not build:
        return None
    return MemoryKey.of(cfg.backend.name, build, cfg.device.name, settings)


def trial_prediction(ctx: TrialContext, key: Optional[MemoryKey], model: Optional[str]) -> tuple[Optional[Prediction], str]:
    """The planner's prediction for this trial (weights + KV from the model file here, measured compute and output
    buffers when this configuration was measured before), or None and why."""
    cfg = ctx.cfg
    if not ctx.backend.reads_model_file(ctx.trial):
        return None, "not predicted: the backend does not read the trial's model file (its server loads a model of its own)"
    try:
        path, _ = resolve_model_file(cfg.model)
    except ModelError as exc:
        return None, f"not predicted: {exc}"
    if not Path(path).is_file():
        return None, (f"not predicted: model file {path} is not on this machine (remote device): no file size or "
                      "GGUF header to predict from")
    type_k, type_v = _kv_types(cfg.backend)
    try:
        facts = model_facts(path)
        arch, _ = facts.model_arch()
        kv_tok = kv_bytes_per_token(arch, type_k.upper(), type_v.upper())
    except (OSError, GGUFMetaError, RooflineError, KeyError, ValueError) as exc:
        return None, f"not predicted: {exc}"
    measured = lookup(key, model) if key is not None and model else None
    return predict(facts.size, kv_tok * context_tokens(cfg.backend),
                   measured.compute_mib if measured else None, measured.output_mib if measured else None,
                   measured_from=f"{measured.describe()}, build {key.build}" if measured and key else ""), "ok"


class Memory(Stage):
    """The trial's memory: peak RSS and the backend's buffers from a memory pass, CMA before it, the prediction."""

    NAME = metrics.MEMORY
    PROVIDES = tuple(metrics.provided_by(NAME))
    REQUIRES = tuple(metrics.required_by(NAME))

    def applies(self, ctx: TrialContext) -> bool:
        return ctx.backend_result is not None  # the measurement ran: a failed one stopped the trial before here

    def run(self, ctx: TrialContext) -> None:
        cfg = ctx.cfg
        out = Result()
        try:
            cma, out.tags["memory.cma.status"] = cma_in_use(ctx.conn)
        except ConnectionLost:
            raise
        except DeviceError as exc:
            cma, out.tags["memory.cma.status"] = None, f"not measured: {exc}"
        if cma is not None:
            out.metrics["memory_cma_idle_mib"] = cma
        key = buffer_key(ctx)
        model = ctx.session.model_digest(cfg.model)
        # Predicted before this pass stores its own figures: the prediction is what the planner knew.
        prediction, why = trial_prediction(ctx, key, model)
        try:
            with ctx.quiet():  # on this machine: nothing else of jbench's runs while the backend does
                found = ctx.backend.memory_pass(ctx.trial, ctx.conn, ctx.log)
        except ConnectionLost:
            raise
        except (BackendError, DeviceError) as exc:
            found = None
            if isinstance(exc, BackendError) and exc.category == "out_of_memory":
                status = f"not measured: the memory pass ran out of memory ({exc})"
            elif isinstance(exc, BackendError):
                status = f"not measured: the memory pass failed ({exc.category}): {exc}"
            else:
                status = f"not measured: the memory pass failed on the device: {exc}"
            ctx.log.warning("memory: %s", status)
            out.tags["memory.status"] = status
            if isinstance(exc, BackendError) and exc.raw_stderr:
                out.artifacts[ARTIFACT] = log_excerpt(exc.raw_stderr, tail=60)
        else:
            if found is None:
                out.tags["memory.status"] = (f"not measured: backend {cfg.backend.name} reports no memory account for "
                                             "this trial")
        if found is None:
            if prediction is not None:
                out.metrics["memory_predicted_mib"] = prediction.mib
                out.tags["memory.prediction"] = prediction.describe()
            else:
                out.tags["memory.prediction"] = why
            ctx.record.merge(out)
            return
        gpu = ctx.record.metrics.get("memory_gpu_over_idle_mib")  # the Measure stage's, NVML
        found_metrics, found_tags = memory_metrics(found.account, found.peak_rss_kib,
                                                   None if gpu is None or math.isnan(gpu) else gpu, prediction)
        out.metrics.update(found_metrics)
        out.tags.update(found_tags)
        if prediction is None:
            out.tags["memory.prediction"] = why
        out.tags["memory.command"] = shlex.join(found.command)[:4000]
        out.artifacts[ARTIFACT] = log_excerpt(found.raw_stderr)
        ctx.record.merge(out)
        account = found.account
        compute = account.total("compute") if account else None
        output = account.total("output") if account else None
        if key is not None and model and compute is not None and output is not None:
            store(key, model, MeasuredBuffers(compute_mib=compute, output_mib=output,
                                              kv_mib=account.total("kv") if account else None,
                                              measured_at=now(), device=cfg.device.name))
