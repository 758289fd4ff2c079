"""GEMV trace and engine-log analysis (jbench.backends.engine.trace), and the stand-in engine fixture.

Expected bytes are computed here by hand with M x K x type_size / block_size (Q4_K: 144 B per 256
weights, Q6_K: 210 per 256, Q8_0: 34 per 32), never through the module under test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jbench.backends.engine.trace import (
    AnalysisOptions,
    Gemv,
    LogPatterns,
    TraceError,
    TraceHints,
    analyze_trace_text,
    detect_layers,
    parse_trace,
    split_tokens,
    split_tokens_with_method,
)

ENGINE = Path(__file__).resolve().parent / "fixtures" / "engine" / "stand_in_engine.py"

Q4_K, Q6_K, Q8_0 = 12, 14, 8

# A Qwen3-4B-like decoder: 36 layers, d=2560, 32 query heads x 128 = 4096, 8 KV heads x 128 = 1024,
# n_ff=9728, vocab 151936 with the LM head tied to the embeddings and stored as Q6_K.
QWEN = dict(layers=36, d=2560, q=4096, kv=1024, ff=9728, vocab=151936)


def q4k(m: int, k: int) -> int:
    return m * k * 144 // 256


def q6k(m: int, k: int) -> int:
    return m * k * 210 // 256


def layer_shapes(d: int, q: int, kv: int, ff: int, *, fused_qkv: bool, fused_gate_up: bool, t: int = Q4_K):
    shapes = [(t, q + 2 * kv, d)] if fused_qkv else [(t, q, d), (t, kv, d), (t, kv, d)]
    shapes.append((t, d, q))  # attention output: reads the q_dim attention result
    shapes += [(t, 2 * ff, d)] if fused_gate_up else [(t, ff, d), (t, ff, d)]
    shapes.append((t, d, ff))  # down
    return shapes


def token_shapes(arch=QWEN, *, fused_qkv=False, fused_gate_up=False, head_type=Q6_K):
    shapes = layer_shapes(arch["d"], arch["q"], arch["kv"], arch["ff"], fused_qkv=fused_qkv,
                          fused_gate_up=fused_gate_up) * arch["layers"]
    shapes.append((head_type, arch["vocab"], arch["d"]))
    return shapes


def trace_text(shapes, n_tokens: int, *, index: bool = True, prefix: str = "") -> str:
    lines = []
    for _ in range(n_tokens):
        for i, (t, m, k) in enumerate(shapes):
            tag = f"[GEMV #{i}]" if index else "[GEMV]"
            lines.append(f"{prefix}{tag} type={t} M={m} K={k}")
    return "\n".join(lines) + "\n"


# Hand-computed bytes of one Qwen3-4B-like token (domain.md's worked examples).
Q_BYTES = q4k(4096, 2560)
KV_BYTES = q4k(1024, 2560)
O_BYTES = q4k(2560, 4096)
FF_BYTES = q4k(9728, 2560)
HEAD_BYTES = q6k(151936, 2560)
LAYER_BYTES = Q_BYTES + 2 * KV_BYTES + O_BYTES + 3 * FF_BYTES
TOKEN_BYTES = 36 * LAYER_BYTES + HEAD_BYTES


def test_hand_computed_bytes_match_domain_notes():
    assert Q_BYTES == 5_898_240
    assert HEAD_BYTES == 319_065_600
    assert KV_BYTES == 1_474_560
    assert FF_BYTES == 14_008_320
    assert LAYER_BYTES == 56_770_560
    assert TOKEN_BYTES == 2_362_805_760


# --------------------------------------------------------------------------------------------
# Bytes per token and fusion findings


def test_unfused_qwen_trace_bytes_launches_and_findings():
    text = trace_text(token_shapes(), 3)
    r = analyze_trace_text(text)
    tok = r.token
    assert tok.split_method == "index-reset"
    assert tok.n_blocks == 3 and tok.n_consistent == 3
    assert tok.launches == 36 * 7 + 1 == 253
    assert tok.weight_bytes == TOKEN_BYTES
    by = {b.type_name: b for b in tok.by_type}
    assert by["Q4_K"].weight_bytes == 36 * LAYER_BYTES == 2_043_740_160
    assert by["Q4_K"].launches == 252
    assert by["Q6_K"].weight_bytes == HEAD_BYTES and by["Q6_K"].launches == 1
    assert r.layers.count == 36 and r.layers.period == 7 and r.layers.start == 0

    codes = r.codes
    assert "qkv_not_fused" in codes and "gate_up_not_fused" in codes
    qkv = next(f for f in r.findings if f.code == "qkv_not_fused")
    assert qkv.evidence["d_model"] == 2560
    assert qkv.evidence["q_dim"] == 4096 and qkv.evidence["kv_dim"] == 1024
    assert qkv.evidence["fused_M"] == 4096 + 2 * 1024
    assert qkv.evidence["groups_per_token"] == 36 and qkv.evidence["per_layer"] == 1
    assert qkv.evidence["layers"] == 36 and qkv.evidence["extra_launches_per_token"] == 72
    gu = next(f for f in r.findings if f.code == "gate_up_not_fused")
    assert gu.evidence["n_ff"] == 9728 and gu.evidence["fused_M"] == 19456
    assert gu.evidence["pairs_per_token"] == 36 and gu.evidence["per_layer"] == 1


def test_fused_trace_same_bytes_no_fusion_findings():
    r = analyze_trace_text(trace_text(token_shapes(fused_qkv=True, fused_gate_up=True), 2))
    assert r.token.launches == 36 * 4 + 1
    # Fusing changes launches, not bytes: the fused matrices are the concatenations.
    assert q4k(6144, 2560) == Q_BYTES + 2 * KV_BYTES
    assert r.token.weight_bytes == TOKEN_BYTES
    assert "qkv_not_fused" not in r.codes and "gate_up_not_fused" not in r.codes


def test_only_gate_up_fused():
    r = analyze_trace_text(trace_text(token_shapes(fused_gate_up=True), 2))
    assert "qkv_not_fused" in r.codes and "gate_up_not_fused" not in r.codes
    r = analyze_trace_text(trace_text(token_shapes(fused_qkv=True), 2))
    assert "qkv_not_fused" not in r.codes and "gate_up_not_fused" in r.codes


def test_mha_qkv_three_times_d():
    # Llama-2-7B-like multi-head attention: Q, K, V are all d x d; q8_0 layers, f16-free LM head in Q6_K.
    arch = dict(layers=4, d=4096, q=4096, kv=4096, ff=11008, vocab=32000)
    shapes = token_shapes(arch, head_type=Q6_K)
    shapes = [(Q8_0, m, k) if t == Q4_K else (t, m, k) for t, m, k in shapes]
    r = analyze_trace_text(trace_text(shapes, 2))
    q8 = lambda m, k: m * k * 34 // 32  # noqa: E731
    layer = 4 * q8(4096, 4096) + 3 * q8(11008, 4096)
    assert r.token.weight_bytes == 4 * layer + q6k(32000, 4096)
    qkv = next(f for f in r.findings if f.code == "qkv_not_fused")
    assert qkv.evidence["groups_per_token"] == 4 and qkv.evidence["fused_M"] == 3 * 4096
    assert "gate_up_not_fused" in r.codes
    fused = [(t, m, k) for t, m, k in shapes]
    # the same model fused: one 3d x d GEMV per layer
    fused_shapes = [(Q8_0, m, k) for _, m, k in layer_shapes(4096, 4096, 4096, 11008, fused_qkv=True,
                                                               fused_gate_up=True)] * 4 + [fused[-1]]
    r2 = analyze_trace_text(trace_text(fused_shapes, 2))
    assert not {"qkv_not_fused", "gate_up_not_fused"} & set(r2.codes)
    assert r2.token.weight_bytes == r.token.weight_bytes


def test_hints_make_matching_exact():
    text = trace_text(token_shapes(), 2)
    assert "qkv_not_fused" in analyze_trace_text(text, hints={"d_model": 2560, "n_head_kv*head_dim": 1024}).codes
    assert "qkv_not_fused" not in analyze_trace_text(text, hints={"kv_dim": 512}).codes
    assert "qkv_not_fused" not in analyze_trace_text(text, hints=TraceHints(d_model=4096)).codes
    assert "gate_up_not_fused" not in analyze_trace_text(text, hints={"n_ff": 8192}).codes
    with pytest.raises(TraceError, match="unknown hint"):
        analyze_trace_text(text, hints={"dmodel": 2560})


def test_detect_layers_with_prefix_and_head():
    layer = [(Q4_K, 64, 256), (Q4_K, 256, 64), (Q4_K, 512, 256)]
    shapes = [(Q8_0, 999, 256)] + layer * 5 + [(Q6_K, 1000, 256)]
    lp = detect_layers(shapes)
    assert (lp.start, lp.period, lp.count) == (1, 3, 5)
    assert detect_layers([(Q4_K, 1, 256), (Q4_K, 2, 256)]) is None


# --------------------------------------------------------------------------------------------
# Plain log lines (exact lines from the domain notes) and their findings

DOMAIN_LOG = """\
[engine] Prefill: 18 tokens in 110400 ms (0.2 tok/s)
[engine] Decode: 16 tokens in 100064 ms (0.2 tok/s)
Power: 0W mode, GPU @ 0 MHz
"""


def test_plain_log_rates_from_tokens_and_ms():
    parsed = parse_trace(DOMAIN_LOG)
    assert parsed.ignored_lines == 0
    assert parsed.prefill[0].tokens == 18 and parsed.prefill[0].ms == 110400
    assert parsed.decode[0].tokens == 16 and parsed.decode[0].ms == 100064
    assert parsed.power[0].mode == "0W" and parsed.power[0].gpu_mhz == 0
    r = analyze_trace_text(DOMAIN_LOG)
    assert r.prefill_tps == pytest.approx(18 / 110.4)
    assert round(r.prefill_tps, 3) == 0.163  # not the printed, rounded 0.2
    assert r.decode_tps == pytest.approx(16 / 100.064)
    assert r.token is None and r.ceiling_tps is None


def test_gpu_clock_zero_and_prefill_per_token_findings():
    r = analyze_trace_text(DOMAIN_LOG)
    assert {"gpu_clock_zero", "prefill_per_token"} <= set(r.codes)
    gz = next(f for f in r.findings if f.code == "gpu_clock_zero")
    assert gz.severity == "error" and gz.evidence["gpu_mhz"] == 0 and gz.evidence["mode"] == "0W"
    pp = next(f for f in r.findings if f.code == "prefill_per_token")
    assert pp.evidence["ratio"] == pytest.approx((18 / 110.4) / (16 / 100.064))
    assert pp.evidence["threshold_ratio"] == 2.0


def test_power_line_variants():
    ok = analyze_trace_text("Power: MAXN mode, GPU @ 1020 MHz\n")
    assert "gpu_clock_zero" not in ok.codes and ok.power.mode == "MAXN" and ok.power.gpu_mhz == 1020
    assert "gpu_clock_zero" in analyze_trace_text("Power: 0W mode, GPU @ 306 MHz\n").codes  # the mode alone
    assert "gpu_clock_zero" in analyze_trace_text("Power: 15W mode, GPU @ 0 MHz\n").codes  # the clock alone
    assert analyze_trace_text("Power: MAXN_SUPER mode, GPU @ 1020.5 MHz\n").power.mode == "MAXN_SUPER"


def test_prefill_batched_is_not_flagged_and_ratio_is_configurable():
    log = ("[engine] Prefill: 512 tokens in 1000 ms (512.0 tok/s)\n"
           "[engine] Decode: 64 tokens in 4000 ms (16.0 tok/s)\n")
    assert "prefill_per_token" not in analyze_trace_text(log).codes
    assert "prefill_per_token" in analyze_trace_text(log, options=AnalysisOptions(prefill_decode_ratio=40)).codes
    # caller-given rates win over the log's
    r = analyze_trace_text(log, prefill_tps=20.0, decode_tps=16.0)
    assert r.prefill_tps == 20.0 and "prefill_per_token" in r.codes


def test_several_runs_are_summed():
    log = ("[engine] Decode: 16 tokens in 1000 ms (16.0 tok/s)\n"
           "[engine] Decode: 16 tokens in 3000 ms (5.3 tok/s)\n")
    r = analyze_trace_text(log)
    assert r.decode.tokens == 32 and r.decode.lines == 2 and r.decode_tps == pytest.approx(8.0)


def test_custom_patterns():
    pats = LogPatterns(
        prefill=r"PP\s+(?P<tokens>\d+)\s+tok\s+(?P<ms>[\d.]+)ms",
        decode=r"TG\s+(?P<tokens>\d+)\s+tok\s+(?P<ms>[\d.]+)ms",
        power=r"nvpmodel=(?P<mode>\S+)\s+gpu=(?P<mhz>\d+)",
    )
    r = analyze_trace_text("PP 100 tok 50ms\nTG 10 tok 1000ms\nnvpmodel=MAXN gpu=0\n", patterns=pats)
    assert r.prefill_tps == pytest.approx(2000.0) and r.decode_tps == pytest.approx(10.0)
    assert "gpu_clock_zero" in r.codes
    with pytest.raises(TraceError, match="tokens"):
        analyze_trace_text("x", patterns=LogPatterns(decode=r"Decode: (?P<ms>\d+)"))
    with pytest.raises(TraceError, match="not a valid regex"):
        analyze_trace_text("x", patterns=LogPatterns(decode=r"Decode: (?P<tokens>\d+"))


# --------------------------------------------------------------------------------------------
# JSON lines and garbage


def test_jsonl_protocol():
    shapes = token_shapes(dict(layers=3, d=2560, q=4096, kv=1024, ff=9728, vocab=151936))
    lines = ['{"event": "power", "mode": "MAXN", "gpu_mhz": 1020}']
    for _ in range(2):
        lines += [json.dumps({"event": "gemv", "index": i, "type": t, "M": m, "K": k})
                  for i, (t, m, k) in enumerate(shapes)]
    lines += ['{"event": "prefill", "tokens": 18, "ms": 110400, "power_w": 6.5, "gpu_mhz": 0}',
              '2024-05-01T10:00:00Z {"event": "decode", "tokens": 16, "ms": 100064.0, "power_w": 6.0}',
              '{"event": "something_else", "x": 1}',
              '{"event": "decode", "tokens": "many", "ms": 1}',
              '{not json']
    r = analyze_trace_text("\n".join(lines))
    assert r.token.weight_bytes == 3 * LAYER_BYTES + HEAD_BYTES
    assert r.token.n_blocks == 2 and r.token.split_method == "index-reset"
    assert r.prefill_tps == pytest.approx(18 / 110.4) and r.decode_tps == pytest.approx(16 / 100.064)
    assert r.prefill.power_w == 6.5 and r.decode.power_w == 6.0
    assert "gpu_clock_zero" in r.codes  # gpu_mhz 0 on the prefill event
    assert {"qkv_not_fused", "gate_up_not_fused", "prefill_per_token"} <= set(r.codes)
    assert r.ignored_lines == 3
    assert any("tokens must be an integer" in w for w in r.warnings)


def test_gemv_type_names_and_jsonl_without_index():
    lines = [json.dumps({"event": "gemv", "type": "Q4_K", "M": 256, "K": 256}),
             json.dumps({"event": "gemv", "type": "q6_k", "M": 512, "K": 256})] * 4
    r = analyze_trace_text("\n".join(lines))
    assert r.token.split_method == "period" and r.token.n_blocks == 4
    assert r.token.weight_bytes == q4k(256, 256) + q6k(512, 256)


def test_garbage_lines_timestamps_and_extra_fields_tolerated():
    shapes = token_shapes(dict(layers=2, d=2560, q=4096, kv=1024, ff=9728, vocab=151936))
    lines = ["loading model...", "", "   ", "CUDA: 1 device(s), compute 8.7", "#### random ####"]
    for _ in range(2):
        for i, (t, m, k) in enumerate(shapes):
            lines.append(f"2024-05-01 10:00:00.{i:03d} [GEMV #{i}] type={t} M={m} K={k} us=12.5 stream=0")
            if i == 3:
                lines.append("[kernel] rmsnorm 2560")
    lines += ["[GEMV #99] type=banana M=1 K=1", "[GEMV #100] M=1", "Decode: lots of tokens",
              "12:00:01 [engine] Decode: 16 tokens in 100064 ms (0.2 tok/s)"]
    r = analyze_trace_text("\n".join(lines))
    assert r.n_gemv_lines == 2 * len(shapes)
    assert r.token.weight_bytes == 2 * LAYER_BYTES + HEAD_BYTES and r.token.n_blocks == 2
    assert r.decode_tps == pytest.approx(16 / 100.064)
    assert r.ignored_lines == 3 + 2 + 3  # 3 log lines (blank ones are not counted), 2 rmsnorm, 3 bad
    assert any("banana" in w for w in r.warnings) and any("lacks" in w for w in r.warnings)


def test_nothing_recognisable_is_an_error():
    with pytest.raises(TraceError, match="no GEMV, Prefill, Decode or Power"):
        analyze_trace_text("hello\nworld\n")


# --------------------------------------------------------------------------------------------
# Splitting into tokens


def _gemvs(shapes, n_tokens, index=False):
    out = []
    for _ in range(n_tokens):
        out += [Gemv(type_id=t, M=m, K=k, index=i if index else None) for i, (t, m, k) in enumerate(shapes)]
    return out


def test_split_by_token_count_and_by_period():
    shapes = token_shapes(dict(layers=2, d=2560, q=4096, kv=1024, ff=9728, vocab=151936))
    gs = _gemvs(shapes, 3)
    blocks, method = split_tokens_with_method(gs)
    assert method == "period" and len(blocks) == 3 and all(len(b) == len(shapes) for b in blocks)
    blocks, method = split_tokens_with_method(gs, n_tokens=3)
    assert method == "token-count" and len(blocks) == 3
    assert len(split_tokens(gs, 1)) == 1
    with pytest.raises(TraceError, match="not a multiple"):
        split_tokens(gs, 4)
    # resets win over the count
    assert split_tokens_with_method(_gemvs(shapes, 3, index=True), 1)[1] == "index-reset"


def test_trace_that_cannot_be_split():
    shapes = token_shapes(dict(layers=2, d=2560, q=4096, kv=1024, ff=9728, vocab=151936))
    # one token plus half of the next, no index numbers: no resets, no period, no count
    gs = _gemvs(shapes, 1) + _gemvs(shapes, 1)[:5]
    with pytest.raises(TraceError, match="pass the number of decoded tokens"):
        split_tokens(gs)
    text = "\n".join(f"[GEMV] type={g.type_id} M={g.M} K={g.K}" for g in gs)
    with pytest.raises(TraceError, match="cannot tell where one decoded token"):
        analyze_trace_text(text)
    with pytest.raises(TraceError, match="not a multiple"):
        analyze_trace_text(text, n_decode_tokens=3)
    with pytest.raises(TraceError, match="differs from token 0"):
        analyze_trace_text(text, n_decode_tokens=2)
    # a count that divides but gives different blocks
    odd = _gemvs(shapes, 1) + _gemvs(list(reversed(shapes)), 1)
    with pytest.raises(TraceError, match="differs from token 0"):
        split_tokens(odd, 2)
    with pytest.raises(TraceError, match="no GEMV"):
        split_tokens([])


def test_period_split_warns_when_log_count_disagrees():
    # Without an LM head (or another per-token GEMV) a token is just its layers repeated: period detection
    # then cuts per layer. The log's decode count exposes it; n_decode_tokens fixes it.
    layer = [(Q4_K, 256, 256), (Q4_K, 512, 256), (Q4_K, 256, 512)]
    text = trace_text(layer * 3, 2, index=False) + "[engine] Decode: 2 tokens in 20 ms (100.0 tok/s)\n"
    r = analyze_trace_text(text)
    assert r.token.split_method == "period" and r.token.n_blocks == 6
    assert any("pass n_decode_tokens" in w for w in r.warnings)
    r = analyze_trace_text(text, n_decode_tokens=2)
    assert r.token.split_method == "token-count" and r.token.n_blocks == 2 and r.token.launches == 9
    assert r.token.weight_bytes == 3 * (q4k(256, 256) + q4k(512, 256) + q4k(256, 512))
    assert not r.warnings
    # with an LM head, period detection finds the token and agrees with the log
    r = analyze_trace_text(trace_text(layer * 3 + [(Q6_K, 1024, 256)], 2, index=False)
                           + "[engine] Decode: 2 tokens in 20 ms (100.0 tok/s)\n")
    assert r.token.n_blocks == 2 and not r.warnings


def test_cut_off_last_token_is_left_out_with_warning():
    shapes = token_shapes(dict(layers=2, d=2560, q=4096, kv=1024, ff=9728, vocab=151936))
    lines = trace_text(shapes, 3).splitlines()[:-4]
    r = analyze_trace_text("\n".join(lines))
    assert r.token.n_blocks == 3 and r.token.n_consistent == 2
    assert r.token.weight_bytes == 2 * LAYER_BYTES + HEAD_BYTES
    assert any("left out" in w for w in r.warnings)


# --------------------------------------------------------------------------------------------
# Rates against the bandwidth ceiling


def test_implied_bandwidth_ceiling_and_far_below_without_launch_blame():
    bw = 102.4e9  # Orin NX 16GB datasheet
    text = trace_text(token_shapes(), 2) + "[engine] Decode: 16 tokens in 3200 ms (5.0 tok/s)\n"
    r = analyze_trace_text(text, bandwidth_bytes_per_s=bw)
    assert r.decode_tps == pytest.approx(5.0)
    assert r.implied_bandwidth_bytes_per_s == pytest.approx(TOKEN_BYTES * 5.0)
    assert r.ceiling_tps == pytest.approx(bw / TOKEN_BYTES)  # ~43.3 tok/s
    assert r.fraction_of_ceiling == pytest.approx(5.0 * TOKEN_BYTES / bw)
    fb = next(f for f in r.findings if f.code == "far_below_ceiling")
    assert fb.evidence["launches_per_token"] == 253
    assert fb.evidence["launch_time_per_token_ms"] == pytest.approx(253 * 7.5 / 1000)
    # ~1.9 ms of launches cannot explain a ~177 ms gap
    assert fb.evidence["launch_share_of_gap"] < 0.1 and "does not explain" in fb.message


def test_far_below_ceiling_blames_launches_when_they_fit_the_gap():
    # A small model: 18 layers of d=640 (Gemma-3-270M-like sizes, MHA for simplicity), ceiling high.
    arch = dict(layers=18, d=640, q=1024, kv=256, ff=2048, vocab=262144)
    shapes = token_shapes(arch, head_type=Q8_0)
    text = trace_text(shapes, 2)
    r0 = analyze_trace_text(text, bandwidth_bytes_per_s=102.4e9)
    ceiling = r0.ceiling_tps
    r = analyze_trace_text(text, bandwidth_bytes_per_s=102.4e9, decode_tps=ceiling * 0.2)
    fb = next(f for f in r.findings if f.code == "far_below_ceiling")
    assert fb.evidence["launches_per_token"] == 18 * 7 + 1
    assert fb.evidence["many_launches"] is True and fb.evidence["launch_share_of_gap"] >= 0.1
    assert "launch overhead" in fb.message and "5-10 us" in fb.message
    near = analyze_trace_text(text, bandwidth_bytes_per_s=102.4e9, decode_tps=ceiling * 0.5)
    assert "far_below_ceiling" not in near.codes


def test_report_dict_is_json_and_summary_is_short():
    text = trace_text(token_shapes(), 2) + DOMAIN_LOG
    r = analyze_trace_text(text, bandwidth_bytes_per_s=102.4e9)
    d = json.loads(json.dumps(r.to_dict()))
    assert d["token"]["weight_bytes"] == TOKEN_BYTES
    assert d["token"]["by_type"]["Q6_K"]["weight_bytes"] == HEAD_BYTES
    assert d["layers"] == {"start": 0, "gemvs_per_layer": 7, "count": 36}
    assert {f["code"] for f in d["findings"]} >= {"qkv_not_fused", "gate_up_not_fused", "prefill_per_token",
                                                 "gpu_clock_zero", "far_below_ceiling"}
    s = r.summary()
    assert "253 GEMVs/token" in s and "qkv_not_fused" in s and len(s.splitlines()) < 20


# --------------------------------------------------------------------------------------------
# The stand-in engine fixture

# Shapes the engine is asked for, and their Q4_K bytes by hand: 2 layers, d=1024, q=1024, kv=256,
# ff=2816, LM head 8192 x 1024.
ENGINE_ARGS = ["--layers", "2", "--d", "1024", "--ff", "2816", "--kv-dim", "256", "--vocab", "8192", "--type", "12"]
ENGINE_LAYER = q4k(1024, 1024) * 2 + q4k(256, 1024) * 2 + q4k(2816, 1024) * 3
ENGINE_TOKEN = 2 * ENGINE_LAYER + q4k(8192, 1024)


def run_engine(model: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.pop("ENGINE_POWER_MODE", None)
    e.pop("ENGINE_GPU_MHZ", None)
    e.update(env or {})
    return subprocess.run([sys.executable, str(ENGINE), "--model", str(model), *extra],
                          capture_output=True, text=True, env=e, timeout=120)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    # A weight file exactly as large as one token's GEMV bytes: the engine reads it once per token.
    assert ENGINE_TOKEN == 17_399_808
    p = tmp_path_factory.mktemp("engine") / "weights.bin"
    p.write_bytes(os.urandom(ENGINE_TOKEN))
    return p


def test_engine_is_executable_script():
    assert ENGINE.read_text().startswith("#!/usr/bin/env python3")
    assert os.access(ENGINE, os.X_OK)


def test_engine_log_trace_parses_consistently(weights):
    proc = run_engine(weights, "--prompt-tokens", "18", "--gen-tokens", "4", "--trace", *ENGINE_ARGS)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert re.search(r"^Power: MAXN mode, GPU @ 1020 MHz$", out, re.M)
    m = re.search(r"^\[engine\] Decode: (\d+) tokens in (\d+) ms \((\d+\.\d) tok/s\)$", out, re.M)
    assert m, out[-500:]
    printed_tokens, printed_ms, printed_tps = int(m.group(1)), int(m.group(2)), float(m.group(3))
    assert printed_tokens == 4 and printed_ms > 0
    r = analyze_trace_text(out, bandwidth_bytes_per_s=50e9)
    assert r.decode_tps == pytest.approx(printed_tokens * 1000 / printed_ms)
    assert abs(r.decode_tps - printed_tps) <= 0.05 + r.decode_tps * 1.0 / printed_ms  # ms rounding
    tok = r.token
    assert tok.split_method == "index-reset" and tok.n_blocks == 4 and tok.n_consistent == 4
    assert tok.launches == 2 * 7 + 1
    assert tok.weight_bytes == ENGINE_TOKEN == weights.stat().st_size
    assert r.implied_bandwidth_bytes_per_s == pytest.approx(ENGINE_TOKEN * r.decode_tps)
    assert {"qkv_not_fused", "gate_up_not_fused"} <= set(r.codes)
    assert "gpu_clock_zero" not in r.codes
    # prefill is one batched pass for 18 tokens, decode one pass per token
    assert "prefill_per_token" not in r.codes and r.prefill_tps > 2 * r.decode_tps


def test_engine_jsonl_fused_and_parked_clock(weights):
    proc = run_engine(weights, "--prompt-tokens", "4", "--gen-tokens", "2", "--trace", "--fused",
                      "--format", "jsonl", *ENGINE_ARGS, env={"ENGINE_POWER_MODE": "0W", "ENGINE_GPU_MHZ": "0"})
    assert proc.returncode == 0, proc.stderr
    assert all(json.loads(line)["event"] for line in proc.stdout.splitlines())
    r = analyze_trace_text(proc.stdout)
    dec = [json.loads(x) for x in proc.stdout.splitlines() if '"decode"' in x][0]
    assert r.decode_tps == pytest.approx(dec["tokens"] * 1000 / dec["ms"])
    assert r.token.launches == 2 * 4 + 1 and r.token.weight_bytes == ENGINE_TOKEN
    assert "gpu_clock_zero" in r.codes
    assert not {"qkv_not_fused", "gate_up_not_fused"} & set(r.codes)


def test_engine_per_token_prefill_is_flagged(weights):
    # --batch 1: one weight pass per prompt token, as a per-token-GEMV prefill does
    proc = run_engine(weights, "--prompt-tokens", "4", "--gen-tokens", "4", "--batch", "1", "--ms-decimals", "3",
                      *ENGINE_ARGS)
    assert proc.returncode == 0, proc.stderr
    r = analyze_trace_text(proc.stdout)
    assert "prefill_per_token" in r.codes and r.token is None


def test_engine_fail_and_no_decode(weights):
    proc = run_engine(weights, "--prompt-tokens", "4", "--gen-tokens", "2", "--fail")
    assert proc.returncode == 3 and "error" in proc.stderr and proc.stdout == ""
    proc = run_engine(weights, "--prompt-tokens", "4", "--gen-tokens", "2", "--no-decode")
    assert proc.returncode == 0 and "Decode:" not in proc.stdout and "Prefill:" in proc.stdout
    r = analyze_trace_text(proc.stdout)
    assert r.decode is None and r.decode_tps is None
    proc = run_engine(weights.with_name("missing.bin"), "--prompt-tokens", "1", "--gen-tokens", "1")
    assert proc.returncode == 2 and "not found" in proc.stderr
