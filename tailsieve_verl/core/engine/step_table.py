"""The decode step model tabulated once: the controller, the exact oracle and routing estimates
read grids of ``perf.step_time`` instead of calling it per decision, and share one way to sample
it and one separable split of a step into per-replica and per-request parts."""

from __future__ import annotations

import numpy as np

from .perf import PerfModel


class StepTimeGrid:
    """``values[i, j]`` = step_time(actives[i], contexts[j]), sampled in one vectorised call."""

    def __init__(self, perf: PerfModel, actives, contexts):
        self.actives = np.asarray(actives, dtype=float)
        self.contexts = np.asarray(contexts, dtype=float)
        a, c = np.meshgrid(self.actives, self.contexts, indexing="ij")
        self.values = np.asarray(perf.step_time(a.ravel(), c.ravel()), dtype=float).reshape(a.shape)


def separable_cums(first: np.ndarray, slope: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Prefix sums (leading 0) of the split step(s) ≈ α(s) + β(s)·active, from the active = 1 row
    ``first`` and a per-step ``slope``: β = slope clipped to [0, first] so that neither part is
    negative, α = first − β. Returns (Σ α: paid once per replica up to its longest response,
    Σ β: paid per request up to its length) — exact for a linear model."""
    beta = np.clip(slope, 0.0, first)
    return np.concatenate([[0.0], np.cumsum(first - beta)]), np.concatenate([[0.0], np.cumsum(beta)])
