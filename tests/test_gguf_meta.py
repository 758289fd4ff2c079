"""The fast GGUF header reader agrees with the gguf package's reader on the real bundled model."""

from __future__ import annotations

from pathlib import Path

import pytest

from jbench.analysis.roofline import weight_bytes_per_token
from jbench.models.facts import read_gguf, read_gguf_header
from jbench.models.facts import model_facts
from jbench.models.gguf import GGUFMetaError, header


@pytest.mark.slow
@pytest.mark.e2e
def test_fast_header_matches_gguf_reader(bundled_model):
    path = bundled_model["Q4_K_M"]["path"]
    slow, fast = read_gguf(path), read_gguf_header(path)
    assert fast.arch == slow.arch and fast.architecture == slow.architecture == "gemma3"
    assert fast.tensors == slow.tensors
    assert weight_bytes_per_token(fast).total == weight_bytes_per_token(slow).total == 246_588_584
    meta = model_facts(path).kv_arch()
    assert (meta["context_length"], meta["n_layer"], meta["n_head_kv"], meta["head_dim"]) == (32768, 18, 1, 256)
    values, _ = header(path)
    assert values["tokenizer.ggml.tokens.__len__"] == 262144


def test_corrupt_and_foreign_files(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (1).to_bytes(8, "little")
                    + (10**15).to_bytes(8, "little"))
    with pytest.raises(GGUFMetaError, match="corrupt"):
        header(bad)
    other = tmp_path / "x.bin"
    other.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(GGUFMetaError, match="not a GGUF file"):
        header(other)


def test_data_end_is_a_whole_files_size_and_finds_a_cut_one(tmp_path):
    from jbench.models.gguf import data_end
    from jbench.models.store import gguf_file_problem

    from .gguf_files import unloadable_gguf

    whole = unloadable_gguf(tmp_path / "whole.gguf")
    size = whole.stat().st_size
    assert data_end(whole) == size and gguf_file_problem(str(whole)) is None
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:-1])  # one byte of the last tensor's data missing
    assert data_end(cut) == size
    assert gguf_file_problem(str(cut)) == (f"is truncated: its header describes {size} bytes, the file has {size - 1} "
                                           "(an interrupted download or copy?)")


@pytest.mark.e2e
def test_data_end_of_every_bundled_file_is_its_size(bundled_model):
    from jbench.models.gguf import data_end

    for quant, entry in bundled_model.items():
        assert data_end(entry["path"]) == Path(entry["path"]).stat().st_size, quant
