"""Statistics over repetition samples (pure functions)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class SampleStats:
    n: int
    mean: float
    std: float  # sample standard deviation (n - 1); NaN for a single sample
    median: float
    min: float
    max: float

    @property
    def ci95(self) -> tuple[float, float]:
        """95 % confidence interval of the mean (Student's t with n - 1 degrees of freedom)."""
        if self.n < 2:
            return (math.nan, math.nan)
        from scipy.stats import t

        half = t.ppf(0.975, self.n - 1) * self.std / math.sqrt(self.n)
        return (self.mean - half, self.mean + half)

    @property
    def cv(self) -> float:
        """Coefficient of variation, std / mean; NaN when undefined."""
        if self.n < 2 or not self.mean:
            return math.nan
        return self.std / self.mean


def describe(samples: list[float]) -> SampleStats:
    if not samples:
        nan = math.nan
        return SampleStats(0, nan, nan, nan, nan, nan)
    std = statistics.stdev(samples) if len(samples) > 1 else math.nan
    return SampleStats(
        n=len(samples),
        mean=statistics.fmean(samples),
        std=std,
        median=statistics.median(samples),
        min=min(samples),
        max=max(samples),
    )
