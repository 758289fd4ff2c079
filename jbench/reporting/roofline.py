"""Roofline figures for a trial or a model: its model file's tensor table, the device's bandwidth
(jbench.device.bandwidth), and the pure analysis in jbench.analysis.roofline."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from jbench.analysis.roofline import (
    RooflineError,
    decode_ceiling,
    flops_per_token,
    kv_bytes_at_depth,
    kv_bytes_per_token,
    matmul_params,
    regime_label,
    weight_bytes_per_token,
)
from jbench.device.bandwidth import device_bandwidth
from jbench.models.facts import read_gguf_header

def trial_roofline(config: dict, decode_tps: Optional[float]) -> tuple[dict[str, float], dict[str, str]]:
    """roofline_* metrics and tags for a trial whose model file is readable on this machine."""
    from jbench.models.store import ModelError, resolve_model_file

    try:
        path, _ = resolve_model_file(config["model"])
    except ModelError as exc:
        return {}, {"roofline.status": str(exc)}
    if not Path(path).is_file():
        return {}, {"roofline.status": f"model file {path} is not on this machine (remote device): no tensor table"}
    bw, source = device_bandwidth(config["device"], config.get("profile"))
    try:
        model = read_gguf_header(path)
    except RooflineError as exc:
        return {}, {"roofline.status": str(exc)}
    backend = config["backend"]
    weights = weight_bytes_per_token(model).total
    kv_tok = kv_bytes_per_token(model.arch, backend.get("cache_type_k", "f16"), backend.get("cache_type_v", "f16"))
    depth = int(backend.get("depth", 0))
    kv = kv_bytes_at_depth(model.arch, depth, backend.get("cache_type_k", "f16"), backend.get("cache_type_v", "f16"))
    metrics = {"roofline_weight_bytes_per_token": weights, "roofline_kv_bytes_per_token": kv_tok,
               "roofline_bytes_per_token": weights + kv.swa_aware}
    tags = {"roofline.bandwidth_source": source}
    if bw is None:
        tags["roofline.status"] = source
        return metrics, tags
    result = decode_ceiling(weights, kv_tok, depth, bw * 1e9, kv_bytes_read=kv.swa_aware)
    metrics["roofline_bandwidth_gbs"] = bw
    metrics["roofline_decode_tps"] = result.ceiling_tps
    if decode_tps and not math.isnan(decode_tps):
        metrics["roofline_fraction"] = decode_tps / result.ceiling_tps
        tags["roofline.regime"] = regime_label(decode_tps, result.ceiling_tps)
    tags["roofline.status"] = "ok"
    return metrics, tags


def roofline_figures(model: str, *, quant: Optional[str] = None, depth: int = 0, kv_type: str = "f16",
                     device_name: Optional[str] = None, bandwidth_gbs: Optional[float] = None,
                     config_dirs: Optional[list] = None) -> dict[str, Any]:
    """What `jbench roofline` prints."""
    from omegaconf import OmegaConf

    from jbench.config import compose, load_profile, user_config_dirs
    from jbench.models.store import ModelError, resolve_model_file

    dirs = user_config_dirs(config_dirs or [])
    if model.endswith(".gguf") or Path(model).is_file():
        path = model
    else:
        overrides = [f"model={model}"] + ([f"model.quant={quant}"] if quant else [])
        cfg, _ = compose(overrides, dirs)
        try:
            path, _ = resolve_model_file(OmegaConf.to_container(cfg.model, resolve=True))
        except ModelError as exc:
            raise ValueError(str(exc)) from None
    source = "--bandwidth-gbs"
    if bandwidth_gbs is None and device_name:
        cfg, _ = compose([f"device={device_name}"], dirs)
        device = OmegaConf.to_container(cfg.device, resolve=True)
        profile = load_profile(device["profile"], dirs) if device.get("profile") else None
        bandwidth_gbs, source = device_bandwidth(device, profile)
        if bandwidth_gbs is None:
            raise ValueError(source)
    m = read_gguf_header(path)
    weights = weight_bytes_per_token(m)
    kv_tok = kv_bytes_per_token(m.arch, kv_type, kv_type)
    kv = kv_bytes_at_depth(m.arch, depth, kv_type, kv_type)
    out: dict[str, Any] = {
        "model": Path(path).name, "quant": quant or m.file_type_name, "architecture": m.architecture,
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
    return out
