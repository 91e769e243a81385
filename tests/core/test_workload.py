"""Workload generator: the seed's variance shares, tail transform, truncation, persistent prompt
difficulty with drift, trace-backed pools, and errors."""

from __future__ import annotations

import numpy as np
import pytest

from tailsieve_verl.core.data.trace import Group, Trace
from tailsieve_verl.core.data.workload import (PRESETS, SEED_VARIANCE_SHARES, PromptPool, TailTransform, WorkloadError,
                                          WorkloadSpec, generate_trace, get_preset, tail_transform)


def _pooled(pool: PromptPool, steps=range(0, 1000, 50), n: int = 4, seed: int = 0) -> np.ndarray:
    """Lengths over many far-apart checkpoints (one step alone is shifted by its checkpoint effect)."""
    rng = np.random.default_rng(seed)
    return np.array([v for step in steps for g in pool.sample_groups(pool.prompt_ids, n, step, rng) for v in g.lengths])


def test_log_length_variance_shares_match_the_seed():
    """Two-way random-effects ANOVA (prompt × checkpoint, replicated samples) on the length model."""
    P, C, S, spacing = 1000, 100, 3, 40  # checkpoints far apart: their drift is ~independent (0.9^40)
    pool = PromptPool("real", P, seed=7)
    rng = np.random.default_rng(0)
    y = np.stack([np.stack([pool.log_lengths(pid, S, c * spacing, rng) for c in range(C)]) for pid in pool.prompt_ids])
    grand = y.mean()
    a_mean, b_mean, ab_mean = y.mean(axis=(1, 2)), y.mean(axis=(0, 2)), y.mean(axis=2)
    ms_a = C * S * np.sum((a_mean - grand) ** 2) / (P - 1)
    ms_b = P * S * np.sum((b_mean - grand) ** 2) / (C - 1)
    ms_ab = S * np.sum((ab_mean - a_mean[:, None] - b_mean[None, :] + grand) ** 2) / ((P - 1) * (C - 1))
    ms_e = np.sum((y - ab_mean[:, :, None]) ** 2) / (P * C * (S - 1))
    comps = {"sampling": ms_e, "interaction": (ms_ab - ms_e) / S, "prompt": (ms_a - ms_ab) / (C * S),
             "checkpoint": (ms_b - ms_ab) / (P * S)}
    # Share of the model's total log-variance; tolerances ~3 standard errors of each estimate
    # (prompt: 1000 prompts, checkpoint: 100 checkpoints, interaction/sampling: 10^5 cells).
    shares = {k: v / pool.spec.log_sigma ** 2 for k, v in comps.items()}
    assert shares["prompt"] == pytest.approx(SEED_VARIANCE_SHARES["prompt"], rel=0.12)
    assert shares["sampling"] == pytest.approx(SEED_VARIANCE_SHARES["sampling"], rel=0.03)
    assert shares["interaction"] == pytest.approx(SEED_VARIANCE_SHARES["interaction"], rel=0.1)
    assert shares["checkpoint"] == pytest.approx(SEED_VARIANCE_SHARES["checkpoint"], rel=0.45)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_hit_their_tail_ratio_and_keep_the_median(name):
    pool = PromptPool(name, 2000, seed=1)  # 2000 prompts: the realised prompt variance is within ~3 %
    lengths = _pooled(pool, n=2)
    median = np.median(lengths)
    ratio = np.percentile(lengths, 90) / median
    target = pool.spec.tail_ratio or pool.spec.model_p90_ratio
    assert ratio == pytest.approx(target, rel=0.05)
    assert median == pytest.approx(pool.spec.median_len, rel=0.05)
    assert lengths.min() >= 1 and lengths.max() <= pool.spec.max_response_length


def test_weak_and_strong_order():
    ratios = {n: np.percentile(x := _pooled(PromptPool(n, 200, seed=2)), 90) / np.median(x) for n in PRESETS}
    assert ratios["weak"] < ratios["real"] < ratios["strong"]


def test_truncation_leaves_a_point_mass_at_max_response_length():
    spec = get_preset("strong", max_response_length=8192)
    lengths = _pooled(PromptPool(spec, 300, seed=3))
    at_cap = np.mean(lengths == 8192)
    assert at_cap > 0.01 and lengths.max() == 8192
    assert np.mean(lengths == 8191) < at_cap / 10


def test_tail_transform_changes_only_the_upper_half_and_keeps_order():
    rng = np.random.default_rng(4)
    x = np.rint(np.exp(rng.normal(7, 1, 5001))).astype(int)
    for ratio in (1.5, 6.0):
        y = tail_transform(x, ratio)
        m = np.median(x)
        assert np.array_equal(y[x <= m], x[x <= m])
        assert np.all(np.diff(y[np.argsort(x, kind="stable")]) >= 0)  # order preserved
        assert np.median(y) == m
        assert np.percentile(y, 90) / m == pytest.approx(ratio, rel=0.01)
    capped = tail_transform(x, 6.0, max_response_length=4000)
    assert capped.max() == 4000


def test_tail_transform_fit_maps_p90_exactly():
    t = TailTransform.fit(1000.0, 3000.0, 6.0)
    assert t(np.array([500.0, 1000.0, 3000.0]))[2] == pytest.approx(6000.0)
    assert t(np.array([500.0]))[0] == 500.0


def test_prompt_difficulty_persists_across_steps_and_drifts_slowly():
    pool = PromptPool("real", 400, seed=5)
    mean_at = {s: np.array([np.mean(g.lengths) for g in pool.sample_groups(pool.prompt_ids, 16, s,
                                                                                np.random.default_rng(s))])
               for s in (0, 1, 300)}
    rank = lambda v: np.argsort(np.argsort(v))  # noqa: E731
    near = np.corrcoef(rank(mean_at[0]), rank(mean_at[1]))[0, 1]
    far = np.corrcoef(rank(mean_at[0]), rank(mean_at[300]))[0, 1]
    assert near > 0.8  # tail prompts stay tail prompts
    assert far < near  # the interaction term drifts away
    _, inter0 = pool._effects_at(0)
    _, inter300 = pool._effects_at(300)
    assert abs(np.corrcoef(inter0, inter300)[0, 1]) < 0.3


def test_checkpoint_effects_do_not_depend_on_call_order():
    a, b = PromptPool("real", 50, seed=9), PromptPool("real", 50, seed=9)
    first_a = a.sample_group("p000003", 4, 7, np.random.default_rng(1))
    b.sample_group("p000001", 4, 2, np.random.default_rng(5))
    first_b = b.sample_group("p000003", 4, 7, np.random.default_rng(1))
    assert first_a == first_b


def test_typical_length_is_the_median_of_a_prompts_draws():
    """What a perfect per-prompt predictor knows: the median of the prompt's lengths at that step."""
    pool, rng = PromptPool("strong", 40, seed=3), np.random.default_rng(0)
    for pid in pool.prompt_ids[:5]:
        draws = pool.sample_group(pid, 4001, 6, rng).lengths
        assert abs(np.log(pool.typical_length(pid, 6) / np.median(draws))) < 0.1
    assert len({pool.typical_length(pid, 6) for pid in pool.prompt_ids}) > 20  # prompts differ
    observed = PromptPool.from_trace(Trace((Group("x", (10, 20, 90)),), name="obs"))
    assert observed.typical_length("x", 0) == 20


def test_generate_trace_is_deterministic():
    t1, t2 = generate_trace("strong", 20, 8, seed=3), generate_trace("strong", 20, 8, seed=3)
    assert t1.groups == t2.groups and len(t1) == 20 and all(g.n == 8 for g in t1)
    assert generate_trace("strong", 20, 8, seed=4).groups != t1.groups


def test_trace_backed_pool_resamples_observed_lengths():
    trace = Trace((Group("x", (10, 20, 30), 5), Group("y", (1000, 4000))), name="obs")
    pool = PromptPool.from_trace(trace, seed=0)
    rng = np.random.default_rng(0)
    gx = pool.sample_group("x", 50, 3, rng)
    assert set(gx.lengths) <= {10, 20, 30} and len(set(gx.lengths)) == 3 and gx.prompt_len == 5
    assert set(pool.sample_group("y", 20, 0, rng).lengths) <= {1000, 4000}
    # Pooled median 30, P90 2800 (ratio 93): ratio 6 maps P90 to 180, i.e. excess scaled by 150/2770.
    squeezed = PromptPool.from_trace(trace, tail_ratio=6.0)
    assert set(squeezed.sample_group("y", 30, 0, rng).lengths) == {83, 245}
    assert set(squeezed.sample_group("x", 30, 0, rng).lengths) <= {10, 20, 30}
    with pytest.raises(WorkloadError, match="no length model"):
        pool.log_lengths("x", 2, 0, rng)


@pytest.mark.parametrize("call, needle", [
    (lambda: get_preset("medium"), "unknown workload preset 'medium'"),
    (lambda: WorkloadSpec("w", tail_ratio=1.0), "tail ratio P90/P50 must be > 1"),
    (lambda: WorkloadSpec("w", prompt_share=0.9), "variance shares must be >= 0 and sum to 1"),
    (lambda: WorkloadSpec("w", max_response_length=10), "max_response_length"),
    (lambda: WorkloadSpec("w", drift_corr=1.5), "drift_corr"),
    (lambda: PromptPool("real", 0), "at least one prompt"),
    (lambda: PromptPool("real", 3).sample_group("nope", 2, 0, np.random.default_rng()), "unknown prompt 'nope'"),
    (lambda: PromptPool("real", 3).sample_group("p000000", 0, 0, np.random.default_rng()), "group size must be >= 1"),
    (lambda: PromptPool("real", 3).sample_group("p000000", 2, -1, np.random.default_rng()), "step must be >= 0"),
    (lambda: PromptPool("real", 3).sample_batch(4, 2, 0, np.random.default_rng()), "batch size must be between 1"),
    (lambda: tail_transform([5, 5, 5], 2.0), "no upper tail"),
    (lambda: tail_transform([], 2.0), "at least one length"),
])
def test_bad_workload_inputs(call, needle):
    with pytest.raises(WorkloadError, match=needle):
        call()
