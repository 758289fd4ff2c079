"""Per-trial analyses that run after the measurement, each a Stage registered in the `jbench.analyses`
entry-point group: phase speed statistics, the roofline ceiling, the noise check."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Optional, Union

from jbench.analysis.roofline import (LABEL_ABOVE_CEILING, RooflineError, decode_ceiling, file_bits_per_weight,
                                      kv_bytes_at_depth, kv_bytes_per_token, regime_label, weight_bytes_per_token)
from jbench.analysis.stats import describe, rate_interval
from jbench.core import metrics
from jbench.core.results import BackendResult, Finding, Result
from jbench.core.trial import TrialConfig
from jbench.device.bandwidth import Bandwidth, trial_bandwidth
from jbench.models.facts import read_gguf_header
from jbench.models.store import ModelError, resolve_model_file
from jbench.runner.context import TrialContext
from jbench.runner.stages import Stage


def phase_metrics(result: BackendResult) -> Result:
    """Summary metrics and per-repetition series of each phase, named as in docs/metrics.md."""
    out = Result()
    for phase, pr in result.phases.items():
        tps = pr.samples_tps
        st = describe(tps)
        m = out.metrics
        m[f"{phase}_tps"] = st.mean
        m[f"{phase}_tps_std"] = st.std
        m[f"{phase}_tps_median"] = st.median
        m[f"{phase}_tps_ci95_low"], m[f"{phase}_tps_ci95_high"] = rate_interval(tps)
        m[f"{phase}_tps_cv"] = st.cv
        m[f"{phase}_tokens"] = pr.n_tokens
        m[f"{phase}_repetitions"] = st.n
        m[f"{phase}_ms_mean"] = describe([ns / 1e6 for ns in pr.samples_ns]).mean
        out.stepped[f"{phase}_tps_rep"] = tps
        if pr.settle:
            # The settle check ran: how many leading repetitions were cold, and their rate, beside the figure.
            m[f"{phase}_cold_repetitions"] = len(pr.cold_samples_ns)
            if pr.cold_samples_ns:
                m[f"{phase}_cold_tps"] = describe([pr.n_tokens / (ns / 1e9) for ns in pr.cold_samples_ns]).mean
            out.tags[f"{phase}.settle"] = pr.settle
    return out


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


def _kv_types(backend: Any) -> tuple[str, str]:
    """The KV-cache types a backend's config sets; a backend without the setting keeps its cache in F16."""
    if hasattr(backend, "cache_type_k"):
        return backend.cache_type_k, backend.cache_type_v
    return "f16", "f16"


def _depth(backend: Any) -> int:
    """The context depth a backend's config decodes at; a backend without the setting decodes from an empty cache."""
    return int(backend.depth) if hasattr(backend, "depth") else 0


def trial_roofline(cfg: TrialConfig, decode_tps: Optional[float],
                   bandwidth: Union[Bandwidth, Callable[[], Bandwidth]]) -> Result:
    """roofline_* metrics, tags and the ceiling finding for a trial whose model file is readable here.

    bandwidth may be a function, called only once the model file is known to be readable (it may measure).
    roofline_fraction is decode / ceiling when that is at most 1; above 1 the ratio is only recorded as
    roofline_measured_over_ceiling, with the finding ceiling_below_measured."""
    try:
        path, _ = resolve_model_file(cfg.model)
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
    type_k, type_v = _kv_types(cfg.backend)
    weights = weight_bytes_per_token(model).total
    kv_tok = kv_bytes_per_token(model.arch, type_k, type_v)
    depth = _depth(cfg.backend)
    kv = kv_bytes_at_depth(model.arch, depth, type_k, type_v)
    total = weights + kv.swa_aware
    out = Result(metrics={"roofline_weight_bytes_per_token": weights, "roofline_kv_bytes_per_token": kv_tok,
                          "roofline_bytes_per_token": total, "roofline_bits_per_weight": file_bits_per_weight(model)},
                 tags=bw.tags())
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


class PhaseSpeed(Stage):
    """Mean, spread and confidence interval of each phase's tok/s over the repetitions."""

    NAME = metrics.PHASE_SPEED
    PROVIDES = tuple(metrics.provided_by(NAME))

    def applies(self, ctx: TrialContext) -> bool:
        return ctx.backend_result is not None

    def run(self, ctx: TrialContext) -> None:
        ctx.record.merge(phase_metrics(ctx.backend_result))


class Roofline(Stage):
    """Decode speed against the bandwidth ceiling of the model's bytes per token."""

    NAME = metrics.ROOFLINE
    PROVIDES = tuple(metrics.provided_by(NAME))
    REQUIRES = tuple(metrics.required_by(NAME))

    def applies(self, ctx: TrialContext) -> bool:
        # A server that loads a model of its own (the openai backend without {model_path}): the trial's model file
        # says nothing about what ran.
        return ctx.backend_result is not None and ctx.backend.reads_model_file(ctx.trial)

    def run(self, ctx: TrialContext) -> None:
        cfg = ctx.cfg
        reported = ctx.backend_result.info.get("backends") if ctx.backend_result else None

        def bandwidth() -> Bandwidth:
            # The read rate of this trial's compute path in the state the trial ran in; measured once per
            # (device, probe, power state) when no calibration matches (device.auto_calibrate).
            return trial_bandwidth(ctx.conn, cfg.device, cfg.profile, cfg.backend,
                                   str(reported) if reported else None, auto_calibrate=cfg.device.auto_calibrate)

        ctx.record.merge(trial_roofline(cfg, ctx.record.metrics.get("decode_tps"), bandwidth))


class Noise(Stage):
    """A rate whose coefficient of variation is above sweep.max_cv marks the trial noisy."""

    NAME = "noise"
    REQUIRES = ("prefill_tps_cv", "decode_tps_cv")  # it reads them where they were measured (tags only)

    def applies(self, ctx: TrialContext) -> bool:
        return ctx.max_cv is not None

    def run(self, ctx: TrialContext) -> None:
        cvs = {k: v for k, v in ctx.record.metrics.items() if k.endswith("_tps_cv") and not math.isnan(v)}
        reasons = [f"{k}={v:.3f} > sweep.max_cv={ctx.max_cv}" for k, v in cvs.items() if v > ctx.max_cv]
        if reasons:
            ctx.noisy = True
            ctx.record.tags.update({"jbench.noisy": "true", "jbench.noisy_reason": ", ".join(reasons)})
