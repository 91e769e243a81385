"""One replica under vLLM v1's scheduler (``vllm/v1/core/sched/scheduler.py``), in the engine model's
first-order terms (:mod:`core.engine`).

Each step, as vLLM does it: running requests first, in admission order — a decoding request asks
for ``1 + k`` tokens of the step's budget and KV slots for ``prompt + generated + k`` tokens (a new
block every ``block_size`` tokens); a request still prefilling asks for its next chunk. When the
free blocks do not cover a request, the most recently admitted running request is preempted
(recompute: its blocks are freed and it goes back to the front of the waiting queue) until the
request fits or is itself the one preempted. Then, unless something was preempted, waiting requests
are admitted FCFS while the running count is below ``max_num_seqs``, budget is left and the free
blocks hold the whole sequence (prompt, plus the generated tokens of a preempted request, all
prefilled again; a group's shared prompt blocks are a prefix-cache hit while a sibling holds them).
A request whose prefill completes emits its first token in that step; a decoding request emits
``1 + Σᵢ Πⱼ≤ᵢ αⱼ`` tokens (speculation's expectation, 1 without it), with k looked up from the
number of requests the previous step scheduled (vLLM's dynamic SD drafts for the next step).

Scheduling is step-based, never time-based, so the run records per step what the cost model needs
(requests emitting a token, their context sum, verify query tokens, k, prefilled tokens) and prices
every step in one vectorised call at the end. Only steps around events are walked one at a time:
stretches where every running request decodes and nothing can be admitted (up to a finish, or
through finishes when nobody waits) and stretches where only ``max_num_seqs`` binds (each finish
refilled FIFO at the next step, checked against the token budget and the KV blocks step by step)
are advanced at once. ``tests/core/test_engine_spans.py`` checks both against the step-by-step walk.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np

from .engine import EngineConfig, EngineConfigError, EngineEvents, ReplicaRun, TokenProgress
from .perf import PerfModel


class _Steps:
    """Per-step records (requests emitting a token, their context sum, verify query tokens, k,
    prefilled tokens), appended one step or one span at a time."""

    def __init__(self) -> None:
        self.chunks: list[tuple[np.ndarray, ...]] = []
        self.single: list[tuple[float, float, float, float, float]] = []

    def add(self, emitting: int, ctx_sum: float, query: int, k: int, prefill: int) -> None:
        self.single.append((emitting, ctx_sum, query, k, prefill))

    def add_span(self, emitting: np.ndarray, ctx_sums: np.ndarray, k: int, query: np.ndarray | None = None,
                 prefill: np.ndarray | None = None) -> None:
        self._flush()
        n = len(ctx_sums)
        self.chunks.append((emitting, ctx_sums, emitting * (1 + k) if query is None else query,
                            np.full(n, float(k)), np.zeros(n) if prefill is None else prefill))

    def _flush(self) -> None:
        if self.single:
            self.chunks.append(tuple(np.asarray(col, dtype=float) for col in zip(*self.single)))
            self.single = []

    def columns(self) -> tuple[np.ndarray, ...]:
        self._flush()
        if not self.chunks:
            return tuple(np.zeros(0) for _ in range(5))
        return tuple(np.concatenate(col) for col in zip(*self.chunks))


def steps_to_finish(left, rate):
    """Decode steps that bring ``left`` tokens at ``rate`` per step (fractional under speculation):
    one rule for the walk and the spans, tolerant of rounding in the accumulated expectation. Two
    Python numbers give an int (the same float arithmetic, without numpy's per-call cost)."""
    if isinstance(left, float) and isinstance(rate, float):
        return math.ceil(left / rate - 1e-9)
    return np.ceil(np.asarray(left) / rate - 1e-9)


def step_seconds(perf: PerfModel, cfg: EngineConfig, emitting, ctx_sum, query, k, prefill) -> np.ndarray:
    """Price of each step: ``T(b, c)`` for b requests emitting a token at mean context c; with k
    draft tokens ``T(query, 0) + [T(b, c) − T(b, 0)]`` (weights at every query token, KV read once
    per request) or, given a measured verify table, ``T(b, c)`` times its verify/decode ratio at the
    step's mean depth ``query / b − 1``; plus ``k · draft_cost · T(b, c)``; plus
    ``prefill_s_per_token`` per prefilled token."""
    mean_ctx = np.divide(ctx_sum, emitting, out=np.zeros(len(emitting)), where=emitting > 0)
    step = np.asarray(perf.step_time(emitting, mean_ctx), dtype=float)
    spec = cfg.speculative
    if spec is not None and np.any(k > 0):
        m = k > 0
        if spec.verify_table is not None:
            depth = np.divide(query[m], emitting[m], out=np.ones(int(m.sum())), where=emitting[m] > 0) - 1
            verify = step[m] * spec.verify_table.ratio(emitting[m], mean_ctx[m], depth)
        else:
            zero = np.zeros(int(m.sum()))
            verify = (np.asarray(perf.step_time(query[m], zero), dtype=float) + step[m]
                      - np.asarray(perf.step_time(emitting[m], zero), dtype=float))
        step[m] = verify + spec.draft_cost * k[m] * step[m]
    if cfg.prefill_s_per_token > 0:
        step = step + cfg.prefill_s_per_token * prefill
    return step


class ReplicaScheduler:
    """The run of one replica's requests (input order = arrival order); see the module docstring."""

    def __init__(self, lengths: np.ndarray, prompts: np.ndarray, groups: np.ndarray | None, cfg: EngineConfig):
        self.cfg = cfg
        n = self.n = len(lengths)
        self.L = lengths.astype(float)
        self.P = prompts.astype(np.int64)
        self.bs = cfg.block_size
        self.cap = n + 1 if cfg.max_num_seqs is None else cfg.max_num_seqs
        self.budget = np.inf if cfg.max_num_batched_tokens is None else cfg.max_num_batched_tokens
        self.capacity = cfg.num_gpu_blocks
        self.spec = cfg.speculative
        self.k_max = self.spec.num_speculative_tokens if self.spec else 0
        if groups is not None and cfg.enable_prefix_caching:
            _, self.gid = np.unique(np.asarray(groups), return_inverse=True)
            self.hit_blocks = np.maximum(self.P - 1, 0) // self.bs  # vLLM recomputes at least the last prompt token
        else:
            self.gid = np.arange(n)
            self.hit_blocks = np.zeros(n, dtype=np.int64)
        self.refs = np.zeros(int(self.gid.max(initial=-1)) + 1, dtype=np.int64)
        self._check_fits()
        self.g = np.zeros(n)  # tokens generated (an expectation under speculation)
        # the context at which a residency's acceptance is read: midway between admission and the end
        # (first order in the decay; one value per residency keeps the spans exact)
        self.ctx_mid = self.P + self.L / 2
        self.computed = np.zeros(n, dtype=np.int64)  # prefill progress of the current admission
        self.target = np.zeros(n, dtype=np.int64)
        self.held = np.zeros(n, dtype=np.int64)  # private blocks (shared prompt blocks are counted per group)
        self.used = 0
        self.prefilling = np.zeros(n, dtype=bool)
        self.n_prefilling = 0
        self.run = np.zeros(0, dtype=np.int64)  # running requests, admission order
        self.waiting = deque(range(n))
        self.first_admit = np.full(n, -1, dtype=np.int64)
        self.finish_idx = np.full(n, -1, dtype=np.int64)  # clock index of each finish
        self.wait_from = np.zeros(n, dtype=np.int64)
        self.waits: list[tuple[int, int]] = []  # (from, to) clock indices of every wait for admission
        self.knots: list[tuple[int, int, float]] = []
        self.steps = _Steps()
        self.step = 0
        self.unfinished = n
        self.last_scheduled = 0  # requests scheduled in the previous step: picks this step's k (vLLM dynamic SD)
        self.preemptions = self.recomputed = self.prefilled = 0
        self.drafted = self.accepted = 0.0

    def _check_fits(self) -> None:
        total = self.P + self.L.astype(np.int64)
        if not self.n:
            return
        if self.capacity is not None:
            need = -(-(total + self.k_max) // self.bs)
            worst = int(np.argmax(need))
            if need[worst] > self.capacity:
                raise EngineConfigError(
                    f"a request of {int(total[worst])} tokens needs {int(need[worst])} KV blocks but the replica has "
                    f"{self.capacity} (num_gpu_blocks); raise num_gpu_blocks or shorten the responses")
        longest = int((self.P + np.maximum(self.L.astype(np.int64) - 1, 0)).max())  # a recompute's prefill
        if not self.cfg.enable_chunked_prefill and longest > self.budget:
            raise EngineConfigError(f"with chunked prefill off, a prefill of up to {longest} tokens (prompt + "
                                    f"tokens generated before a preemption) needs max_num_batched_tokens >= {longest} "
                                    f"(got {int(self.budget)}); enable chunked prefill or raise the budget")

    # ------------------------------------------------------------------ blocks

    def _blocks(self, i: int, tokens: float) -> int:
        """Private blocks request i holds for ``tokens`` tokens (its group's prompt blocks apart)."""
        return max(math.ceil(tokens / self.bs) - int(self.hit_blocks[i]), 0)

    def _blocks_of(self, run: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        return np.maximum(np.ceil(tokens / self.bs).astype(np.int64) - self.hit_blocks[run], 0)

    def _k(self, running: int) -> int:
        return self.spec.k_for_batch(running) if self.spec else 0

    def _release(self, i: int) -> None:
        """Free a request's blocks (finish or preemption); the group's prompt blocks go with its last holder."""
        gid = self.gid[i]
        self.refs[gid] -= 1
        if self.capacity is not None:
            self.used -= int(self.held[i]) + (int(self.hit_blocks[i]) if self.refs[gid] == 0 else 0)
            self.held[i] = 0

    def _release_all(self, finished: np.ndarray) -> None:
        """:meth:`_release` of several requests at once (a group's members share one prompt length,
        so which member frees the prompt blocks does not matter)."""
        gids = self.gid[finished]
        np.subtract.at(self.refs, gids, 1)
        if self.capacity is not None:
            groups, first = np.unique(gids, return_index=True)
            emptied = self.refs[groups] == 0
            self.used -= int(self.held[finished].sum()) + int(self.hit_blocks[finished[first[emptied]]].sum())
            self.held[finished] = 0

    # ------------------------------------------------------------------ the run

    def run_to_end(self, perf: PerfModel) -> ReplicaRun:
        while self.unfinished:
            if self._refill_span():
                continue
            plan = self._quiet_span()
            if plan is None:
                self._event_step()
                continue
            *span, short = plan
            self._advance(*span)
            if short:  # cut where the blocks may run out: that step needs the scheduler
                self._event_step()
        emitting, ctx_sum, query, k, prefill = self.steps.columns()
        step = step_seconds(perf, self.cfg, emitting, ctx_sum, query, k, prefill)
        clock = np.concatenate([[0.0], np.cumsum(step)])
        waits = np.array([clock[b] - clock[a] for a, b in self.waits]) if self.waits else np.zeros(1)
        events = EngineEvents(steps=len(step), preemptions=self.preemptions, queue_wait_s=float(waits.sum()),
                              max_queue_wait_s=float(waits.max()), tokens_recomputed=self.recomputed,
                              prefill_tokens=self.prefilled, spec_draft_tokens=self.drafted,
                              spec_accepted_tokens=self.accepted)
        knots = np.array(sorted(self.knots), dtype=float).reshape(-1, 3)
        progress = TokenProgress(clock, knots[:, 0].astype(np.int64), knots[:, 1].astype(np.int64), knots[:, 2],
                                 self.L.astype(np.int64))
        return ReplicaRun(float(clock[-1]), clock[self.finish_idx], len(step), clock[self.first_admit], events,
                          progress)

    def _head_admissible(self, b: int, k: int) -> bool:
        """Could the waiting head be admitted at the next step (judged before that step's
        allocations, so a yes may be wrong — costing one walked step — but a no is right)?"""
        left = self.budget - b * (1 + k)
        if b >= self.cap or left <= 0:
            return False
        i = self.waiting[0]
        if self.L[i] == 0:
            return True
        tokens = int(self.P[i]) + int(self.g[i])
        shared = self.refs[self.gid[i]] > 0
        if not self.cfg.enable_chunked_prefill and tokens - (int(self.hit_blocks[i]) * self.bs if shared else 0) > left:
            return False
        if self.capacity is None:
            return True
        gate = self._blocks(i, tokens) + (0 if shared else int(self.hit_blocks[i]))
        return gate <= self.capacity - self.used

    def _quiet_span(self):
        """Steps from now in which every running request decodes and nothing is admitted or
        preempted, as ``(span, k, tokens per step, steps to finish, blocks may run out next)``; None
        when the next step needs the scheduler. With requests waiting the span ends at the first finish (a slot or blocks
        may free); with none it runs through finishes while k (by batch size) stays."""
        run = self.run
        b = len(run)
        if not b or self.n_prefilling:
            return None
        k = self._k(self.last_scheduled)
        if b * (1 + k) > self.budget or (self.waiting and self._head_admissible(b, k)):
            return None
        g = self.g[run]
        left = self.L[run] - g
        e = self.spec.tokens_per_step(k, self.ctx_mid[run]) if k else np.ones(b)
        to_finish = steps_to_finish(left, e)
        span = int(to_finish.min() if self.waiting else to_finish.max())
        if self.spec is not None and self.spec.schedule:
            span = self._span_keeping_k(to_finish, k, span)
        short = False
        if self.capacity is not None:
            room = self._steps_with_blocks(run, g, e, k, span)
            span, short = min(span, room), room < span
        return (span, k, e, to_finish, short) if span else None

    def _refill_span(self) -> bool:
        """Advance through a stretch where only ``max_num_seqs`` binds: the batch stays full, each
        finish frees a slot that the next waiting request takes at the following step, its prefill
        done within that step (the closed form's FIFO refill). Admissions are played out with a heap,
        then the stretch is cut at the first step whose token budget or KV blocks would not hold it
        (the scheduler walks from there). False when no step qualifies. The play-out goes in doubling
        chunks of the queue, each checked against the limits up to the next admission: a stretch cut
        early by the KV blocks does not play out the whole queue (the result is the same: the steps
        before the next admission depend only on the admissions played out)."""
        run, b = self.run, len(self.run)
        if not self.waiting or b != self.cap or self.n_prefilling:
            return False
        k = self._k(self.last_scheduled)
        if b * (1 + k) > self.budget or self._k(b) != k:
            return False
        step0 = self.step
        g_run = self.g[run]
        e_run = self.spec.tokens_per_step(k, self.ctx_mid[run]) if k else np.ones(b)
        to_finish = steps_to_finish(self.L[run] - g_run, e_run)
        f_run = step0 + to_finish.astype(np.int64)
        heap = f_run.tolist()
        heapq.heapify(heap)
        holding_end: dict[int, int] = {}  # a group's prompt blocks are held until this clock index
        for i, f in zip(run.tolist(), f_run.tolist()):
            gid = int(self.gid[i])
            holding_end[gid] = max(holding_end.get(gid, step0), f)
        new: list[tuple[int, int, int, float, int, bool]] = []  # (request, admitted at, done at, e, prefill, hit)
        zero: list[tuple[int, int]] = []  # (request, clock index) of zero-length requests, done on admission
        waiting = list(self.waiting)
        pos, chunk = 0, 16
        while True:
            pos, stop = self._refill_chunk(heap, holding_end, new, zero, waiting, pos, pos + chunk, k)
            played_out = stop is None
            stop = heap[0] if played_out else stop  # played out: the first finish the queue does not refill
            cut = min(stop, self._refill_budget_limit(b, k, new, stop))
            if self.capacity is not None:
                cut = self._refill_block_limit(k, step0, cut, e_run, f_run, new)
            if cut < stop or played_out:
                stop = cut
                break
            chunk *= 2
        if stop <= step0:
            return False
        self._apply_refill(k, step0, stop, e_run, f_run, [x for x in new if x[1] < stop],
                           [x for x in zero if x[1] < stop])
        return True

    def _refill_chunk(self, heap: list, holding_end: dict, new: list, zero: list, waiting: list, pos: int,
                      until: int, k: int) -> tuple[int, int | None]:
        """Play out the refill admissions of ``waiting[pos:until]`` (see :meth:`_refill_span`): the next
        position in the queue and the clock index of its admission, None once the queue ran out (the
        heap then holds the finishes)."""
        # without speculation, or without an acceptance decay, every request gains the same tokens per
        # step: price it once (None: per request, at its mid-way context)
        if not k:
            flat = 1.0
        elif self.spec.acceptance_half_life is None:
            flat = float(self.spec.tokens_per_step(k, 0.0))
        else:
            flat = None
        while pos < len(waiting):
            if pos >= until:
                return pos, heap[0]
            free_at = heapq.heappop(heap)
            while pos < len(waiting) and self.L[waiting[pos]] == 0:
                zero.append((waiting[pos], free_at))
                pos += 1
            if pos == len(waiting):
                heapq.heappush(heap, free_at)  # a slot nobody takes: the batch shrinks here
                return pos, None
            j = waiting[pos]
            pos += 1
            gid, g0, length, prompt = int(self.gid[j]), float(self.g[j]), float(self.L[j]), int(self.P[j])
            hit = holding_end.get(gid, -1) > free_at  # a sibling still running holds the prompt's blocks
            mid = prompt + (g0 + length) / 2
            self.ctx_mid[j] = mid
            e_j = flat if flat is not None else float(self.spec.tokens_per_step(k, mid))
            end = free_at + 1 + steps_to_finish(length - g0 - 1, e_j)  # after the prefill step's token
            holding_end[gid] = max(holding_end.get(gid, -1), end)
            new.append((j, free_at, end, e_j, prompt + int(g0) - (int(self.hit_blocks[j]) * self.bs if hit else 0),
                        hit))
            heapq.heappush(heap, end)
        return pos, None

    def _refill_budget_limit(self, b: int, k: int, new: list, stop: int) -> int:
        """The first admission step whose decodes and whole prefills exceed the token budget."""
        if not new or self.budget == np.inf:
            return stop
        at = np.array([x[1] for x in new])
        tokens = np.array([x[4] for x in new], dtype=float)
        steps, first = np.unique(at, return_index=True)
        admitted = np.diff(np.append(first, len(at)))
        total = (b - admitted) * (1 + k) + np.add.reduceat(tokens, first)
        over = np.flatnonzero(total > self.budget)
        return int(steps[over[0]]) if len(over) else stop

    def _refill_block_limit(self, k: int, step0: int, stop: int, e_run: np.ndarray, f_run: np.ndarray,
                            new: list) -> int:
        """The first step of [step0, stop) whose KV blocks (the running requests' growth, the new ones'
        prefill and growth, each group's shared prompt held while a member runs) exceed the capacity."""
        new = [x for x in new if x[1] < stop]
        run = self.run
        bs = self.bs
        idx = np.concatenate([run, np.array([x[0] for x in new], dtype=np.int64)])
        start = np.concatenate([np.full(len(run), step0), np.array([x[1] for x in new], dtype=np.int64)])
        end = np.minimum(np.concatenate([f_run, np.array([x[2] for x in new], dtype=np.int64)]), stop)
        rate = np.concatenate([e_run, np.array([x[3] for x in new])])
        g0 = self.g[idx]
        # tokens needing slots at step s: P + g + k at the start step, then + rate per step (a new
        # request's prefill step emits one token, its decode steps ``rate``; rate >= 1 keeps it linear-or-above)
        first_tokens = self.P[idx] + g0 + k
        is_new = np.arange(len(idx)) >= len(run)
        lin0 = np.where(is_new, first_tokens + 1 - rate, first_tokens)  # the linear part, extrapolated to start
        tokens_at = lambda s: np.where(s == start, first_tokens, lin0 + (s - start) * rate)  # noqa: E731
        blocks_first = np.ceil(first_tokens / bs).astype(np.int64)
        blocks_last = np.ceil(tokens_at(end - 1) / bs).astype(np.int64)
        hb = self.hit_blocks[idx]
        span = stop - step0
        diff = np.zeros(span + 1)
        np.add.at(diff, start - step0, blocks_first - hb)
        np.add.at(diff, end - step0, -(blocks_last - hb))
        grow = blocks_last - blocks_first  # one step per block boundary crossed on the linear part
        if grow.sum():
            owner = np.repeat(np.arange(len(idx)), grow)
            nth = np.arange(int(grow.sum())) - np.repeat(np.cumsum(grow) - grow, grow)
            boundary = (blocks_first[owner] + nth) * bs  # the step's tokens exceed this
            at = start[owner] + np.floor((boundary - lin0[owner]) / rate[owner]).astype(np.int64) + 1
            np.add.at(diff, np.maximum(at, start[owner] + 1) - step0, 1.0)
        # group prompt blocks: held from a holding's first member to its last member's end (a group's
        # members, by start, form one holding while each starts before the ends so far)
        order = np.lexsort((start, self.gid[idx]))
        blocks = self.hit_blocks[idx][order]
        shared = blocks > 0  # a group's members share one prompt length, hence one block count
        gids, starts, ends, blocks = self.gid[idx][order][shared], start[order][shared], end[order][shared], blocks[shared]
        if len(gids):
            new_group = np.concatenate([[True], gids[1:] != gids[:-1]])
            rank = np.cumsum(new_group) - 1
            offset = rank * (int(ends.max()) + 1)  # a running max per group, as one running max
            reach = np.maximum.accumulate(ends + offset) - offset
            opens = np.flatnonzero(new_group | np.concatenate([[True], starts[1:] >= reach[:-1]]))
            closes = np.concatenate([opens[1:] - 1, [len(gids) - 1]])
            np.add.at(diff, starts[opens] - step0, blocks[opens])
            np.add.at(diff, reach[closes] - step0, -blocks[opens])
        over = np.flatnonzero(np.cumsum(diff)[:span] > self.capacity)
        return step0 + int(over[0]) if len(over) else stop

    def _apply_refill(self, k: int, step0: int, stop: int, e_run: np.ndarray, f_run: np.ndarray, new: list,
                      zero: list) -> None:
        """Record the refill stretch's steps and bring every request's state to clock index ``stop``."""
        run = self.run
        span = stop - step0
        idx = np.concatenate([run, np.array([x[0] for x in new], dtype=np.int64)])
        start = np.concatenate([np.full(len(run), step0), np.array([x[1] for x in new], dtype=np.int64)])
        done_at = np.concatenate([f_run, np.array([x[2] for x in new], dtype=np.int64)])
        end = np.minimum(done_at, stop)
        rate = np.concatenate([e_run, np.array([x[3] for x in new])])
        g0 = self.g[idx].copy()
        is_new = np.arange(len(idx)) >= len(run)
        # context of a request at step s: P + g0 at its start step, then linear at ``rate`` (a new one
        # gains 1 in its prefill step): intercept + s·rate on the linear part, a point value at the start
        first_ctx = self.P[idx] + g0
        lin0 = np.where(is_new, first_ctx + 1 - rate, first_ctx) - start * rate
        rel_start, rel_end = start - step0, end - step0
        lin_from = rel_start + is_new  # a new request's prefill step is priced at its point value
        count = np.bincount(rel_start, minlength=span + 1) - np.bincount(rel_end, minlength=span + 1)
        icpt = (np.bincount(lin_from, weights=lin0, minlength=span + 1)
                - np.bincount(rel_end, weights=lin0, minlength=span + 1))
        slope = (np.bincount(lin_from, weights=rate, minlength=span + 1)
                 - np.bincount(rel_end, weights=rate, minlength=span + 1))
        point = np.bincount(rel_start[is_new], weights=first_ctx[is_new], minlength=span + 1)
        steps = np.arange(step0, stop, dtype=float)
        active = np.cumsum(count)[:span].astype(float)
        ctx = np.cumsum(icpt)[:span] + steps * np.cumsum(slope)[:span] + point[:span]
        admitted = np.bincount(rel_start[is_new], minlength=span + 1)[:span]
        prefill = np.bincount(rel_start[is_new], weights=np.array([x[4] for x in new], dtype=float),
                              minlength=span + 1)[:span]
        self.steps.add_span(active, ctx, k, query=active * (1 + k) - admitted * k, prefill=prefill)
        self.last_scheduled = int(active[-1])
        decode_steps = np.maximum(end - start - is_new, 0)
        left = self.L[idx] - g0 - is_new
        produced = np.minimum(decode_steps * rate, left)
        if k:
            self.drafted += float(k * decode_steps.sum())
            self.accepted += float((produced - decode_steps).sum())
        self.prefilled += int(prefill.sum())
        finished = done_at <= stop
        self.g[idx] = np.where(finished, self.L[idx], g0 + is_new + produced)
        # admissions, a prefix of the queue in FIFO order: leave it, join the batch after the running
        zero_at = dict(zero)
        for _ in range(len(new) + len(zero)):
            i = self.waiting.popleft()
            if i in zero_at:
                at = zero_at[i]
                self.first_admit[i] = self.finish_idx[i] = at
                self.waits.append((int(self.wait_from[i]), at))
                self.knots.append((i, at, 0.0))
                self.unfinished -= 1
        for pos, (j, at, _, _, tokens, _) in enumerate(new, start=len(run)):
            self.refs[self.gid[j]] += 1
            if self.first_admit[j] < 0:
                self.first_admit[j] = at
            else:
                self.recomputed += tokens
            self.waits.append((int(self.wait_from[j]), at))
            self.knots.append((j, at, float(g0[pos])))
            self.knots.append((j, at + 1, float(g0[pos] + 1)))
        self.run = idx
        if self.capacity is not None:
            last_tokens = np.where(end - 1 == start, self.P[idx] + g0 + k,
                                   self.P[idx] + g0 + is_new + (end - 1 - start - is_new) * rate + k)
            self.held[idx] = self._blocks_of(idx, last_tokens)
        self._finish(finished, done_at)
        self.step = stop
        if self.capacity is not None:
            groups = np.unique(self.gid[self.run])
            first_of = {int(self.gid[i]): int(i) for i in self.run.tolist()}
            self.used = int(self.held[self.run].sum()) + sum(int(self.hit_blocks[first_of[int(gid)]]) for gid in groups)

    def _span_keeping_k(self, to_finish: np.ndarray, k: int, span: int) -> int:
        """Steps whose k stays ``k``: step s + 1 drafts by the count scheduled at step s, which drops
        as requests finish (``span`` if k never changes)."""
        if self._k(len(to_finish)) != k:
            return 1
        ends = np.unique(to_finish)
        alive_after = len(to_finish) - np.searchsorted(np.sort(to_finish), ends, side="right")
        for end, alive in zip(ends, alive_after):
            if alive and self._k(int(alive)) != k:
                return min(int(end) + 1, span)
        return span

    def _steps_with_blocks(self, run: np.ndarray, g: np.ndarray, e: np.ndarray, k: int, span: int) -> int:
        """The first step s < span whose allocations might exceed the free blocks (``span`` if none):
        request i takes its j-th new block at the first s with ``P + g + s·rate + k > (held + j)·bs``,
        so with f blocks free the shortage comes at the (f + 1)-th smallest such step. Finishes inside
        the span are not credited, so the cut is safe and at most early."""
        free = self.capacity - self.used
        have = self.hit_blocks[run] + self.held[run]
        base = self.P[run] + g + k

        def taken_by(s: int) -> int:  # new blocks the running requests hold by step s
            return int(np.maximum(np.ceil((base + s * e) / self.bs) - have, 0).sum())

        if taken_by(span - 1) <= free:
            return span
        # the first few new blocks of every request usually hold the (f + 1)-th; a check says when not
        nth = np.arange(min(free // len(run) + 2, int(span * e.max()) // self.bs + 2))
        edge = (have[:, None] + nth) * self.bs - base[:, None]
        takes = np.maximum(np.floor(edge / e[:, None]).astype(np.int64) + 1, 0).ravel()
        first = int(np.partition(takes, free)[free])
        if first > 0 and taken_by(first - 1) > free:  # some request takes more blocks sooner
            lo, hi = 0, first - 1  # taken_by(hi) > free; the smallest such s
            while lo < hi:
                mid = (lo + hi) // 2
                if taken_by(mid) > free:
                    hi = mid
                else:
                    lo = mid + 1
            first = lo
        return min(span, first)

    def _advance(self, span: int, k: int, e: np.ndarray, to_finish: np.ndarray) -> None:
        """``span`` plain decode steps of the running set at once (requests may finish inside)."""
        run = self.run
        b = len(run)
        g, left = self.g[run], self.L[run] - self.g[run]
        ends = np.minimum(to_finish, span).astype(np.int64)  # steps each request runs in the span
        base = (self.P[run] + g).astype(float)
        if span <= ends.min():  # nobody leaves before the last step: a constant batch
            active = np.full(span, float(b))
            ctx = base.sum() + np.arange(span) * float(e.sum())
        else:  # active(s) and Σ context(s) over the requests alive at step s (to_finish > s)
            gone = np.cumsum(np.bincount(ends, minlength=span + 1))[:span]
            gone_base = np.cumsum(np.bincount(ends, weights=base, minlength=span + 1))[:span]
            gone_rate = np.cumsum(np.bincount(ends, weights=e, minlength=span + 1))[:span]
            active = (b - gone).astype(float)
            ctx = (base.sum() - gone_base) + np.arange(span) * (float(e.sum()) - gone_rate)
        self.steps.add_span(active, ctx, k)
        self.last_scheduled = int(active[-1])
        produced = np.minimum(ends * e, left)
        if k:
            self.drafted += float(k * active.sum())
            self.accepted += float((produced - ends).sum())
        if self.capacity is not None:
            grow = np.maximum(self._blocks_of(run, base + (ends - 1) * e + k) - self.held[run], 0)
            self.held[run] += grow
            self.used += int(grow.sum())
        done = to_finish <= span
        self.g[run] = np.where(done, self.L[run], g + produced)
        self._finish(done, self.step + ends)
        self.step += span

    def _finish(self, done: np.ndarray, at) -> None:
        """Release the running requests marked in ``done``; ``at``: the clock index of each finish."""
        if not done.any():
            return
        finished = self.run[done]
        at = at[done] if isinstance(at, np.ndarray) else np.full(len(finished), at, dtype=np.int64)
        self._release_all(finished)
        self.knots.extend(zip(finished.tolist(), at.tolist(), self.L[finished].tolist()))
        self.finish_idx[finished] = at
        self.run = self.run[~done]
        self.unfinished -= len(finished)

    def _preempt_newest(self) -> int:
        """vLLM's FCFS preemption: the most recently admitted running request goes back to the front
        of the waiting queue with its blocks freed (recompute mode)."""
        i = int(self.run[-1])
        self.run = self.run[:-1]
        self._release(i)
        if self.prefilling[i]:
            self.prefilling[i] = False
            self.n_prefilling -= 1
        self.computed[i] = 0
        self.waiting.appendleft(i)
        self.wait_from[i] = self.step
        self.preemptions += 1
        self.knots.append((i, self.step, float(self.g[i])))
        return i

    def _event_step(self) -> None:
        """One scheduler step walked request by request (admissions, chunks, preemptions)."""
        budget = self.budget
        run = self.run
        k = self._k(self.last_scheduled)
        chunks: list[tuple[int, int]] = []
        preempted = False
        extra = None
        if len(run) and self.capacity is not None and not self.n_prefilling:
            extra = np.maximum(self._blocks_of(run, self.P[run] + self.g[run] + k) - self.held[run], 0)
        if not len(run) or (not self.n_prefilling and len(run) * (1 + k) <= budget
                            and (extra is None or self.used + int(extra.sum()) <= self.capacity)):
            decoding = run  # the common case: every running request decodes and fits
            budget -= len(run) * (1 + k)
            if extra is not None:
                self.held[run] += extra
                self.used += int(extra.sum())
        else:
            scheduled: list[int] = []
            idx = 0
            while idx < len(self.run) and budget > 0:
                i = int(self.run[idx])
                if self.prefilling[i]:
                    new = int(min(self.target[i] - self.computed[i], budget))
                    tokens = self.computed[i] + new + k
                else:
                    new = int(min(1 + k, budget))
                    tokens = self.P[i] + self.g[i] + (new - 1)
                if self.capacity is not None:
                    more = max(self._blocks(i, tokens) - int(self.held[i]), 0)
                    while more > self.capacity - self.used:
                        preempted = True
                        if self._preempt_newest() == i:
                            break
                    if len(self.run) <= idx:  # the request itself was preempted
                        break
                    self.held[i] += more
                    self.used += more
                if self.prefilling[i]:
                    chunks.append((i, new))
                else:
                    scheduled.append(i)
                budget -= new
                idx += 1
            decoding = np.asarray(scheduled, dtype=np.int64)
        if not preempted:
            self._admit(budget, k, chunks)
        self._execute(decoding, chunks, k)

    def _admit(self, budget: float, k: int, chunks: list[tuple[int, int]]) -> None:
        """FCFS admission of waiting requests (``chunks`` receives their first prefill chunk)."""
        admitted: list[int] = []
        while self.waiting and budget > 0 and len(self.run) + len(admitted) < self.cap:
            i = self.waiting[0]
            if self.L[i] == 0:  # nothing to generate: done on admission, holds nothing
                self.waiting.popleft()
                self.first_admit[i] = self.finish_idx[i] = self.step
                self.waits.append((int(self.wait_from[i]), self.step))
                self.knots.append((i, self.step, 0.0))
                self.unfinished -= 1
                continue
            tokens = int(self.P[i]) + int(self.g[i])
            shared = bool(self.refs[self.gid[i]] > 0)
            hit = int(self.hit_blocks[i]) * self.bs if shared else 0
            new = tokens - hit
            if not self.cfg.enable_chunked_prefill and new > budget:
                break
            chunk = int(min(new, budget))
            if self.capacity is not None:
                gate = self._blocks(i, tokens) + (0 if shared else int(self.hit_blocks[i]))
                if gate > self.capacity - self.used:
                    break
                if not shared:
                    self.used += int(self.hit_blocks[i])
                self.held[i] = self._blocks(i, hit + chunk + k)
                self.used += int(self.held[i])
            self.waiting.popleft()
            admitted.append(i)
            self.refs[self.gid[i]] += 1
            self.computed[i], self.target[i] = hit, tokens
            self.ctx_mid[i] = self.P[i] + (self.g[i] + self.L[i]) / 2
            self.prefilling[i] = True
            self.n_prefilling += 1
            if self.first_admit[i] < 0:
                self.first_admit[i] = self.step
            else:
                self.recomputed += new
            self.waits.append((int(self.wait_from[i]), self.step))
            self.knots.append((i, self.step, float(self.g[i])))
            chunks.append((i, chunk))
            budget -= chunk
        if admitted:
            self.run = np.concatenate([self.run, np.asarray(admitted, dtype=np.int64)])

    def _execute(self, decoding: np.ndarray, chunks: list[tuple[int, int]], k: int) -> None:
        """Apply one step's work: tokens emitted, chunks prefilled, finished requests released."""
        emitting, ctx_sum, query, prefill = 0, 0.0, 0, 0
        if len(decoding):
            g = self.g[decoding]
            ctx_sum += float((self.P[decoding] + g).sum())
            emitting += len(decoding)
            query += len(decoding) * (1 + k)
            left = self.L[decoding] - g
            rate = self.spec.tokens_per_step(k, self.ctx_mid[decoding]) if k else np.ones(len(decoding))
            last = steps_to_finish(left, rate) <= 1
            gained = np.where(last, left, rate)
            if k:
                self.drafted += float(len(decoding) * k)
                self.accepted += float((gained - 1).sum())
            self.g[decoding] = np.where(last, self.L[decoding], g + gained)
        for i, chunk in chunks:
            self.computed[i] += chunk
            prefill += chunk
            if self.computed[i] >= self.target[i]:  # prefill done: the step emits its first token
                ctx_sum += float(self.P[i] + self.g[i])
                emitting += 1
                query += 1
                self.g[i] = min(self.g[i] + 1, self.L[i])
                self.prefilling[i] = False
                self.n_prefilling -= 1
                self.knots.append((i, self.step + 1, float(self.g[i])))
        self.prefilled += prefill
        self.last_scheduled = len(decoding) + len(chunks)
        self.steps.add(emitting, ctx_sum, query, k, prefill)
        self.step += 1
        run = self.run
        if len(run):
            self._finish((self.g[run] >= self.L[run]) & ~self.prefilling[run], self.step)
