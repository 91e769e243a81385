"""TailSieve's rollout path against real vLLM engines behind verl's own server (``vLLMReplica``).

Two standalone replicas: rank 0 is the tail pool, rank 1 the bulk pool. Requests go through the
pieces the trainer uses — TailSieve's :class:`PoolRouter` as verl's load-balancer actor and
:class:`GroupTaggedClient` (verl's ``LLMServerClient`` with the group uid in the request id) — and
:class:`TailSelector` plans and closes each step. The cutoff aborts the unfinished bulk groups with
the server's ``abort_groups`` (TailSieve's vLLM server, :mod:`integration.vllm_server`: the call
TailSieveTrainer makes); the engine never pauses.

Response lengths are forced per prompt (``min_tokens = max_tokens``, ``ignore_eos``): a prompt's
identity decides whether it is long, as the tail signal assumes. Where verl's trainer would update
weights between steps, this test performs the same engine calls a weight sync makes (abort every
replica, then resume) and keeps the weights: nothing here trains. Not run here: the
TailSieveTrainer orchestration itself (TransferQueue replay buffer, dispatch, cutoff watcher) and
``TailSieveAgentLoop`` wrapping verl's single-turn loop — the step below is driven by the test with
the same calls, setting the client's per-sample context as that agent loop does.

The replicas are launched as the plugin launches them, with per-pool engine settings (``conftest``):
the tail replica speculates (a draft model, k = 2), the bulk replica does not. Each replica's own
``/metrics`` says which one drafted, over the two steps.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest
import ray

from tailsieve_verl.core.engine.perf import TablePerf
from tailsieve_verl.core.kinds import Pool
from tailsieve_verl.core.tailsieve.selector import TailSelector
from tailsieve_verl.core.data.trace import Group
from tailsieve_verl.integration.agent_loop import _SAMPLE, GroupContext, GroupTaggedClient
from tailsieve_verl.integration.router import PoolRouter
from tailsieve_verl.tools.bench import bench
from tailsieve_verl.tools.calibrate import SweepPlan, calibrate, write_calibration
from tailsieve_verl.tools.openai_client import OpenAIServer, synthetic_prompt
from tailsieve_verl.tools.vllm_metrics import SpecCounters, parse_metrics

N_SAMPLES = 2
SHORT, LONG = 12, 320
PROMPT_LEN = 40  # > 2 KV blocks, so a reused prefix would show as cached tokens
LONG_PROMPTS = {"p1", "p4", "p7", "p8"}


def prompt_ids(prompt_id: str) -> list[int]:
    return list(synthetic_prompt(PROMPT_LEN, prompt_id))


def forced_length(prompt_id: str) -> int:
    return LONG if prompt_id in LONG_PROMPTS else SHORT


@dataclass
class GroupRun:
    prompt_id: str
    uid: str
    outputs: list
    samples: list[GroupContext]  # the client's per-sample bookkeeping

    @property
    def aborted(self) -> bool:
        return any(s.aborted for s in self.samples)

    @property
    def completed(self) -> bool:
        return not self.aborted and all(o.stop_reason == "completed" for o in self.outputs)


@dataclass
class StepRun:
    plan: object
    outcome: object
    tail: dict[str, GroupRun]
    bulk: dict[str, GroupRun]
    aborted_request_ids: list[str]
    servers: dict[str, list[str]]  # group uid → replica addresses that served its samples


class Harness:
    """One synchronous TailSieve step at a time over the tail and bulk replicas."""

    def __init__(self, cfg, replicas):
        self.tail_replica, self.bulk_replica = replicas
        servers = {r.server_address: r.server_handle for r in replicas}
        self.router = ray.remote(PoolRouter).remote(servers, {})
        ray.get(self.router.set_pools.remote([self.tail_replica.server_address]))
        self.client = GroupTaggedClient(cfg, load_balancer_handle=self.router)
        self.speculation: dict[str, SpecCounters] = {}  # per replica address, over the steps measured

    async def run_sample(self, prompt_id: str, uid: str, k: int) -> tuple[object, GroupContext]:
        sample = GroupContext(uid=uid)
        token = _SAMPLE.set(sample)  # as TailSieveAgentLoop does around each sample
        try:
            length = forced_length(prompt_id)
            params = {"max_tokens": length, "min_tokens": length, "ignore_eos": True, "temperature": 1.0}
            output = await self.client.generate(f"{uid}-{k}", prompt_ids=prompt_ids(prompt_id), sampling_params=params)
        finally:
            _SAMPLE.reset(token)
        return output, sample

    async def run_group(self, prompt_id: str, uid: str) -> GroupRun:
        results = await asyncio.gather(*(self.run_sample(prompt_id, uid, k) for k in range(N_SAMPLES)))
        return GroupRun(prompt_id, uid, [o for o, _ in results], [s for _, s in results])

    async def step(self, selector: TailSelector, q: int, fresh_ids: list[str]) -> StepRun:
        plan = selector.plan_step(q)
        assert len(fresh_ids) == plan.n_fresh
        uid = {pid: f"s{plan.step}-{pid}" for pid in (*plan.tail_ids, *fresh_ids)}
        await self.router.assign_groups.remote({**{uid[p]: Pool.TAIL for p in plan.tail_ids},
                                                **{uid[p]: Pool.BULK for p in fresh_ids}})
        tail_tasks = [asyncio.ensure_future(self.run_group(p, uid[p])) for p in plan.tail_ids]
        bulk_tasks = [asyncio.ensure_future(self.run_group(p, uid[p])) for p in fresh_ids]
        finished: list[str] = []
        aborted_ids: list[str] = []
        for next_done in asyncio.as_completed(bulk_tasks):
            run = await next_done
            if not run.completed:
                continue
            finished.append(run.prompt_id)
            if len(finished) == plan.fresh_quota and plan.n_abort:
                # The cutoff: the fresh quota is done; abort the bulk groups still running, those only.
                running = [uid[p] for p in fresh_ids if p not in finished]
                result = await self.bulk_replica.server_handle.abort_groups.remote(running)
                aborted_ids = list(result["request_ids"])
                break
        bulk = {r.prompt_id: r for r in await asyncio.gather(*bulk_tasks)}
        tail = {r.prompt_id: r for r in await asyncio.gather(*tail_tasks)}
        scores = {pid: sum(len(o.token_ids) for o in run.outputs) for pid, run in bulk.items() if not run.completed}
        outcome = selector.finish_step(plan, fresh_ids, finished[:plan.bulk_quota], policy_version=plan.step,
                                       scores=scores)  # abort score: tokens generated by the abort
        servers = await self.router.group_servers.remote(list(uid.values()))
        return StepRun(plan, outcome, tail, bulk, aborted_ids, servers)

    async def weight_sync_point(self) -> None:
        """The engine calls of verl's weight update (abort + resume) without changing weights."""
        await asyncio.gather(*(r.abort_all_requests() for r in (self.tail_replica, self.bulk_replica)))
        await asyncio.gather(*(r.resume_generation() for r in (self.tail_replica, self.bulk_replica)))

    def spec_counters(self) -> dict[str, SpecCounters]:
        """Each replica's speculation counters, read from its own ``/metrics``, by address."""
        return {r.server_address: SpecCounters.from_metrics(parse_metrics(
            OpenAIServer(f"http://{r.server_address}").metrics_text())) for r in (self.tail_replica, self.bulk_replica)}


@pytest.fixture(scope="module")
def two_steps(verl_cfg, replicas):
    """Two TailSieve steps; each replica's speculation counters over them ride along on the harness."""
    harness = Harness(verl_cfg, replicas)
    selector = TailSelector(batch_size=4)

    async def run():
        first = await harness.step(selector, q=2, fresh_ids=["p0", "p1", "p2", "p3", "p4", "p5"])
        await harness.weight_sync_point()
        second = await harness.step(selector, q=2, fresh_ids=["p6", "p7", "p8", "p9"])
        return first, second

    before = harness.spec_counters()
    steps = asyncio.run(run())
    after = harness.spec_counters()
    harness.speculation = {address: after[address] - before[address] for address in after}
    return harness, steps


def test_bulk_groups_unfinished_at_the_cutoff_are_aborted_and_carried(two_steps):
    harness, (first, _) = two_steps
    assert first.plan.tail_ids == () and first.plan.bulk_quota == 4 and first.plan.n_abort == 2
    assert set(first.outcome.carried_ids) == {"p1", "p4"}
    for pid in ("p1", "p4"):
        run = first.bulk[pid]
        assert all(s.aborted for s in run.samples) and not run.completed
        assert all(o.stop_reason == "aborted" and len(o.token_ids) < LONG for o in run.outputs)
    assert len(first.aborted_request_ids) == 2 * N_SAMPLES  # only the unfinished groups' requests
    generated = [sum(len(o.token_ids) for o in first.bulk[pid].outputs) for pid in first.outcome.carried_ids]
    assert generated == sorted(generated, reverse=True) and generated[-1] > 0  # candidates ranked by abort score


def test_only_finished_groups_are_consumed_never_an_aborted_trajectory(two_steps):
    _, steps = two_steps
    for step in steps:
        assert len(step.outcome.consumed) == 4  # exactly B groups per step
        runs = {**step.bulk, **step.tail}
        for consumed in step.outcome.consumed:
            run = runs[consumed.prompt_id]
            assert run.completed
            assert all(len(o.token_ids) == forced_length(run.prompt_id) for o in run.outputs)
            assert consumed.policy_version == step.plan.step
        assert not set(step.outcome.consumed_ids) & set(step.outcome.carried_ids)
    consumed_everywhere = [pid for step in steps for pid in step.outcome.consumed_ids]
    assert len(consumed_everywhere) == len(set(consumed_everywhere))  # each prompt consumed once


def test_carried_groups_regenerate_from_scratch_on_the_tail_pool(two_steps):
    harness, (first, second) = two_steps
    assert set(second.plan.tail_ids) == {"p1", "p4"} and second.plan.n_fresh == 4
    tail_address = harness.tail_replica.server_address
    for pid in ("p1", "p4"):
        run = second.tail[pid]
        assert run.completed
        # the whole forced length, generated anew (the aborted attempt had produced a prefix)
        assert all(len(o.token_ids) == LONG for o in run.outputs)
        # no prompt KV carried over: the first sample of the group prefilled from scratch
        assert min(o.extra_fields["num_cached_tokens"] for o in run.outputs) == 0
        assert second.servers[run.uid] == [tail_address]
        assert tail_address not in first.servers[first.bulk[pid].uid]
    consumed_routes = {c.prompt_id: c.route for c in second.outcome.consumed}
    assert consumed_routes == {"p1": Pool.TAIL, "p4": Pool.TAIL, "p6": Pool.BULK, "p9": Pool.BULK}
    assert set(second.outcome.carried_ids) == {"p7", "p8"}


def test_samples_stay_within_their_pool(two_steps):
    harness, steps = two_steps
    tail, bulk = harness.tail_replica.server_address, harness.bulk_replica.server_address
    for step in steps:
        for run in step.tail.values():
            assert step.servers[run.uid] == [tail]
        for run in step.bulk.values():
            assert step.servers[run.uid] == [bulk]


def test_the_tail_replica_speculates_on_the_carried_groups_and_the_bulk_replica_never_drafts(two_steps):
    """Per-pool engine settings on real engines: over the two steps the tail replica, which served the
    carried groups and nothing else, drafted k = 2 tokens per verify step and had some accepted (the model
    drafts for itself); the bulk replica, which served every fresh group, drafted nothing."""
    harness, steps = two_steps
    tail, bulk = harness.tail_replica.server_address, harness.bulk_replica.server_address
    served = {tail: [], bulk: []}
    for step in steps:
        for run in (*step.tail.values(), *step.bulk.values()):
            for address in step.servers[run.uid]:
                served[address].append(f"s{step.plan.step}:{run.prompt_id}")
    for name, address in (("tail", tail), ("bulk", bulk)):
        spec = harness.speculation[address]
        print(f"\n[vllm] {name} replica {address}: drafts={spec.drafts:.0f} draft_tokens={spec.draft_tokens:.0f} "
              f"accepted={spec.accepted:.0f} per_position={[round(a) for a in spec.accepted_per_pos]} "
              f"groups served={served[address]}")
    carried = [f"s{steps[1].plan.step}:{pid}" for pid in steps[1].plan.tail_ids]
    assert len(carried) == 2 and sorted(served[tail]) == sorted(carried)  # the carried groups, there only
    spec = harness.speculation[tail]
    assert spec.drafts > 0 and spec.draft_tokens == 2 * spec.drafts and spec.accepted > 0
    assert len(spec.accepted_per_pos) == 2 and sum(spec.accepted_per_pos) == spec.accepted
    assert harness.speculation[bulk] == SpecCounters()  # no speculation counter moved: no drafter there


def test_calibrate_against_the_replicas_openai_endpoint(replicas, tmp_path):
    server = OpenAIServer(f"http://{replicas[0].server_address}")
    plan = SweepPlan(batches=(1, 8), prompt_lens=(16,), decode_short=8, decode_long=40, repeats=1)
    doc = calibrate(server, plan, device="tier")
    cal = write_calibration(doc, tmp_path / "cal.json")
    assert [r["batch"] for r in doc["rows"]] == [1, 8]
    assert all(r["step_ms"] > 0 for r in doc["rows"])
    assert TablePerf(cal).step_time(4, 40.0) > 0


def test_bench_runs_every_policy_on_the_real_servers(replicas, tmp_path):
    servers = [OpenAIServer(f"http://{r.server_address}") for r in replicas]
    groups = [Group(f"g{i}", (forced_length(f"p{i}") // 4,) * 2, prompt_len=8) for i in range(6)]
    perf = TablePerf(write_calibration(
        {"device": "tier", "rows": [{"model": servers[0].model, "batch": b, "context": 20, "step_ms": 5 + b}
                                    for b in (1, 4, 16)]}, tmp_path / "cal.json"))
    report = bench(groups, servers, 2, perf, repeats=1, oracle_time_limit_s=2.0)
    assert [row["policy"] for row in report["policies"]] == ["verl", "uniform", "tailsieve", "oracle"]
    assert report["replicas_per_server_run"] == "concurrent"
    assert all(row["measured_makespan_s"] > 0 for row in report["policies"])


def test_closed_loop_runs_stock_verl_and_tailsieve_on_the_real_servers(replicas, tmp_path):
    """`tailsieve closed-loop`'s loop on verl's vLLM servers: measured finish times drive the cutoff,
    the carried groups and the controller; every step has a prediction next to it; nothing lost."""
    from tailsieve_verl.core.simulation.sim import SimConfig
    from tailsieve_verl.core.data.workload import PromptPool, get_preset
    from tailsieve_verl.tools.closed_loop import closed_loop

    servers = [OpenAIServer(f"http://{r.server_address}") for r in replicas]
    perf = TablePerf(write_calibration(
        {"device": "tier", "rows": [{"model": servers[0].model, "batch": b, "context": 20, "step_ms": 5 + b}
                                    for b in (1, 4, 16)]}, tmp_path / "cal.json"))
    cfg = SimConfig(steps=3, n_replicas=2, batch_size=4, n=2, seed=1, policies=("verl", "tailsieve"))
    pool = PromptPool(get_preset("strong", median_len=8, max_response_length=64, prompt_len=8), 8, seed=1)
    report = closed_loop(cfg, pool, servers, perf)
    assert [(r["policy"], r["step"]) for r in report["steps"]] == [(p, s) for p in cfg.policies for s in range(3)]
    assert all(r["measured_makespan_s"] > 0 and r["predicted_makespan_s"] > 0 for r in report["steps"])
    assert all(s["lost"] == s["duplicated"] == 0 for s in report["policies"].values())
    assert report["measured_speedup"] > 0 and report["median_prediction_error"] >= 0


def test_abort_groups_stops_one_group_while_another_runs_on(verl_cfg, replicas):
    """Per-group abort on a real engine: one long group is aborted mid-decode (partial tokens), a
    later request of it comes back aborted at once, while another long group on the same replica
    runs to its full length and a new group runs after: nothing paused, nothing parked."""
    harness = Harness(verl_cfg, replicas)
    server = harness.bulk_replica.server_handle

    async def run():
        await harness.router.assign_groups.remote({"ga": Pool.BULK, "gb": Pool.BULK, "gc": Pool.BULK})
        before = (await server.progress.remote())["tokens"]  # the replica served earlier tests
        doomed = asyncio.ensure_future(harness.run_group("p1", "ga"))
        survivor = asyncio.ensure_future(harness.run_group("p4", "gb"))
        while True:  # both groups' requests in the engine and decoding
            progress = await server.progress.remote()
            if progress["in_flight"] == 2 * N_SAMPLES and progress["tokens"] >= before + 8 * 2 * N_SAMPLES:
                break
            await asyncio.sleep(0.05)
        result = await server.abort_groups.remote(["ga"])
        aborted = await doomed
        started = time.monotonic()
        late, _ = await harness.run_sample("p1", "ga", N_SAMPLES)  # e.g. a next turn of the aborted group
        late_s = time.monotonic() - started
        finished = await survivor
        after = await harness.run_group("p0", "gc")
        return result, aborted, late, late_s, finished, after, await server.check_engine.remote()

    result, aborted, late, late_s, finished, after, healthy = asyncio.run(run())
    assert result["aborted_count"] == N_SAMPLES
    assert all(rid.startswith("ts:ga:") for rid in result["request_ids"])  # matched by the tag, vLLM ids unseen
    assert all(s.aborted for s in aborted.samples)
    assert all(o.stop_reason == "aborted" and 0 < len(o.token_ids) < LONG for o in aborted.outputs)  # partial
    assert late.stop_reason == "aborted" and late.token_ids == [] and late_s < 2.0
    assert finished.completed and all(len(o.token_ids) == LONG for o in finished.outputs)
    assert after.completed and all(len(o.token_ids) == SHORT for o in after.outputs)
    assert healthy
