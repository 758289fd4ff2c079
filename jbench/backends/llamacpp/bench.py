"""llama-bench output: JSON-lines records read by field name (pure functions).

The record schema drifts between llama.cpp builds (fields appear, flash_attn changed from bool to int,
use_mmap became load_mode), so nothing here depends on field order or on fields jbench does not use.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from jbench.core.results import PhaseResult

# --------------------------------------------------------------------------------------------
# Parsing (pure functions)


class ParseError(ValueError):
    pass


def parse_records(stdout: str) -> list[dict]:
    """JSON records from llama-bench -o jsonl output; other lines (logs, comments) are ignored.

    A line may carry a leading device timestamp (`<epoch> {...}`, added by jbench's stamping
    wrapper); it is kept in the record as `_jbench_time`."""
    records = []
    for line in stdout.splitlines():
        line = line.strip()
        stamp = None
        if not line.startswith("{") and " {" in line:
            head, _, rest = line.partition(" ")
            try:
                stamp = float(head)
                line = rest.strip()
            except ValueError:
                continue
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            if stamp is not None:
                obj["_jbench_time"] = stamp
            records.append(obj)
    return records


def start_stamp(stdout: str) -> Optional[float]:
    for line in stdout.splitlines():
        head, _, rest = line.strip().partition(" ")
        if rest == "@@start":
            try:
                return float(head)
            except ValueError:
                return None
    return None


def _int(record: dict, key: str, default: Optional[int] = None) -> Optional[int]:
    value = record.get(key, default)
    if value is None or isinstance(value, bool):
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def record_phase(record: dict) -> Optional[PhaseResult]:
    """A prefill (n_prompt > 0, n_gen == 0) or decode (n_gen > 0, n_prompt == 0) result.

    Mixed pg tests (both > 0) are not a single phase and are skipped. Per-repetition times come
    from samples_ns; builds without samples_ns give avg_ns as a single sample.
    """
    n_prompt = _int(record, "n_prompt", 0)
    n_gen = _int(record, "n_gen", 0)
    depth = _int(record, "n_depth", 0) or 0
    if n_prompt and not n_gen:
        phase, n = "prefill", n_prompt
    elif n_gen and not n_prompt:
        phase, n = "decode", n_gen
    else:
        return None
    samples = record.get("samples_ns")
    if isinstance(samples, list) and samples:
        samples_ns = [int(s) for s in samples]
    elif _int(record, "avg_ns"):
        samples_ns = [_int(record, "avg_ns")]
    else:
        raise ParseError(f"{phase} record has neither samples_ns nor avg_ns")
    if any(s <= 0 for s in samples_ns):
        raise ParseError(f"{phase} record has a non-positive sample time: {samples_ns}")
    end = record.get("_jbench_time")
    return PhaseResult(phase=phase, n_tokens=n, samples_ns=samples_ns, depth=depth,
                       end_time=float(end) if end is not None else None)


def normalize_flash_attn(value: Any) -> str:
    """Older builds print a bool, newer an int (-1 auto, 0 off, 1 on)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int):
        return {-1: "auto", 0: "off", 1: "on"}.get(value, str(value))
    return str(value)


_INFO_FIELDS = (
    "cpu_info", "gpu_info", "backends", "model_filename", "model_type", "model_size",
    "model_n_params", "n_batch", "n_ubatch", "n_threads", "type_k", "type_v", "n_gpu_layers",
    "test_time", "devices",
)


def parse_output(stdout: str) -> tuple[dict[str, PhaseResult], dict[str, str], dict[str, Any]]:
    """(phases, build identity, info) from llama-bench jsonl output. Raises ParseError."""
    records = parse_records(stdout)
    if not records:
        raise ParseError("no JSON records in llama-bench output")
    phases: dict[str, PhaseResult] = {}
    for rec in records:
        phase = record_phase(rec)
        if phase is None:
            continue
        if phase.phase in phases:
            raise ParseError(f"more than one {phase.phase} record; jbench runs one of each per trial")
        phases[phase.phase] = phase
    if not phases:
        raise ParseError("no prefill or decode record (need n_prompt or n_gen in each record)")
    first = records[0]
    build = {}
    for key in ("build_commit", "build_number"):
        if first.get(key) is not None:
            build[key] = str(first[key])
    info = {k: first[k] for k in _INFO_FIELDS if k in first}
    if "flash_attn" in first:
        info["flash_attn"] = normalize_flash_attn(first["flash_attn"])
    return phases, build, info


# --------------------------------------------------------------------------------------------
# The backend
