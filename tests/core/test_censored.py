"""core.tailsieve.censored: response lengths past an abort, from a run's finished and cut samples."""

import numpy as np
import pytest

from tailsieve_verl.core.tailsieve.censored import LengthSurvival


def test_without_censoring_the_estimate_is_the_empirical_distribution():
    lengths = np.random.default_rng(0).integers(100, 5000, 2000)
    survival = LengthSurvival(lengths, np.zeros(0))
    for x in (100, 1000, 2500, 4999):
        assert survival.survival_at(np.array([x]))[0] == pytest.approx(np.mean(lengths > x), abs=1e-12)


def test_draws_past_the_tokens_follow_the_distribution_conditioned_on_exceeding_them():
    rng = np.random.default_rng(1)
    lengths = rng.lognormal(7.0, 0.8, 20000).astype(int) + 1
    cut_at = rng.uniform(0, 30000, len(lengths))  # abort moments: most lengths are seen whole
    seen, cut = lengths[lengths <= cut_at], cut_at[lengths > cut_at]
    survival = LengthSurvival(seen, cut)
    drawn = survival.beyond(np.full(20000, 2000.0), rng.random(20000))
    truth = lengths[lengths > 2000]
    assert (drawn > 2000).all()
    for q in (0.25, 0.5, 0.75):
        assert abs(np.quantile(drawn, q) / np.quantile(truth, q) - 1) < 0.05


def test_past_every_finished_length_a_cut_sample_keeps_its_tokens():
    survival = LengthSurvival(np.array([10, 20, 30]), np.array([40, 50]))
    assert survival.beyond(np.array([45.0, 25.0]), np.array([0.99, 0.0])).tolist() == [45.0, 30.0]
    assert LengthSurvival(np.zeros(0), np.array([5])).beyond(np.array([5.0]), np.array([0.5])).tolist() == [5.0]
