"""The sweep summary's quality and memory columns and the choice within the quality bar printed under it, as pure
functions over hand-built outcomes: columns only when a trial has the figures, one line per trial at 80 columns
(same top % left out first, and said), the choice from the trials' `quality` config, nothing when quality was
neither measured nor enabled."""

from __future__ import annotations

import re
from types import SimpleNamespace as NS

import pytest
from rich.console import Console

from jbench.cli.summary import choice_lines, summary_tables
from jbench.core.results import Category, Status

MEANING = "requantization loss against the F16 reference, not quality against the original weights"


def _trial(index, quant, kv="f16", quality=None, device="local", depth=0):
    backend = NS(n_prompt=16, n_gen=4, repetitions=2, cache_type_k=kv, cache_type_v=kv, depth=depth)
    quality = quality or NS(enabled=False, max_kld=None, min_same_top_pct=None)
    cfg = NS(backend=backend, model=NS(name="gemma3_270m", quant=quant), device=NS(name=device), quality=quality)
    label = quant if kv == "f16" else f"{quant} KV {kv}"
    return NS(index=index, label=label, short_label=label, point={"model.quant": quant}, cfg=cfg)


def _outcome(index, quant, metrics, status=Status.FINISHED, category=None, tags=None, **kw):
    base = {"prefill_tps": 1234.56, "prefill_tps_std": 123.4, "decode_tps": 56.78, "decode_tps_std": 1.23}
    return NS(trial=_trial(index, quant, **kw), status=status, category=category, error=None, noisy=False,
              run_id=f"{index:08x}" + "0" * 24, metrics={**base, **metrics}, device=None,
              record=NS(tags=tags or {}))


def _sweep(outcomes):
    return NS(experiment="quant_ladder", sweep_id="s", parent_run_id="p", outcomes=outcomes)


def _label(trial, keys):
    return trial.label


def _ladder(bar=None, enabled=True, tags=True):
    q = NS(enabled=enabled, max_kld=bar, min_same_top_pct=None)
    t = {"quality.meaning": MEANING} if tags else {}
    return [
        _outcome(1, "Q4_0", {"quality_kld_mean": 0.048, "quality_kld_mean_err": 0.003, "quality_same_top_pct": 91.2,
                             "memory_peak_rss_mib": 402.0, "roofline_bits_per_weight": 4.56,
                             "decode_tokens_per_joule": 3.5}, quality=q, tags=t),
        _outcome(2, "Q4_K_M", {"quality_kld_mean": 0.0301, "quality_kld_mean_err": 0.002, "quality_same_top_pct": 93.0,
                               "memory_peak_rss_mib": 431.0, "roofline_bits_per_weight": 4.89,
                               "decode_tokens_per_joule": 3.2}, quality=q, tags=t),
        _outcome(3, "Q8_0", {"quality_kld_mean": 0.0021, "quality_kld_mean_err": 0.0002, "quality_same_top_pct": 99.0,
                             "memory_peak_rss_mib": 560.0, "roofline_bits_per_weight": 8.5}, quality=q, tags=t),
    ]


def _render(outcomes, width):
    console = Console(width=width, record=True)
    (part,) = summary_tables(_sweep(outcomes), ["model.quant"], _label, console)
    console.print(part.table)
    return part, console.export_text().splitlines()


@pytest.mark.parametrize("width", [80, 100])
def test_quality_and_memory_columns_fit_one_line_a_trial(width):
    part, lines = _render(_ladder(), width)
    assert max(len(line.rstrip()) for line in lines) <= width, "\n".join(lines)
    rows = [line for line in lines if re.match(r"^\s*\d+\s{2,}", line)]
    assert len(rows) == 3, "\n".join(lines)
    assert "0.0301" in rows[1] and "431" in rows[1]  # KLD (3 significant digits) and the peak, always
    header = "\n".join(lines[:4])
    legend = "\n".join(part.legend)
    if width >= 100:  # room for every column: same top % shown, nothing left out
        assert "93.0" in rows[1] and "left out" not in legend
    else:
        assert "93.0" not in rows[1] and "left out at this width" in legend and "quality_same_top_pct" in legend
    assert "KLD" in header and "peak" in header and "quality_kld_mean" in legend


def test_a_long_label_is_cut_not_wrapped_and_the_columns_keep_their_order():
    outcomes = _ladder()
    outcomes[0].trial.label = "gemma3_270m Q4_0 n_gen=128 depth=4096 /models/very/long/path/to/a.gguf"
    part, lines = _render(outcomes, 80)
    assert max(len(line.rstrip()) for line in lines) <= 80, "\n".join(lines)
    rows = [line for line in lines if re.match(r"^\s*\d+\s{2,}", line)]
    assert len(rows) == 3 and "…" in rows[0] and outcomes[0].trial.label in "\n".join(part.cut)
    assert re.search(r"56\.8 ± 1\.2\s+0\.048\s+402\s+00000001", rows[0]), rows[0]  # decode, KLD, peak, run id


def test_no_quality_no_columns_and_no_choice():
    plain = [_outcome(1, "Q4_0", {}), _outcome(2, "Q8_0", {})]
    part, lines = _render(plain, 80)
    assert not any("KLD" in line or "peak" in line for line in lines)
    assert choice_lines(_sweep(plain), [], _label) == []  # not measured, not enabled: nothing about quality
    enabled = [_outcome(1, "Q4_0", {}, quality=NS(enabled=True, max_kld=0.05, min_same_top_pct=None))]
    (line,) = choice_lines(_sweep(enabled), [], _label)
    assert line.startswith("quality: No trial has quality figures")


def test_the_choice_within_the_sweeps_bar_with_speed_energy_memory_and_the_caveat():
    lines = choice_lines(_sweep(_ladder(bar=0.05)), [], _label)
    head = lines[0]
    assert head.startswith("quality: Choice within the quality bar (mean KLD <= 0.05 nat")
    assert "Q4_K_M (4.89 bpw)" in head and "decode 56.8 tok/s, 3.2 tok/J, peak RSS 431 MiB" in head
    assert any("Q4_0" in line and "meets within noise" in line for line in lines)  # 0.048 + 1.645*0.003 > 0.05
    assert lines[-1] == f"  caveat: {MEANING}"
    none = choice_lines(_sweep(_ladder(bar=0.001)), [], _label)
    assert none[0].startswith("quality: No configuration meets the quality bar") and "closest: Q8_0" in none[0]
    front = choice_lines(_sweep(_ladder(bar=None)), [], _label)
    assert "Pareto front" in front[0]


def test_a_failed_trial_is_no_candidate_and_groups_are_named_per_device():
    q = NS(enabled=True, max_kld=0.05, min_same_top_pct=None)
    outcomes = _ladder(bar=0.05)
    outcomes[1].status, outcomes[1].category = Status.FAILED, Category.BACKEND_CRASH
    lines = choice_lines(_sweep(outcomes), [], _label)
    assert "Q8_0 (8.5 bpw" in lines[0]  # Q4_K_M failed, Q4_0 is within noise only
    other = _outcome(4, "Q4_K_M", {"quality_kld_mean": 0.01, "quality_kld_mean_err": 0.001}, quality=q,
                     device="orin")
    lines = choice_lines(_sweep(_ladder(bar=0.05) + [other]), [], _label)
    heads = [line for line in lines if line.startswith("quality: ")]
    assert len(heads) == 2 and heads[0].startswith("quality: gemma3_270m on local: Choice")
    assert heads[1].startswith("quality: gemma3_270m on orin: Choice")


def test_the_choice_is_made_at_each_depth_a_workload_not_across_them():
    # kv_precision on the embedded default (measured): q8_0 KV within the 0.01 bar at depth 4096 only.
    q = NS(enabled=True, max_kld=0.01, min_same_top_pct=None)
    runs = [(1, "f16", 512, 0.0, 0.0), (2, "f16", 4096, 0.0, 0.0), (3, "q8_0", 512, 0.00911, 0.000553),
            (4, "q8_0", 4096, 0.00793, 0.000222), (5, "q4_0", 512, 0.142, 0.004), (6, "q4_0", 4096, 0.133, 0.003)]
    outcomes = [_outcome(i, "Q4_K_M", {"quality_kld_mean": kld, "quality_kld_mean_err": err,
                                       "roofline_bits_per_weight": 4.89}, quality=q, kv=kv, depth=depth)
                for i, kv, depth, kld, err in runs]
    heads = [line for line in choice_lines(_sweep(outcomes), [], _label) if line.startswith("quality: ")]
    assert len(heads) == 2, heads
    assert heads[0].startswith("quality: at depth 512: ") and heads[1].startswith("quality: at depth 4096: ")
    # At 4096 q8_0 meets the bar; at 512 its interval straddles it, so the f16 cache is the one that meets it.
    assert "Q4_K_M KV q8_0" in heads[1] and "Q4_K_M KV q8_0" not in heads[0], heads
