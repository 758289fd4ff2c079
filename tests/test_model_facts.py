"""Model facts cached across processes: a hit never opens the GGUF file, a changed file or a bad
cache entry is read again, and cached facts equal a fresh read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from jbench.analysis.roofline import RooflineError, weight_bytes_per_token
from jbench.models import facts as mf
from jbench.models import gguf as fast
from jbench.models.gguf import GGUFMetaError


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test gets its own cache directory and an empty in-process memo."""
    monkeypatch.setenv("JBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("JBENCH_FACTS_CACHE", raising=False)
    mf.clear_memory_cache()
    yield
    mf.clear_memory_cache()


def _write_gguf(path: Path, *, n_vocab: int = 300, tied: bool = True, pattern: bool = False) -> Path:
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("tiny")
    writer.add_file_type(1)
    writer.add_context_length(2048)
    writer.add_block_count(6)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(1)
    writer.add_key_length(32)
    writer.add_value_length(32)
    writer.add_sliding_window(128)
    if pattern:
        writer.add_array("gemma3.attention.sliding_window_pattern", [True, True, False, True, True, False])
    writer.add_token_list([f"tok{i}" for i in range(n_vocab)])
    writer.add_token_scores([0.0] * n_vocab)
    writer.add_tensor("token_embd.weight", np.zeros((n_vocab, 64), dtype=np.float16))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((n_vocab, 64), dtype=np.float16))
    writer.add_tensor("output_norm.weight", np.zeros(64, dtype=np.float32))
    for i in range(6):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.zeros(64, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((128, 64), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _count_reads(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = fast.read_header

    def counting(path):
        calls.append(str(path))
        return real(path)

    monkeypatch.setattr(fast, "read_header", counting)
    return calls


def _forbid_reads(monkeypatch) -> None:
    def boom(path):
        raise AssertionError(f"the GGUF file {path} was opened on a cache hit")

    monkeypatch.setattr(fast, "read_header", boom)
    monkeypatch.setattr(fast, "header", boom)


def test_hit_does_not_open_the_gguf(tmp_path, monkeypatch):
    path = _write_gguf(tmp_path / "m.gguf")
    first = mf.model_facts(path)
    assert list(mf.cache_root().glob("*.json"))
    mf.clear_memory_cache()  # as a new process would start
    _forbid_reads(monkeypatch)
    again = mf.model_facts(path)
    assert again == first
    assert mf.model_facts(path).kv_arch() == first.kv_arch()
    assert mf.read_gguf_header(path) == first.gguf_model()


def test_changed_mtime_or_size_invalidates(tmp_path, monkeypatch):
    path = _write_gguf(tmp_path / "m.gguf")
    calls = _count_reads(monkeypatch)
    mf.model_facts(path)
    mf.clear_memory_cache()
    mf.model_facts(path)
    assert len(calls) == 1

    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    mf.clear_memory_cache()
    touched = mf.model_facts(path)
    assert len(calls) == 2 and touched.mtime_ns == st.st_mtime_ns + 1_000_000

    # Replaced by a different model of another size (the new file is what counts).
    _write_gguf(path, n_vocab=500, tied=False)
    mf.clear_memory_cache()
    replaced = mf.model_facts(path)
    assert len(calls) == 3
    assert replaced.size == path.stat().st_size and replaced.vocab_size() == 500
    assert not replaced.tied_embeddings
    # Even within one process (no clear): the memo is keyed by size and mtime too.
    with open(path, "ab") as f:
        f.write(b"\0" * 32)
    assert mf.model_facts(path).size == replaced.size + 32 and len(calls) == 4


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"version": 1, "path": 3}', b"[1, 2]",
                                     b'{"version": 0, "path": "x", "size": 1, "mtime_ns": 1, "metadata": {}, "tensors": []}'])
def test_corrupt_or_old_entry_is_rewritten(tmp_path, monkeypatch, content):
    path = _write_gguf(tmp_path / "m.gguf")
    fresh = mf.model_facts(path)
    (entry,) = mf.cache_root().glob("*.json")
    entry.write_bytes(content)
    mf.clear_memory_cache()
    calls = _count_reads(monkeypatch)
    assert mf.model_facts(path) == fresh
    assert len(calls) == 1
    data = json.loads(entry.read_text())
    assert data["version"] == mf.FACTS_VERSION and data["size"] == path.stat().st_size
    assert list(mf.cache_root().iterdir()) == [entry]  # no temporary files left behind


def test_entry_of_another_path_is_not_used(tmp_path, monkeypatch):
    """An entry is trusted only for the exact path it names (a hash collision or a copied cache)."""
    a = _write_gguf(tmp_path / "a.gguf")
    b = tmp_path / "b.gguf"
    b.write_bytes(a.read_bytes())
    os.utime(b, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns))
    facts_a = mf.model_facts(a)
    entry_b = mf._cache_file(os.path.abspath(b))
    entry_b.write_text(json.dumps(facts_a.to_json()))
    mf.clear_memory_cache()
    calls = _count_reads(monkeypatch)
    assert mf.model_facts(b).path == os.path.abspath(b)
    assert len(calls) == 1


@pytest.mark.e2e  # the bundled model from `jbench setup`
def test_cached_facts_equal_a_fresh_read(bundled_model):
    for quant in ("Q4_K_M", "Q8_0"):
        path = bundled_model[quant]["path"]
        cached_first = mf.model_facts(path)
        mf.clear_memory_cache()
        with pytest.MonkeyPatch.context() as mp:
            _forbid_reads(mp)
            cached = mf.model_facts(path)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("JBENCH_FACTS_CACHE", "0")  # no disk cache: straight from the header
            mf.clear_memory_cache()
            fresh = mf.model_facts(path)
        assert str(mf.cache_root()).startswith(os.environ["JBENCH_CACHE_DIR"])
        assert cached == cached_first == fresh
        assert cached.kv_arch() == fresh.kv_arch()
        assert cached.gguf_model() == fresh.gguf_model()
        values, _ = fast.header(path)
        assert cached.metadata == mf.select_metadata(values)
    facts = mf.model_facts(bundled_model["Q4_K_M"]["path"])
    arch, _ = facts.model_arch()
    assert (arch.n_layer, arch.n_head_kv, arch.head_dim, arch.vocab_size) == (18, 1, 256, 262144)
    assert arch.tied_embeddings and arch.sliding_window == 512 and facts.file_type_name == "Q4_K_M"
    assert weight_bytes_per_token(facts.gguf_model()).total == 246_588_584


def test_cache_is_shared_across_processes(tmp_path):
    path = _write_gguf(tmp_path / "m.gguf")
    mf.model_facts(path)
    code = (
        "import sys\n"
        "from jbench.models import facts, gguf\n"
        "def boom(p): raise SystemExit('opened ' + str(p))\n"
        "gguf.read_header = boom\n"
        f"print(facts.model_facts({str(path)!r}).kv_arch()['n_layer'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "6"


def test_tiny_file_facts_match_the_gguf_reader(tmp_path):
    for pattern in (False, True):
        for tied in (True, False):
            path = _write_gguf(tmp_path / f"m{pattern}{tied}.gguf", tied=tied, pattern=pattern)
            slow, quick = mf.read_gguf(path), mf.read_gguf_header(path)
            assert slow.arch == quick.arch and slow.tensors == quick.tensors
            assert (slow.file_type_name, slow.name) == (quick.file_type_name, quick.name) == ("F16", "tiny")
            assert quick.arch.tied_embeddings is tied
            expected = (0, 1, 3, 4) if pattern else (0, 1, 2, 3, 4)  # gemma3 default: every 6th is full
            assert quick.arch.swa_layers == expected and quick.arch.vocab_size == 300


def test_unwritable_cache_dir_only_costs_speed(tmp_path, monkeypatch):
    path = _write_gguf(tmp_path / "m.gguf")
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    monkeypatch.setenv("JBENCH_CACHE_DIR", str(blocker))
    assert mf.model_facts(path).kv_arch()["n_layer"] == 6


def test_errors_are_not_cached_and_name_the_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(GGUFMetaError, match="not a GGUF file"):
        mf.model_facts(bad)
    with pytest.raises(RooflineError, match="bad.gguf"):
        mf.read_gguf_header(bad)
    with pytest.raises(FileNotFoundError):
        mf.model_facts(tmp_path / "absent.gguf").kv_arch()
    with pytest.raises(RooflineError, match="absent.gguf"):
        mf.read_gguf_header(tmp_path / "absent.gguf")
    assert not mf.cache_root().exists() or not list(mf.cache_root().glob("*.json"))
    # Now a real model appears at the bad path: read, not a cached failure.
    _write_gguf(bad)
    assert mf.model_facts(bad).architecture == "gemma3"


def test_missing_key_is_named_like_a_fresh_read(tmp_path):
    path = tmp_path / "nokv.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_feed_forward_length(128)
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for _ in range(2):  # a miss, then a hit: the same errors
        mf.clear_memory_cache()
        with pytest.raises(GGUFMetaError, match=r"llama\.context_length"):
            mf.model_facts(path).kv_arch()
        with pytest.raises(RooflineError, match=r"llama\.attention\.head_count_kv"):
            mf.read_gguf_header(path)
