"""Where a phase's rate settles: the leading repetitions that run cold are set aside, the rest are the figure.

The first timed repetition in a fresh llama.cpp context runs well below the settled rate on a GPU even after
llama-bench's own warm-up run (measured on an H100, CUDA build, Gemma-3-270M-shaped model, `-p 128 -r 10`: Q4_0
9,768 then 28,111-29,173 tok/s; F16 13,112 then 45,680-48,069; the decode test's first repetition 4 % low), and a new
context is cold again (`-p 128,128,128`: each test's first repetition at about half speed). So the backend runs a
bounded number of extra timed repetitions in the same context, and this module decides, from the rates alone, how
many of the leading ones were cold:

- the settled reference is the median of the repetitions after the bound (those are never set aside);
- the threshold is the larger of a floor (3 %) and 3 standard deviations of those repetitions relative to their
  median (robust, 1.4826 × the median absolute deviation, from three or more; the sample SD of two), so a noisy
  machine sets aside only what stands out of its own noise; with a single repetition after the bound there is no
  noise to measure, and only a repetition more than 25 % slower counts;
- leading repetitions are cold while their rate is below the reference by more than the threshold (warm-up makes a
  repetition slow; a fast one is never set aside, so a slow outlier after the bound cannot discard a good one); the
  first one within it ends the warm-up;
- when every allowed repetition was cold and the first reference repetition is itself off the median of the rest,
  the rate had not settled within the bound: said, never hidden.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Sequence

from jbench.core.results import PhaseResult

FLOOR = 0.03
FLOOR_WITHOUT_NOISE = 0.25  # one repetition after the bound: no spread to measure
K_SIGMA = 3.0
MAD_TO_SD = 1.4826


@dataclass(frozen=True)
class Settle:
    """How many leading repetitions were cold, out of how many allowed, against which settled rate."""

    cold: int
    allowed: int
    settled: bool
    reference_tps: float
    threshold: float  # relative deviation from reference_tps that counts as cold

    def describe(self, cold_rates: Sequence[float] = ()) -> str:
        if self.allowed == 0:
            return "not checked: no settle repetitions (backend.settle_repetitions=0)"
        if not self.settled:
            return (f"not settled within {self.allowed} warm-up repetition(s): the rate still moved by more than "
                    f"{100 * self.threshold:.1f} % after them (raise backend.settle_repetitions)")
        if self.cold == 0:
            return f"settled from the first repetition (within {100 * self.threshold:.1f} % of the settled rate)"
        rates = ", ".join(f"{r:,.0f}" for r in cold_rates)
        return (f"{self.cold} cold repetition(s) set aside ({rates} tok/s against {self.reference_tps:,.0f} "
                f"settled; threshold {100 * self.threshold:.1f} %)")


def settle_point(rates: Sequence[float], allowed: int, floor: float = FLOOR, k_sigma: float = K_SIGMA) -> Settle:
    """Leading repetitions of `rates` (in run order) that are cold, at most `allowed` of them (module doc)."""
    allowed = max(0, min(allowed, len(rates) - 1))
    if allowed == 0:
        return Settle(0, 0, True, statistics.median(rates) if rates else float("nan"), floor)
    reference = list(rates[allowed:])
    m = statistics.median(reference)
    if m <= 0:
        return Settle(0, allowed, True, m, floor)
    if len(reference) >= 3:
        spread = MAD_TO_SD * statistics.median(abs(r - m) for r in reference) / m
    elif len(reference) == 2:
        spread = statistics.stdev(reference) / m
    else:
        spread = FLOOR_WITHOUT_NOISE / k_sigma
    threshold = max(floor, k_sigma * spread)
    cold = 0
    while cold < allowed and (m - rates[cold]) / m > threshold:
        cold += 1
    settled = True
    if cold == allowed and len(reference) >= 3:
        rest = statistics.median(reference[1:])
        settled = rest > 0 and (rest - reference[0]) / rest <= threshold
    return Settle(cold, allowed, settled, m, threshold)


def settle_phase(pr: PhaseResult, allowed: int) -> tuple[PhaseResult, Settle]:
    """The phase with its cold leading repetitions moved to `cold_samples_ns` (its window then starts where the
    settled repetitions start: the cold ones ran first), and the decision."""
    decision = settle_point(pr.samples_tps, allowed)
    if decision.cold == 0:
        return replace(pr, settle=decision.describe(), settled=decision.settled if decision.allowed else None), decision
    cold_ns, kept = pr.samples_ns[:decision.cold], pr.samples_ns[decision.cold:]
    cold_rates = [pr.n_tokens / (ns / 1e9) for ns in cold_ns]
    return replace(pr, samples_ns=list(kept), cold_samples_ns=list(cold_ns), settle=decision.describe(cold_rates),
                   settled=decision.settled), decision
