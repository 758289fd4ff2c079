"""GGUF files for tests, written with the `gguf` package (llama.cpp's own writer): a whole file llama.cpp cannot
load, and the broken model files users point jbench at (a directory, an empty file, a text file, a file cut inside
its header, a file cut inside its tensor data)."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np


def unloadable_gguf(path: Path, name: str = "Llama 3.2 1B") -> Path:
    """A complete GGUF file (header and every tensor's data) of a two-layer llama without a tokenizer: jbench's
    planning reads it like any model file, llama.cpp refuses to load it (llama-bench exits 1)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_feed_forward_length(128)
    writer.add_context_length(2048)
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.zeros(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def broken_model_files(root: Path, real_gguf: Path) -> dict[str, Path]:
    """Model files that are no usable GGUF, by kind. real_gguf: a real model file, cut twice: inside its header
    (its 262k-token vocabulary) and inside its tensor data (the header whole, the weights not)."""
    from jbench.models.gguf import data_end

    root.mkdir(parents=True, exist_ok=True)
    (root / "a-directory.gguf").mkdir(exist_ok=True)
    (root / "empty.gguf").write_bytes(b"")
    (root / "text.gguf").write_text("this is a README, not a model\n")
    with open(real_gguf, "rb") as src, open(root / "cut-header.gguf", "wb") as dst:
        dst.write(src.read(64 << 10))
    whole = unloadable_gguf(root / "whole.gguf")
    cut = root / "cut-data.gguf"
    shutil.copyfile(whole, cut)
    with open(cut, "r+b") as f:
        f.truncate(data_end(whole) - 100)
    return {"directory": root / "a-directory.gguf", "empty": root / "empty.gguf", "text": root / "text.gguf",
            "cut-header": root / "cut-header.gguf", "cut-data": cut}
