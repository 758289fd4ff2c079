"""What one trial's quality measurement is made of, and its identity (no I/O).

Quality is measured against a reference: the next-token distributions of the reference model file (KV cache f16)
over a corpus, compared with the trial's own (its weights, its KV types). The figures depend on the trial's model
file, KV types and numerics (build, GPU offload, batch sizes), the device, the corpus, the context and chunk count,
and the reference file; not on speed knobs (prompt and generation lengths, depth, repetitions, threads, power
mode). So quality has an identity of its own: a trial whose only change is a speed knob reuses the quality an
earlier trial of the same quality identity measured, and the reference logits are computed once per reference key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Optional

QUALITY_HASH_VERSION = 1


@dataclass(frozen=True)
class QualityRequest:
    """Everything a backend needs to measure one trial's quality; paths of model files as the controller resolves
    them (the backend maps them onto the device)."""

    corpus_path: str  # on this machine
    corpus_sha256: str
    corpus_name: str
    context: int
    chunks: int
    reference_quant: str
    reference_model_path: str
    reference_key: str  # names the reference logits in the device's cache
    identity: str
    cache_dir: str = "~/.cache/jbench/quality"
    cache_max_bytes: int = 8 * 10**9
    timeout_s: float = 3600.0


@dataclass
class QualityOutcome:
    """What a backend's quality pass found: metrics named as jbench.core.metrics declares them, `quality.*` tags,
    the raw outputs as artifacts."""

    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    artifacts: dict[str, str] = field(default_factory=dict)


def _digest(payload: dict[str, Any]) -> str:
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def reference_key(*, backend: str, build: Optional[str], device: str, reference_digest: Optional[str],
                  corpus_sha256: str, context: int, chunks: int, numerics: dict[str, Any]) -> str:
    """The reference logits' key: the reference file, the tokens (corpus, context, chunks) and what changes the
    numbers (build, device, GPU offload, batch sizes); KV types of a reference are always f16."""
    return _digest({"v": QUALITY_HASH_VERSION, "backend": backend, "build": build, "device": device,
                    "reference": reference_digest, "corpus": corpus_sha256, "context": context, "chunks": chunks,
                    "numerics": numerics})


def quality_identity(*, reference: str, model_digest: Optional[str], kv: tuple[str, str], flash_attn: Optional[str]
                     ) -> str:
    """A trial's quality identity: its reference key and the trial's own file and KV-cache settings."""
    return _digest({"v": QUALITY_HASH_VERSION, "reference": reference, "model": model_digest, "kv": list(kv),
                    "flash_attn": flash_attn})


def meaning(*, same_weights: bool, requantized_from: Optional[str], reference_quant: str,
            reference_requantized_from: Optional[str], kv: tuple[str, str] = ("f16", "f16")) -> str:
    """What the figures measure, in words (tag quality.meaning)."""
    if same_weights and tuple(kv) == ("f16", "f16"):
        return (f"the reference itself ({reference_quant}, f16 KV cache): the measurement's zero, not a loss "
                "(other numerics, e.g. flash attention, show here as a departure from 0)")
    if same_weights:
        return (f"KV-cache precision against an f16 KV cache on the same weights ({reference_quant}): a full "
                "measurement of what the KV type costs")
    source = requantized_from or reference_requantized_from
    if source:
        return (f"requantization loss against {reference_quant} (itself made from {source}): how much this file "
                f"departs from the reference, not its quality against the original weights")
    return f"loss against {reference_quant} of the same model"
