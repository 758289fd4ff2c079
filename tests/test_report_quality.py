"""The report's quality and memory sections over hand-built run tables (the columns `runs_frame` gives): a plot of
speed and of tokens per joule against mean KLD per model and device with the Pareto front and the choice marked,
the choice within the bar in words with the caveat beside it, the bar from the runs or the report's option, the
memory table, and each trial's audit (`jbench.analysis.memory`, written against its signature)."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pandas as pd
import pytest
from PIL import Image

from jbench.analysis.choice import QualityBar
from jbench.reporting import report
from jbench.reporting.report import build_report

MEANING = "requantization loss against Q8_0 (a requantized reference), not quality against the original weights"
LADDER = (("Q4_0", 4.56, 0.048, 0.003, 60.0, 3.5, 402.0, 380.0), ("Q4_K_M", 4.89, 0.030, 0.002, 55.0, 3.2, 431.0, 420.0),
          ("Q8_0", 8.5, 0.002, 0.0002, 40.0, 2.1, 560.0, 600.0))


def _frame(device="orin", model="gemma3_270m", start=0, **extra) -> pd.DataFrame:
    rows = []
    for i, (q, bpw, kld, err, tps, tpj, peak, pred) in enumerate(LADDER, start=start):
        rows.append({"run_id": f"run{i:04d}" + "0" * 24, "experiment": "e", "status": "FINISHED",
                     "start_time": pd.Timestamp("2025-01-01", tz="UTC"), "tags.jbench.kind": "trial",
                     "tags.jbench.trial_label": q, "tags.jbench.config_hash": f"{device}{i}",
                     "params.model.quant": q, "params.model.name": model, "tags.device.name": device,
                     "params.backend.cache_type_k": "f16", "params.backend.cache_type_v": "f16",
                     "metrics.decode_tps": tps, "metrics.decode_tps_std": 1.0, "metrics.decode_tokens_per_joule": tpj,
                     "metrics.roofline_bits_per_weight": bpw, "metrics.quality_kld_mean": kld,
                     "metrics.quality_kld_mean_err": err, "metrics.quality_same_top_pct": 90.0 + 4 * (i - start),
                     "metrics.quality_same_top_pct_err": 1.0, "metrics.memory_peak_rss_mib": peak,
                     "metrics.memory_predicted_mib": pred,
                     "metrics.memory_prediction_error_pct": 100 * (peak - pred) / peak,
                     "tags.quality.meaning": MEANING, "tags.quality.reference": "Q8_0 (KV f16)", **extra})
    return pd.DataFrame(rows)


def _alt(html_text: str, stem: str) -> str:
    import html

    return html.unescape(re.search(rf'<img alt="({stem}: [^"]*)"', html_text).group(1))


def _valid_png(path: Path) -> None:
    with Image.open(path) as im:
        im.load()
        assert im.width > 100 and im.height > 100 and im.convert("L").getextrema()[0] < 255


def test_quality_plots_and_the_choice_within_the_reports_bar(tmp_path):
    files = build_report(_frame(), out_dir=tmp_path, quality_bar=QualityBar(max_kld=0.05))
    assert "quality_1" in files.pngs
    _valid_png(files.pngs["quality_1"])
    md = files.markdown_path.read_text()
    html_text = files.html_path.read_text()
    alt = _alt(html_text, "quality_1")
    assert "speed vs quality: gemma3_270m, orin: x mean KL divergence from the reference" in alt
    assert re.search(r"y decode tok/s: 0 to \d", alt) and re.search(r"y decode tokens per joule: 0 to \d", alt)
    choice = next(line for line in md.splitlines() if line.startswith("- Choice within the quality bar"))
    assert "Q4_K_M (4.89 bpw): decode 55.0 tok/s, 3.2 tok/J, peak RSS 431 MiB" in choice
    assert "- Q4_0 (4.56 bpw) meets within noise" in md
    assert f"- caveat: {MEANING}" in md and MEANING in html_text  # the caveat beside the choice, in both
    assert "from the report's option" in md
    assert "<script" not in html_text and html_text.count('src="data:image/png;base64,') == len(files.pngs)
    table = [line for line in md.splitlines() if line.startswith("| orin") or line.startswith("| gemma3_270m, orin")]
    verdicts = [line.split("|")[-5].strip() for line in table]  # verdict, pareto_speed, pareto_energy, reference
    assert verdicts == ["within_noise", "chosen", "meets"], table


def test_the_bar_comes_from_the_runs_when_the_report_sets_none_and_groups_get_a_plot_each(tmp_path):
    df = pd.concat([_frame("orin", **{"params.quality.max_kld": "0.001"}),
                    _frame("nano", start=3, **{"params.quality.max_kld": "0.001"})], ignore_index=True)
    files = build_report(df, out_dir=tmp_path)
    assert {"quality_1", "quality_2"} <= set(files.pngs)
    md = files.markdown_path.read_text()
    assert "from the runs' quality config" in md
    assert "- gemma3_270m, orin: No configuration meets the quality bar (mean KLD <= 0.001 nat" in md
    assert "- gemma3_270m, nano: No configuration meets" in md and "closest: Q8_0" in md
    # The report's option wins over the runs'.
    files = build_report(df, out_dir=tmp_path / "opt", quality_bar=QualityBar(max_kld=0.05))
    assert "- gemma3_270m, nano: Choice within the quality bar" in files.markdown_path.read_text()


def test_without_a_bar_the_pareto_front_is_named(tmp_path):
    df = _frame()
    df.loc[1, "metrics.decode_tps"] = 30.0  # Q4_K_M now slower than Q8_0 and worse: off the speed front
    md = build_report(df, out_dir=tmp_path).markdown_path.read_text()
    head = next(line for line in md.splitlines() if line.startswith("- No quality bar set"))
    assert "Q4_0 (decode 60.0 tok/s" in head and "Q8_0 (decode 40.0 tok/s" in head and "Q4_K_M" not in head
    row = next(line for line in md.splitlines() if line.startswith("| gemma3_270m, orin | Q4_K_M |"))
    assert "| False | True |" in row  # off the speed front, on the energy front (3.2 tok/J beats Q8_0's 2.1)


def test_quality_without_speed_figures_is_still_judged(tmp_path):
    df = _frame().drop(columns=["metrics.decode_tps", "metrics.decode_tps_std"])
    files = build_report(df, out_dir=tmp_path, quality_bar=QualityBar(max_kld=0.05))
    md = files.markdown_path.read_text()
    assert "Q4_K_M (4.89 bpw): decode_tps not measured, 3.2 tok/J" in md
    assert not any(k.startswith("quality") for k in files.pngs)  # no speed: nothing to plot against


def test_no_quality_figures_no_section_and_a_failed_quality_stage_says_why(tmp_path):
    plain = _frame().drop(columns=[c for c in _frame().columns if "quality" in c or "memory" in c])
    files = build_report(plain, out_dir=tmp_path / "plain")
    text = files.markdown_path.read_text()
    assert "Quality and memory" not in text and "## Memory" not in text and not any(
        k.startswith("quality") for k in files.pngs)
    failed = plain.assign(**{"tags.quality.status": "FAILED: llama-perplexity printed no KLD statistics"})
    md = build_report(failed, out_dir=tmp_path / "failed").markdown_path.read_text()
    assert "no finished trial has quality figures" in md
    assert "3 finished trial(s) have no quality figures: FAILED: llama-perplexity printed no KLD statistics" in md


def test_memory_section_lists_peak_and_prediction_error_and_says_when_the_audit_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "memory_audit", None)  # an installation without jbench.analysis.memory
    md = build_report(_frame(), out_dir=tmp_path).markdown_path.read_text()
    memory = md.split("## Memory", 1)[1]
    assert "| Q8_0 | Q8_0 | f16 | 560 | 600 | -7.143 |" in memory
    assert "median 2.55 %, largest -7.14 % (Q8_0) over 3 trial(s)" in memory
    assert "needs jbench.analysis.memory" in memory


def test_memory_audit_blocks_come_from_the_audit_functions(tmp_path, monkeypatch):
    """Written against `audit(metrics, tags) -> [AuditLine(label, mib, source)]` and `audit_markdown(lines)`: a
    stand-in with that signature records what the report passes it."""
    seen = []

    def audit(metrics, tags):
        seen.append((metrics, tags))
        return [types.SimpleNamespace(label="weights", mib=metrics["memory_peak_rss_mib"] / 2, source="file size"),
                types.SimpleNamespace(label="KV cache", mib=12.5, source="GGUF header")]

    def audit_markdown(lines):
        return "\n".join(f"* {a.label}: {a.mib:g} MiB ({a.source})" for a in lines) + "\n"

    monkeypatch.setattr(report, "memory_audit", types.SimpleNamespace(audit=audit, audit_markdown=audit_markdown))
    files = build_report(_frame(), out_dir=tmp_path)
    md = files.markdown_path.read_text()
    assert "_memory audit: Q4_K_M_\n\n* weights: 215.5 MiB (file size)\n* KV cache: 12.5 MiB (GGUF header)" in md
    assert len(seen) == 3 and seen[0][0]["memory_peak_rss_mib"] == 402.0 and seen[0][1]["quality.meaning"] == MEANING
    assert "memory.status" not in seen[0][1] and "jbench.trial_label" in seen[0][1]
    html_text = files.html_path.read_text()
    assert "memory audit: Q8_0" in html_text and "GGUF header" in html_text


def test_memory_audit_with_the_real_module(tmp_path):
    import importlib

    memory = importlib.import_module("jbench.analysis.memory")
    assert report.memory_audit is memory  # the report found it
    df = _frame()
    md = build_report(df, out_dir=tmp_path).markdown_path.read_text()
    r = df.iloc[0]
    metrics = {c[len("metrics."):]: float(v) for c, v in r.items() if c.startswith("metrics.")}
    tags = {c[len("tags."):]: v for c, v in r.items() if c.startswith("tags.") and isinstance(v, str)}
    lines = memory.audit(metrics, tags)
    if lines:
        assert memory.audit_markdown(lines).strip() in md
