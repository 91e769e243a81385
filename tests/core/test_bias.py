from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import ks_2samp

from tailsieve_verl.core.tailsieve.bias import BiasMonitorError, LengthBiasMonitor, censored_ks, ks_distance, ks_noise
from tailsieve_verl.core.data.workload import PromptPool


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


def test_live_mode_compares_with_the_pulled_population_and_prefixes_metrics():
    pool = PromptPool("real", 512, seed=2)
    rng = np.random.default_rng(3)
    monitor = LengthBiasMonitor(window=2)
    assert monitor.update(_batch(pool, rng)) == {}  # nothing pulled yet: no reference
    monitor.add_reference(_batch(pool, rng))
    step = monitor.update(_batch(pool, rng))
    assert set(step) >= {"ks", "ks_noise", "ks_ratio", "mean_shift", "censored_share"}
    assert set(monitor.metrics()) == {"tailsieve/bias/" + k for k in step}
    monitor.reset_pooled()
    assert monitor.pooled() == {}
    with pytest.raises(BiasMonitorError):
        monitor.update([])
    with pytest.raises(BiasMonitorError):
        monitor.add_reference([(1, 2)], [(False,)])


def test_censored_ks_is_a_lower_bound_whatever_the_censored_lengths_reach():
    rng = np.random.default_rng(4)
    consumed, reference = rng.lognormal(5, 1, 200), rng.lognormal(5.3, 1, 300)
    censored = rng.random(300) < 0.3
    bound = np.where(censored, reference * rng.uniform(0.2, 1.0, 300), reference)  # what was seen by the abort
    assert censored_ks(consumed, reference, np.zeros(300, dtype=bool)) == ks_distance(consumed, reference)
    distance = censored_ks(consumed, bound, censored)
    for _ in range(50):  # any lengths the censored samples could have reached
        completed = np.where(censored, bound * rng.uniform(1.0, 5.0, 300), bound)
        assert distance <= ks_distance(consumed, completed) + 1e-12
    assert distance <= ks_distance(consumed, reference) + 1e-12


def _pulled_step(rng, n_pulled: int, n_consumed: int, n: int = 4):
    """One step's fresh pulls: the first ``n_consumed`` groups to finish are consumed, the others are
    aborted when the last of those finishes — each sample then known only up to that many tokens."""
    means = rng.lognormal(5.0, 0.8, n_pulled)
    groups = [tuple(int(x) for x in m * rng.lognormal(0, 0.3, n)) for m in means]
    order = sorted(range(n_pulled), key=lambda i: max(groups[i]))
    cutoff = max(groups[order[n_consumed - 1]])
    finished = [groups[i] for i in order[:n_consumed]]
    aborted = [(means[i], tuple(min(x, cutoff) for x in groups[i]), tuple(x > cutoff for x in groups[i]))
               for i in order[n_consumed:]]
    pulled = finished + [seen for _, seen, _ in aborted]
    censored = [(False,) * n for _ in finished] + [cut for _, _, cut in aborted]
    return finished, aborted, pulled, censored


def test_a_steady_loss_of_long_prompts_shows_against_the_pulled_population():
    """A routing that never consumes the prompts it aborts loses the long ones at every step. Against
    earlier consumed batches (the old reference) that never shows; against every pulled group, the
    aborted ones included as lower bounds, it does — and the fair stream (the aborted prompts
    regenerated and consumed the next step) stays within noise."""
    rng = np.random.default_rng(5)
    batch, aborts = 16, 8
    fair, lossy, old_reference = LengthBiasMonitor(), LengthBiasMonitor(), LengthBiasMonitor()
    carried, earlier = [], []
    for step in range(30):
        finished, aborted, pulled, censored = _pulled_step(rng, batch + aborts - len(carried), batch - len(carried))
        regenerated = [tuple(int(x) for x in m * rng.lognormal(0, 0.3, 4)) for m in carried]
        fair.update(regenerated + finished)
        fair.add_reference(pulled, censored)
        carried = [m for m, _, _ in aborted]
        lost_finished, _, lost_pulled, lost_censored = _pulled_step(rng, batch + aborts, batch)
        lossy.update(lost_finished)  # the aborted groups never come back
        lossy.add_reference(lost_pulled, lost_censored)
        if earlier:
            old_reference.update(lost_finished, earlier[-8 * batch:])  # the earlier steps consumed
        earlier += lost_finished
    assert fair.pooled()["ks_ratio"] < 1.5 and fair.pooled()["censored_share"] > 0
    assert lossy.pooled()["ks_ratio"] > 3.0 and lossy.pooled()["mean_shift"] < -0.2
    assert old_reference.pooled()["ks_ratio"] < 1.5  # the old reference is blind to it


def test_per_prompt_record_adds_no_length_bias():
    """Over a multi-epoch run the record only moves prompts between pools: TailSieve's consumed
    lengths match stock verl's (same prompts, fresh draws) within the KS noise."""
    from tailsieve_verl.core.engine.perf import parse_perf_model
    from tailsieve_verl.core.simulation.sim import SimConfig, simulate
    from tailsieve_verl.core.data.workload import PromptPool, get_preset

    pool = PromptPool(get_preset("strong", max_response_length=4096), 64, seed=2)
    cfg = SimConfig(steps=24, n_replicas=4, batch_size=16, n=4, seed=2, policies=("verl", "tailsieve-fixed"))
    result = simulate(cfg, pool, parse_perf_model("table:h200-dense"))
    lengths = {name: np.concatenate([r.consumed_lengths for r in p.records]) for name, p in result.policies.items()}
    distance = ks_distance(lengths["tailsieve-fixed"], lengths["verl"])
    groups = cfg.steps * cfg.batch_size
    assert distance < 1.5 * ks_noise(groups, groups), distance / ks_noise(groups, groups)
