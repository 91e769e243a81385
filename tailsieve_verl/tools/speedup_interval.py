"""Is a run really faster than the baseline, or is the difference step-to-step noise?

The speedup of a run over the baseline is R = mean(baseline) / mean(run) over the steps both logged.
Steps are paired (the same step of two runs sees the same prompts and the same point of training),
so the interval comes from a paired bootstrap: step indices are resampled jointly for both runs
(``scipy.stats.bootstrap(paired=True)``, BCa, a fixed seed so the same logs give the same output).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

FASTER, SLOWER, NOT_RESOLVED = "faster", "slower", "not resolved"
RESAMPLES = 9999
SEED = 0
# Below this many paired steps a bootstrap interval covers far less than its nominal level (two steps
# have three distinct resamples): the interval is shown, but no verdict is drawn from it.
MIN_VERDICT_STEPS = 10


@dataclass(frozen=True)
class SpeedupInterval:
    """R = mean(baseline)/mean(run) with its ``confidence`` interval [low, high] over ``steps`` paired steps.

    ``verdict`` is "faster" when the whole interval lies above 1, "slower" when below, else (and
    always below ``MIN_VERDICT_STEPS`` paired steps) "not resolved". ``steps_needed`` is how many paired steps would make the interval exclude 1, if the
    ratio and the per-step spread stayed as observed: the interval narrows as 1/sqrt(n), so with h
    its half-width on the side facing 1 (R - low when R > 1, high - R when R < 1),

        steps_needed = ceil(n * (h / |R - 1|) ** 2).

    (For the per-step linearised ratio d_i = (b_i - R r_i) / mean(r), h ~ z sd(d) / sqrt(n), which
    gives the textbook n = (z sd(d) / |R - 1|)^2; using the bootstrap's own h keeps the count
    consistent with the interval shown.) None when R is exactly 1 or the interval is undefined."""

    ratio: float
    low: float
    high: float
    confidence: float
    steps: int
    verdict: str
    steps_needed: int | None

    @property
    def more_steps(self) -> int | None:
        """Paired steps to log beyond those compared before the interval would exclude 1 (0 when it does)."""
        return None if self.steps_needed is None else max(0, self.steps_needed - self.steps)

    def to_json(self) -> dict:
        out = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in self.__dict__.items()}
        out["more_steps"] = self.more_steps
        return out


def _ratio_of_means(baseline: np.ndarray, run: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(baseline, axis=axis) / np.mean(run, axis=axis)


def paired_speedup(baseline: np.ndarray, run: np.ndarray, confidence: float = 0.95) -> SpeedupInterval:
    """The speedup of ``run`` over ``baseline`` (per-step times, aligned by step; NaN where a run did
    not log the step) with a paired bootstrap interval. Fewer than 2 paired steps: no interval."""
    baseline, run = np.asarray(baseline, dtype=float), np.asarray(run, dtype=float)
    paired = np.isfinite(baseline) & np.isfinite(run)
    baseline, run = baseline[paired], run[paired]
    n = int(paired.sum())
    if n == 0 or run.mean() <= 0:
        return SpeedupInterval(math.nan, math.nan, math.nan, confidence, n, NOT_RESOLVED, None)
    ratio = float(_ratio_of_means(baseline, run))
    if n < 2:
        return SpeedupInterval(ratio, math.nan, math.nan, confidence, n, NOT_RESOLVED, None)
    low, high = _bootstrap(baseline, run, confidence)
    verdict = NOT_RESOLVED if n < MIN_VERDICT_STEPS else FASTER if low > 1 else SLOWER if high < 1 else NOT_RESOLVED
    needed = _steps_needed(ratio, low, high, n)
    return SpeedupInterval(ratio, low, high, confidence, n, verdict,
                           None if needed is None else max(needed, MIN_VERDICT_STEPS))


def _bootstrap(baseline: np.ndarray, run: np.ndarray, confidence: float) -> tuple[float, float]:
    from scipy.stats import bootstrap

    def interval(method: str) -> tuple[float, float]:
        with warnings.catch_warnings():  # constant per-step times: BCa is undefined, said by a warning
            warnings.simplefilter("ignore")
            result = bootstrap((baseline, run), _ratio_of_means, paired=True, vectorized=True,
                               confidence_level=confidence, n_resamples=RESAMPLES, method=method,
                               random_state=np.random.default_rng(SEED))
        return float(result.confidence_interval.low), float(result.confidence_interval.high)

    low, high = interval("BCa")
    if not (math.isfinite(low) and math.isfinite(high)):  # a degenerate resample distribution
        low, high = interval("percentile")
    return low, high


def _steps_needed(ratio: float, low: float, high: float, n: int) -> int | None:
    if ratio == 1 or not (math.isfinite(low) and math.isfinite(high)):
        return None
    half_width = max(ratio - low if ratio > 1 else high - ratio, 0.0)
    return max(1, math.ceil(n * (half_width / abs(ratio - 1)) ** 2))
