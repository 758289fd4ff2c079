"""The choice within a quality bar (jbench.analysis.choice) over hand-built rows: the one-sided bound changes the
answer, ties go to the faster, NaN and missing figures never count, a kv_precision sweep ranks by the cache's
bits, and each 'nothing to choose' case says which one it is."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from jbench.analysis.choice import QualityBar, choose, kv_bits, nominal_bits, pareto_front

NAN = float("nan")


def _row(quant, kld, err=None, tps=50.0, bpw=None, **extra):
    row = {"label": quant, "model.quant": quant, "quality_kld_mean": kld, "decode_tps": tps}
    if err is not None:
        row["quality_kld_mean_err"] = err
    if bpw is not None:
        row["roofline_bits_per_weight"] = bpw
    row.update(extra)
    return row


LADDER = [_row("Q4_0", 0.048, 0.003, tps=60.0, bpw=4.56),  # mean under 0.05, bound 0.0529 above it
          _row("Q4_K_M", 0.030, 0.002, tps=55.0, bpw=4.89, decode_tokens_per_joule=3.2, memory_peak_rss_mib=410.0),
          _row("Q8_0", 0.002, 0.0002, tps=40.0, bpw=8.5)]


# --------------------------------------------------------------------------------------------
# pareto_front


def test_pareto_front_keeps_the_non_dominated_and_drops_nan_and_missing():
    rows = [{"s": 10, "k": 0.5}, {"s": 8, "k": 0.1}, {"s": 7, "k": 0.2},  # 2 is dominated by 1
            {"s": 12, "k": NAN}, {"k": 0.01}, {"s": 5, "k": 0.01}, {"s": 5, "k": 0.01}]  # NaN, missing; equal pair
    assert pareto_front(rows, "s", "k", x_better="higher", y_better="lower") == [0, 1, 5, 6]
    # Both "higher": the largest k is now best: only row 0 survives (most speed, most k).
    assert pareto_front(rows, "s", "k", x_better="higher", y_better="higher") == [0]


def test_pareto_front_over_a_frame_returns_index_labels_and_reads_metric_columns():
    df = pd.DataFrame({"metrics.decode_tps": [10.0, 8.0, 9.0], "metrics.quality_kld_mean": [0.5, 0.1, 0.6]},
                      index=["a", "b", "c"])
    assert pareto_front(df, "decode_tps", "quality_kld_mean", x_better="higher", y_better="lower") == ["a", "b"]
    with pytest.raises(ValueError, match="x_better"):
        pareto_front(df, "decode_tps", "quality_kld_mean", x_better="more")


# --------------------------------------------------------------------------------------------
# choose: the bar and its uncertainty


def test_the_one_sided_bound_rejects_a_mean_under_the_bar_and_says_it_is_within_noise():
    choice = choose(LADDER, QualityBar(max_kld=0.05))
    assert choice.status == "chosen" and choice.key == 1 and choice.chosen.label == "Q4_K_M"
    assert [c.label for c in choice.within_noise] == ["Q4_0"]
    text = choice.message()
    assert "Q4_0 (4.56 bpw) meets within noise" in text and "straddles 0.05" in text
    assert "decode 55.0 tok/s, 3.2 tok/J, peak RSS 410 MiB" in text and "95 % bound 0.0333" in text
    assert [c.label for c in choice.runners_up] == ["Q8_0"]
    # Without the uncertainty the mean alone is under the bar: the lower-bit Q4_0 would be the choice.
    no_err = [{k: v for k, v in r.items() if k != "quality_kld_mean_err"} for r in LADDER]
    plain = choose(no_err, QualityBar(max_kld=0.05))
    assert plain.chosen.label == "Q4_0" and "judged on the mean alone" in plain.message()


def test_a_row_whose_whole_interval_is_above_the_bar_fails_and_none_meets_names_the_closest():
    choice = choose(LADDER, QualityBar(max_kld=0.001))
    assert choice.status == "none_meets" and choice.chosen is None and choice.key is None
    assert choice.closest.label == "Q8_0" and not choice.within_noise
    assert choice.message().startswith("No configuration meets the quality bar (mean KLD <= 0.001 nat")
    assert all(c.verdict == "fails" for c in choice.candidates)
    # Within noise only: still none meets, but it says which would need more chunks.
    straddle = choose(LADDER, QualityBar(max_kld=0.0022))
    assert straddle.status == "none_meets" and [c.label for c in straddle.within_noise] == ["Q8_0"]
    assert "Q8_0 meets within noise" in straddle.message() and "quality.chunks" in straddle.message()


def test_same_top_bar_uses_the_lower_bound_and_both_bars_must_hold():
    rows = [_row("Q4_0", 0.01, 0.001, bpw=4.5, quality_same_top_pct=91.0, quality_same_top_pct_err=1.0),
            _row("Q5_0", 0.01, 0.001, bpw=5.5, quality_same_top_pct=94.0, quality_same_top_pct_err=1.0),
            _row("Q6_K", 0.09, 0.001, bpw=6.6, quality_same_top_pct=99.0, quality_same_top_pct_err=0.5)]
    # 91 - 1.645 = 89.4 < 90 <= 92.6: within noise; 94 - 1.645 >= 90: meets.
    choice = choose(rows, QualityBar(min_same_top_pct=90.0))
    assert choice.chosen.label == "Q5_0" and [c.label for c in choice.within_noise] == ["Q4_0"]
    # Adding a KLD bar that Q5_0 meets but Q6_K fails changes nothing for Q5_0; a stricter same-top bar leaves
    # only Q6_K, which the KLD bar rejects.
    assert choose(rows, QualityBar(max_kld=0.05, min_same_top_pct=90.0)).chosen.label == "Q5_0"
    strict = choose(rows, QualityBar(max_kld=0.05, min_same_top_pct=97.0))
    assert strict.status == "none_meets"
    assert {c.label: c.verdict for c in strict.candidates} == {"Q4_0": "fails", "Q5_0": "fails", "Q6_K": "fails"}


# --------------------------------------------------------------------------------------------
# choose: ranking


def test_ties_on_bits_go_to_the_faster_and_nan_speed_ranks_last():
    rows = [_row("Q4_K_M", 0.01, 0.001, tps=40.0, bpw=4.89, threads=2),
            _row("Q4_K_M", 0.01, 0.001, tps=NAN, bpw=4.89, threads=8),
            _row("Q4_K_M", 0.01, 0.001, tps=52.0, bpw=4.89, threads=4)]
    choice = choose(rows, QualityBar(max_kld=0.05))
    assert choice.key == 2 and "tie on bits" in choice.message()
    assert choice.runners_up[-1].key == 1 and choice.runners_up[-1].speed is None  # NaN is no speed


def test_nan_or_missing_quality_never_meets_the_bar():
    rows = [_row("Q2_K", NAN, 0.001, bpw=2.9), _row("Q3_K_M", None, bpw=3.9), _row("Q8_0", 0.002, 0.0001, bpw=8.5)]
    choice = choose(rows, QualityBar(max_kld=0.05))
    assert choice.chosen.label == "Q8_0"
    assert {c.label: c.verdict for c in choice.candidates}["Q2_K"] == "unmeasured"


def test_without_file_bits_the_quant_names_order_keeps_q4_0_below_q4_k_m():
    assert nominal_bits("Q4_0") == nominal_bits("Q4_K_M") == 4.5 and nominal_bits("nonsense") is None
    rows = [_row("Q4_K_M", 0.01, 0.001, tps=60.0), _row("Q4_0", 0.02, 0.001, tps=50.0),
            _row("Q8_0", 0.001, 0.0001, tps=40.0, bpw=8.5)]  # one row's file figure is not enough to use them
    choice = choose(rows, QualityBar(max_kld=0.05))
    assert choice.bits_basis == "quant name" and choice.chosen.label == "Q4_0"  # despite Q4_K_M being faster
    assert "nominal" in choice.message()
    # With every file's figure, the real bits decide (here Q4_K_M's file is the smaller one).
    real = [dict(rows[0], roofline_bits_per_weight=4.4), dict(rows[1], roofline_bits_per_weight=4.6), rows[2]]
    assert choose(real, QualityBar(max_kld=0.05)).chosen.label == "Q4_K_M"


def test_a_kv_precision_sweep_ranks_by_the_cache_types_bits():
    assert kv_bits("q8_0", "q8_0") == 8.5 and kv_bits("q4_0", "f16") == (4.5 + 16) / 2 and kv_bits(None, None) is None
    rows = [{"label": f"KV {k}/{v}", "model.quant": "Q4_K_M", "roofline_bits_per_weight": 4.89, "decode_tps": tps,
             "backend.cache_type_k": k, "backend.cache_type_v": v, "quality_kld_mean": kld,
             "quality_kld_mean_err": 0.001}
            for k, v, kld, tps in (("f16", "f16", 0.030, 50.0), ("q8_0", "q8_0", 0.031, 51.0),
                                   ("q4_0", "q4_0", 0.090, 52.0), ("q4_0", "f16", 0.035, 49.0))]
    choice = choose(rows, QualityBar(max_kld=0.05))
    # q4_0/q4_0 (4.5 bits) fails the bar; then q8_0/q8_0 (8.5) < q4_0 K with f16 V (10.25) < f16/f16 (16).
    assert choice.chosen.label == "KV q8_0/q8_0" and choice.chosen.kv == "q8_0"
    assert [c.label for c in choice.runners_up] == ["KV q4_0/f16", "KV f16/f16"]
    # The same rows as a run table (params., metrics. columns) give the same answer, keyed by the index.
    frame = pd.DataFrame([{("params." if k in ("model.quant", "backend.cache_type_k", "backend.cache_type_v")
                            else "tags.jbench.trial_" if k == "label" else "metrics.") + k: v for k, v in r.items()}
                          for r in rows], index=[10, 11, 12, 13])
    assert choose(frame, QualityBar(max_kld=0.05)).key == 11


# --------------------------------------------------------------------------------------------
# choose: nothing to choose


def test_no_quality_no_bar_no_rows_and_failed_rows_are_said_plainly():
    speed_only = [{"label": "Q4_0", "decode_tps": 50.0}, {"label": "Q8_0", "decode_tps": 40.0}]
    none = choose(speed_only, QualityBar(max_kld=0.05))
    assert none.status == "no_quality" and none.message().startswith("No trial has quality figures")
    assert choose([], QualityBar(max_kld=0.05)).status == "no_rows"
    failed = [dict(LADDER[0], status="FAILED")]
    assert choose(failed, QualityBar(max_kld=0.1)).status == "no_rows"
    earlier = [dict(LADDER[1], status="FINISHED (earlier)")]
    assert choose(earlier, QualityBar(max_kld=0.1)).chosen.label == "Q4_K_M"

    front = choose(LADDER + [_row("Q5_K_M", 0.04, 0.001, tps=45.0, bpw=5.7)], None)
    assert front.status == "no_bar" and front.chosen is None
    assert [c.label for c in front.front] == ["Q4_0", "Q4_K_M", "Q8_0"]  # Q5_K_M: slower and worse than Q4_K_M
    assert "Pareto front" in front.message() and "Q5_K_M" not in front.headline()
    assert choose(LADDER, QualityBar()).status == "no_bar"  # an empty bar is no bar


def test_the_caveat_of_the_reference_is_carried_once():
    meaning = "requantization loss against the Q8_0 reference, not quality against the original weights"
    rows = [dict(r, **{"tags.quality.meaning": meaning}) for r in LADDER]
    choice = choose(rows, QualityBar(max_kld=0.05))
    assert choice.caveats == [meaning] and choice.message().endswith(f"caveat: {meaning}")
    d = choice.as_dict()
    assert d["status"] == "chosen" and d["chosen"]["label"] == "Q4_K_M"
    assert math.isclose(d["chosen"]["kld_bound_95"], 0.030 + 1.645 * 0.002)
