"""Roofline figures for a trial or a model: its model file's tensor table, the device's bandwidth
(jbench.device.bandwidth), and the pure analysis in jbench.analysis.roofline."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Optional, Union

from jbench.analysis.roofline import (
    LABEL_ABOVE_CEILING,
    RooflineError,
    decode_ceiling,
    flops_per_token,
    kv_bytes_at_depth,
    kv_bytes_per_token,
    matmul_params,
    regime_label,
    weight_bytes_per_token,
)
from jbench.device.bandwidth import Bandwidth, device_bandwidth
from jbench.models.facts import read_gguf_header
from jbench.results import Finding, Result


CEILING_BELOW_MEASURED = "ceiling_below_measured"


def ceiling_finding(decode_tps: float, ceiling_tps: float, bandwidth: Bandwidth, bytes_per_token: float) -> Finding:
    """A decode rate above its bandwidth ceiling: the ceiling is wrong (a calibration that measured less than
    the compute path reads, a datasheet figure for another state) or the model sits in a cache."""
    return Finding(CEILING_BELOW_MEASURED, "ceiling below measured: calibration wrong or cache-resident model", {
        "decode_tps": decode_tps, "ceiling_tps": ceiling_tps, "measured_over_ceiling": decode_tps / ceiling_tps,
        "bandwidth_gbs": bandwidth.gbs, "bandwidth_source": bandwidth.source,
        "bandwidth_method": bandwidth.calibration.method if bandwidth.calibration else None,
        "bytes_per_token": bytes_per_token,
        "implied_read_gbs": decode_tps * bytes_per_token / 1e9})


def trial_roofline(config: dict, decode_tps: Optional[float],
                   bandwidth: Union[Bandwidth, Callable[[], Bandwidth]]) -> Result:
    """roofline_* metrics, tags and the ceiling finding for a trial whose model file is readable here.

    bandwidth may be a function, called only once the model file is known to be readable (it may measure).
    roofline_fraction is decode / ceiling when that is at most 1; above 1 the ratio is only recorded as
    roofline_measured_over_ceiling, with the finding ceiling_below_measured."""
    from jbench.models.store import ModelError, resolve_model_file

    try:
        path, _ = resolve_model_file(config["model"])
    except ModelError as exc:
        return Result(tags={"roofline.status": str(exc)})
    if not Path(path).is_file():
        return Result(tags={"roofline.status": f"model file {path} is not on this machine (remote device): "
                                               "no tensor table"})
    try:
        model = read_gguf_header(path)
    except RooflineError as exc:
        return Result(tags={"roofline.status": str(exc)})
    bw = bandwidth() if callable(bandwidth) else bandwidth
    backend = config["backend"]
    weights = weight_bytes_per_token(model).total
    kv_tok = kv_bytes_per_token(model.arch, backend.get("cache_type_k", "f16"), backend.get("cache_type_v", "f16"))
    depth = int(backend.get("depth", 0))
    kv = kv_bytes_at_depth(model.arch, depth, backend.get("cache_type_k", "f16"), backend.get("cache_type_v", "f16"))
    total = weights + kv.swa_aware
    out = Result(metrics={"roofline_weight_bytes_per_token": weights, "roofline_kv_bytes_per_token": kv_tok,
                          "roofline_bytes_per_token": total}, tags=bw.tags())
    if bw.gbs is None:
        out.tags["roofline.status"] = bw.source
        return out
    result = decode_ceiling(weights, kv_tok, depth, bw.gbs * 1e9, kv_bytes_read=kv.swa_aware)
    out.metrics["roofline_bandwidth_gbs"] = bw.gbs
    out.metrics["roofline_decode_tps"] = result.ceiling_tps
    if bw.calibration is not None:
        cal = bw.calibration
        out.metrics.update({"roofline_bandwidth_median_gbs": cal.median, "roofline_bandwidth_min_gbs": cal.min,
                            "roofline_bandwidth_spread": cal.spread})
    if decode_tps and not math.isnan(decode_tps):
        ratio = decode_tps / result.ceiling_tps
        out.metrics["roofline_measured_over_ceiling"] = ratio
        if ratio <= 1.0:
            out.metrics["roofline_fraction"] = ratio
            out.tags["roofline.regime"] = regime_label(decode_tps, result.ceiling_tps)
        else:
            out.tags["roofline.regime"] = LABEL_ABOVE_CEILING
            out.findings.append(ceiling_finding(decode_tps, result.ceiling_tps, bw, total))
    out.tags["roofline.status"] = "ok"
    return out


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
        bw = device_bandwidth(device, profile)
        if bw.gbs is None:
            raise ValueError(bw.source)
        bandwidth_gbs, source = bw.gbs, bw.source
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
