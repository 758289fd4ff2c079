"""Per-trial analyses that run after the measurement, each a Stage registered in the `jbench.analyses`
entry-point group: phase speed statistics, the roofline ceiling, the noise check."""

from __future__ import annotations

import math

from jbench.analysis.stats import describe
from jbench.device.bandwidth import Bandwidth, trial_bandwidth
from jbench.reporting.roofline import trial_roofline
from jbench.results import BackendResult, Result
from jbench.sweeps.context import TrialContext
from jbench.sweeps.stages import Stage


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
        m[f"{phase}_tps_ci95_low"], m[f"{phase}_tps_ci95_high"] = st.ci95
        m[f"{phase}_tps_cv"] = st.cv
        m[f"{phase}_tokens"] = pr.n_tokens
        m[f"{phase}_repetitions"] = st.n
        m[f"{phase}_ms_mean"] = describe([ns / 1e6 for ns in pr.samples_ns]).mean
        out.stepped[f"{phase}_tps_rep"] = tps
    return out


class PhaseSpeed(Stage):
    """Mean, spread and confidence interval of each phase's tok/s over the repetitions."""

    NAME = "phase_speed"
    ORDER = 10

    def applies(self, ctx: TrialContext) -> bool:
        return ctx.backend_result is not None

    def run(self, ctx: TrialContext) -> None:
        ctx.record.merge(phase_metrics(ctx.backend_result))


class Roofline(Stage):
    """Decode speed against the bandwidth ceiling of the model's bytes per token."""

    NAME = "roofline"
    ORDER = 20

    def applies(self, ctx: TrialContext) -> bool:
        return ctx.backend_result is not None

    def run(self, ctx: TrialContext) -> None:
        config = ctx.trial.config
        reported = ctx.backend_result.info.get("backends") if ctx.backend_result else None

        def bandwidth() -> Bandwidth:
            # The read rate of this trial's compute path in the state the trial ran in; measured once per
            # (device, probe, power state) when no calibration matches (device.auto_calibrate).
            return trial_bandwidth(ctx.conn, config["device"], config.get("profile"), config["backend"],
                                   str(reported) if reported else None,
                                   auto_calibrate=bool(config["device"].get("auto_calibrate", True)))

        ctx.record.merge(trial_roofline(config, ctx.record.metrics.get("decode_tps"), bandwidth))


class Noise(Stage):
    """A rate whose coefficient of variation is above sweep.max_cv marks the trial noisy."""

    NAME = "noise"
    ORDER = 30

    def applies(self, ctx: TrialContext) -> bool:
        return ctx.max_cv is not None

    def run(self, ctx: TrialContext) -> None:
        cvs = {k: v for k, v in ctx.record.metrics.items() if k.endswith("_tps_cv") and not math.isnan(v)}
        over = {k: v for k, v in cvs.items() if v > ctx.max_cv}
        if over:
            ctx.noisy = True
            ctx.record.tags.update({"jbench.noisy": "true", "jbench.noisy_reason": ", ".join(
                f"{k}={v:.3f} > sweep.max_cv={ctx.max_cv}" for k, v in over.items())})
