"""The text the quality pass scores (`quality.corpus`): a user's UTF-8 file, or a default derived at run time.

The default ships nobody's prose in the repository: it is the documentation CPython itself carries
(`pydoc_data.topics`, the `help()` topics), joined in sorted key order and written once under jbench's cache, named
by its SHA-256. It is deterministic for a given Python version; the hash recorded with the quality says which text
was scored.

Token counts come from the real `llama-tokenize` of the trial's build, fed exactly what `llama-perplexity -f` scores
(the file less one trailing newline, no escape processing, BOS as the model wants it), and are cached by
(corpus SHA-256, model SHA-256) so planning a sweep twice tokenizes once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from jbench.core import paths
from jbench.core.errors import UserError
from jbench.models.digest import file_digest

SETTING = "quality.corpus"
# Between two topics: a blank line, so no two entries' words run together.
SEPARATOR = "\n\n"
TOKENIZE_TIMEOUT_S = 600.0


class CorpusError(UserError):
    """A corpus that cannot be used; the message names the file (or the default) and the setting to change."""


@dataclass(frozen=True)
class Corpus:
    path: str  # a local file, UTF-8
    name: str  # short: the user file's name, or "pydoc-topics"
    sha256: str  # of the file's bytes
    n_bytes: int
    description: str  # what it is, for the record


def quality_cache_dir(cache_dir: Optional[Path] = None) -> Path:
    """Where the quality layer keeps its local files: the default corpus, token counts."""
    return Path(cache_dir) if cache_dir is not None else paths.cache_dir() / "quality"


def default_text() -> tuple[str, int]:
    """The default corpus's text and its entry count; CorpusError when this Python has no pydoc_data."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # Debian/Ubuntu's python3-minimal and some containers strip it
        raise CorpusError(
            f"the default quality corpus is derived from CPython's pydoc_data, which this Python "
            f"({sys.executable}) lacks ({exc}): set {SETTING} to a UTF-8 text file (e.g. wikitext-2 raw)") from None
    return SEPARATOR.join(topics[key] for key in sorted(topics)), len(topics)


def default_corpus(cache_dir: Optional[Path] = None) -> Corpus:
    """The default corpus, written once under <cache>/quality/corpus/pydoc-topics-<sha256>.txt (a second call writes
    nothing while the file there still has that hash)."""
    text, n_entries = default_text()
    data = text.encode("utf-8")
    digest = hashlib.sha256(data).hexdigest()
    folder = quality_cache_dir(cache_dir) / "corpus"
    path = folder / f"pydoc-topics-{digest}.txt"
    if not _holds(path, len(data), digest):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)  # atomic: another process never reads half a corpus
        except OSError as exc:
            raise CorpusError(f"cannot write the default quality corpus to {path} ({exc}): free space there or set "
                              f"{SETTING} to a UTF-8 text file") from None
    version = ".".join(str(v) for v in sys.version_info[:3])
    return Corpus(path=str(path), name="pydoc-topics", sha256=digest, n_bytes=len(data),
                  description=f"CPython {version} pydoc_data topics, {n_entries} entries")


def _holds(path: Path, size: int, digest: str) -> bool:
    try:
        return path.stat().st_size == size and hashlib.sha256(path.read_bytes()).hexdigest() == digest
    except OSError:
        return False


def resolve_corpus(path: Optional[str]) -> Corpus:
    """The corpus of `quality.corpus`: a user's file (an existing, non-empty regular file of UTF-8 text), or the
    default when the setting is null/empty. CorpusError (one line naming the file and the setting) otherwise."""
    if path is None or not str(path).strip():
        return default_corpus()
    given = str(path)
    real = Path(given).expanduser()
    try:
        real = real.resolve(strict=True)
    except (OSError, RuntimeError):
        raise CorpusError(f"{SETTING}: {given} does not exist") from None
    if not real.is_file():
        raise CorpusError(f"{SETTING}: {given} is not a regular file (a UTF-8 text file is needed)")
    try:
        data = real.read_bytes()
    except OSError as exc:
        raise CorpusError(f"{SETTING}: {given} cannot be read ({exc.strerror or exc})") from None
    if not data.strip():
        raise CorpusError(f"{SETTING}: {given} is empty (a UTF-8 text of at least 2 x quality.context tokens is "
                          "needed)")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{SETTING}: {given} is not UTF-8 text (invalid byte at offset {exc.start}): convert it "
                          "with e.g. `iconv -t UTF-8`") from None
    return Corpus(path=str(real), name=real.name, sha256=hashlib.sha256(data).hexdigest(), n_bytes=len(data),
                  description=f"user file {real}, {len(data)} bytes")


# --------------------------------------------------------------------------------------------
# Tokens: how many the model makes of the corpus, and how many a context and chunk count need.


def needed_tokens(context: int, chunks: int) -> int:
    """Tokens `llama-perplexity -c context --chunks chunks` needs to score all the chunks asked for.

    perplexity.cpp refuses a text of fewer than 2 x context tokens, and cuts the text into floor(tokens / context)
    chunks of context tokens, silently using fewer than --chunks when fewer fit: chunks x context are needed for
    every chunk asked for to be scored."""
    if context < 1 or chunks < 1:
        raise ValueError(f"context and chunks must be >= 1 (got {context}, {chunks})")
    return max(2 * context, chunks * context)


def check_length(corpus: Corpus, n_tokens: int, context: int, chunks: int) -> Optional[str]:
    """None when the corpus holds enough tokens, else the one message saying what to change."""
    need = needed_tokens(context, chunks)
    if n_tokens >= need:
        return None
    fit = n_tokens // context if n_tokens >= 2 * context else 0
    if fit:
        room = f"only {fit} chunk{'s' if fit != 1 else ''} of {context} fit"
    else:
        room = f"llama-perplexity refuses a text shorter than 2 x quality.context = {2 * context}"
    return (f"the quality corpus {corpus.name} ({corpus.description}) tokenizes to {n_tokens} tokens; "
            f"quality.context={context} x quality.chunks={chunks} needs {need} ({room}): lower quality.context or "
            f"quality.chunks, or set {SETTING} to a longer UTF-8 text")


def _counts_path(cache_dir: Optional[Path]) -> Path:
    return quality_cache_dir(cache_dir) / "token_counts.json"


def _load_counts(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def count_tokens(corpus: Corpus, model_path: str, bin_dir: str, *, cache_dir: Optional[Path] = None) -> int:
    """Tokens the model's vocabulary makes of the corpus as llama-perplexity tokenizes it (BOS included when the
    model adds one), counted with this machine's `llama-tokenize` from bin_dir. Cached in
    <cache>/quality/token_counts.json by (corpus SHA-256, model file SHA-256): the count depends only on the text
    and the vocabulary, so a second call for the same pair runs nothing. CorpusError when it cannot be counted."""
    model_sha = file_digest(model_path)
    if model_sha is None:
        raise CorpusError(f"cannot count the quality corpus's tokens: the model file {model_path} cannot be read")
    key = f"{corpus.sha256}:{model_sha}"
    counts_path = _counts_path(cache_dir)
    cached = _load_counts(counts_path).get(key)
    if isinstance(cached, dict) and isinstance(cached.get("tokens"), int):
        return cached["tokens"]
    n_tokens = _run_tokenize(corpus, model_path, bin_dir)
    counts = _load_counts(counts_path)
    counts[key] = {"tokens": n_tokens, "corpus": corpus.name, "model": os.path.realpath(model_path)}
    try:
        counts_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = counts_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(counts, indent=1, sort_keys=True))
        tmp.replace(counts_path)
    except OSError:
        pass  # a read-only cache only costs tokenizing again
    return n_tokens


_COUNT = re.compile(r"^Total number of tokens: (\d+)\s*$", re.M)


def _run_tokenize(corpus: Corpus, model_path: str, bin_dir: str) -> int:
    tool = Path(bin_dir) / "llama-tokenize"
    try:
        data = Path(corpus.path).read_bytes()
    except OSError as exc:
        raise CorpusError(f"{SETTING}: {corpus.path} cannot be read ({exc.strerror or exc})") from None
    # llama-perplexity's -f drops one trailing newline and applies no escapes; llama-tokenize -f keeps the bytes and
    # applies escapes, so give it exactly perplexity's text on stdin with escapes off.
    if data.endswith(b"\n"):
        data = data[:-1]
    # --ids: one line of ids instead of a line per token; --show-count then prints the total.
    argv = [str(tool), "-m", model_path, "--stdin", "--ids", "--show-count", "--no-escape", "--log-disable"]
    try:
        proc = subprocess.run(argv, input=data, capture_output=True, timeout=TOKENIZE_TIMEOUT_S)
    except FileNotFoundError:
        raise CorpusError(f"cannot count the quality corpus's tokens: {tool} not found (run `jbench setup` to build "
                          "llama-tokenize)") from None
    except subprocess.TimeoutExpired:
        raise CorpusError(f"llama-tokenize took over {TOKENIZE_TIMEOUT_S:.0f} s on {corpus.path}: set {SETTING} "
                          "to a shorter text") from None
    except OSError as exc:
        raise CorpusError(f"cannot run {tool}: {exc}") from None
    out = proc.stdout.decode("utf-8", "replace")
    found = _COUNT.findall(out)
    if proc.returncode != 0 or not found:
        tail = (proc.stderr.decode("utf-8", "replace").strip() or out.strip())[-300:]
        raise CorpusError(f"llama-tokenize failed on {model_path} (exit {proc.returncode}): {tail}")
    return int(found[-1])
