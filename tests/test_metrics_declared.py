"""Every metric jbench records is declared once (jbench/core/metrics.py) and documented (docs/metrics.md).

Three checks keep the three in step: docs/metrics.md's `name | unit | description` tables are the declarations,
row for row; the real producers, run on fixture data, emit exactly the names their group declares; and every
metric key the code writes (`metrics[...] = `, `metrics={...}`, `.metrics.update({...})`, a `*metrics` function's
result) resolves to a declaration, so a new metric cannot be added without its declaration.
"""

from __future__ import annotations

import ast
import dataclasses
import graphlib
import logging
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Optional

import pytest

from jbench.core import metrics as M
from jbench.core.metrics import MetricDecl, UnknownMetric, metric, unit_of

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "metrics.md"
HEADER = "| name | unit | description |"
MARKER = re.compile(r"<!-- metrics: (\w+) -->")


def _names(group: str) -> set[str]:
    return {n for d in M.declarations() if d.group == group for n in d.names()}


# --------------------------------------------------------------------------------------------
# The declarations themselves


def test_lookup_resolves_patterns_and_concrete_names():
    assert metric("decode_tps") is metric("{phase}_tps") and metric("decode_tps").name == "{phase}_tps"
    assert unit_of("prefill_tps") == "tok/s" and unit_of("ttft_ms_p99") == "ms" and unit_of("ttft_ms_mean") == "ms"
    assert unit_of("cooldown_oc3_events") == "1" and unit_of("decode_tokens_per_joule") == "tok/J"
    assert unit_of("system/device/temp_max_c") == "°C" and unit_of("trial_wall_s") == "s"
    assert metric("decode_energy_j").name == "{window}_energy_j"
    assert metric("decode_wall_energy_j").name == "{window}_wall_energy_j"  # not {window}_energy_j's
    assert metric("decode_tps_cv").match("decode_tps_cv") == {"phase": "decode"}
    assert metric("decode_tps_cv").inputs("decode_tps_cv") == ("decode_tps", "decode_tps_std")
    assert metric("ttft_ms_p50").sign == -1 and metric("decode_tps").sign == 1 and metric("decode_tokens").sign == 0
    for bad in ("warmup_tps", "decode_tsp", "ttft_ms_p95", "{phase}_nope", ""):
        assert not M.is_declared(bad) and M.find(bad) is None
        with pytest.raises(UnknownMetric):
            metric(bad)
    with pytest.raises(KeyError, match="did you mean decode_tps"):
        unit_of("decode_tsp")


def test_declared_names_are_every_concrete_name_once():
    names = M.declared_names()
    assert len(names) == len(set(names))
    assert {"prefill_tps", "decode_tps", "idle_power_w", "load_energy_j", "ttft_ms_p90", "decode_oc1_events",
            "roofline_fraction", "gemv_ceiling_tps", "system/device/power_w"} <= set(names)
    assert not [n for n in names if "{" in n]
    for name in names:
        assert M.is_declared(name) and metric(name).match(name) is not None


@pytest.mark.parametrize("decl", list(M.DECLARATIONS), ids=lambda d: d.name)
def test_a_declaration_is_well_formed(decl: MetricDecl):
    assert decl.unit in M.UNITS
    assert decl.group in M.GROUPS
    assert decl.provider in (M.MEASURE, M.PHASE_SPEED, M.ROOFLINE, M.RUNNER, M.QUALITY, M.MEMORY, M.SERVING)
    assert decl.better in (None, M.HIGHER, M.LOWER)
    assert set(decl.placeholders) <= set(M.PLACEHOLDERS)
    # One table row: no line break, no cell separator.
    assert decl.description and "\n" not in decl.description and "|" not in decl.description
    for req in decl.requires:  # an input uses only the placeholders the name binds, and is declared itself
        assert set(re.findall(r"\{(\w+)\}", req)) <= set(decl.placeholders), req
    for name in decl.names():
        for req in decl.inputs(name):
            assert M.is_declared(req), f"{name} requires undeclared {req}"


def test_stages_can_be_ordered_by_what_they_provide_and_require():
    assert M.required_by(M.ROOFLINE) == ["decode_tps"]
    assert M.required_by(M.PHASE_SPEED) == [] and M.required_by(M.MEASURE) == []
    assert set(M.provided_by(M.PHASE_SPEED)) >= {"decode_tps", "prefill_tps_cv", "decode_tps_rep"}
    order = list(graphlib.TopologicalSorter(M.stage_dependencies()).static_order())  # raises on a cycle
    assert order.index(M.PHASE_SPEED) < order.index(M.ROOFLINE)


# --------------------------------------------------------------------------------------------
# docs/metrics.md


def doc_tables(text: str) -> Iterator[tuple[str, int, list[tuple[str, str, str]]]]:
    """(group, line number, rows) of every `name | unit | description` table; a table must follow its marker."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() != HEADER:
            continue
        marker = MARKER.fullmatch(lines[i - 1].strip()) if i else None
        assert marker, f"docs/metrics.md:{i + 1}: a metric table without its <!-- metrics: GROUP --> line above"
        rows = []
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            cells = [c.strip() for c in row.strip().strip("|").split("|")]
            assert len(cells) == 3 and re.fullmatch(r"`[^`]+`", cells[0]), f"not a name | unit | description row: {row}"
            rows.append((cells[0].strip("`"), cells[1], cells[2]))
        yield marker.group(1), i + 1, rows


def test_every_documented_metric_is_declared_and_every_declared_one_documented():
    text = DOC.read_text(encoding="utf-8")
    documented: dict[str, tuple[str, str, str]] = {}
    groups: list[str] = []
    for group, line, rows in doc_tables(text):
        groups.append(group)
        assert group in M.GROUPS, f"docs/metrics.md:{line}: unknown group {group}"
        expected = M.metrics_table(group)
        for name, unit, description in rows:
            assert name not in documented, f"{name} is documented twice"
            documented[name] = (group, unit, description)
            assert M.find(name) is not None and M.find(name).name == name, (
                f"docs/metrics.md:{line}: {name} is documented but not declared in jbench/core/metrics.py")
            decl = metric(name)
            assert (group, unit, description) == (decl.group, decl.unit, decl.description), (
                f"docs/metrics.md:{line}: {name} differs from its declaration; the table should read:\n{expected}")
    assert sorted(groups) == sorted(M.GROUPS), "one table per group"
    missing = [d.name for d in M.declarations() if d.name not in documented]
    assert not missing, f"declared but not in docs/metrics.md: {missing}"


def test_metrics_md_has_no_unchecked_metric_table():
    # Any other table whose first column is a metric would escape the check above.
    for i, line in enumerate(DOC.read_text(encoding="utf-8").splitlines()):
        assert not re.match(r"\|\s*metric\b", line), f"docs/metrics.md:{i + 1}: write metric tables as {HEADER}"


def test_the_checker_notices_a_wrong_row():
    table = M.metrics_table("roofline").replace("| B/tok |", "| s |", 1)
    ((group, _, rows),) = list(doc_tables(table))
    wrong = next(r for r in rows if r[1] == "s")
    assert group == "roofline" and unit_of(wrong[0]) != "s"
    with pytest.raises(AssertionError, match="without its"):
        list(doc_tables(HEADER + "\n|---|---|---|\n| `decode_tps` | tok/s | x |\n"))


# --------------------------------------------------------------------------------------------
# The real producers on fixture data: each emits exactly its group's names


def test_phase_metrics_emits_the_phase_speed_declarations():
    from jbench.core.results import BackendResult, PhaseResult
    from jbench.runner.analyses import phase_metrics

    from jbench.analysis.settle import settle_phase

    # Settled as the llama.cpp backend settles them: a cold first prefill repetition is set aside.
    result = BackendResult(phases={
        "prefill": settle_phase(PhaseResult("prefill", 16, [6_000_000, 2_000_000, 2_100_000, 1_900_000]), 1)[0],
        "decode": settle_phase(PhaseResult("decode", 4, [90_000_000, 40_000_000, 41_000_000, 39_000_000]), 1)[0],
    })
    out = phase_metrics(result)
    emitted = set(out.metrics) | set(out.stepped)
    assert emitted == set(M.provided_by(M.PHASE_SPEED))
    assert set(out.stepped) == {n for d in M.declarations() if d.stepped and d.provider == M.PHASE_SPEED for n in d.names()}
    assert all(math.isfinite(v) for v in out.metrics.values())


def _telemetry_samples() -> list[dict]:
    """60 s at 10 Hz with every signal the energy and throttling metrics read (counters rising, clocks moving)."""
    samples = []
    for i in range(601):
        t = 1000.0 + i / 10
        samples.append({"t": t, "power_w": 5.0 + (i % 7), "energy_j": 6.0 * i / 10, "gpu_power_w": 2.0,
                        "cpu_power_w": 1.0, "cpu_gpu_cv_power_w": 2.5, "oc1_event_cnt": i // 50,
                        "oc2_event_cnt": i // 40, "oc3_event_cnt": i // 30, "temp_max_c": 40 + i / 100,
                        "gpu_freq_mhz": 900.0 - (i % 10) * 10, "cpu_freq_mhz": 1500.0 - (i % 5) * 20,
                        "gpu_load_pct": 90.0, "emc_load_pct": 60.0})
    return samples


def _windows():
    from jbench.analysis.telemetry import PhaseWindow

    return [PhaseWindow("idle", 1000.5, 1010.0), PhaseWindow("load", 1010.0, 1015.0),
            PhaseWindow("prefill", 1015.0, 1025.0, tokens=1600), PhaseWindow("decode", 1025.0, 1040.0, tokens=400),
            PhaseWindow("cooldown", 1040.0, 1050.0)]


def test_energy_metrics_emit_the_energy_and_throttling_declarations():
    from jbench.analysis.telemetry import EnergySettings, energy_metrics

    # The idle window draws little, so the phases' above-idle figures are positive and logged.
    samples = [dict(s, power_w=1.0) if s["t"] <= 1010.0 else s for s in _telemetry_samples()]
    metrics, tags = energy_metrics(samples, _windows(), EnergySettings())
    assert tags["energy.status"] == "ok" and tags["throttling.status"] == "ok"
    assert set(metrics) == _names("energy") | _names("throttling")


def test_wall_metrics_emit_the_wall_declarations():
    from jbench.analysis.telemetry import EnergySettings
    from jbench.analysis.wall import board_coverage_metrics, wall_energy_metrics

    samples = _telemetry_samples()
    metrics, tags = wall_energy_metrics(samples, _windows(), EnergySettings(), counter_resolution_j=0.001)
    metrics.update(board_coverage_metrics(samples, _windows(), EnergySettings()))
    assert tags["wall.energy.status"] == "ok"
    assert set(metrics) == _names("wall")


def test_telemetry_series_are_declared():
    from jbench.analysis.telemetry import mlflow_series

    assert set(mlflow_series(_telemetry_samples())) == _names("telemetry_series")


def test_latency_metrics_emit_the_latency_declarations():
    from jbench.backends.llamacpp.client import RequestRecord, latency_metrics
    from jbench.backends.llamacpp.serving import draft_metrics

    # With a draft model: the server's counters in each request's final timings (what the latency scenario adds).
    records = [RequestRecord(index=i, worker=0, sent_at=float(i), ttft_s=0.05 + i / 100, e2e_s=0.5 + i / 50,
                             token_times_s=[], output_tokens=8, tokens_source="usage", streamed_token_chunks=8,
                             server_timings={"prompt_per_second": 300.0 + i, "predicted_per_second": 20.0 + i,
                                             "draft_n": 6, "draft_n_accepted": 4})
               for i in range(5)]
    metrics = {**latency_metrics(records, concurrency=2, wall_s=1.5), **draft_metrics(records)}
    assert set(metrics) == _names("latency")
    assert all(metric(n).backend == "llamacpp" for n in metrics)


def test_roofline_emits_the_roofline_declarations(tmp_path):
    from jbench.device.bandwidth import Bandwidth, Calibration
    from jbench.runner.analyses import trial_roofline
    from tests.test_roofline import _write_gguf

    path = tmp_path / "tiny.gguf"
    _write_gguf(path)
    cal = Calibration(device="dev", probe="cpu", power_state="governor=performance", method="test",
                      runs=[9.0, 10.0, 11.0], size_mb=64, measured_at="2026-01-01T00:00:00")
    from jbench.core.trial import trial_config

    config = trial_config({"model": {"name": "tiny", "quant": "F16", "source": "files", "files": {"F16": str(path)}},
                           "backend": {"name": "llamacpp"}, "device": {"name": "dev"}})
    out = trial_roofline(config, 1.0, Bandwidth(cal.ceiling_gbs, "jbench calibrate", cal))
    assert out.tags["roofline.status"] == "ok" and out.metrics["roofline_fraction"] < 1
    assert set(out.metrics) == set(M.provided_by(M.ROOFLINE)) == _names("roofline")


def test_the_engine_trace_emits_the_engine_declarations(tmp_path):
    from jbench.device.local import LocalConnection
    from tests.test_engine_backend import _trial

    trial, backend = _trial(tmp_path, "backend.repetitions=1", "backend.trace=true", "backend.bandwidth_gbs=50",
                            "backend.extra_args=[--ms-decimals,3]")
    result = backend.run(trial, LocalConnection(), logging.getLogger("jbench.test.metrics"))
    assert set(result.metrics) == _names("engine")


def test_trtllm_phase_metrics_are_declared():
    from jbench.backends.trtllm.parse import JetsonReferenceRow, phase_metrics

    row = JetsonReferenceRow(config="INT4", batch_size=1, input_length=128, output_length=128, context_ms=50.0,
                             decode_tps=30.0)
    assert set(phase_metrics(row).as_metrics()) == {"decode_tps", "prefill_tps"}


# --------------------------------------------------------------------------------------------
# Every key the code writes into a metrics dict resolves to a declaration


def _key(node: ast.AST) -> Optional[str]:
    """A constant key as is, an f-string with `*` for each replacement field, else None (a computed key)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.values)
    return None


def _is_metrics(expr: ast.AST, aliases: set[str]) -> bool:
    if isinstance(expr, ast.Attribute):
        return expr.attr in ("metrics", "stepped")
    return isinstance(expr, ast.Name) and (expr.id == "metrics" or expr.id in aliases)


def _aliases(fn: ast.AST) -> set[str]:
    """Names that hold a metrics dict: `m = out.metrics`, and what a function named *metrics* returns."""
    out: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and node.value.attr == "metrics":
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and "metrics" in fn.name:
        for node in ast.walk(fn):
            if isinstance(node, ast.Return) and node.value is not None:
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                out |= {v.id for v in values[:1] if isinstance(v, ast.Name)}
    return out


@lru_cache(maxsize=1)
def written_metric_keys() -> tuple[tuple[str, int, str], ...]:
    """(file, line, key) of every metric key written in jbench/ (f-string replacement fields as `*`)."""
    found: set[tuple[str, int, str]] = set()
    for path in sorted((ROOT / "jbench").rglob("*.py")):
        if path.name == "metrics.py" and path.parent.name == "core":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        rel = str(path.relative_to(ROOT))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            aliases = _aliases(fn)
            for node in ast.walk(fn):
                keys: list[ast.AST] = []
                if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        for sub in (t.elts if isinstance(t, ast.Tuple) else [t]):
                            if isinstance(sub, ast.Subscript) and _is_metrics(sub.value, aliases):
                                keys.append(sub.slice)
                elif isinstance(node, ast.Call):
                    for kw in node.keywords:
                        if kw.arg in ("metrics", "stepped") and isinstance(kw.value, ast.Dict):
                            keys += [k for k in kw.value.keys if k is not None]
                    func = node.func
                    if (isinstance(func, ast.Attribute) and func.attr == "update" and _is_metrics(func.value, aliases)
                            and node.args and isinstance(node.args[0], ast.Dict)):
                        keys += [k for k in node.args[0].keys if k is not None]
                for k in keys:
                    key = _key(k)
                    if key is not None:
                        found.add((rel, getattr(k, "lineno", node.lineno), key))
    return tuple(sorted(found))


def _resolves(key: str) -> bool:
    if "*" not in key:
        return M.is_declared(key)
    pattern = re.compile(".+".join(map(re.escape, key.split("*"))))
    return any(pattern.fullmatch(name) for name in M.declared_names())


def test_every_metric_key_the_code_writes_is_declared():
    keys = written_metric_keys()
    # The scan sees the producers: phase speed, roofline, energy, throttling, wall, the speed match, the engine,
    # the trial runner's trial time.
    seen = {key for _, _, key in keys}
    assert {"*_tps", "roofline_fraction", "*_energy_j", "*_*_events", "*_wall_energy_j", "*_energy_window_tps",
            "gemv_ceiling_tps", "trial_wall_s", "latency_requests", "*_energy_coverage"} <= seen, seen
    undeclared = [f"{file}:{line}: {key}" for file, line, key in keys if not _resolves(key)]
    assert not undeclared, "metrics written but not declared in jbench/core/metrics.py:\n" + "\n".join(undeclared)


def test_the_scan_catches_an_undeclared_key(tmp_path):
    assert not _resolves("*_tokens_per_watt") and not _resolves("decode_tps_p50") and _resolves("*_oc*_events")


def test_every_declaration_has_a_producer():
    # A declaration matched by no key the code writes must come from a producer run above (latency percentiles
    # from client._stats' prefix, the telemetry series from analysis.telemetry.SERIES): nothing declared is dead.
    from jbench.analysis.telemetry import SERIES
    from jbench.backends.llamacpp.client import PERCENTILES
    from jbench.backends.llamacpp.perplexity import QualityStats

    patterns = [re.compile(".+".join(map(re.escape, key.split("*")))) for _, _, key in written_metric_keys()]
    runtime = set(SERIES.values()) | {f"{p}_{s}" for p in ("ttft_ms", "itl_ms", "e2e_ms", "output_tps")
                                      for s in [*(f"p{q}" for q in PERCENTILES), "mean"]}
    # llama-perplexity's statistics are written under their QualityStats field names (QualityStats.metrics()).
    runtime |= {f.name for f in dataclasses.fields(QualityStats)}
    dead = [n for n in M.declared_names() if n not in runtime and not any(p.fullmatch(n) for p in patterns)]
    assert not dead, f"declared but never written by jbench: {dead}"
    assert {f"p{q}" for q in PERCENTILES} == {f"p{q}" for q in M.PLACEHOLDERS["q"]}


def test_history_judges_its_series_in_the_declared_direction_and_unit():
    from jbench.analysis.history import METRICS, UNITS

    assert METRICS == {"decode_tps": 1, "prefill_tps": 1, "ttft_ms_p50": -1, "decode_tokens_per_joule": 1}
    assert UNITS == {"decode_tps": "tok/s", "prefill_tps": "tok/s", "ttft_ms_p50": "ms",
                     "decode_tokens_per_joule": "tok/J"}
