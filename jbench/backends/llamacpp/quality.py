"""One trial's output quality with llama-perplexity on the device (docs/quality.md).

The reference pass (the reference file, KV cache f16) writes its log-probabilities over the corpus to a file in the
device's quality cache, named by the reference key; every later trial of that key reads it. The trial's pass compares
its own distributions with them and prints the KL-divergence statistics jbench records. The cache is bounded: after a
new file is written, the least recently used files go until the cache fits `quality.cache_max_gb`.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
from typing import Any

from jbench.backends.base import BackendError, device_model_path
from jbench.backends.llamacpp import perplexity
from jbench.core.quality import QualityOutcome, QualityRequest
from jbench.core.trial import Trial
from jbench.device.connection import CommandTimeout, Connection

MIB = 1 << 20


def _run(conn: Connection, argv: list[str], timeout: float, log: logging.Logger, what: str,
         env: dict[str, str] | None = None):
    log.info("quality: %s: %s", what, shlex.join(argv))
    try:
        res = conn.run(argv, timeout=timeout, env=env or None)
    except CommandTimeout:
        raise BackendError("timeout", f"llama-perplexity ({what}) did not finish within quality.timeout_s="
                                      f"{timeout:g} s") from None
    log.info("quality: %s exited %d after %.1f s", what, res.returncode, res.duration_s)
    return res


def _refused(res: Any, what: str) -> BackendError:
    text = res.stdout + "\n" + res.stderr
    found = perplexity.refusal(text)
    if found is not None:
        return BackendError("quality", f"{what}: {found.reason}", res.stdout, res.stderr)
    if res.returncode != 0:
        from jbench.backends.base import command_failure

        failure = command_failure(f"llama-perplexity ({what})", res)
        if failure.category == "out_of_memory":
            return failure
        return BackendError("quality", str(failure), res.stdout, res.stderr)
    return BackendError("quality", f"{what}: llama-perplexity printed no statistics", res.stdout, res.stderr)


def _device_corpus(conn: Connection, req: QualityRequest, cache: str) -> str:
    if conn.is_local:
        return req.corpus_path
    remote = f"{cache}/corpus-{req.corpus_sha256[:16]}.txt"
    if not conn.exists(remote):
        conn.put_file(req.corpus_path, remote + ".partial")
        _check(conn, ["mv", "-f", remote + ".partial", remote], "store the corpus in the quality cache")
    return remote


def _check(conn: Connection, argv: list[str], what: str) -> Any:
    res = conn.run(argv, timeout=120)
    if res.returncode != 0:
        raise BackendError("quality", f"could not {what} on device '{conn.name}': {res.stderr.strip()[-300:]}")
    return res


def _cache_files(conn: Connection, cache: str) -> list[tuple[float, int, str]]:
    """(last use, bytes, path) of each reference logits file in the cache."""
    res = conn.run(["find", cache, "-maxdepth", "1", "-name", "ref-*.kld", "-printf", "%T@ %s %p\\n"], timeout=60)
    out = []
    for line in res.stdout.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3:
            try:
                out.append((float(parts[0]), int(parts[1]), parts[2]))
            except ValueError:
                continue
    return out


def prune_cache(conn: Connection, cache: str, keep: str, max_bytes: int, log: logging.Logger) -> tuple[int, list[str]]:
    """Remove the least recently used reference files until the cache holds at most max_bytes (never `keep`);
    (bytes left, removed paths)."""
    files = sorted(_cache_files(conn, cache))
    total = sum(size for _, size, _ in files)
    removed = []
    for _, size, path in files:
        if total <= max_bytes:
            break
        if path == keep:
            continue
        if conn.run(["rm", "-f", "--", path], timeout=60).returncode == 0:
            total -= size
            removed.append(path)
            log.info("quality: cache over %.0f MiB: removed %s (%.0f MiB)", max_bytes / MIB, path, size / MIB)
    return total, removed


def measure_quality(backend: Any, trial: Trial, conn: Connection, log: logging.Logger,
                    req: QualityRequest) -> QualityOutcome:
    """The trial's quality against its reference (module doc). BackendError `quality` with one clear reason when
    llama-perplexity refuses or prints no statistics; `missing_binary` without llama-perplexity on the device."""
    cfg = backend.config_of(trial)
    tool = os.path.join(backend.binary_dir(), "llama-perplexity")
    if not conn.exists(tool):
        raise BackendError("missing_binary", f"{tool} not found on device '{conn.name}': quality needs "
                                             "llama-perplexity (`jbench setup` builds it; with your own build, build "
                                             "the llama-perplexity target) or set quality.enabled=false")
    cache = conn.expand_path(req.cache_dir)
    _check(conn, ["mkdir", "-p", cache], f"create the quality cache {cache}")
    model_path = device_model_path(trial, conn)
    reference_path = conn.expand_path(req.reference_model_path)
    if not conn.exists(reference_path):
        raise BackendError("missing_model", f"reference model file {reference_path} ({req.reference_quant}) not found "
                                            f"on device '{conn.name}'")
    corpus = _device_corpus(conn, req, cache)
    logits = f"{cache}/ref-{req.reference_key}.kld"
    # One chunk per batch: a batch larger than the context makes llama-perplexity score several sequences at once
    # with that many more KV cells (the trial's own batch settings, where smaller, are kept: they change numerics).
    n_batch = min(cfg.n_batch, req.context) if cfg.n_batch else req.context
    numerics = dict(context=req.context, chunks=req.chunks, n_gpu_layers=cfg.n_gpu_layers, threads=cfg.threads,
                    n_batch=n_batch, n_ubatch=min(cfg.n_ubatch or 512, n_batch))
    out = QualityOutcome()
    started = time.monotonic()
    if conn.exists(logits):
        conn.run(["touch", "--", logits], timeout=60)  # its last use: the cache drops the least recently used first
        out.tags["quality.reference_cache"] = "hit: reference logits computed by an earlier trial"
    else:
        partial = logits + ".partial"
        argv = perplexity.reference_argv(backend.binary_dir(), reference_path, corpus, partial, **numerics)
        res = _run(conn, argv, req.timeout_s, log, f"reference pass ({req.reference_quant}, KV f16)")
        out.artifacts["raw/quality-reference.txt"] = res.stdout + "\n--- stderr ---\n" + res.stderr
        if res.returncode != 0 or perplexity.refusal(res.stdout + "\n" + res.stderr) is not None:
            conn.run(["rm", "-f", "--", partial], timeout=60)
            raise _refused(res, f"reference pass on {req.reference_quant}")
        _check(conn, ["mv", "-f", "--", partial, logits], "keep the reference logits")
        out.tags["quality.reference_cache"] = "computed by this trial"
        base = perplexity.parse_base_output(res.stdout + "\n" + res.stderr)
        if base.get("ppl") is not None:
            out.tags["quality.reference_ppl"] = f"{base['ppl']:.6g}"
    argv = perplexity.candidate_argv(backend.binary_dir(), model_path, logits, cache_type_k=cfg.cache_type_k,
                                     cache_type_v=cfg.cache_type_v, flash_attn=cfg.flash_attn
                                     if cfg.flash_attn in ("on", "off") else None, **numerics)
    # The trial's backend.env (as for llama-bench and llama-server); the cached reference is the trial's knobs' no more.
    env = {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in cfg.env.items()}
    for attempt in (1, 2):
        res = _run(conn, argv, req.timeout_s, log, "trial pass", env=env)
        text = res.stdout + "\n" + res.stderr
        out.artifacts["raw/quality-trial.txt"] = res.stdout + "\n--- stderr ---\n" + res.stderr
        if res.returncode != 0 or perplexity.refusal(text) is not None:
            raise _refused(res, "trial pass")
        try:
            stats = perplexity.parse_kld_output(text)
            break
        except perplexity.PerplexityError as exc:
            if exc.kind == "cut_short" and attempt == 1:  # once more; the cut output is kept as an artifact
                log.warning("quality: %s; running the trial pass once more", exc.reason)
                out.artifacts["raw/quality-trial-cut-short.txt"] = out.artifacts["raw/quality-trial.txt"]
                out.tags["quality.trial_pass_rerun"] = exc.reason
                continue
            raise BackendError("quality", exc.reason, res.stdout, res.stderr) from None
    out.metrics.update(stats.metrics())
    out.metrics["quality_wall_s"] = time.monotonic() - started
    size = conn.run(["stat", "-c", "%s", "--", logits], timeout=60)
    if size.returncode == 0 and size.stdout.strip().isdigit():
        out.metrics["quality_reference_logits_mib"] = int(size.stdout.strip()) / MIB
    total, removed = prune_cache(conn, cache, logits, req.cache_max_bytes, log)
    out.tags["quality.cache_mib"] = f"{total / MIB:.0f}"
    if removed:
        out.tags["quality.cache_removed"] = str(len(removed))
    return out
