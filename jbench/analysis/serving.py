"""The analysis of a serving (capacity) measurement (pure): load levels in, metrics and answers with intervals out.

A serving measurement puts a server (llama-server with -np slots) under load at several levels: closed loop (a
concurrency: N requests in flight, each client sending its next request when the last one ends) or open loop (a
request rate: arrivals due on a schedule, `RequestOutcome.scheduled_s`). The controller records one
`RequestOutcome` per request; a `Level` is one run of one load (a load may be run more than once: replicates).

Definitions (all latencies of completed requests only; a failed request is counted, never timed):
  * TTFT: first streamed token - sent. E2E: stream end - sent.
  * TPOT (time per output token): (E2E - TTFT) / (output tokens - 1), per request; undefined below 2 tokens.
  * ITL (inter-token latency): the gaps between consecutive streamed tokens, pooled over the level's requests
    (vLLM's distinction: ITL is per gap, TPOT per request).
  * send lag (open loop): sent - due; the controller falling behind its schedule.
  * wall: first send to last stream end of the level. Rates are counts over the wall.
  * SLO (`Slo`): a request meets it when it completed and every target set holds (TTFT, TPOT, E2E, each <=). A TPOT
    target does not apply to a request of fewer than 2 output tokens (it has no time between tokens); a completed
    request without a first token fails a TTFT target. Attainment: the share of a level's requests (failed ones
    included) that meet it; goodput: those requests per second of wall.

Answers (`Estimate`: a value, an interval, and the reason it was found or is NaN):
  * `knee`: throughput (output tok/s) against load, replicates pooled (their tokens over their summed wall);
    Kneedle's rule on the curve normalised to [0, 1] on both axes: the interior load farthest ABOVE the chord from
    the lowest to the highest load, when that distance is at least `KNEE_MIN_DISTANCE` (a straight or convex curve
    has no knee; a curve still bending at the top load has its knee where it bends most). Interval: bootstrap, each
    load's replicates resampled (when there are several) and each replicate's requests resampled, throughput =
    resampled output tokens / wall, the knee recomputed; percentiles over the tested loads the resamples give.
  * `slo_capacity`: attainment against load, replicates pooled (meeting / requests), fitted non-increasing by
    weighted isotonic regression (weights: request counts), so one noisy load neither ends nor extends the range;
    capacity = the highest tested load whose fitted attainment >= the target. A load any of whose runs was stopped
    early (over-saturated) fails. Interval: bootstrap of each load's requests (the count meeting the SLO drawn
    binomially, which is resampling the pooled requests), refit, recompute; an end beyond the tested loads is NaN.
  * `CapacitySearch`: which integer load to run next to find that capacity (bracket, bisect, replicates at the
    boundary), pure over the levels run so far.
  * `oversaturated`: whether a level's queue keeps growing (the reason to stop it early), as a one-line finding.

Percentiles are numpy's linear interpolation (jbench.analysis.stats.percentile), like the latency scenario's.
numpy and scipy are imported where used (the CLI's start should not pay for them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from jbench.analysis.stats import percentile

__all__ = [
    "KNEE_MIN_DISTANCE", "PERCENTILES", "RequestOutcome", "Slo", "Level", "Estimate", "level_figures", "level_table",
    "oversaturated", "knee", "slo_capacity", "CapacitySearch",
]

PERCENTILES = (50, 90, 99)
# Kneedle's distance above the chord (normalised units) below which a curve is called straight: no knee.
KNEE_MIN_DISTANCE = 0.1
# Over-saturation: the last quarter's median delay must be at least this multiple of the first quarter's.
GROWTH_FACTOR = 2.0
# Fitted attainment is compared with this tolerance: 36/40 pooled must meet a 0.9 target despite rounding.
_EPS = 1e-9


@dataclass(frozen=True)
class RequestOutcome:
    """One request of a level, on the controller's clock (seconds)."""

    index: int
    sent_s: float  # when the request was sent
    ttft_s: float  # first token - sent (NaN when it failed before one)
    e2e_s: float  # stream end - sent (NaN when failed)
    output_tokens: int  # as the server's usage reported (0 when failed)
    prompt_tokens: int
    token_gaps_s: tuple[float, ...] = ()  # gaps between consecutive streamed tokens (ITL samples)
    error: Optional[str] = None  # None: completed
    scheduled_s: Optional[float] = None  # open loop: when it was due (send lag = sent_s - scheduled_s)

    @property
    def ok(self) -> bool:
        """Completed: no error and a stream end."""
        return self.error is None and math.isfinite(self.e2e_s)

    @property
    def tpot_s(self) -> float:
        """(e2e - ttft) / (output tokens - 1); NaN below 2 tokens or when not completed."""
        if not self.ok or self.output_tokens < 2 or not math.isfinite(self.ttft_s):
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def send_lag_s(self) -> float:
        """sent - due (open loop); NaN in closed loop."""
        return math.nan if self.scheduled_s is None else self.sent_s - self.scheduled_s


@dataclass(frozen=True)
class Slo:
    """Latency targets (ms, each <=) and the share of a level's requests that must meet all of them."""

    ttft_ms: Optional[float] = None
    tpot_ms: Optional[float] = None
    e2e_ms: Optional[float] = None
    attainment: float = 0.9

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"Slo.{name} must be > 0, got {value}")
        if not 0.0 < self.attainment <= 1.0:
            raise ValueError(f"Slo.attainment must be in (0, 1], got {self.attainment}")

    @property
    def defined(self) -> bool:
        """Whether any latency target is set."""
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def meets(self, o: RequestOutcome) -> bool:
        """Completed and within every target set (a failed request never meets)."""
        if not o.ok:
            return False
        if self.ttft_ms is not None and not (math.isfinite(o.ttft_s) and o.ttft_s * 1000.0 <= self.ttft_ms):
            return False
        # A request of fewer than 2 tokens has no time per output token: a TPOT target does not apply to it.
        if self.tpot_ms is not None and o.output_tokens >= 2 and not o.tpot_s * 1000.0 <= self.tpot_ms:
            return False
        if self.e2e_ms is not None and not o.e2e_s * 1000.0 <= self.e2e_ms:
            return False
        return True


def slo_from(section: Any) -> Slo:
    """The Slo of a `serving.slo` config section (jbench.core.schema.SloConfig, or anything with its fields)."""
    return Slo(ttft_ms=section.ttft_ms, tpot_ms=section.tpot_ms, e2e_ms=section.e2e_ms, attainment=section.attainment)


@dataclass(frozen=True)
class Level:
    """One load level as run (a level may be run more than once: replicates)."""

    load: float  # concurrency (requests in flight) or rate (requests/s)
    outcomes: tuple[RequestOutcome, ...]
    wall_s: float  # first send to last stream end
    stopped_early: Optional[str] = None  # why the level was cut short (over-saturation), else None


@dataclass(frozen=True)
class Estimate:
    """An answer with its interval; NaN parts say what cannot be said, and `reason` says why."""

    value: float  # NaN when it cannot be said
    low: float  # interval (bootstrap percentiles over the tested loads), NaN when not available
    high: float
    reason: str  # how it was found, or why it is NaN / only a bound ("not bracketed: ...")


# --------------------------------------------------------------------------------------------
# One level


def _stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/mean of the finite values; nothing when there are none (absent, never 0)."""
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return {}
    out = {f"{prefix}_p{q}": percentile(vals, q) for q in PERCENTILES}
    out[f"{prefix}_mean"] = math.fsum(vals) / len(vals)
    return out


def _wall_ok(wall_s: float) -> bool:
    return math.isfinite(wall_s) and wall_s > 0


def level_figures(level: Level, slo: Slo) -> dict[str, float]:
    """The level's metrics. Counts: requests (all), failed_requests. Rates over the wall (absent without a positive
    wall): request_throughput_rps (completed), output_tps, total_tps ((prompt + output tokens of completed
    requests) / wall), goodput_rps (requests meeting the SLO; without targets, every completed request). A count of
    0 over a measured wall is a real 0. Latencies in ms over completed requests: ttft_ms_*, tpot_ms_*, itl_ms_*
    (pooled token gaps), e2e_ms_* (p50, p90, p99, mean). slo_attainment: meeting / requests (absent when the SLO
    sets no target). send_lag_ms_p50/p99: open loop only (requests with a due time). A statistic with no samples is
    absent, never 0."""
    outcomes = level.outcomes
    done = [o for o in outcomes if o.ok]
    m: dict[str, float] = {"requests": float(len(outcomes)), "failed_requests": float(len(outcomes) - len(done))}
    meeting = sum(1 for o in outcomes if slo.meets(o))
    if _wall_ok(level.wall_s) and outcomes:
        out_tok = sum(o.output_tokens for o in done)
        m["request_throughput_rps"] = len(done) / level.wall_s
        m["output_tps"] = out_tok / level.wall_s
        m["total_tps"] = (out_tok + sum(o.prompt_tokens for o in done)) / level.wall_s
        m["goodput_rps"] = meeting / level.wall_s
    m.update(_stats("ttft_ms", [o.ttft_s * 1000.0 for o in done]))
    m.update(_stats("tpot_ms", [o.tpot_s * 1000.0 for o in done]))
    m.update(_stats("itl_ms", [g * 1000.0 for o in done for g in o.token_gaps_s]))
    m.update(_stats("e2e_ms", [o.e2e_s * 1000.0 for o in done]))
    if slo.defined and outcomes:
        m["slo_attainment"] = meeting / len(outcomes)
    lags = [o.send_lag_s * 1000.0 for o in outcomes if o.scheduled_s is not None and math.isfinite(o.send_lag_s)]
    if lags:
        m["send_lag_ms_p50"] = percentile(lags, 50)
        m["send_lag_ms_p99"] = percentile(lags, 99)
    return m


def level_table(levels: Sequence[Level], slo: Slo) -> list[dict[str, float]]:
    """One row per level, in run order: {"load": ..., **level_figures}."""
    return [{"load": float(lv.load), **level_figures(lv, slo)} for lv in levels]


# --------------------------------------------------------------------------------------------
# Over-saturation within a level


def _fmt_ms(ms: float) -> str:
    return f"{ms:.0f}" if abs(ms) >= 10 else f"{ms:.2g}"


def oversaturated(outcomes: Sequence[RequestOutcome], *, min_requests: int = 8,
                  confidence: float = 0.95) -> Optional[str]:
    """Whether the server's queue keeps growing within a level: the one-line reason with its numbers, else None.

    The delay judged, in send order, over completed requests: closed loop, the TTFT of the requests sent after the
    first stream end (the ramp's first burst waits behind each other once, which is not growth: a closed loop's
    queue is bounded by its concurrency, so only a growing TTFT after the ramp means trouble); open loop (every
    completed request has a due time), TTFT counted from the due time (send lag + TTFT), so a controller falling
    behind its schedule counts as well as a server queue. It grows when BOTH
      * its Theil-Sen slope against the send order has a lower confidence bound > 0 (robust to a few outliers), and
      * the median of the last quarter is at least GROWTH_FACTOR x the median of the first quarter
    (a flat noisy series fails the first, a one-off spike both). None with fewer than min_requests judged."""
    done = sorted((o for o in outcomes if o.ok and math.isfinite(o.ttft_s)), key=lambda o: (o.sent_s, o.index))
    open_loop = bool(done) and all(o.scheduled_s is not None for o in done)
    if not open_loop and done:
        first_end = min(o.sent_s + o.e2e_s for o in done)
        done = [o for o in done if o.sent_s >= first_end]
    if len(done) < max(min_requests, 4):
        return None
    if open_loop:
        delay = [(o.send_lag_s + o.ttft_s) * 1000.0 for o in done]
    else:
        delay = [o.ttft_s * 1000.0 for o in done]
    n = len(delay)
    quarter = max(2, n // 4)
    first = percentile(delay[:quarter], 50)
    last = percentile(delay[-quarter:], 50)
    if not (last >= GROWTH_FACTOR * first and last > first):
        return None
    from scipy.stats import theilslopes

    _, _, low_slope, _ = theilslopes(delay, range(n), alpha=confidence)
    if not low_slope > 0:
        return None
    if open_loop:
        lags = [o.send_lag_s * 1000.0 for o in done]
        lag_first, lag_last = percentile(lags[:quarter], 50), percentile(lags[-quarter:], 50)
        return (f"TTFT from the due time grew from {_fmt_ms(first)} ms to {_fmt_ms(last)} ms over {n} requests "
                f"(send lag {_fmt_ms(lag_first)} -> {_fmt_ms(lag_last)} ms): the queue grows")
    return f"TTFT grew from {_fmt_ms(first)} ms to {_fmt_ms(last)} ms over {n} requests: the queue grows"


# --------------------------------------------------------------------------------------------
# Pooling replicates


def _by_load(levels: Sequence[Level]) -> dict[float, list[Level]]:
    """Levels grouped by load (replicates), loads ascending."""
    groups: dict[float, list[Level]] = {}
    for lv in levels:
        groups.setdefault(float(lv.load), []).append(lv)
    return dict(sorted(groups.items()))


@dataclass(frozen=True)
class _Pooled:
    load: float
    requests: int
    meeting: int
    stopped: bool  # any replicate stopped early (over-saturated)

    @property
    def attainment(self) -> float:
        # A stopped or empty load served nothing it could be judged on: it fails.
        if self.stopped or self.requests == 0:
            return 0.0
        return self.meeting / self.requests

    def passes(self, target: float) -> bool:
        return self.attainment >= target - _EPS


def _pool(levels: Sequence[Level], slo: Slo) -> list[_Pooled]:
    return [_Pooled(load, sum(len(lv.outcomes) for lv in group),
                    sum(1 for lv in group for o in lv.outcomes if slo.meets(o)),
                    any(lv.stopped_early for lv in group))
            for load, group in _by_load(levels).items()]


def _interval_ends(samples: Any, confidence: float) -> tuple[float, float]:
    """The bootstrap percentile interval's ends as values the samples hold (they are tested loads)."""
    import numpy as np

    tail = (1.0 - confidence) / 2.0
    return (float(np.quantile(samples, tail, method="inverted_cdf")),
            float(np.quantile(samples, 1.0 - tail, method="inverted_cdf")))


def _check_boot(n_boot: int, confidence: float) -> None:
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


# --------------------------------------------------------------------------------------------
# The knee of throughput against load


def _kneedle(x: Sequence[float], y: Sequence[float]) -> tuple[int, float]:
    """(index of the knee, its distance above the chord), or (-1, the largest distance) when there is none."""
    x0, x1 = x[0], x[-1]
    lo, hi = min(y), max(y)
    if not hi > lo:
        return -1, 0.0
    xn = [(v - x0) / (x1 - x0) for v in x]
    yn = [(v - lo) / (hi - lo) for v in y]
    d = [yn[i] - (yn[0] + (yn[-1] - yn[0]) * xn[i]) for i in range(len(x))]
    best = max(range(1, len(x) - 1), key=lambda i: (d[i], -i))
    return (best, d[best]) if d[best] >= KNEE_MIN_DISTANCE else (-1, d[best])


def knee(levels: Sequence[Level], *, n_boot: int = 1000, seed: int = 0, confidence: float = 0.95) -> Estimate:
    """The load where output throughput stops growing with load (module doc: Kneedle rule and interval).

    A level stopped early counts with the tokens it served over its wall. Needs >= 3 distinct loads with a
    positive wall. NaN with the reason when the curve has no knee (flat,
    straight, convex). The interval's ends are tested loads; resamples without a knee are counted in the reason."""
    import numpy as np

    _check_boot(n_boot, confidence)
    groups = {load: [lv for lv in g if _wall_ok(lv.wall_s)] for load, g in _by_load(levels).items()}
    groups = {load: g for load, g in groups.items() if g}
    loads = list(groups)
    nan = math.nan
    if len(loads) < 3:
        return Estimate(nan, nan, nan, f"a knee needs >= 3 distinct loads with a wall time; {len(loads)} given")

    def tokens(lv: Level) -> Any:
        return np.array([o.output_tokens if o.ok else 0 for o in lv.outcomes], dtype=float)

    tps = [sum(float(tokens(lv).sum()) for lv in g) / sum(lv.wall_s for lv in g) for g in groups.values()]
    idx, dist = _kneedle(loads, tps)
    if idx < 0:
        if tps[-1] >= max(tps) - _EPS:
            why = f"throughput still rises at the highest load {loads[-1]:g} ({tps[-1]:.4g} tok/s)"
        else:
            why = "throughput does not bend away from its chord"
        return Estimate(nan, nan, nan, f"no knee: {why} (largest distance above the chord {dist:.2f} "
                                       f"< {KNEE_MIN_DISTANCE})")

    rng = np.random.default_rng(seed)
    boot_tps = np.zeros((n_boot, len(loads)))
    for j, g in enumerate(groups.values()):
        toks = [tokens(lv) for lv in g]
        tok_sum, wall_sum = np.zeros(n_boot), np.zeros(n_boot)
        for _slot in range(len(g)):
            # Several replicates: draw which one fills each slot, so their wall-to-wall spread counts too.
            pick = rng.integers(0, len(g), n_boot) if len(g) > 1 else np.zeros(n_boot, dtype=int)
            for r, (t, lv) in enumerate(zip(toks, g)):
                rows = np.flatnonzero(pick == r)
                if len(rows) and len(t):
                    tok_sum[rows] += t[rng.integers(0, len(t), (len(rows), len(t)))].sum(axis=1)
                wall_sum[rows] += lv.wall_s
        boot_tps[:, j] = tok_sum / wall_sum
    knees = np.array([_kneedle(loads, list(row))[0] for row in boot_tps])
    found = knees[knees >= 0]
    missing = n_boot - len(found)
    low = high = nan
    if len(found):
        low, high = (loads[int(i)] for i in _interval_ends(found, confidence))
    reason = (f"knee at load {loads[idx]:g} ({tps[idx]:.4g} tok/s): the farthest point above the chord of throughput "
              f"from load {loads[0]:g} to {loads[-1]:g} (distance {dist:.2f} of the normalised range); "
              f"{confidence:.0%} interval from {n_boot} resamples of each load's requests")
    if missing:
        reason += f"; {missing} of {n_boot} resamples had no knee (left out of the interval)"
    return Estimate(float(loads[idx]), low, high, reason)


# --------------------------------------------------------------------------------------------
# The highest load that meets an SLO


def _fit(attainment: Any, weights: Any) -> Any:
    """Weighted least-squares non-increasing fit of attainment against ascending load."""
    from scipy.optimize import isotonic_regression

    return isotonic_regression(attainment, weights=weights, increasing=False).x


def _capacity_index(fitted: Any, target: float) -> int:
    """Index of the highest load whose fitted attainment meets the target (a prefix, as the fit is
    non-increasing); -1 when none does."""
    return int((fitted >= target - _EPS).sum()) - 1


def slo_capacity(levels: Sequence[Level], slo: Slo, *, n_boot: int = 1000, seed: int = 0,
                 confidence: float = 0.95) -> Estimate:
    """The highest tested load whose isotonic-fitted attainment meets `slo.attainment` (module doc).

    NaN with the reason when the SLO sets no target, there are no levels, or even the lowest load fails. When the
    highest tested load still passes, the value is that load and the reason starts "not bracketed: at least".
    Interval ends are tested loads; an end below the lowest or at/above the highest tested load (where the capacity
    is only a bound) is NaN and said in the reason."""
    import numpy as np

    _check_boot(n_boot, confidence)
    nan = math.nan
    if not slo.defined:
        return Estimate(nan, nan, nan, "the SLO sets no latency target")
    pooled = _pool(levels, slo)
    if not pooled:
        return Estimate(nan, nan, nan, "no levels")
    loads = [p.load for p in pooled]
    raw = np.array([p.attainment for p in pooled])
    weights = np.array([max(p.requests, 1) for p in pooled], dtype=float)
    fitted = _fit(raw, weights)
    idx = _capacity_index(fitted, slo.attainment)
    target = slo.attainment

    rng = np.random.default_rng(seed)
    n = np.array([p.requests for p in pooled])
    share = np.array([p.meeting / p.requests if p.requests else 0.0 for p in pooled])
    failing = np.array([p.stopped or p.requests == 0 for p in pooled])
    draws = rng.binomial(n, share, size=(n_boot, len(pooled))) / np.maximum(n, 1)
    draws[:, failing] = 0.0
    boot = np.array([_capacity_index(_fit(row, weights), target) for row in draws])
    lo_i, hi_i = (int(v) for v in _interval_ends(boot, confidence))
    low = loads[lo_i] if lo_i >= 0 else nan
    high = loads[hi_i] if 0 <= hi_i < len(loads) - 1 else nan
    notes = []
    if lo_i < 0:
        notes.append("the interval's lower end is below the lowest tested load")
    if hi_i == len(loads) - 1:
        notes.append("its upper end is at or beyond the highest tested load")
    stopped = [f"{p.load:g}" for p in pooled if p.stopped]
    if stopped:
        notes.append(f"stopped early (over-saturated), counted as failing: load {', '.join(stopped)}")
    if not np.allclose(fitted, raw):
        notes.append("non-monotone attainment pooled by the isotonic fit")
    tail = (f"; {confidence:.0%} interval from {n_boot} bootstrap resamples of each load's requests"
            + "".join(f"; {s}" for s in notes))

    if idx < 0:
        return Estimate(nan, nan, nan, f"the SLO is not met even at the lowest tested load {loads[0]:g} (fitted "
                                       f"attainment {fitted[0]:.3f} < {target:g})" + tail)
    if idx == len(loads) - 1:
        return Estimate(float(loads[idx]), low, nan, f"not bracketed: at least {loads[idx]:g}: the highest tested "
                                                     f"load still meets the SLO (fitted attainment "
                                                     f"{fitted[idx]:.3f} >= {target:g})" + tail)
    return Estimate(float(loads[idx]), low, high,
                    f"highest tested load meeting the SLO: {loads[idx]:g} (fitted attainment {fitted[idx]:.3f} >= "
                    f"{target:g}); the next tested load {loads[idx + 1]:g} fails ({fitted[idx + 1]:.3f})" + tail)


# --------------------------------------------------------------------------------------------
# Searching for that load


class CapacitySearch:
    """Bracket then bisect over integer loads (concurrency), then replicates at the boundary.

    `next_load` is pure over the levels run so far; each call re-decides from all of them, with each load's verdict
    pooled over its replicates (attainment >= the target, no run stopped early):
      1. nothing fails yet: the next bracket load, growth x the highest passing one (at least one more, at most
         max_load), starting at `start`;
      2. a load fails: hi = the lowest failing load, lo = the highest passing load below it; while they are more
         than 1 apart, their midpoint;
      3. adjacent (or an end: start fails, max_load passes): each boundary load gets `replicates` runs; a pooled
         verdict that flips re-opens the search at step 1 or 2;
      4. None: done. The capacity is then `slo_capacity` over the same levels (bracketed, never met at `start`, or
         not bracketed at max_load).
    Every call returns a load not yet run or one with fewer than `replicates` runs, so the search ends."""

    def __init__(self, slo: Slo, *, start: int = 1, max_load: int = 64, growth: float = 2.0,
                 replicates: int = 2) -> None:
        if not slo.defined:
            raise ValueError("a capacity search needs an SLO with at least one latency target")
        if not 1 <= start <= max_load:
            raise ValueError(f"need 1 <= start <= max_load, got start={start}, max_load={max_load}")
        if not growth > 1.0:
            raise ValueError(f"growth must be > 1, got {growth}")
        if replicates < 1:
            raise ValueError(f"replicates must be >= 1, got {replicates}")
        self.slo, self.start, self.max_load, self.growth, self.replicates = slo, start, max_load, growth, replicates

    def _grow(self, load: int) -> int:
        return min(self.max_load, max(load + 1, math.ceil(load * self.growth - 1e-9)))

    def next_load(self, levels: Sequence[Level]) -> Optional[int]:
        """The next load to run, or None when the search is done."""
        for lv in levels:
            if float(lv.load) != int(lv.load):
                raise ValueError(f"a capacity search runs integer loads; got {lv.load}")
        pooled = {int(p.load): p for p in _pool(levels, self.slo)}
        runs = {load: len(g) for load, g in _by_load(levels).items()}
        passing = sorted(load for load, p in pooled.items() if p.passes(self.slo.attainment))
        failing = sorted(load for load, p in pooled.items() if not p.passes(self.slo.attainment))

        def confirm(*boundary: int) -> Optional[int]:
            for load in boundary:
                if runs.get(float(load), 0) < self.replicates:
                    return load
            return None

        if self.start not in pooled:
            return self.start
        if not failing:
            top = passing[-1]
            return confirm(top) if top >= self.max_load else self._grow(top)
        hi = failing[0]
        below = [load for load in passing if load < hi]
        if not below:
            return confirm(hi)  # the lowest load fails (start runs first, so hi is start): nothing to bisect
        lo = below[-1]
        if hi - lo > 1:
            return (lo + hi) // 2
        return confirm(lo, hi)

    def grid_size(self) -> int:
        """The number of levels a full grid needs: every integer load in 1..max_load (one run each), to compare
        with the levels the search used."""
        return self.max_load
