"""The quality stage: each trial's output quality against its reference (docs/quality.md).

`quality_request(trial, session)` turns a trial into what its backend needs (the corpus, the reference file, the
reference key, the quality identity); the sweep calls it after preflight too, for resume (a trial FINISHED without
the quality it now asks for runs again) and to reuse quality an earlier run measured. The stage reuses a result of
the same quality identity (this sweep's, or a stored run's the sweep preloaded into the session); otherwise it asks
the backend to measure. A backend without a quality path is recorded as such, never left silent.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol, runtime_checkable

from jbench.core import metrics
from jbench.core.quality import QualityOutcome, QualityRequest, meaning, quality_identity, reference_key
from jbench.core.results import Result
from jbench.core.trial import ChoosesKVTypes, SwitchesFlashAttention, Trial
from jbench.models.corpus import count_tokens, resolve_corpus
from jbench.models.store import ModelError, resolve_model_file
from jbench.runner.context import TrialContext
from jbench.runner.session import DeviceSession
from jbench.runner.stages import Stage

QUALITY_METRICS = frozenset(metrics.provided_by(metrics.QUALITY))


@runtime_checkable
class MeasuresQuality(Protocol):
    """A backend with a quality measurement (llama.cpp: llama-perplexity)."""

    def measure_quality(self, trial: Trial, conn: Any, log: Any, request: QualityRequest) -> QualityOutcome: ...

    def binary_dir(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class Numerics:
    """The backend settings besides the file and the KV types that change a pass's numbers (llama.cpp's names;
    None where a backend has no such setting)."""

    n_gpu_layers: Optional[int] = None
    n_batch: Optional[int] = None
    n_ubatch: Optional[int] = None


def _kv(backend: Any) -> tuple[str, str]:
    """The KV-cache types a backend config sets; f16 for a backend without the setting."""
    return (backend.cache_type_k, backend.cache_type_v) if isinstance(backend, ChoosesKVTypes) else ("f16", "f16")


def reference_model(trial: Trial):
    """The trial's model section with the reference quant (resolved by the planner into quality.reference)."""
    ref = trial.cfg.quality.reference or trial.cfg.model.quant
    return dataclasses.replace(trial.cfg.model, quant=ref)


def quality_request(trial: Trial, session: DeviceSession) -> QualityRequest:
    """What the trial's quality measurement is made of. Raises ModelError when a model file cannot be resolved,
    UserError (from the corpus) for an unusable corpus."""
    cfg, q = trial.cfg, trial.cfg.quality
    corpus = resolve_corpus(q.corpus)
    ref_model = reference_model(trial)
    ref_path, _ = resolve_model_file(ref_model)
    backend = cfg.backend
    numerics = dataclasses.asdict(Numerics(**{f.name: getattr(backend, f.name, None)
                                               for f in dataclasses.fields(Numerics)}))
    key = reference_key(backend=backend.name, build=session.build_id(backend), device=cfg.device.name,
                        reference_digest=session.model_digest(ref_model), corpus_sha256=corpus.sha256,
                        context=q.context, chunks=q.chunks, numerics=numerics)
    ident = quality_identity(reference=key, model_digest=session.model_digest(cfg.model), kv=_kv(backend),
                             flash_attn=backend.flash_attn if isinstance(backend, SwitchesFlashAttention) else None)
    return QualityRequest(corpus_path=corpus.path, corpus_sha256=corpus.sha256, corpus_name=corpus.description,
                          context=q.context, chunks=q.chunks, reference_quant=ref_model.quant,
                          reference_model_path=ref_path, reference_key=key, identity=ident,
                          cache_max_bytes=int(q.cache_max_gb * 1e9), timeout_s=q.timeout_s)


def quality_tags(trial: Trial, req: QualityRequest) -> dict[str, str]:
    """What the figures are measured against, in the record's tags."""
    cfg = trial.cfg
    _, facts = resolve_model_file(cfg.model)
    try:
        _, ref_facts = resolve_model_file(reference_model(trial))
    except ModelError:
        ref_facts = {}
    same = ref_facts.get("model.sha256", "ref") == facts.get("model.sha256") or req.reference_quant == cfg.model.quant
    ref_source = ref_facts.get("model.requantized_from")
    label = f"{cfg.model.name} {req.reference_quant}, KV cache f16"
    if ref_source:
        label += f" (made from {ref_source} by jbench setup)"
    return {
        "quality.status": "ok",
        "quality.identity": req.identity,
        "quality.reference": label,
        "quality.reference_quant": req.reference_quant,
        "quality.meaning": meaning(same_weights=same, requantized_from=facts.get("model.requantized_from"),
                                   reference_quant=req.reference_quant, reference_requantized_from=ref_source,
                                   kv=_kv(cfg.backend)),
        "quality.corpus": req.corpus_name,
        "quality.corpus_sha256": req.corpus_sha256,
        "quality.context": str(req.context),
        "quality.chunks": str(req.chunks),
    }


def _corpus_tokens(ctx: TrialContext, req: QualityRequest) -> Optional[int]:
    """The corpus's length in the model's tokens, where the model and the tokenizer are on this machine (the
    planner counted them already: a cached answer); None elsewhere."""
    if not ctx.conn.is_local:
        return None
    if not isinstance(ctx.backend, MeasuresQuality):
        return None
    try:
        path, _ = resolve_model_file(ctx.cfg.model)
        return count_tokens(resolve_corpus(ctx.cfg.quality.corpus), path, ctx.backend.binary_dir())
    except Exception:  # the count is a label; the measurement does not depend on it
        return None


class Quality(Stage):
    """The trial's output quality (llama-perplexity's KL divergence against the reference)."""

    NAME = metrics.QUALITY
    PROVIDES = tuple(metrics.provided_by(NAME))

    def applies(self, ctx: TrialContext) -> bool:
        return ctx.cfg.quality.enabled

    def run(self, ctx: TrialContext) -> None:
        if not isinstance(ctx.backend, MeasuresQuality):
            ctx.record.tags["quality.status"] = (f"not measured: the {ctx.cfg.backend.name} backend has no quality "
                                                 "measurement (llama.cpp's llama-perplexity is the one jbench has)")
            return
        req = quality_request(ctx.trial, ctx.session)
        tags = quality_tags(ctx.trial, req)
        tokens = _corpus_tokens(ctx, req)
        if tokens is not None:
            tags["quality.corpus_tokens"] = str(tokens)
        known: Optional[tuple[str, dict[str, float]]] = ctx.session.known_quality.get(req.identity)
        if known is not None:
            source, figures = known
            ctx.record.merge(Result(metrics=dict(figures), tags={**tags, "quality.reused_from": source}))
            ctx.log.info("quality: reused (%s)", source)
            return
        with ctx.quiet():
            outcome = ctx.backend.measure_quality(ctx.trial, ctx.conn, ctx.log, req)
        ctx.record.merge(Result(metrics=outcome.metrics, tags={**tags, **outcome.tags}, artifacts=outcome.artifacts))
        figures = {k: v for k, v in outcome.metrics.items() if k in QUALITY_METRICS and k != "quality_wall_s"}
        ctx.session.known_quality[req.identity] = (f"trial {ctx.trial.label} of this sweep", figures)
