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

Live use (the verl layer, once per step)::

    monitor.update(consumed_groups)            # reference: the rolling window of earlier steps
    metrics.update(monitor.metrics())          # "tailsieve/bias/ks", ".../ks_noise", ...

In the simulator the reference is an independent population sample of the same step (the uniform
policy's batch), passed as ``reference``.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np

from .errors import TailSieveError

KOLMOGOROV_MEAN = 0.8687311606361592  # E[sup|B(t)|], the mean of the Kolmogorov distribution


class BiasMonitorError(TailSieveError):
    """Bad input to the length-bias monitor."""


def ks_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample KS statistic sup_x |F_a(x) − F_b(x)|."""
    a, b = np.sort(np.asarray(a, dtype=float)), np.sort(np.asarray(b, dtype=float))
    if len(a) == 0 or len(b) == 0:
        raise BiasMonitorError("KS distance needs two non-empty samples")
    x = np.concatenate([a, b])
    return float(np.max(np.abs(np.searchsorted(a, x, side="right") / len(a) - np.searchsorted(b, x, side="right") / len(b))))


def ks_noise(n_groups_a: int, n_groups_b: int) -> float:
    """Expected KS distance between two unbiased samples of these many groups."""
    n_eff = n_groups_a * n_groups_b / (n_groups_a + n_groups_b)
    return float(KOLMOGOROV_MEAN / np.sqrt(n_eff))


class LengthBiasMonitor:
    """Per-step KS distance of consumed lengths to a reference, and its pooled steady-state value."""

    def __init__(self, window: int = 8):
        if window < 1:
            raise BiasMonitorError(f"window must be >= 1, got {window}")
        self.window = window
        self._history: deque[list[tuple[int, ...]]] = deque(maxlen=window)
        self._pooled_consumed: list[np.ndarray] = []
        self._pooled_reference: list[np.ndarray] = []
        self._groups = [0, 0]
        self._last: dict[str, float] = {}

    def update(self, consumed: Sequence[Sequence[int]], reference: Sequence[Sequence[int]] | None = None) -> dict[str, float]:
        """Fold in one step's consumed groups (response lengths per group); returns this step's metrics."""
        consumed = [tuple(int(x) for x in g) for g in consumed if len(g)]
        if not consumed:
            raise BiasMonitorError("a step must consume at least one non-empty group")
        if reference is None:
            reference = [g for batch in self._history for g in batch]
        else:
            reference = [tuple(int(x) for x in g) for g in reference if len(g)]
        self._history.append(consumed)
        if not reference:
            self._last = {}
            return {}
        flat_c = np.fromiter((x for g in consumed for x in g), dtype=float)
        flat_r = np.fromiter((x for g in reference for x in g), dtype=float)
        self._pooled_consumed.append(flat_c)
        self._pooled_reference.append(flat_r)
        self._groups[0] += len(consumed)
        self._groups[1] += len(reference)
        distance, noise = ks_distance(flat_c, flat_r), ks_noise(len(consumed), len(reference))
        self._last = {
            "ks": distance, "ks_noise": noise, "ks_ratio": distance / noise,
            "mean_len": float(flat_c.mean()), "reference_mean_len": float(flat_r.mean()),
            "mean_shift": float(flat_c.mean() / flat_r.mean() - 1.0) if flat_r.mean() > 0 else 0.0,
        }
        return dict(self._last)

    def pooled(self) -> dict[str, float]:
        """KS distance of everything consumed since the last reset against everything referenced."""
        if not self._pooled_consumed:
            return {}
        c, r = np.concatenate(self._pooled_consumed), np.concatenate(self._pooled_reference)
        distance, noise = ks_distance(c, r), ks_noise(*self._groups)
        return {"ks": distance, "ks_noise": noise, "ks_ratio": distance / noise,
                "mean_shift": float(c.mean() / r.mean() - 1.0) if r.mean() > 0 else 0.0}

    def reset_pooled(self) -> None:
        """Start a new steady-state window (call after a change of q)."""
        self._pooled_consumed, self._pooled_reference, self._groups = [], [], [0, 0]

    def metrics(self, prefix: str = "tailsieve/bias/") -> dict[str, float]:
        """Last step's metrics, keys prefixed for a metrics logger."""
        return {prefix + k: v for k, v in self._last.items()}
