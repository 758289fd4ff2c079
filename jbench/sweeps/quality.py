"""Planning the quality measurement of a sweep's trials (quality.enabled=true), before any device is touched.

Each trial gets its reference: `quality.reference` when set, else the highest-precision quant of the same model among
the sweep's trials (F16/BF16 when present; the reference's KV cache is always f16, so a KV-precision sweep on one file
compares each KV type with the f16 cache of the same weights). Then everything checkable here is checked, each
problem one line: the corpus (a readable UTF-8 file, long enough for quality.context and quality.chunks in the
model's own tokens, counted with llama-tokenize where the model and the build are on this machine), the reference
file, and a reference of another vocabulary (its logits cannot be compared token for token).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from jbench.core.errors import UserError
from jbench.core.trial import Trial
from jbench.models.corpus import check_length, count_tokens, resolve_corpus
from jbench.models.store import ModelError, resolve_model_file

# Bits per weight of the dominant ggml type of each llama.cpp file type (ggml block sizes); a size suffix breaks
# ties the way llama-quantize's mixes do (L keeps more tensors at higher precision than M, M than S).
_SUFFIX = {"L": 0.03, "M": 0.02, "S": 0.01, "XS": 0.005, "XXS": 0.0}


def precision_rank(quant: str) -> Optional[float]:
    """A sortable precision of a quant name (more bits per weight ranks higher); None for an unknown name."""
    from gguf import GGML_QUANT_SIZES

    from jbench.analysis.roofline import RooflineError, dominant_ggml_type

    try:
        block, size = GGML_QUANT_SIZES[dominant_ggml_type(quant)]
    except (RooflineError, KeyError):
        return None
    suffix = re.search(r"_(L|M|S|XS|XXS)$", str(quant).upper())
    return 8 * size / block + (_SUFFIX[suffix.group(1)] if suffix else 0.0)


def highest_precision(quants: list[str]) -> Optional[str]:
    """The quant with the most bits per weight; ties keep the first given."""
    ranked = [(r, -i, q) for i, q in enumerate(quants) if (r := precision_rank(q)) is not None]
    return max(ranked)[2] if ranked else None


def _with_reference(trial: Trial, quant: str) -> Trial:
    quality = dataclasses.replace(trial.cfg.quality, reference=quant)
    config = {**trial.config, "quality": dataclasses.asdict(quality)}
    return dataclasses.replace(trial, config=config).with_cfg(dataclasses.replace(trial.cfg, quality=quality))


def _vocab_size(path: str) -> Optional[int]:
    from jbench.models.facts import model_facts

    try:
        return model_facts(path).vocab_size()
    except Exception:  # unreadable here: the device's llama-perplexity refuses a mismatch in its own words
        return None


def plan_quality(trials: list[Trial]) -> tuple[list[Trial], list[str], list[str]]:
    """(the trials with their reference set, problems, notes). The corpus's tokens are counted with the local
    llama.cpp build for trials on this machine (on another device llama-perplexity checks the length itself)."""
    from jbench.backends.llamacpp.backend import default_binary_dir

    wanted = [t for t in trials if t.cfg.quality.enabled]
    if not wanted:
        return trials, [], []
    problems: list[str] = []
    notes: list[str] = []
    quants: dict[str, list[str]] = {}
    for t in wanted:
        quants.setdefault(t.cfg.model.name, [])
        if t.cfg.model.quant not in quants[t.cfg.model.name]:
            quants[t.cfg.model.name].append(t.cfg.model.quant)
    counted: dict[tuple[str, str], Optional[int]] = {}
    out: list[Trial] = []
    for t in trials:
        if not t.cfg.quality.enabled:
            out.append(t)
            continue
        q = t.cfg.quality
        if t.cfg.backend.name != "llamacpp":
            notes.append(f"quality is not measured by the {t.cfg.backend.name} backend: its trials record "
                         "quality.status 'not measured'")
            out.append(t)
            continue
        ref = q.reference or highest_precision(quants[t.cfg.model.name]) or t.cfg.model.quant
        t = _with_reference(t, ref)
        out.append(t)
        try:
            corpus = resolve_corpus(q.corpus)
        except UserError as exc:
            problems.append(str(exc))
            continue
        try:
            ref_path, _ = resolve_model_file(dataclasses.replace(t.cfg.model, quant=ref))
        except ModelError as exc:
            problems.append(f"quality.reference {ref}: {exc}")
            continue
        try:
            path, _ = resolve_model_file(t.cfg.model)
        except ModelError:
            continue  # the model file's own problem is reported by validation
        if t.cfg.device.kind != "local":
            continue
        a, b = _vocab_size(path), _vocab_size(ref_path)
        if a is not None and b is not None and a != b:
            problems.append(f"quality.reference {ref} ({ref_path}) has a vocabulary of {b} tokens and "
                            f"{t.cfg.model.quant} has {a}: a reference must be the same model (its logits are compared "
                            "token for token); set quality.reference to a quant of this model")
            continue
        binary_dir = t.cfg.backend.binary_dir or default_binary_dir()
        if binary_dir is None:
            continue
        key = (corpus.sha256, ref_path)
        if key not in counted:
            try:
                counted[key] = count_tokens(corpus, ref_path, binary_dir)
            except Exception as exc:  # noqa: BLE001 - the count is a check; the device's own refusal is the backstop
                notes.append(f"the corpus's length could not be counted here ({exc}); llama-perplexity checks it")
                counted[key] = None
        if counted[key] is not None and (msg := check_length(corpus, counted[key], q.context, q.chunks)):
            problems.append(msg)
    return out, list(dict.fromkeys(problems)), list(dict.fromkeys(notes))
