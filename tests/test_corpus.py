"""The quality corpus (jbench.models.corpus): the default derived from CPython's pydoc_data, users' files, the
tokens a context and chunk count need, and counting tokens with the real llama-tokenize (cached)."""

from __future__ import annotations

import hashlib
import pathlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jbench.models.corpus import (SEPARATOR, Corpus, CorpusError, check_length, count_tokens, default_corpus,
                                  needed_tokens, resolve_corpus)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """jbench's cache in tmp_path (the default corpus, token counts and model digests land there)."""
    monkeypatch.setenv("JBENCH_CACHE_DIR", str(tmp_path / "jbench-cache"))
    return tmp_path / "jbench-cache"


def test_default_corpus_is_derived_hashed_and_described(tmp_path):
    from pydoc_data.topics import topics

    corpus = default_corpus(tmp_path)
    data = Path(corpus.path).read_bytes()
    assert data == SEPARATOR.join(topics[k] for k in sorted(topics)).encode("utf-8")
    assert corpus.sha256 == hashlib.sha256(data).hexdigest() and corpus.n_bytes == len(data)
    assert Path(corpus.path) == tmp_path / "corpus" / f"pydoc-topics-{corpus.sha256}.txt"
    version = ".".join(map(str, sys.version_info[:3]))
    assert corpus.description == f"CPython {version} pydoc_data topics, {len(topics)} entries"
    assert corpus.name == "pydoc-topics"


def test_default_corpus_is_deterministic_and_written_once(tmp_path, monkeypatch):
    first = default_corpus(tmp_path / "a")
    assert default_corpus(tmp_path / "b") == Corpus(**{**first.__dict__, "path": first.path.replace("/a/", "/b/")})

    def no_write(*args, **kwargs):
        raise AssertionError("the default corpus was written again")

    monkeypatch.setattr(pathlib.Path, "write_bytes", no_write)
    assert default_corpus(tmp_path / "a") == first  # the second call writes nothing


def test_a_damaged_default_corpus_is_written_again(tmp_path):
    first = default_corpus(tmp_path)
    Path(first.path).write_text("something else")
    assert default_corpus(tmp_path) == first
    assert hashlib.sha256(Path(first.path).read_bytes()).hexdigest() == first.sha256


def test_default_corpus_without_pydoc_data_names_the_setting(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # as distro Pythons that strip it
    with pytest.raises(CorpusError) as err:
        default_corpus(tmp_path)
    assert "pydoc_data" in str(err.value) and "set quality.corpus" in str(err.value)


def test_resolve_corpus_default_and_user_file(cache, tmp_path):
    assert resolve_corpus(None).name == "pydoc-topics"
    assert Path(resolve_corpus("").path).parent == cache / "quality" / "corpus"
    text = tmp_path / "wiki.txt"
    text.write_text("Übung macht den Meister.\n" * 50, encoding="utf-8")
    corpus = resolve_corpus(str(text))
    assert corpus.path == str(text.resolve()) and corpus.name == "wiki.txt"
    assert corpus.sha256 == hashlib.sha256(text.read_bytes()).hexdigest() and corpus.n_bytes == text.stat().st_size


@pytest.mark.parametrize("make, words", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "is not a regular file"),
    (lambda p: p.write_text(""), "is empty"),
    (lambda p: p.write_text(" \n\n"), "is empty"),
    (lambda p: p.write_bytes(b"caf\xe9 latin-1 text"), "is not UTF-8 text (invalid byte at offset 3)"),
])
def test_bad_user_files_give_one_clear_message(tmp_path, make, words):
    path = tmp_path / "corpus.txt"
    make(path)
    with pytest.raises(CorpusError) as err:
        resolve_corpus(str(path))
    message = str(err.value)
    assert message.startswith(f"quality.corpus: {path} ") and words in message and "\n" not in message


def test_needed_tokens_follow_perplexity_cpp():
    assert needed_tokens(256, 1) == 512  # at least 2 x context whatever the chunks
    assert needed_tokens(256, 2) == 512
    assert needed_tokens(256, 5) == 1280  # chunks x context for every chunk asked for
    with pytest.raises(ValueError):
        needed_tokens(0, 1)


def test_check_length_messages():
    corpus = Corpus(path="/x", name="wiki.txt", sha256="0" * 64, n_bytes=10, description="user file /x, 10 bytes")
    assert check_length(corpus, 512, 256, 2) is None
    short = check_length(corpus, 441, 256, 1)
    assert "tokenizes to 441 tokens" in short and "needs 512" in short and "refuses a text shorter" in short
    some = check_length(corpus, 700, 256, 4)
    assert "needs 1024" in some and "only 2 chunks of 256 fit" in some
    for message in (short, some):
        assert all(s in message for s in ("quality.context", "quality.chunks", "quality.corpus"))


@pytest.mark.e2e
def test_count_tokens_matches_llama_perplexity_and_is_cached(llama_build, bundled_model, cache, tmp_path):
    """llama-tokenize's count of a text ending in a newline is the one llama-perplexity itself reports for -f (which
    drops that newline); a second call for the same corpus and model runs nothing (the binary path made invalid)."""
    model = bundled_model["Q4_K_M"]["path"]
    default = default_corpus(tmp_path / "c")
    text = tmp_path / "short.txt"
    text.write_bytes(Path(default.path).read_bytes()[:1500].decode("utf-8", "ignore").encode("utf-8") + b"\n")
    corpus = resolve_corpus(str(text))

    n = count_tokens(corpus, model, llama_build["bin_dir"])
    ppl = subprocess.run([str(Path(llama_build["bin_dir"]) / "llama-perplexity"), "-m", model, "-f", str(text),
                          "-c", "512", "-t", "2"], capture_output=True, text=True, timeout=60)
    said = re.search(r"tokenizes to only (\d+) tokens", ppl.stdout + ppl.stderr)
    assert said, (ppl.stdout + ppl.stderr)[-1500:]
    assert n == int(said.group(1))
    assert check_length(corpus, n, 512, 1) is not None and check_length(corpus, n, n // 2, 1) is None

    assert count_tokens(corpus, model, str(tmp_path / "no-build")) == n  # from the cache
    other = tmp_path / "other.txt"
    other.write_text("another text")
    with pytest.raises(CorpusError) as err:  # another corpus is counted again: the cache is keyed by it
        count_tokens(resolve_corpus(str(other)), model, str(tmp_path / "no-build"))
    assert "llama-tokenize not found" in str(err.value)
