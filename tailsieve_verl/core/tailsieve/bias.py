"""Length-bias monitor: does the consumed batch still look like the policy's population?

TailSieve consumes regenerated tail groups plus the bulk groups that finished before the cutoff.
With a stationary policy and a stable (q, m) the consumed response lengths follow the policy's
population; a change of q causes a 1-step (raise) or 2-step (lower, residual drain) composition
transition. The monitor measures it with the two-sample Kolmogorov–Smirnov distance between the
consumed lengths and a reference sample of the population, next to that distance's sampling noise.

The noise is the mean of the Kolmogorov distribution (≈ 0.8687) over √(effective sample size).
Responses of one prompt are correlated (prompt identity explains most length variance), so the
effective size counts *groups*, not responses: a conservative yardstick (ratio ≈ 1 or below for
an unbiased stream, clearly above for a biased one).

The reference must not come from the consumed batches themselves: a routing that loses long prompts
at every step would then compare biased batches with biased batches and never show. Live, it is the
population the run draws from — every group pulled fresh from the data set in the last ``window``
steps, the aborted ones included — where an aborted sample's length is only known to be at least its
work so far (censored). :func:`censored_ks` keeps that honest: it is a lower bound on the distance to
the population whatever those samples would have reached, so a warning is never an artefact of the
censoring (only of sampling noise), and a shift hidden inside the censored samples cannot show.

Live use (the verl layer, once per step)::

    monitor.update(consumed_groups)                      # against the window of earlier steps' pulls
    monitor.add_reference(pulled_groups, censored)       # this step's pulls join the window
    metrics.update(monitor.metrics())                    # "tailsieve/bias/ks", ".../ks_noise", ...

In the simulator the reference is an independent population sample of the same step (the uniform
policy's batch), passed as ``reference``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import TailSieveError

KOLMOGOROV_MEAN = 0.8687311606361592  # E[sup|B(t)|], the mean of the Kolmogorov distribution


class BiasMonitorError(TailSieveError):
    """Bad input to the length-bias monitor."""


def ks_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample KS statistic sup_x |F_a(x) − F_b(x)|."""
    return censored_ks(a, b, np.zeros(len(b), dtype=bool))


def censored_ks(consumed: np.ndarray, reference: np.ndarray, censored: np.ndarray) -> float:
    """KS distance of ``consumed`` to ``reference`` where the ``censored`` reference lengths are lower
    bounds: at each x the reference CDF lies between the one with the censored lengths above x and the
    one with them at their bounds, and only the distance beyond that band counts. A lower bound on the
    distance to every completion of the censored lengths; the plain two-sample KS without censoring."""
    a = np.sort(np.asarray(consumed, dtype=float))
    b = np.asarray(reference, dtype=float)
    cut = np.asarray(censored, dtype=bool)
    if len(a) == 0 or len(b) == 0 or len(cut) != len(b):
        raise BiasMonitorError("KS distance needs two non-empty samples (and a censoring flag per reference length)")
    x = np.concatenate([a, b])
    f_consumed = np.searchsorted(a, x, side="right") / len(a)
    f_high = np.searchsorted(np.sort(b), x, side="right") / len(b)  # censored lengths at their bounds
    f_low = np.searchsorted(np.sort(b[~cut]), x, side="right") / len(b)  # censored lengths beyond every x
    return float(max(0.0, np.max(f_consumed - f_high), np.max(f_low - f_consumed)))


def ks_noise(n_groups_a: int, n_groups_b: int) -> float:
    """Expected KS distance between two unbiased samples of these many groups."""
    n_eff = n_groups_a * n_groups_b / (n_groups_a + n_groups_b)
    return float(KOLMOGOROV_MEAN / np.sqrt(n_eff))


@dataclass(frozen=True)
class LengthSample:
    """Response lengths of some groups, flattened; ``censored`` marks lengths known only as lower bounds."""

    lengths: np.ndarray
    censored: np.ndarray
    groups: int

    @classmethod
    def of(cls, groups: Sequence[Sequence[int]], censored: Sequence[Sequence[bool]] | None = None) -> "LengthSample":
        flags = censored if censored is not None else [(False,) * len(g) for g in groups]
        if len(flags) != len(groups) or any(len(f) != len(g) for f, g in zip(flags, groups)):
            raise BiasMonitorError("one censoring flag per length is needed")
        kept = [(g, f) for g, f in zip(groups, flags) if len(g)]
        return cls(np.fromiter((x for g, _ in kept for x in g), dtype=float),
                   np.fromiter((c for _, f in kept for c in f), dtype=bool), len(kept))

    @classmethod
    def join(cls, samples: Sequence["LengthSample"]) -> "LengthSample":
        return cls(np.concatenate([s.lengths for s in samples] or [np.zeros(0)]),
                   np.concatenate([s.censored for s in samples] or [np.zeros(0, dtype=bool)]),
                   sum(s.groups for s in samples))


def _compare(consumed: LengthSample, reference: LengthSample) -> dict[str, float]:
    distance = censored_ks(consumed.lengths, reference.lengths, reference.censored)
    noise = ks_noise(consumed.groups, reference.groups)
    reference_mean = float(reference.lengths.mean())  # censored lengths at their bounds: a lower bound
    return {"ks": distance, "ks_noise": noise, "ks_ratio": distance / noise,
            "mean_shift": float(consumed.lengths.mean() / reference_mean - 1.0) if reference_mean > 0 else 0.0,
            "censored_share": float(reference.censored.mean())}


class LengthBiasMonitor:
    """Per-step KS distance of consumed lengths to a reference, and its pooled steady-state value."""

    def __init__(self, window: int = 8):
        if window < 1:
            raise BiasMonitorError(f"window must be >= 1, got {window}")
        self.window = window
        self._references: deque[LengthSample] = deque(maxlen=window)
        self._pooled_consumed: list[LengthSample] = []
        self._pooled_reference: list[LengthSample] = []
        self._last: dict[str, float] = {}

    def add_reference(self, groups: Sequence[Sequence[int]], censored: Sequence[Sequence[bool]] | None = None) -> None:
        """Fold a step's population sample into the live reference (the last ``window`` steps'): the
        lengths of every group it pulled fresh, ``censored`` marking each aborted sample's work so far."""
        sample = LengthSample.of(groups, censored)
        if sample.groups:
            self._references.append(sample)

    def update(self, consumed: Sequence[Sequence[int]], reference: Sequence[Sequence[int]] | None = None,
               censored: Sequence[Sequence[bool]] | None = None) -> dict[str, float]:
        """Compare one step's consumed groups (response lengths per group) with ``reference`` (an
        independent population sample, ``censored`` marking lower bounds), else with the live reference
        (:meth:`add_reference`); returns this step's metrics ({} before any reference)."""
        taken = LengthSample.of(consumed)
        if not taken.groups:
            raise BiasMonitorError("a step must consume at least one non-empty group")
        against = LengthSample.of(reference, censored) if reference is not None else LengthSample.join(self._references)
        if not against.groups:
            self._last = {}
            return {}
        self._pooled_consumed.append(taken)
        self._pooled_reference.append(against)
        self._last = {**_compare(taken, against), "mean_len": float(taken.lengths.mean()),
                      "reference_mean_len": float(against.lengths.mean())}
        return dict(self._last)

    def pooled(self) -> dict[str, float]:
        """KS distance of everything consumed since the last reset against everything referenced."""
        if not self._pooled_consumed:
            return {}
        return _compare(LengthSample.join(self._pooled_consumed), LengthSample.join(self._pooled_reference))

    def reset_pooled(self) -> None:
        """Start a new steady-state window (call after a change of q)."""
        self._pooled_consumed, self._pooled_reference = [], []

    def metrics(self, prefix: str = "tailsieve/bias/") -> dict[str, float]:
        """Last step's metrics, keys prefixed for a metrics logger."""
        return {prefix + k: v for k, v in self._last.items()}
