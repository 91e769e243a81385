from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import ks_2samp

from tailsieve_verl.core.bias import BiasMonitorError, LengthBiasMonitor, ks_distance, ks_noise
from tailsieve_verl.core.workload import PromptPool


def _batch(pool: PromptPool, rng: np.random.Generator, size: int = 64, step: int = 0) -> list[tuple[int, ...]]:
    return [g.lengths for g in pool.sample_batch(size, 8, step, rng)]


def test_ks_distance_matches_scipy():
    rng = np.random.default_rng(0)
    a, b = rng.lognormal(7, 1, 300), rng.lognormal(7.2, 1, 200)
    assert ks_distance(a, b) == pytest.approx(ks_2samp(a, b).statistic)
    assert ks_noise(64, 64) == pytest.approx(0.8687 / np.sqrt(32), rel=1e-3)


def test_unbiased_stream_stays_within_noise_and_biased_stream_does_not():
    pool = PromptPool("real", 2048, seed=0)
    rng = np.random.default_rng(1)
    fair, biased = LengthBiasMonitor(), LengthBiasMonitor()
    for step in range(20):
        consumed, reference = _batch(pool, rng, step=step), _batch(pool, rng, step=step)
        fair.update(consumed, reference)
        # drop the 10 % longest groups and replace them with short ones: a routing-induced bias
        kept = sorted(consumed, key=max)[: int(0.9 * len(consumed))]
        biased.update(kept + kept[: len(consumed) - len(kept)], reference)
    assert fair.pooled()["ks_ratio"] < 1.5
    assert biased.pooled()["ks_ratio"] > 2.0
    assert biased.pooled()["ks_ratio"] > 3 * fair.pooled()["ks_ratio"]
    assert biased.pooled()["mean_shift"] < -0.1


def test_live_mode_uses_the_rolling_window_and_prefixes_metrics():
    pool = PromptPool("real", 512, seed=2)
    rng = np.random.default_rng(3)
    monitor = LengthBiasMonitor(window=2)
    assert monitor.update(_batch(pool, rng)) == {}  # no reference yet
    step = monitor.update(_batch(pool, rng))
    assert set(step) >= {"ks", "ks_noise", "ks_ratio", "mean_shift"}
    assert set(monitor.metrics()) == {"tailsieve/bias/" + k for k in step}
    monitor.reset_pooled()
    assert monitor.pooled() == {}
    with pytest.raises(BiasMonitorError):
        monitor.update([])


def test_per_prompt_record_adds_no_length_bias():
    """Over a multi-epoch run the record only moves prompts between pools: TailSieve's consumed
    lengths match stock verl's (same prompts, fresh draws) within the KS noise."""
    from tailsieve_verl.core.perf import parse_perf_model
    from tailsieve_verl.core.sim import SimConfig, simulate
    from tailsieve_verl.core.workload import PromptPool, get_preset

    pool = PromptPool(get_preset("strong", max_response_length=4096), 64, seed=2)
    cfg = SimConfig(steps=24, n_replicas=4, batch_size=16, n=4, seed=2, policies=("verl", "tailsieve-fixed"))
    result = simulate(cfg, pool, parse_perf_model("table:h200-dense"))
    lengths = {name: np.concatenate([r.consumed_lengths for r in p.records]) for name, p in result.policies.items()}
    distance = ks_distance(lengths["tailsieve-fixed"], lengths["verl"])
    groups = cfg.steps * cfg.batch_size
    assert distance < 1.5 * ks_noise(groups, groups), distance / ks_noise(groups, groups)
