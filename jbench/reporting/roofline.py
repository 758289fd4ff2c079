"""Roofline figures of a model file (what `jbench roofline` prints): its tensor table through the pure analysis in
jbench.analysis.roofline, against a bandwidth the caller found (a trial's ceiling is the run layer's Roofline
analysis, jbench.runner.analyses)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from jbench.analysis.roofline import (
    decode_ceiling,
    flops_per_token,
    kv_bytes_at_depth,
    kv_bytes_per_token,
    matmul_params,
    memory_fit,
    weight_bytes_per_token,
)
from jbench.core.schema import ProfileConfig, SweepConfig
from jbench.models.facts import read_gguf_header


def roofline_figures(path: str, *, quant: Optional[str] = None, depth: int = 0, kv_type: str = "f16",
                     bandwidth_gbs: Optional[float] = None, bandwidth_source: str = "--bandwidth-gbs",
                     model_label: Optional[str] = None, profile: Optional[ProfileConfig] = None) -> dict[str, Any]:
    """What `jbench roofline` prints for the GGUF file at `path` (its header only), with the decode ceiling when a
    bandwidth is given (GB/s) and where that figure came from; with a module profile, whether the file and a KV
    cache of `depth` tokens fit its RAM less the sweep's default reserve (what planning a sweep checks)."""
    source = bandwidth_source
    m = read_gguf_header(path)
    weights = weight_bytes_per_token(m)
    kv_tok = kv_bytes_per_token(m.arch, kv_type, kv_type)
    kv = kv_bytes_at_depth(m.arch, depth, kv_type, kv_type)
    out: dict[str, Any] = {
        "model": model_label or Path(path).name, "quant": quant or m.file_type_name, "architecture": m.architecture,
        "weight_bytes_per_token": weights.total, "lm_head_bytes": weights.lm_head,
        "tied_embeddings": str(m.arch.tied_embeddings), "kv_type": kv_type,
        "kv_bytes_per_token_of_context": kv_tok, "context_depth": depth,
        "kv_bytes_read_at_depth": kv.swa_aware, "kv_bytes_read_at_depth_full_attention": kv.full_attention,
        "bytes_per_decoded_token": weights.total + kv.swa_aware,
        "flops_per_token": flops_per_token(m.arch, depth, matmul_params=matmul_params(m)),
    }
    out["arithmetic_intensity_flop_per_byte"] = out["flops_per_token"] / out["bytes_per_decoded_token"]
    if bandwidth_gbs:
        res = decode_ceiling(weights.total, kv_tok, depth, bandwidth_gbs * 1e9, kv_bytes_read=kv.swa_aware)
        out.update({"bandwidth_gbs": bandwidth_gbs, "bandwidth_source": source,
                    "decode_ceiling_tok_s": res.ceiling_tps, "ms_per_token_at_ceiling": 1000 / res.ceiling_tps})
    if profile is not None:
        reserve_gb = SweepConfig().memory_reserve_gb
        fit = memory_fit(os.path.getsize(path), kv_tok, depth, profile.ram_gb * 1e9, reserve_gb * 1e9)
        out.update({"profile": profile.name, "module": profile.module, "ram_gb": profile.ram_gb,
                    "memory_reserve_gb": reserve_gb, "memory_needed_bytes": fit.needed_bytes,
                    "fits_in_ram": fit.fits, "memory_fit": fit.message})
    return out
