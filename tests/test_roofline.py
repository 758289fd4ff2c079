"""Roofline arithmetic against the worked examples of the domain notes and a real GGUF file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from jbench.analysis import roofline as rl
from jbench.analysis.roofline import ModelArch, RooflineError
from jbench.models.facts import read_gguf

# The classes of model the domain notes' worked examples use.
LLAMA3_8B = ModelArch(
    n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=14336, vocab_size=128256,
    tied_embeddings=False,
)
QWEN3_4B = ModelArch(
    n_layer=36, n_embd=2560, n_head=32, n_head_kv=8, head_dim=128, n_ff=9728, vocab_size=151936,
    tied_embeddings=True,
)
LLAMA2_7B = ModelArch(
    n_layer=32, n_embd=4096, n_head=32, n_head_kv=32, head_dim=128, n_ff=11008, vocab_size=32000,
    tied_embeddings=False,
)


# --------------------------------------------------------------------------------------------
# Types and sizes


@pytest.mark.parametrize(
    "type_id,name", [(12, "Q4_K"), (13, "Q5_K"), (14, "Q6_K"), (8, "Q8_0"), (2, "Q4_0"), (1, "F16")]
)
def test_ggml_type_ids(type_id, name):
    assert rl.ggml_type(type_id).name == name
    assert rl.ggml_type(name) == type_id
    assert rl.ggml_type(name.lower()) == type_id
    assert rl.bytes_per_weight(type_id) == rl.bytes_per_weight(name)


def test_bytes_per_weight_from_gguf_constants():
    for qtype, (block, size) in gguf.GGML_QUANT_SIZES.items():
        assert rl.bytes_per_weight(qtype) == size / block
    # The effective bits per weight the domain notes quote.
    assert rl.bytes_per_weight("Q4_K") * 8 == pytest.approx(4.5)
    assert rl.bytes_per_weight("Q4_0") * 8 == pytest.approx(4.5)
    assert rl.bytes_per_weight("Q5_K") * 8 == pytest.approx(5.5)
    assert rl.bytes_per_weight("Q6_K") * 8 == pytest.approx(6.5625)
    assert rl.bytes_per_weight("Q8_0") * 8 == pytest.approx(8.5)
    assert rl.bytes_per_weight("F16") * 8 == 16


def test_q4_k_matrix_bytes():
    assert rl.tensor_bytes("Q4_K", 4096 * 2560) == 5_898_240
    assert rl.tensor_bytes(12, 4096 * 2560) == 5_898_240


def test_tied_q6_k_lm_head_bytes():
    assert rl.tensor_bytes("Q6_K", 151936 * 2560) == 319_065_600
    assert rl.tensor_bytes(14, 151936 * 2560) == 319_065_600


def test_unknown_type_and_partial_block_are_errors():
    with pytest.raises(RooflineError, match="Q9_Z"):
        rl.bytes_per_weight("Q9_Z")
    with pytest.raises(RooflineError, match="9999"):
        rl.bytes_per_weight(9999)
    with pytest.raises(RooflineError, match="block"):
        rl.tensor_bytes("Q4_K", 100)


# --------------------------------------------------------------------------------------------
# KV cache


def test_llama3_8b_kv_bytes():
    assert rl.kv_bytes_per_token(LLAMA3_8B) == 131_072
    assert rl.kv_bytes_per_token(LLAMA3_8B) * 4096 == 536_870_912
    assert rl.kv_bytes_at_depth(LLAMA3_8B, 4096).full_attention == 536_870_912
    # No sliding layers: the sliding-window-aware figure is the same.
    assert rl.kv_bytes_at_depth(LLAMA3_8B, 4096).swa_aware == 536_870_912


def test_qwen3_4b_kv_bytes_at_4096():
    assert rl.kv_bytes_per_token(QWEN3_4B) * 4096 == 603_979_776
    result = rl.decode_ceiling(0, rl.kv_bytes_per_token(QWEN3_4B), 4096, 1e9)
    assert result.kv_bytes == 603_979_776


def test_quantized_kv_cache_bytes():
    def per_element(name):
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        return size / block

    for k, v in [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f16", "q4_0")]:
        expected = 32 * 8 * 128 * (per_element(k.upper()) + per_element(v.upper()))
        assert rl.kv_bytes_per_token(LLAMA3_8B, k, v) == pytest.approx(expected)
    assert rl.kv_bytes_per_token(LLAMA3_8B, "q8_0", "q8_0") == 69_632  # 131072 * 34/32 / 2
    assert rl.kv_bytes_per_token(LLAMA3_8B, "q4_0", "q4_0") == 36_864  # 131072 * 18/32 / 4


def test_sliding_window_kv_bytes():
    arch = ModelArch(
        n_layer=12, n_embd=64, n_head=4, n_head_kv=1, head_dim=16, n_ff=128, vocab_size=100,
        sliding_window=512, swa_layers=rl.swa_layers_from_pattern(12, 6),
    )
    assert arch.full_attention_layers == (5, 11)
    per_layer = 1 * 16 * 2 * 2  # K and V, f16
    kv = rl.kv_bytes_at_depth(arch, 4096)
    assert kv.full_attention == 12 * per_layer * 4096
    assert kv.swa_aware == per_layer * (2 * 4096 + 10 * 512)
    # Below the window every layer reads the whole context.
    assert rl.kv_bytes_at_depth(arch, 300).swa_aware == 12 * per_layer * 300
    # swa_slack (llama.cpp keeps window + n_ubatch cells) raises the sliding layers' reads.
    assert rl.kv_bytes_at_depth(arch, 4096, swa_slack=512).swa_aware == per_layer * (2 * 4096 + 10 * 1024)


# --------------------------------------------------------------------------------------------
# Ceiling, FLOPs, regime, fit


def test_7b_int4_ceiling_about_14_tok_s():
    result = rl.decode_ceiling(3.5e9, 0, 0, 50e9)
    assert result.ceiling_tps == pytest.approx(14.3, abs=0.1)
    assert result.bytes_per_token == 3.5e9
    # The same from an architecture: Llama-2-7B at Q4_0 is ~3.8 GB of weights.
    est = rl.roofline_from_arch(LLAMA2_7B, "Q4_0", 0, 50e9)
    assert est.estimated
    assert 3.6e9 < est.weight_bytes < 4.0e9
    assert 12 < est.ceiling_tps < 15


def test_ceiling_adds_kv_at_depth():
    kv = rl.kv_bytes_per_token(LLAMA3_8B)
    result = rl.decode_ceiling(4e9, kv, 4096, 100e9)
    assert result.bytes_per_token == 4e9 + 536_870_912
    assert result.ceiling_tps == pytest.approx(100e9 / (4e9 + 536_870_912))
    assert result.arithmetic_intensity is None
    override = rl.decode_ceiling(4e9, kv, 4096, 100e9, kv_bytes_read=1e6)
    assert override.bytes_per_token == 4e9 + 1e6


def test_flops_and_arithmetic_intensity():
    params = rl.arch_matmul_params(LLAMA3_8B)
    per_layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336
    assert params == 32 * per_layer + 128256 * 4096
    assert rl.flops_per_token(LLAMA3_8B, 0) == 2 * params
    attention = 2 * 32 * (128 + 128) * 32 * 4096
    assert rl.flops_per_token(LLAMA3_8B, 4096) == 2 * params + attention
    # Batch-1 intensity on weights alone is 2 / bytes_per_weight FLOP/byte.
    bpw = rl.bytes_per_weight("Q8_0")
    result = rl.decode_ceiling(params * bpw, 0, 0, 100e9, flops_per_token=2 * params)
    assert result.arithmetic_intensity == pytest.approx(2 / bpw)


def test_regime_labels():
    assert rl.regime_label(80, 100) == rl.LABEL_NEAR_ROOFLINE == "near-roofline"
    assert rl.regime_label(70, 100) == "near-roofline"
    assert rl.regime_label(50, 100) == "memory-bound, below roofline"
    assert rl.regime_label(30, 100) == "memory-bound, below roofline"
    assert rl.regime_label(0.2, 10) == "far below roofline (overheads)"
    assert rl.regime_label(150, 100) == rl.LABEL_ABOVE_CEILING
    assert rl.regime_label(101, 100) == rl.LABEL_ABOVE_CEILING and rl.regime_label(100, 100) == "near-roofline"
    assert rl.NEAR_ROOFLINE_FRACTION == 0.7 and rl.MEMORY_BOUND_FRACTION == 0.3
    with pytest.raises(RooflineError):
        rl.regime_label(10, 0)


def test_dominant_type_of_file_types():
    assert rl.dominant_ggml_type("Q4_K_M").name == "Q4_K"
    assert rl.dominant_ggml_type("Q5_K_S").name == "Q5_K"
    assert rl.dominant_ggml_type("Q3_K_L").name == "Q3_K"
    assert rl.dominant_ggml_type("Q8_0").name == "Q8_0"
    assert rl.dominant_ggml_type("IQ3_M").name == "IQ3_S"
    assert rl.dominant_ggml_type("F16").name == "F16"
    with pytest.raises(RooflineError, match="Q4_K_X"):
        rl.dominant_ggml_type("Q4_K_X")


def test_memory_fit():
    kv = rl.kv_bytes_per_token(QWEN3_4B)
    ok = rl.memory_fit(2.5e9, kv, 4096, 8 * 2**30, 1.5 * 2**30)
    assert ok.fits and ok.needed_bytes == 2_500_000_000 + 603_979_776
    assert ok.available_bytes == int(6.5 * 2**30)
    assert ok.message.startswith("fits")
    short = rl.memory_fit(2.5e9, kv, 40960, 8 * 2**30, 1.5 * 2**30)
    assert not short.fits
    assert "does not fit" in short.message and "-ctk" in short.message


# --------------------------------------------------------------------------------------------
# GGUF files


def _write_gguf(path: Path, *, head_count_kv: bool = True, tied: bool = False) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    if head_count_kv:
        writer.add_head_count_kv(2)
    writer.add_feed_forward_length(128)
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((16, 64), dtype=np.float16))
    writer.add_tensor("output_norm.weight", np.zeros(64, dtype=np.float32))
    for i in range(2):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.zeros(64, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((64, 64), dtype=np.float16))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", np.zeros((128, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_missing_metadata_key_is_named(tmp_path):
    path = tmp_path / "no_kv_heads.gguf"
    _write_gguf(path, head_count_kv=False)
    with pytest.raises(RooflineError, match=r"llama\.attention\.head_count_kv"):
        read_gguf(path)


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all, just text\n" * 4])
def test_unreadable_file_is_named(tmp_path, content):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(RooflineError, match="broken.gguf"):
        read_gguf(path)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(RooflineError, match="absent.gguf"):
        read_gguf(tmp_path / "absent.gguf")


def test_tiny_gguf_untied_and_tied(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path)
    model = read_gguf(path)
    assert model.architecture == "llama"
    assert model.arch.head_dim == 16 and model.arch.head_dim_v == 16  # 64 / 4 heads
    assert model.arch.vocab_size == 16 and not model.arch.tied_embeddings
    w = rl.weight_bytes_per_token(model)
    layer = 64 * 4 + 64 * 64 * 2 + 128 * 64 * 4
    assert w.per_layer == (layer, layer)
    assert w.lm_head == 16 * 64 * 2  # output.weight, F16
    assert w.token_embd_row == 64 * 4  # one gathered F32 row, not the table
    assert w.other == 64 * 4
    assert w.total == 2 * layer + 16 * 64 * 2 + 64 * 4 + 64 * 4

    tied_path = tmp_path / "tied.gguf"
    _write_gguf(tied_path, tied=True)
    tied = read_gguf(tied_path)
    assert tied.arch.tied_embeddings
    wt = rl.weight_bytes_per_token(tied)
    assert wt.tied_embeddings and wt.lm_head_tensor == "token_embd.weight"
    assert wt.lm_head == 16 * 64 * 4  # the whole table, read as the LM head
    assert wt.total == 2 * layer + 16 * 64 * 4 + 64 * 4 + 64 * 4


# --------------------------------------------------------------------------------------------
# The bundled model


@pytest.fixture(scope="module")
def bundled_gemma():
    """The bundled model's reader, or why it is missing (reported as a test failure, not a skip)."""
    from jbench.models import store as models

    entry = models.load_manifest("gemma3_270m").get("files", {}).get("Q4_K_M")
    path = Path(entry["path"]) if entry else None
    if path is None or not path.exists():
        return None, (
            f"bundled model gemma3_270m Q4_K_M is not installed ({path or 'no manifest entry'}): "
            "run `jbench setup`"
        )
    # One parse serves both sides: GGUFReader takes ~15 s on a 262k-token vocabulary.
    return gguf.GGUFReader(str(path)), None


def _bundled_reader(cache) -> gguf.GGUFReader:
    # Called in the test body so that a missing model is a FAILED test, not a setup error or skip.
    reader, problem = cache
    if problem:
        pytest.fail(problem)
    return reader


def _expected_weight_bytes(reader: gguf.GGUFReader) -> tuple[int, bool]:
    """The decode rules applied straight to the tensor table, apart from the module's code."""
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    total = 0
    for t in reader.tensors:
        n_bytes = int(t.n_bytes)
        if t.name == "token_embd.weight":
            n_rows = int(t.n_elements) // int(t.shape[0])
            row = n_bytes // n_rows  # one gathered row
            total += row + (n_bytes if tied else 0)
        else:
            total += n_bytes  # matrices, norms and biases: all read once per token
    return total, tied


@pytest.mark.slow
@pytest.mark.e2e
def test_bundled_gemma3_weight_bytes(bundled_gemma):
    gemma_reader = _bundled_reader(bundled_gemma)
    model = read_gguf(gemma_reader)
    assert model.architecture == "gemma3"
    assert model.file_type_name == "Q4_K_M"

    expected, tied = _expected_weight_bytes(gemma_reader)
    w = rl.weight_bytes_per_token(model)
    assert w.total == expected

    # Gemma 3 270M ties its LM head to the embedding table: no output.weight in the file.
    assert tied is True
    assert model.tensor("output.weight") is None
    assert model.arch.tied_embeddings and w.tied_embeddings
    embd = model.tensor("token_embd.weight")
    assert w.lm_head == embd.n_bytes
    assert w.token_embd_row == rl.tensor_bytes(embd.ggml_type, model.arch.n_embd)
    # Tied: every byte of the file's tensors is read, plus the gathered row.
    assert w.total == model.tensor_bytes + w.token_embd_row

    # The module's sizes agree with the gguf block constants for every tensor.
    for t in model.tensors:
        assert rl.tensor_bytes(t.ggml_type, t.n_elements) == t.n_bytes, t.name


@pytest.mark.slow
@pytest.mark.e2e
def test_bundled_gemma3_arch_and_sliding_window(bundled_gemma):
    gemma_reader = _bundled_reader(bundled_gemma)
    model = read_gguf(gemma_reader)
    arch = model.arch
    fields = gemma_reader.fields

    def value(key):
        field = fields[key]
        return int(field.parts[field.data[0]][0])

    assert arch.n_layer == value("gemma3.block_count")
    assert arch.n_embd == value("gemma3.embedding_length")
    assert arch.n_head_kv == value("gemma3.attention.head_count_kv")
    assert arch.head_dim == value("gemma3.attention.key_length")
    assert arch.vocab_size == len(fields["tokenizer.ggml.tokens"].data)
    # llama.cpp's Gemma 3 pattern: every 6th layer is full attention, the rest slide.
    assert arch.sliding_window == value("gemma3.attention.sliding_window")
    assert arch.full_attention_layers == tuple(i for i in range(arch.n_layer) if i % 6 == 5)
    kv = rl.kv_bytes_at_depth(arch, 4096)
    per_layer = arch.n_head_kv * (arch.head_dim + arch.head_dim_v) * 2
    assert kv.full_attention == arch.n_layer * per_layer * 4096
    assert kv.swa_aware == per_layer * (
        arch.n_full_layers * 4096 + arch.n_swa_layers * min(4096, arch.sliding_window)
    )
    result = rl.roofline_from_gguf(model, 4096, 102.4e9)
    assert result.bytes_per_token == rl.weight_bytes_per_token(model).total + kv.swa_aware
    assert not result.estimated
