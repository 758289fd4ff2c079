"""llama-perplexity as jbench runs it for output quality: argument lists, the logits file's size, and what the tool
prints (statistics, refusals). Nothing here runs a process; the quality stage does, through a Connection.

Two passes, with -c / --chunks / -b / -ub equal in both:

1. reference: `llama-perplexity -m REF -f CORPUS --kl-divergence-base BASE.kld` scores the corpus and writes the
   reference's next-token log-probabilities to BASE.kld (KV cache f16, passed explicitly).
2. candidate: `llama-perplexity -m TRIAL --kl-divergence-base BASE.kld --kl-divergence` (no -f: the tokens come from
   BASE.kld) prints per-chunk lines, then `====== Perplexity statistics ======`, `====== KL divergence statistics
   ======` and `====== Token probability statistics ======` -- but only once 100 tokens or more were scored.

What tools/perplexity/perplexity.cpp (llama.cpp 0c1e57098) does, and this module relies on:

- Each chunk is `context` tokens; the first context/2 are context only, and the tokens at positions context/2 ..
  context-2 are scored (each predicts the next): context - 1 - context//2 tokens per chunk.
- The KLD pass takes the chunk size (n_ctx) and the chunk count from BASE.kld's header: its --chunks is ignored and
  its -c only has to be at least the file's n_ctx. jbench passes both equal to the reference's anyway.
- A refusal is a log line and exit status 0 (corpus too short; inconsistent vocabulary, after which the pass even
  goes on and prints numbers of no meaning): the text decides, never the exit status alone (`refusal`).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, fields
from typing import Optional

TOOL = "llama-perplexity"
KINDS = ("corpus_too_short", "vocabulary_mismatch", "bad_logits_file", "no_statistics", "cut_short", "crash")
MIN_STAT_TOKENS = 100  # perplexity.cpp: `if (kld.count < 100) return;` before the statistics
LOGITS_MAGIC = b"_logits_"
# "_logits_", then n_ctx (uint32), n_vocab (int32), n_chunk (int32)
LOGITS_HEADER_BYTES = len(LOGITS_MAGIC) + 3 * 4
FLASH_ATTN = ("on", "off")


class PerplexityError(Exception):
    """What keeps a llama-perplexity pass from giving quality figures: `kind` (one of KINDS) and `reason`, one line a
    user can act on."""

    def __init__(self, kind: str, reason: str):
        if kind not in KINDS:
            raise ValueError(f"unknown PerplexityError kind {kind!r}")
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


@dataclass(frozen=True)
class QualityStats:
    """The candidate pass's statistics, named as jbench.core.metrics declares them; None: not printed."""

    quality_kld_mean: Optional[float] = None
    quality_kld_mean_err: Optional[float] = None
    quality_kld_median: Optional[float] = None
    quality_kld_p99: Optional[float] = None
    quality_kld_max: Optional[float] = None
    quality_same_top_pct: Optional[float] = None
    quality_same_top_pct_err: Optional[float] = None
    quality_rms_dp_pct: Optional[float] = None
    quality_rms_dp_pct_err: Optional[float] = None
    quality_ppl: Optional[float] = None
    quality_ppl_err: Optional[float] = None
    quality_ppl_base: Optional[float] = None
    quality_ppl_base_err: Optional[float] = None
    quality_ppl_ratio: Optional[float] = None
    quality_ppl_ratio_err: Optional[float] = None
    # chunks x (n_ctx - 1 - n_ctx // 2) from the pass's `computing over N chunks, n_ctx=C` line (module doc).
    quality_scored_tokens: Optional[int] = None

    def metrics(self) -> dict[str, float]:
        """The values the tool printed (a printed `nan` stays NaN: the tool's own answer), by metric name."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None}


# --------------------------------------------------------------------------------------------
# Argument lists (never shell strings: the quality stage runs them through a Connection).


def _common(bin_dir: str, model_path: str, logits_path: str, *, context: int, chunks: int, n_gpu_layers: int,
            threads: Optional[int], n_batch: int, n_ubatch: int) -> list[str]:
    for name, value in (("context", context), ("chunks", chunks), ("n_batch", n_batch), ("n_ubatch", n_ubatch)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1 (got {value})")
    argv = [posixpath.join(bin_dir, TOOL), "-m", model_path, "--kl-divergence-base", logits_path,
            "-c", str(int(context)), "--chunks", str(int(chunks)), "-b", str(int(n_batch)), "-ub", str(int(n_ubatch)),
            "-ngl", str(int(n_gpu_layers))]
    if threads is not None:
        argv += ["-t", str(int(threads))]
    return argv


def reference_argv(bin_dir: str, model_path: str, corpus_path: str, logits_path: str, *, context: int, chunks: int,
                   n_gpu_layers: int, threads: Optional[int], n_batch: int, n_ubatch: int) -> list[str]:
    """The reference pass: scores corpus_path and writes the reference log-probs to logits_path. Its KV cache is
    f16 whatever the trials use (-ctk/-ctv f16 explicitly: a build's default could change)."""
    return (_common(bin_dir, model_path, logits_path, context=context, chunks=chunks, n_gpu_layers=n_gpu_layers,
                    threads=threads, n_batch=n_batch, n_ubatch=n_ubatch)
            + ["-f", corpus_path, "-ctk", "f16", "-ctv", "f16"])


def candidate_argv(bin_dir: str, model_path: str, logits_path: str, *, context: int, chunks: int, n_gpu_layers: int,
                   threads: Optional[int], n_batch: int, n_ubatch: int, cache_type_k: str, cache_type_v: str,
                   flash_attn: Optional[str]) -> list[str]:
    """The candidate (trial) pass against the reference's logits_path: no -f, the tokens come from the file.
    flash_attn "on"/"off" is passed as `-fa on|off` (the common argument parser of builds since -fa took a value;
    it also accepts 1/0); None omits it (the build's default, "auto" in 0c1e57098)."""
    argv = _common(bin_dir, model_path, logits_path, context=context, chunks=chunks, n_gpu_layers=n_gpu_layers,
                   threads=threads, n_batch=n_batch, n_ubatch=n_ubatch)
    argv += ["--kl-divergence", "-ctk", str(cache_type_k), "-ctv", str(cache_type_v)]
    if flash_attn is not None:
        if flash_attn not in FLASH_ATTN:
            raise ValueError(f"flash_attn must be 'on', 'off' or None (got {flash_attn!r})")
        argv += ["-fa", flash_attn]
    return argv


# --------------------------------------------------------------------------------------------
# The logits file (perplexity.cpp's format, little-endian as written by the device).


def scored_tokens(context: int, chunks: int) -> int:
    """Tokens scored by `chunks` chunks of `context`: the second half of each chunk less its last token."""
    return int(chunks) * (int(context) - 1 - int(context) // 2)


def too_few_scored(context: int, chunks: int) -> Optional[str]:
    """The message when `chunks` chunks of `context` score fewer tokens than llama-perplexity needs to print any
    statistics (checkable while planning, before a device is touched); None when enough."""
    n = scored_tokens(context, chunks)
    if n >= MIN_STAT_TOKENS:
        return None
    return (f"quality.context={context} x quality.chunks={chunks} scores {n} tokens (context - 1 - context/2 per "
            f"chunk); llama-perplexity prints its statistics from {MIN_STAT_TOKENS} on: raise quality.context or "
            "quality.chunks")


def logits_row_bytes(n_vocab: int) -> int:
    """Bytes per scored token: 2 floats (scale, min log-prob) as 4 uint16, then one uint16 per vocabulary entry,
    the row padded to an even count: nv = 2 * ((n_vocab + 1) // 2) + 4 uint16."""
    return 2 * (2 * ((int(n_vocab) + 1) // 2) + 4)


def logits_file_bytes(n_vocab: int, context: int, chunks: int) -> int:
    """Exact size of the reference pass's logits file: the 20-byte header, every chunk's tokens (int32, scored or
    not), and one row (logits_row_bytes) per scored token."""
    return (LOGITS_HEADER_BYTES + 4 * int(context) * int(chunks)
            + scored_tokens(context, chunks) * logits_row_bytes(n_vocab))


def parse_logits_header(head: bytes) -> dict[str, int]:
    """n_ctx, n_vocab, n_chunk from a logits file's first 20 bytes; PerplexityError(bad_logits_file) otherwise."""
    if len(head) < LOGITS_HEADER_BYTES or not head.startswith(LOGITS_MAGIC):
        raise PerplexityError("bad_logits_file", "the reference logits file has no llama-perplexity header "
                              "(truncated or another kind of file): it is computed again")
    n_ctx = int.from_bytes(head[8:12], "little", signed=False)
    n_vocab = int.from_bytes(head[12:16], "little", signed=True)
    n_chunk = int.from_bytes(head[16:20], "little", signed=True)
    return {"n_ctx": n_ctx, "n_vocab": n_vocab, "n_chunk": n_chunk}


# --------------------------------------------------------------------------------------------
# What the tool prints.

_NUM = r"([-+]?(?:nan|inf|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?))"
_PM = rf"{_NUM}\s*±\s*{_NUM}"
# metric -> (pattern over the statistics, group of the value); each "x ± y" line gives a value and its _err.
_PAIRS = {
    "quality_ppl": r"^Mean PPL\(Q\)\s*:\s*" + _PM,
    "quality_ppl_base": r"^Mean PPL\(base\)\s*:\s*" + _PM,
    "quality_ppl_ratio": r"^Mean PPL\(Q\)/PPL\(base\)\s*:\s*" + _PM,
    "quality_kld_mean": r"^Mean\s+KLD:\s*" + _PM,
    "quality_rms_dp_pct": r"^RMS Δp\s*:\s*" + _PM + r"\s*%",
    "quality_same_top_pct": r"^Same top p\s*:\s*" + _PM + r"\s*%",
}
_SINGLES = {
    "quality_kld_max": r"^Maximum KLD:\s*" + _NUM,
    "quality_kld_p99": r"^99\.0%\s+KLD:\s*" + _NUM,
    "quality_kld_median": r"^Median\s+KLD:\s*" + _NUM,
}
_KLD_BLOCK = "====== KL divergence statistics ======"
_PPL_BLOCK = "====== Perplexity statistics ======"
_KLD_TABLE = re.compile(r"^chunk\s+PPL\s+ln\(PPL\(Q\)/PPL\(base\)\)", re.M)
_KLD_CHUNKS = re.compile(r"kl_divergence: computing over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)")
_PPL_CHUNKS = re.compile(r"perplexity: calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), "
                         r"n_seq=(\d+)")
_FINAL = re.compile(r"Final estimate: PPL = " + _NUM + r" \+/- " + _NUM)


def _num(text: str) -> float:
    return float(text)  # float() reads nan, -nan, inf as C's printf writes them


def parse_kld_output(text: str) -> QualityStats:
    """The candidate pass's statistics from its output (stdout and stderr together). A refusal in the text is raised
    first (refusal()): after `inconsistent vocabulary` the tool still prints numbers, which mean nothing.
    PerplexityError(no_statistics) when the KL-divergence block is absent."""
    refused = refusal(text)
    if refused is not None:
        raise refused
    scored = None
    m = _last(_KLD_CHUNKS, text)
    if m:
        scored = scored_tokens(int(m.group(2)), int(m.group(1)))
    if _KLD_BLOCK not in text:
        if _KLD_TABLE.search(text):
            if scored is not None and scored >= MIN_STAT_TOKENS:
                # Seen once in CI: exit 0, the table's header, then nothing (no chunk row, no statistics).
                raise PerplexityError("cut_short", f"llama-perplexity's output ends after its table header: no chunk "
                                      f"row and no statistics, although {scored} tokens (>= {MIN_STAT_TOKENS}) were "
                                      "to be scored")
            got = f" ({scored} scored)" if scored is not None else ""
            raise PerplexityError("no_statistics", f"fewer than {MIN_STAT_TOKENS} tokens scored{got}: llama-perplexity "
                                  "prints its statistics from 100 on; raise quality.context or quality.chunks")
        raise PerplexityError("no_statistics", "this llama-perplexity printed no KL-divergence statistics (an older "
                              "build?)")
    stats = text[text.find(_PPL_BLOCK) if _PPL_BLOCK in text else text.find(_KLD_BLOCK):]
    values: dict[str, float] = {}
    for name, pattern in _PAIRS.items():
        found = re.search(pattern, stats, re.M)
        if found:
            values[name], values[f"{name}_err"] = _num(found.group(1)), _num(found.group(2))
    for name, pattern in _SINGLES.items():
        found = re.search(pattern, stats, re.M)
        if found:
            values[name] = _num(found.group(1))
    if "quality_kld_mean" not in values:
        raise PerplexityError("no_statistics", "llama-perplexity's KL-divergence statistics have no `Mean KLD` line "
                              "this jbench can read (a changed output format?)")
    return QualityStats(**values, quality_scored_tokens=scored)


def parse_base_output(text: str) -> dict:
    """What the reference pass reports: chunks, context (n_ctx), batch_size, n_seq, scored_tokens (chunks x (n_ctx -
    1 - n_ctx // 2)), and ppl / ppl_err (its `Final estimate`) when printed. A refusal in the text is raised."""
    refused = refusal(text)
    if refused is not None:
        raise refused
    out: dict = {}
    m = _last(_PPL_CHUNKS, text)
    if m:
        chunks, n_ctx = int(m.group(1)), int(m.group(2))
        out.update(chunks=chunks, context=n_ctx, batch_size=int(m.group(3)), n_seq=int(m.group(4)),
                   scored_tokens=scored_tokens(n_ctx, chunks))
    m = _last(_FINAL, text)
    if m:
        out.update(ppl=_num(m.group(1)), ppl_err=_num(m.group(2)))
    return out


def _last(pattern: re.Pattern, text: str) -> Optional[re.Match]:
    found = None
    for found in pattern.finditer(text):
        pass
    return found


# Refusals, as perplexity.cpp and the common code log them (function-name prefixes keep them from matching a loader
# line). Checked in this order: the first that matches is the one reported.
_TOO_SHORT = re.compile(r"you need at least (\d+) tokens to evaluate perplexity with a context of (\d+)")
_ONLY = re.compile(r"the data file you provided tokenizes to only (\d+) tokens")
_VOCAB = re.compile(r"inconsistent vocabulary \((\d+) vs (\d+)\)")
_NOT_LOGITS = re.compile(r"kl_divergence: (.+) does not look like a file containing log-probabilities")
_OPEN = re.compile(r"(?:kl_divergence|perplexity): failed to open (.+?)( for writing)?\s*$", re.M)
_NO_FILE = re.compile(r"you must provide a name of a file containing the log probabilities")
_READ = re.compile(r"kl_divergence: failed reading (n_vocab, n_chunk|evaluation tokens|log-probs for chunk \d+)")
_CTX = re.compile(r"kl_divergence: .* has been computed with (\d+), while the current context is (\d+)")
_CRASH = (
    (re.compile(r"unable to load model|failed to load model"), "llama-perplexity could not load the model"),
    (re.compile(r"failed to create context"), "llama-perplexity could not create its context (out of memory?)"),
    (re.compile(r"failed to decode"), "llama-perplexity failed to decode a batch"),
    (re.compile(r"GGML_ASSERT\([^\n]*"), "llama-perplexity aborted on an assertion"),
    (re.compile(r"Unexpected negative standard deviation"), "llama-perplexity's reference pass found a negative "
     "variance (no final estimate)"),
    (re.compile(r"error while handling argument[^\n]*|^error: [^\n]*", re.M), "llama-perplexity refused its "
     "arguments (an older or newer build?)"),
)


def refusal(text: str) -> Optional[PerplexityError]:
    """The refusal in a pass's output (stdout and stderr together), as one clear PerplexityError; None when there is
    none. The tool exits 0 after most of these, so this, not the exit status, says whether a pass counted."""
    m = _TOO_SHORT.search(text)
    if m:
        need, context = int(m.group(1)), int(m.group(2))
        only = _ONLY.search(text)
        has = f"only {only.group(1)}" if only else "fewer"
        return PerplexityError(
            "corpus_too_short",
            f"the quality corpus tokenizes to {has} tokens; llama-perplexity needs at least {need} (2 x context "
            f"{context}) and quality.chunks x {context} to score every chunk: lower quality.context or quality.chunks, "
            "or set quality.corpus to a longer text")
    m = _VOCAB.search(text)
    if m:
        return PerplexityError(
            "vocabulary_mismatch",
            f"the reference logits hold a vocabulary of {m.group(1)} tokens but this model has {m.group(2)}: "
            "quality.reference must be a quant of the same model as the trial")
    m = _NOT_LOGITS.search(text)
    if m:
        return PerplexityError("bad_logits_file", f"{m.group(1).strip()} is not a llama-perplexity logits file "
                               "(overwritten or another file): the reference pass must run again")
    if _NO_FILE.search(text):
        return PerplexityError("bad_logits_file", "the candidate pass was given no reference logits file "
                               "(--kl-divergence-base)")
    m = _OPEN.search(text)
    if m:
        how = "for writing" if m.group(2) else "for reading"
        return PerplexityError("bad_logits_file", f"llama-perplexity could not open the reference logits file "
                               f"{m.group(1).strip()} {how} (missing, or its folder is not writable / full)")
    m = _READ.search(text)
    if m:
        return PerplexityError("bad_logits_file", f"the reference logits file is truncated (failed reading "
                               f"{m.group(1)}): the reference pass did not finish; it must run again")
    m = _CTX.search(text)
    if m:
        return PerplexityError("bad_logits_file", f"the reference logits were computed with context {m.group(1)} "
                               f"but this pass has {m.group(2)}: both passes need the same quality.context")
    for pattern, what in _CRASH:
        m = pattern.search(text)
        if m:
            return PerplexityError("crash", f"{what}: {m.group(0).strip()[:200]}")
    return None

