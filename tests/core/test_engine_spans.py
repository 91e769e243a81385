"""The scheduler's shortcuts (quiet spans, FIFO refill stretches) change nothing: walked one step
at a time, every engine setting gives the same run."""

from __future__ import annotations

import numpy as np
import pytest

from tailsieve_verl.core.engine import EngineConfig, SpeculativeConfig
from tailsieve_verl.core.perf import parse_perf_model
from tailsieve_verl.core.scheduler import ReplicaScheduler

PERF = parse_perf_model("table:h200-dense")


class StepByStep(ReplicaScheduler):
    """The reference: no span, no refill stretch."""

    def _refill_span(self):
        return False

    def _quiet_span(self):
        return None


class SpansOnly(ReplicaScheduler):
    def _refill_span(self):
        return False


def random_case(seed: int):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 70))
    lengths = rng.integers(0, 300, size=n)
    lengths[rng.random(n) < 0.1] = 0
    prompts = rng.integers(1, 200, size=n)
    groups = np.repeat(np.arange(n), rng.integers(1, 6, size=n))[:n]
    prompts = prompts[groups]  # a group shares its prompt
    block = int(rng.choice([4, 16]))
    need = int(np.ceil((prompts + lengths + 4) / block).max())
    spec = None
    if seed % 3 == 0:  # dyadic acceptances: the expectations add up exactly in binary either way
        spec = SpeculativeConfig(3, (0.5, 0.75) if seed % 2 else (1.0,),
                                 schedule=((1, 4, 3), (5, 16, 1), (17, 64, 0)) if seed % 4 == 0 else (),
                                 acceptance_half_life=300.0 if seed % 9 == 0 else None)
    cfg = EngineConfig(max_num_seqs=int(rng.integers(1, 40)),
                       num_gpu_blocks=None if seed % 5 == 0 else need + int(rng.integers(0, 3 * need)),
                       block_size=block,
                       max_num_batched_tokens=None if seed % 7 == 0 else int(rng.integers(64, 600)),
                       enable_prefix_caching=seed % 2 == 0, prefill_s_per_token=1e-5 * (seed % 4),
                       speculative=spec)
    return lengths, prompts, groups, cfg


# found by fuzzing: 1010, 1114, 1210, 1342 (a sibling finishing exactly when the refill admits the
# next one of its group: no prefix hit); 2484, 2844, 2880 (speculation switched off by the schedule
# while the expected token count is fractional: one finishing rule for the walk and the spans)
@pytest.mark.parametrize("seed", [*range(60), 1010, 1114, 1210, 1342, 2484, 2844, 2880])
def test_shortcuts_match_the_step_by_step_walk(seed):
    lengths, prompts, groups, cfg = random_case(seed)
    ref = StepByStep(lengths, prompts, groups, cfg).run_to_end(PERF)
    for cls in (SpansOnly, ReplicaScheduler):
        run = cls(lengths, prompts, groups, cfg).run_to_end(PERF)
        assert run.steps == ref.steps
        assert run.events.preemptions == ref.events.preemptions
        assert run.events.tokens_recomputed == ref.events.tokens_recomputed
        assert run.events.prefill_tokens == ref.events.prefill_tokens
        np.testing.assert_allclose(run.finish_s, ref.finish_s, rtol=1e-12)
        np.testing.assert_allclose(run.admit_s, ref.admit_s, rtol=1e-12)
        np.testing.assert_allclose(run.events.spec_accepted_tokens, ref.events.spec_accepted_tokens, rtol=1e-12)
        for t in np.linspace(0, ref.completion_s, 7):
            np.testing.assert_array_equal(run.progress.tokens_at(t), ref.progress.tokens_at(t))
