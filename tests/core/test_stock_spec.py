"""Stock verl with speculation on every replica (verl-spec, verl-dynsd, verl-dynsd-best), TailSieve with
per-pool engines, and the best stock configuration as the bar (issue 22)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tailsieve_verl.core.simulation import runners, sim
from tailsieve_verl.core.tailsieve.controller import ControllerConfig
from tailsieve_verl.core.engine.engine import EngineConfig, SpeculativeConfig
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.simulation.sim import SimConfig, SimError, TailSieveRunner, simulate
from tailsieve_verl.core.data.trace import Group, Trace
from tailsieve_verl.core.data.workload import PromptPool, WorkloadError, get_preset

PERF = parse_perf_model("table:h200-dense")
POOL = PromptPool(get_preset("real", max_response_length=2048), 128, seed=3)


def _run(policies, speculation=sim.DEFAULT_SPECULATION, **fields):
    cfg = SimConfig(steps=4, n_replicas=4, batch_size=16, n=4, seed=3, policies=tuple(policies),
                    speculation=speculation, **fields)
    return simulate(cfg, POOL, PERF)


def test_free_perfect_speculation_beats_stock_verl_and_the_deepest_k_wins():
    result = _run(("verl", "verl-spec"), SpeculativeConfig(3, (1.0,), draft_cost=0.0))
    assert result.speedup_vs("verl")["verl-spec"] > 2.0
    assert result.policies["verl-spec"].choice == "k=6"
    assert result.best_stock == "verl-spec"


def test_useless_drafts_only_cost_and_the_best_depth_is_the_smallest():
    result = _run(("verl", "verl-spec", "verl-dynsd"), SpeculativeConfig(3, (0.0,), draft_cost=1 / 28))
    vs_verl = result.speedup_vs("verl")
    assert vs_verl["verl-spec"] < 1.0 and vs_verl["verl-dynsd"] < 1.0  # verify and draft cost, nothing gained
    assert result.policies["verl-spec"].choice == "k=1"
    assert result.best_stock == "verl"


def test_hindsight_picks_the_fastest_of_its_runs():
    cfg = SimConfig(steps=3, n_replicas=4, batch_size=16, n=4, seed=3, spec_depths=(1, 4))
    runner = sim.stock_spec_runner(cfg, POOL, PERF, "verl-spec")
    for t in range(cfg.steps):
        runner.step(t, keep=False)
    result = runner.finish()
    assert set(runner.grid) == {"k=1", "k=4"}
    assert result.mean_makespan_s == min(runner.grid.values())
    assert result.choice == min(runner.grid, key=runner.grid.get)


def test_vllm_doc_schedule_and_its_scaling():
    assert sim.vllm_doc_schedule(3) == ((1, 64, 3), (65, 128, 1), (129, 256, 0))
    assert sim.vllm_doc_schedule(6)[:2] == ((1, 64, 6), (65, 128, 2))
    grid = sim.schedule_grid(6)
    assert "1-64:3,65-128:1,129-256:0" in grid and all(max(k for *_, k in s) <= 6 for s in grid.values())


def test_per_pool_engines_reach_m_tail_and_r_minus_m_bulk_replicas(monkeypatch):
    tail = EngineConfig(max_num_seqs=1)
    bulk = EngineConfig(max_num_seqs=3)
    cfg = SimConfig(steps=2, n_replicas=4, batch_size=16, n=4, seed=3, tail_engine=tail, bulk_engine=bulk)
    assert cfg.pool_engines(1) == [tail, bulk, bulk, bulk] and cfg.pool_engines(0) == [bulk] * 4
    seen = []
    real = runners.evaluate_samples
    monkeypatch.setattr(runners, "evaluate_samples", lambda *a, engine, **k: seen.append(list(engine)) or real(*a, engine=engine, **k))
    runner = TailSieveRunner(cfg, POOL, PERF, ControllerConfig(fixed_tail_replicas=1, q_init=2, inner_loop=False),
                             "tailsieve-fixed")
    runner.step(0, keep=False)  # nothing carried yet: no tail groups, the engines as launched (replica 0 idle)
    runner.step(1, keep=False)
    assert [r.m for r in runner.result.records] == [0, 1]
    assert seen == [[tail, bulk, bulk, bulk]] * 2
    # and the tail engine really ran there: one request at a time makes the tail pool slower than unlimited
    free = TailSieveRunner(replace(cfg, tail_engine=None, bulk_engine=bulk), POOL, PERF,
                           ControllerConfig(fixed_tail_replicas=1, q_init=2, inner_loop=False), "tailsieve-fixed")
    free.step(0, keep=False)
    free.step(1, keep=False)
    assert runner.result.records[1].tail_s > free.result.records[1].tail_s


def test_tailsieve_spec_runs_a_deep_tail_and_the_schedule_in_the_bulk():
    cfg = SimConfig(n_replicas=4, batch_size=16, n=4, fixed_tail_replicas=1)
    spec = sim.tailsieve_spec_config(cfg, "tailsieve-spec")
    assert spec.tail_engine.speculative.num_speculative_tokens == 6 and not spec.tail_engine.speculative.schedule
    assert spec.bulk_engine.speculative.schedule == sim.vllm_doc_schedule(3)
    dyn = sim.tailsieve_spec_config(cfg, "tailsieve-dynsd")
    assert dyn.pool_engines(2) == [dyn.engine] * 4 and dyn.engine.speculative.schedule == sim.vllm_doc_schedule(3)
    result = _run(("verl", "tailsieve-spec", "tailsieve-dynsd"), fixed_tail_replicas=1)
    for name in ("tailsieve-spec", "tailsieve-dynsd"):
        r = result.policies[name]
        assert (r.lost, r.duplicated, r.stale) == (0, 0, 0) and r.max_deferral_steps <= 1
    assert result.policies["tailsieve-spec"].choice == "tail k=6 / bulk 1-64:3,65-128:1,129-256:0"


def test_default_engine_is_todays_model():
    """SimConfig.engine defaults to no limits: the same makespans as an explicit EngineConfig()."""
    a = _run(("verl", "tailsieve"))
    b = _run(("verl", "tailsieve"), engine=EngineConfig(), tail_engine=EngineConfig(), bulk_engine=EngineConfig())
    for name in ("verl", "tailsieve"):
        assert a.policies[name].makespans.tolist() == b.policies[name].makespans.tolist()


@pytest.mark.parametrize("fields, needle", [
    ({"engine": None}, "engine must be an EngineConfig"),
    ({"tail_engine": "deep"}, "tail_engine must be an EngineConfig"),
    ({"speculation": (0.8,)}, "speculation must be a SpeculativeConfig"),
    ({"spec_depths": (0, 2)}, "spec_depths must be integers in 1..64"),
])
def test_bad_engine_settings_are_one_clear_line(fields, needle):
    with pytest.raises(SimError, match=needle):
        SimConfig(**fields).validate()


def test_speculation_policies_need_the_engine_model():
    cfg = SimConfig(steps=1, n_replicas=4, batch_size=16, n=4, policies=("verl-spec",))
    with pytest.raises(SimError, match="verl-spec runs on the engine model"):
        sim.build_runners(cfg, POOL, PERF, execute=lambda name, groups, samples: None)


def test_longest_to_tail_puts_the_q_heaviest_groups_on_the_tail_replicas_in_group_order():
    from tailsieve_verl.core.routing.policies import longest_to_tail
    from tailsieve_verl.core.data.trace import Group

    groups = [Group(f"p{i}", tuple(lengths), 8) for i, lengths in
              enumerate([(5, 5), (100, 1), (7, 7), (50, 60), (1, 1)])]
    samples = longest_to_tail(groups, q=2, m=1, n_replicas=4)
    per_group = [samples[2 * i:2 * i + 2] for i in range(len(groups))]
    on_tail = [bool((s < 1).all()) for s in per_group]
    assert on_tail == [False, True, False, True, False]  # 101 and 110 tokens, the two heaviest
    assert all(((s >= 1) & (s < 4)).all() for s, t in zip(per_group, on_tail) if not t)
    atomic = longest_to_tail(groups, q=2, m=2, n_replicas=4, group_atomic=True)
    assert all(len(set(atomic[2 * i:2 * i + 2])) == 1 for i in range(len(groups)))  # whole groups


def test_clairvoyant_split_is_never_slower_than_stock_verl_on_its_engine_and_beats_it_with_a_deep_tail():
    """The shared-pool candidate is stock verl's own assignment of the step, so every step is at most
    verl's on the same engine; a free perfect drafter in the tail pool makes the split win."""
    engine = sim.with_speculation(EngineConfig(), sim.DEFAULT_SPECULATION, 0, sim.vllm_doc_schedule(3))
    result = _run(("verl-dynsd", "clairvoyant-split"), engine=engine)
    stock, ceiling = result.policies["verl-dynsd"], result.policies["clairvoyant-split"]
    assert (ceiling.makespans <= stock.makespans + 1e-12).all()
    assert (ceiling.lost, ceiling.duplicated, ceiling.max_deferral_steps) == (0, 0, 0)
    free = _run(("verl", "clairvoyant-split"), SpeculativeConfig(3, (1.0,), draft_cost=0.0))
    assert (free.policies["clairvoyant-split"].makespans < free.policies["verl"].makespans).all()
    assert free.policies["clairvoyant-split"].choice.startswith("split on 4 of 4 steps; most often q=")
    assert "tail k=6" in free.policies["clairvoyant-split"].choice


def test_clairvoyant_split_runs_on_the_engine_model_only():
    cfg = SimConfig(steps=1, n_replicas=4, batch_size=16, n=4, seed=3, policies=("clairvoyant-split",))
    with pytest.raises(SimError, match="clairvoyant-split runs on the engine model"):
        sim.build_runners(cfg, POOL, PERF, execute=lambda name, groups, samples: None)


def test_prompt_oracle_split_knows_each_prompt_and_nothing_of_the_step_s_samples():
    """Issue 33: the per-prompt reference ranks groups by each prompt's typical length (its median under
    this step's policy) and picks the step's split on each prompt's typical group, never on this step's
    samples: two draws of the same prompts get the same assignment. With no sampling noise the typical
    group is the group, so there it is the group oracle and no step is slower than stock verl."""
    result = _run(("verl", "prompt-oracle-split", "clairvoyant-split"), speculation=sim.DEFAULT_SPECULATION)
    oracle = result.policies["prompt-oracle-split"]
    assert (oracle.lost, oracle.duplicated, oracle.max_deferral_steps) == (0, 0, 0)
    assert "tail k=" not in oracle.choice  # routing-only: the tail pool runs the run's own engine

    cfg = SimConfig(steps=1, n_replicas=4, batch_size=16, n=4, seed=3, policies=("prompt-oracle-split",))
    ids = list(POOL.prompt_ids[:8])
    a, b = (POOL.sample_groups(ids, 4, 2, np.random.default_rng(seed)) for seed in (0, 1))
    assert [g.lengths for g in a] != [g.lengths for g in b]
    picks = []
    for groups in (a, b):
        runner = sim.PromptOracleSplitRunner(cfg, POOL, PERF)
        runner.step_index = 2
        assert runner.rank(groups) == [POOL.typical_length(g.prompt_id, 2) * 4 for g in groups]
        samples, m = runner.assign(groups)
        picks.append((samples.tolist(), m))
    assert picks[0] == picks[1]

    quiet = PromptPool(get_preset("real", max_response_length=2048, prompt_share=0.909, sampling_share=0.0), 128, seed=3)
    groups = quiet.sample_groups(ids, 4, 0, np.random.default_rng(0))
    runner = sim.PromptOracleSplitRunner(cfg, quiet, PERF)
    assert runner.rank(groups) == [sum(g.lengths) for g in groups]
    assert runner.plan_groups(groups) == groups
    quiet_run = simulate(replace(cfg, steps=4, policies=("verl", "prompt-oracle-split")), quiet, PERF)
    assert (quiet_run.policies["prompt-oracle-split"].makespans <= quiet_run.policies["verl"].makespans + 1e-12).all()
    with pytest.raises(SimError, match="prompt-oracle-split runs on the engine model"):
        sim.build_runners(cfg, POOL, PERF, execute=lambda name, groups, samples: None)


def test_typical_group_is_the_prompt_s_distribution_at_its_quantiles():
    """What the per-prompt reference plans on: n lengths spread over the prompt's distribution (its median
    in the middle), the same on every call, and for a trace-backed pool the observed lengths' quantiles."""
    group = POOL.typical_group(POOL.prompt_ids[5], 8, 3)
    assert group == POOL.typical_group(POOL.prompt_ids[5], 8, 3) and list(group.lengths) == sorted(group.lengths)
    assert group.lengths[0] < POOL.typical_length(POOL.prompt_ids[5], 3) < group.lengths[-1]
    traced = PromptPool.from_trace(Trace([Group("a", (10, 20, 30, 40), 5)], name="t"))
    assert traced.typical_group("a", 4, 0).lengths == (14, 21, 29, 36) and traced.typical_group("a", 4, 0).prompt_len == 5
    with pytest.raises(WorkloadError, match="group size must be >= 1"):
        POOL.typical_group("a", 0, 0)


def test_history_oracle_split_knows_of_each_prompt_what_its_earlier_steps_can_tell():
    """Issue 48: the ceiling of a per-prompt record. Knowing a pool only as far as history can tell is knowing
    exactly the pool whose prompt x checkpoint interaction is sampling noise instead (same seed, so the same
    difficulty and checkpoint draws): typical groups and lengths equal there, and so do history-oracle-split's
    runs on the one and prompt-oracle-split's on the other, step for step."""
    spec = get_preset("weak", max_response_length=2048)
    folded = replace(spec, sampling_share=spec.sampling_share + spec.interaction_share, interaction_share=0.0)
    pool, twin = PromptPool(spec, 128, seed=3), PromptPool(folded, 128, seed=3)
    ids = pool.prompt_ids[:16]
    for step in (0, 5):
        assert ([pool.typical_group(p, 8, step, history_only=True) for p in ids]
                == [twin.typical_group(p, 8, step) for p in ids])
        assert ([pool.typical_length(p, step, history_only=True) for p in ids]
                == [twin.typical_length(p, step) for p in ids])
    # the interaction is the step's own: what the history can tell differs from what the step holds
    assert [pool.typical_group(p, 8, 5, history_only=True) for p in ids] != [pool.typical_group(p, 8, 5) for p in ids]

    cfg = SimConfig(steps=4, n_replicas=4, batch_size=16, n=4, seed=3)
    history = simulate(replace(cfg, policies=("history-oracle-split",)), pool, PERF).policies["history-oracle-split"]
    truth = simulate(replace(cfg, policies=("prompt-oracle-split",)), twin, PERF).policies["prompt-oracle-split"]
    assert [r.m for r in history.records] == [r.m for r in truth.records] and history.choice == truth.choice
    assert (history.lost, history.duplicated) == (0, 0)
    assert (history.makespans != truth.makespans).any()  # run on the pool's own samples, not the twin's


def test_group_oracle_split_is_the_routing_ceiling_of_the_per_prompt_reference():
    """group-oracle-split ranks by this step's true tokens on the same routing-only grid: the split a
    perfect group-length signal picks. It never loses to stock verl (its shared candidate is stock verl's
    assignment), runs no speculation, and on average is at least the per-prompt reference on the same
    draws (its ranking is the truth the per-prompt one estimates)."""
    result = _run(("verl", "group-oracle-split", "prompt-oracle-split"), speculation=sim.DEFAULT_SPECULATION)
    group, prompt, stock = (result.policies[p] for p in ("group-oracle-split", "prompt-oracle-split", "verl"))
    assert (group.makespans <= stock.makespans + 1e-12).all()
    assert "tail k=" not in group.choice and (group.lost, group.duplicated) == (0, 0)
    assert group.mean_makespan_s <= prompt.mean_makespan_s * 1.01
