"""Response lengths past an abort, for the stock-verl price of a split step.

A split step aborts its slowest fresh groups at the cutoff: their cut samples' lengths are then known only to
exceed the tokens they had generated (right-censored). Stock verl would have run them to their end, so a fair
price of what stock verl would have taken on the step's pulled prompts needs those lengths. They are estimated
from the run's own recent samples with the Kaplan–Meier estimator (``scipy.stats.ecdf`` on
``scipy.stats.CensoredData``): every sample seen finished is an event, every sample an abort cut is censored at
its tokens. Where the estimate holds no mass past a sample's tokens (nothing seen finished beyond them), the
sample keeps its tokens: a price that is then a lower bound on stock verl's judges a split no better than it is.
"""

from __future__ import annotations

import numpy as np
from scipy import stats


class LengthSurvival:
    """The Kaplan–Meier estimate of the response-length distribution from finished and cut samples."""

    def __init__(self, finished: np.ndarray, cut: np.ndarray):
        finished = np.asarray(finished, dtype=float)
        if len(finished):
            fit = stats.ecdf(stats.CensoredData(uncensored=finished, right=np.asarray(cut, dtype=float))).sf
            self.events, self.survival = np.asarray(fit.quantiles, dtype=float), np.asarray(fit.probabilities)
        else:
            self.events, self.survival = np.zeros(0), np.zeros(0)

    def survival_at(self, x: np.ndarray) -> np.ndarray:
        """P(length > x) by the estimate (1 before the first event)."""
        k = np.searchsorted(self.events, x, side="right") - 1
        return np.where(k >= 0, self.survival[np.maximum(k, 0)], 1.0) if len(self.events) else np.ones(np.shape(x))

    def beyond(self, tokens: np.ndarray, quantiles: np.ndarray) -> np.ndarray:
        """The length at ``quantiles`` (each in [0, 1)) of the estimate conditioned on exceeding ``tokens``: a
        draw past the abort where the quantiles are uniform draws; the tokens themselves where the estimate
        holds no mass past them."""
        tokens = np.asarray(tokens, dtype=float)
        if not len(self.events):
            return tokens
        left = (1.0 - np.asarray(quantiles, dtype=float)) * self.survival_at(tokens)  # P(L > x) the draw leaves
        # the first event past the tokens at which the survival has fallen to ``left`` (it never rises)
        k = np.maximum(np.searchsorted(-self.survival, -left, side="left"),
                       np.searchsorted(self.events, tokens, side="right"))
        return np.where(k < len(self.events), self.events[np.minimum(k, len(self.events) - 1)], tokens)
