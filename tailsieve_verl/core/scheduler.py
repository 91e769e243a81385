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
``1 + Σᵢ Πⱼ≤ᵢ αⱼ`` tokens (speculation's expectation, 1 without it).

Scheduling is step-based, never time-based, so the run records per step what the cost model needs
(requests emitting a token, their context sum, verify query tokens, k, prefilled tokens) and prices
every step in one vectorised call at the end. Steps in which nothing can be admitted, preempted or
prefilled and nothing finishes are advanced as one span; only the steps around events are walked
one at a time.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .engine import EngineConfig, EngineConfigError, EngineEvents, ReplicaRun, TokenProgress
from .perf import PerfModel

DECAY_SPAN = 64  # with acceptance decay, a span re-reads each request's acceptance at least this often


class _Steps:
    """Per-step records, appended one step or one span at a time."""

    def __init__(self) -> None:
        self.chunks: list[tuple[np.ndarray, ...]] = []
        self.single: list[tuple[float, float, float, float, float]] = []

    def add(self, emitting: int, ctx_sum: float, query: int, k: int, prefill: int) -> None:
        self.single.append((emitting, ctx_sum, query, k, prefill))

    def add_span(self, emitting: int, ctx_sums: np.ndarray, query: int, k: int) -> None:
        self._flush()
        n = len(ctx_sums)
        self.chunks.append((np.full(n, float(emitting)), ctx_sums, np.full(n, float(query)), np.full(n, float(k)),
                            np.zeros(n)))

    def _flush(self) -> None:
        if self.single:
            self.chunks.append(tuple(np.asarray(col, dtype=float) for col in zip(*self.single)))
            self.single = []

    def columns(self) -> tuple[np.ndarray, ...]:
        self._flush()
        if not self.chunks:
            return tuple(np.zeros(0) for _ in range(5))
        return tuple(np.concatenate(col) for col in zip(*self.chunks))


def step_seconds(perf: PerfModel, cfg: EngineConfig, emitting, ctx_sum, query, k, prefill) -> np.ndarray:
    """Price of each step: ``T(b, c)`` for b requests emitting a token at mean context c; with k
    draft tokens ``T(query, 0) + [T(b, c) − T(b, 0)]`` (weights at every query token, KV read once
    per request) plus ``k · draft_cost · T(b, c)``; plus ``prefill_s_per_token`` per prefilled token."""
    mean_ctx = np.divide(ctx_sum, emitting, out=np.zeros(len(emitting)), where=emitting > 0)
    step = np.asarray(perf.step_time(emitting, mean_ctx), dtype=float)
    spec = cfg.speculative
    if spec is not None and np.any(k > 0):
        m = k > 0
        zero = np.zeros(int(m.sum()))
        verify = (np.asarray(perf.step_time(query[m], zero), dtype=float) + step[m]
                  - np.asarray(perf.step_time(emitting[m], zero), dtype=float))
        step[m] = verify + spec.draft_cost * k[m] * step[m]
    if cfg.prefill_s_per_token > 0:
        step = step + cfg.prefill_s_per_token * prefill
    return step


class ReplicaScheduler:
    """The run of one replica's requests (input order = arrival order); see the module docstring."""

    def __init__(self, lengths: np.ndarray, prompts: np.ndarray, groups: np.ndarray | None, cfg: EngineConfig,
                 max_num_seqs: int | None = None):
        self.cfg = cfg
        n = len(lengths)
        self.n = n
        self.L = lengths.astype(float)
        self.P = prompts.astype(np.int64)
        self.bs = cfg.block_size
        cap = cfg.max_num_seqs if cfg.max_num_seqs is not None else max_num_seqs
        self.cap = n + 1 if cap is None else cap
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
        self.g = np.zeros(n)
        self.computed = np.zeros(n, dtype=np.int64)
        self.target = np.zeros(n, dtype=np.int64)
        self.held = np.zeros(n, dtype=np.int64)  # private blocks (shared prompt blocks are counted per group)
        self.used = 0
        self.prefilling = np.zeros(n, dtype=bool)
        self.n_prefilling = 0
        self.running: list[int] = []
        self.waiting = deque(range(n))
        self.first_admit = np.full(n, -1, dtype=np.int64)
        self.finish_idx = np.full(n, -1, dtype=np.int64)  # clock index of each finish
        self.wait_from = np.zeros(n, dtype=np.int64)
        self.waits: list[tuple[int, int]] = []  # (from, to) clock indices of every wait for admission
        self.knots: list[tuple[int, int, float]] = []
        self.steps = _Steps()
        self.step = 0
        self.unfinished = n
        self.preemptions = 0
        self.recomputed = 0
        self.prefilled = 0
        self.drafted = 0.0
        self.accepted = 0.0

    def _check_fits(self) -> None:
        total = self.P + self.L.astype(np.int64)
        if self.capacity is not None:
            need = -(-(total + self.k_max) // self.bs)
            worst = int(np.argmax(need)) if self.n else 0
            if self.n and need[worst] > self.capacity:
                raise EngineConfigError(
                    f"a request of {int(total[worst])} tokens needs {int(need[worst])} KV blocks but the replica has "
                    f"{self.capacity} (num_gpu_blocks); raise num_gpu_blocks or shorten max_response_length")
        if not self.cfg.enable_chunked_prefill and self.n and total.max() > self.budget:
            raise EngineConfigError(f"with chunked prefill off, a request of {int(total.max())} tokens needs "
                                    f"max_num_batched_tokens >= {int(total.max())} (got {int(self.budget)}); "
                                    "enable chunked prefill or raise the budget")

    # ------------------------------------------------------------------ blocks

    def _private_blocks(self, i, tokens):
        return np.maximum(-(-np.asarray(tokens, dtype=float) // self.bs).astype(np.int64) - self.hit_blocks[i], 0)

    def _k(self, running: int) -> int:
        return self.spec.k_for_batch(running) if self.spec else 0

    def _release(self, i: int) -> None:
        """Free a request's blocks (finish or preemption); the group's prompt blocks go with its last holder."""
        gid = self.gid[i]
        self.refs[gid] -= 1
        if self.capacity is not None:
            self.used -= int(self.held[i]) + (int(self.hit_blocks[i]) if self.refs[gid] == 0 else 0)
            self.held[i] = 0

    # ------------------------------------------------------------------ the run

    def run(self, perf: PerfModel) -> ReplicaRun:
        while self.unfinished:
            span = self._quiet_span()
            if span:
                self._advance(span)
            else:
                self._event_step()
        emitting, ctx_sum, query, k, prefill = self.steps.columns()
        step = step_seconds(perf, self.cfg, emitting, ctx_sum, query, k, prefill)
        clock = np.concatenate([[0.0], np.cumsum(step)])
        finish = clock[self.finish_idx]
        admit = clock[self.first_admit]
        waits = np.array([clock[b] - clock[a] for a, b in self.waits]) if self.waits else np.zeros(1)
        events = EngineEvents(preemptions=self.preemptions, queue_wait_s=float(waits.sum()),
                              max_queue_wait_s=float(waits.max()), tokens_recomputed=self.recomputed,
                              prefill_tokens=self.prefilled, spec_draft_tokens=self.drafted,
                              spec_accepted_tokens=self.accepted)
        knots = np.array(sorted(self.knots), dtype=float).reshape(-1, 3)
        progress = TokenProgress(clock, knots[:, 0].astype(np.int64), knots[:, 1].astype(np.int64), knots[:, 2],
                                 self.L.astype(np.int64))
        return ReplicaRun(float(clock[-1]), finish, len(step), admit, events, progress)

    def _head_admissible(self, b: int, k: int) -> bool:
        """Could the waiting head be admitted at the next step (before that step's allocations)?"""
        if b >= self.cap or self.budget - b * (1 + k) <= 0:
            return False
        i = self.waiting[0]
        if self.L[i] == 0:
            return True
        tokens = int(self.P[i] + int(self.g[i]))
        shared = self.refs[self.gid[i]] > 0
        if not self.cfg.enable_chunked_prefill and tokens - (self.hit_blocks[i] * self.bs if shared else 0) \
                > self.budget - b * (1 + k):
            return False
        if self.capacity is None:
            return True
        gate = int(self._private_blocks(i, tokens)) + (0 if shared else int(self.hit_blocks[i]))
        return gate <= self.capacity - self.used

    def _quiet_span(self) -> int:
        """Steps from now in which every running request decodes and nothing is admitted or
        preempted, up to and including the first finish; 0 when the next step needs the scheduler."""
        b = len(self.running)
        if not b or self.n_prefilling:
            return 0
        k = self._k(b)
        if b * (1 + k) > self.budget or (self.waiting and self._head_admissible(b, k)):
            return 0
        run = np.asarray(self.running)
        g, left = self.g[run], self.L[run] - self.g[run]
        if k:
            e = self.spec.tokens_per_step(k, self.P[run] + g)
            to_finish = np.ceil(left / e - 1e-9)
        else:
            e, to_finish = 1.0, left
        span = int(to_finish.min())
        if k and self.spec.acceptance_half_life is not None:
            span = min(span, DECAY_SPAN)
        if self.capacity is not None:
            span = self._steps_with_blocks(run, g, e, k, span)
        return span

    def _steps_with_blocks(self, run: np.ndarray, g: np.ndarray, e, k: int, span: int) -> int:
        """The first step s < span whose allocations the free blocks cannot cover (span if none)."""
        held = self.held[run]

        def used_at(s: int) -> int:
            need = self._private_blocks(run, self.P[run] + g + s * e + k)
            return self.used + int(np.maximum(need - held, 0).sum())

        if used_at(span - 1) <= self.capacity:
            return span
        lo, hi = 0, span - 1  # used_at(hi) > capacity; find the smallest such s
        while lo < hi:
            mid = (lo + hi) // 2
            if used_at(mid) > self.capacity:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _advance(self, span: int) -> None:
        """``span`` plain decode steps of the running set at once."""
        run = np.asarray(self.running)
        b = len(run)
        k = self._k(b)
        g, left = self.g[run], self.L[run] - self.g[run]
        if k:
            e = self.spec.tokens_per_step(k, self.P[run] + g)
            to_finish = np.ceil(left / e - 1e-9)
            produced = np.minimum(span * e, left)
            self.drafted += float(span * b * k)
            self.accepted += float((produced - span).sum())
            ctx0, rate = float((self.P[run] + g).sum()), float(e.sum())
        else:
            e, to_finish, produced = 1.0, left, np.full(b, float(span))
            ctx0, rate = float((self.P[run] + g).sum()), float(b)
        self.steps.add_span(b, ctx0 + np.arange(span) * rate, b * (1 + k), k)
        if self.capacity is not None:
            need = self._private_blocks(run, self.P[run] + g + (span - 1) * e + k)
            grow = np.maximum(need - self.held[run], 0)
            self.held[run] += grow
            self.used += int(grow.sum())
        self.g[run] = g + produced
        self.step += span
        done = run[to_finish <= span]
        self.g[done] = self.L[done]
        self._finish(done)

    def _finish(self, done) -> None:
        if not len(done):
            return
        for i in done:
            i = int(i)
            self._release(i)
            self.finish_idx[i] = self.step
            self.knots.append((i, self.step, float(self.L[i])))
        gone = set(int(i) for i in done)
        self.running = [i for i in self.running if i not in gone]
        self.unfinished -= len(gone)

    def _preempt(self, i: int) -> None:
        self._release(i)
        if self.prefilling[i]:
            self.prefilling[i] = False
            self.n_prefilling -= 1
        self.computed[i] = 0
        self.waiting.appendleft(i)
        self.wait_from[i] = self.step
        self.preemptions += 1
        self.knots.append((i, self.step, float(self.g[i])))

    def _event_step(self) -> None:
        """One scheduler step walked request by request (admissions, chunks, preemptions)."""
        budget = self.budget
        k = self._k(len(self.running))
        decoding: list[int] = []
        chunks: list[tuple[int, int]] = []
        preempted = False
        run = np.asarray(self.running, dtype=np.int64)
        extra = None
        if len(run) and self.capacity is not None and not self.n_prefilling:
            extra = np.maximum(self._private_blocks(run, self.P[run] + self.g[run] + k) - self.held[run], 0)
        if len(run) and not self.n_prefilling and len(run) * (1 + k) <= budget and (
                extra is None or self.used + int(extra.sum()) <= self.capacity):
            decoding = self.running[:]  # the common case: every running request decodes and fits
            budget -= len(run) * (1 + k)
            if extra is not None:
                self.held[run] += extra
                self.used += int(extra.sum())
        else:
            idx = 0
            while idx < len(self.running) and budget > 0:
                i = self.running[idx]
                if self.prefilling[i]:
                    new = int(min(self.target[i] - self.computed[i], budget))
                    tokens = self.computed[i] + new + k
                else:
                    new = int(min(1 + k, budget))
                    tokens = self.P[i] + self.g[i] + (new - 1)
                if self.capacity is not None:
                    more = int(max(int(self._private_blocks(i, tokens)) - self.held[i], 0))
                    while more > self.capacity - self.used:
                        victim = self.running.pop()
                        self._preempt(victim)
                        preempted = True
                        if victim == i:
                            break
                    if len(self.running) <= idx:  # the request itself was preempted
                        break
                    self.held[i] += more
                    self.used += more
                (chunks.append((i, new)) if self.prefilling[i] else decoding.append(i))
                budget -= new
                idx += 1
        if not preempted:
            budget = self._admit(budget, k, chunks)
        self._execute(decoding, chunks, k)

    def _admit(self, budget: float, k: int, chunks: list[tuple[int, int]]) -> float:
        """FCFS admission of waiting requests (``chunks`` receives their first prefill chunk)."""
        while self.waiting and budget > 0 and len(self.running) < self.cap:
            i = self.waiting[0]
            if self.L[i] == 0:  # nothing to generate: done on admission, holds nothing
                self.waiting.popleft()
                self.first_admit[i] = self.finish_idx[i] = self.step
                self.waits.append((int(self.wait_from[i]), self.step))
                self.knots.append((i, self.step, 0.0))
                self.unfinished -= 1
                continue
            tokens = int(self.P[i] + int(self.g[i]))
            shared = bool(self.refs[self.gid[i]] > 0)
            hit = int(self.hit_blocks[i]) * self.bs if shared else 0
            new = tokens - hit
            if not self.cfg.enable_chunked_prefill and new > budget:
                break
            chunk = int(min(new, budget))
            if self.capacity is not None:
                gate = int(self._private_blocks(i, tokens)) + (0 if shared else int(self.hit_blocks[i]))
                if gate > self.capacity - self.used:
                    break
                if not shared:
                    self.used += int(self.hit_blocks[i])
                self.held[i] = int(self._private_blocks(i, hit + chunk + k))
                self.used += int(self.held[i])
            self.waiting.popleft()
            self.running.append(i)
            self.refs[self.gid[i]] += 1
            self.computed[i], self.target[i] = hit, tokens
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
        return budget

    def _execute(self, decoding: list[int], chunks: list[tuple[int, int]], k: int) -> None:
        """Apply one step's work: tokens emitted, chunks prefilled, finished requests released."""
        emitting, ctx_sum, query, prefill = 0, 0.0, 0, 0
        if decoding:
            dec = np.asarray(decoding, dtype=np.int64)
            g = self.g[dec]
            ctx_sum += float((self.P[dec] + g).sum())
            emitting += len(dec)
            query += len(dec) * (1 + k)
            if k:
                gained = np.minimum(self.spec.tokens_per_step(k, self.P[dec] + g), self.L[dec] - g)
                self.drafted += float(len(dec) * k)
                self.accepted += float((gained - 1).sum())
            else:
                gained = 1.0
            self.g[dec] = np.where(g + gained >= self.L[dec] - 1e-9, self.L[dec], g + gained)
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
        self.steps.add(emitting, ctx_sum, query, k, prefill)
        self.step += 1
        if self.running:
            run = np.asarray(self.running, dtype=np.int64)
            self._finish(run[(self.g[run] >= self.L[run]) & ~self.prefilling[run]])

