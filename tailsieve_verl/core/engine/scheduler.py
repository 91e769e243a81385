"""One replica under vLLM v1's scheduler (``vllm/v1/core/sched/scheduler.py``), in the engine model's
first-order terms (:mod:`core.engine.engine`).

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

Scheduling is step-based, never time-based, so the walk records per step what the cost model needs
(requests emitting a token, their context sum, verify query tokens, k, prefilled tokens) and every
step is priced in one vectorised call at the end. The walk (:func:`_walk`) visits the steps one
request at a time, as vLLM does, in plain loops over arrays that numba compiles on first use; a
stretch in which nothing but one token per running request happens (no speculation, prefill,
finish, admission or shortage of blocks: :func:`_quiet_steps`) is taken at once, in whole numbers,
so with the walk's floats. Without speculation the walk keeps the decoding requests by formula
instead of visiting them (a step then costs its admissions, finishes and preemptions, not its ~250
running requests; see ``lazy`` in :func:`_walk`); the one request whose prefill spans steps, always
the newest, is walked beside them. A DAPO-sized replica, ~2·10⁴ steps of ~1,000 requests, walks in
~1 ms where its KV cache suffices and in ~4–5 ms where it preempts thousands of times, about 160 ns
a step. Without numba the same functions run as Python, slowly. ``tests/core/test_engine_recorded.py``
holds the walk to the runs the earlier span-based evaluator recorded.
"""

from __future__ import annotations

import math

import numpy as np

from .engine import EngineConfig, EngineConfigError, EngineEvents, ReplicaRun, TokenProgress, _reach
from .perf import PerfModel


def steps_to_finish(left, rate):
    """Decode steps that bring ``left`` tokens at ``rate`` per step (fractional under speculation),
    tolerant of rounding in the accumulated expectation. Two Python numbers give an int."""
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
        self.L = np.array(lengths, dtype=np.int64)  # a copy: a cached run keeps it read-only
        self.P = np.asarray(prompts, dtype=np.int64)
        self.bs = cfg.block_size
        self.cap = n + 1 if cfg.max_num_seqs is None else cfg.max_num_seqs
        self.budget = np.inf if cfg.max_num_batched_tokens is None else float(cfg.max_num_batched_tokens)
        self.capacity = cfg.num_gpu_blocks
        self.spec = cfg.speculative
        self.k_max = self.spec.num_speculative_tokens if self.spec else 0
        if groups is not None and cfg.enable_prefix_caching:
            _, self.gid = np.unique(np.asarray(groups), return_inverse=True)
            first = np.zeros(self.gid.max() + 1 if n else 0, dtype=np.int64)
            first[self.gid[::-1]] = self.P[::-1]
            odd = np.flatnonzero(first[self.gid] != self.P)
            if len(odd):  # its shared prompt blocks would be counted at two sizes
                i = int(odd[0])
                raise EngineConfigError(f"the requests of a group share its prompt, but request {i} has a {int(self.P[i])}-token "
                                        f"prompt and an earlier one of its group {int(first[self.gid[i]])}")
            self.hit_blocks = np.maximum(self.P - 1, 0) // self.bs  # vLLM recomputes at least the last prompt token
        else:
            self.gid = np.arange(n)
            self.hit_blocks = np.zeros(n, dtype=np.int64)
        self.gid = self.gid.astype(np.int64)
        self._check_fits()

    def _check_fits(self) -> None:
        total = self.P + self.L
        if not self.n:
            return
        if self.capacity is not None:
            need = -(-(total + self.k_max) // self.bs)
            worst = int(np.argmax(need))
            if need[worst] > self.capacity:
                raise EngineConfigError(
                    f"a request of {int(total[worst])} tokens needs {int(need[worst])} KV blocks but the replica has "
                    f"{self.capacity} (num_gpu_blocks); raise num_gpu_blocks or shorten the responses")
        longest = int((self.P + np.maximum(self.L - 1, 0)).max())  # a recompute's prefill
        if not self.cfg.enable_chunked_prefill and longest > self.budget:
            raise EngineConfigError(f"with chunked prefill off, a prefill of up to {longest} tokens (prompt + "
                                    f"tokens generated before a preemption) needs max_num_batched_tokens >= {longest} "
                                    f"(got {int(self.budget)}); enable chunked prefill or raise the budget")

    def _k_by_batch(self) -> np.ndarray:
        """k for every count of requests the previous step scheduled (0..n): vLLM's dynamic-SD lookup."""
        if self.spec is None:
            return np.zeros(self.n + 2, dtype=np.int64)
        return np.array([self.spec.k_for_batch(b) for b in range(self.n + 2)], dtype=np.int64)

    def run_to_end(self, perf: PerfModel) -> ReplicaRun:
        spec = self.spec
        reach = np.asarray(_reach(spec.acceptance, self.k_max), dtype=float) if spec else np.zeros(0)
        half_life = spec.acceptance_half_life if spec and spec.acceptance_half_life is not None else 0.0
        (emitting, ctx_sum, query, k, prefill, finish_idx, first_admit, wait_from, wait_to, knot_req, knot_step,
         knot_tokens, counts, spec_tokens) = walk_kernel()(
            self.L, self.P, self.gid, self.hit_blocks, self.bs, self.cap, self.budget,
            -1 if self.capacity is None else self.capacity, self.cfg.enable_chunked_prefill, self._k_by_batch(),
            reach, half_life)
        step = step_seconds(perf, self.cfg, emitting, ctx_sum, query, k, prefill)
        clock = np.concatenate([[0.0], np.cumsum(step)])
        waits = clock[wait_to] - clock[wait_from] if len(wait_to) else np.zeros(1)
        preemptions, recomputed, prefilled = (int(x) for x in counts)
        events = EngineEvents(steps=len(step), preemptions=preemptions, queue_wait_s=float(waits.sum()),
                              max_queue_wait_s=float(waits.max()), tokens_recomputed=recomputed,
                              prefill_tokens=prefilled, spec_draft_tokens=float(spec_tokens[0]),
                              spec_accepted_tokens=float(spec_tokens[1]))
        # the walk writes knots in step order, a request's knots of one step in token order: sorted by request,
        # stably, they are in (request, step, tokens) order
        order = np.argsort(knot_req, kind="stable")
        progress = TokenProgress(clock, knot_req[order], knot_step[order], knot_tokens[order], self.L)
        return ReplicaRun(float(clock[-1]), clock[finish_idx], len(step), clock[first_admit], events, progress)


_KERNEL = None


def walk_kernel():
    """:func:`_walk`, compiled by numba on first use (cached on disk); the plain function without numba."""
    global _KERNEL, _quiet_steps, _heap_push, _heap_pop, _context_blocks, _preempt
    if _KERNEL is None:
        try:
            import numba
        except ImportError:  # a --no-deps install: the same walk, interpreted
            _KERNEL = _walk
        else:  # the helpers first: the walk calls them compiled
            _quiet_steps = numba.njit(cache=True)(_quiet_steps)
            _heap_push = numba.njit(cache=True)(_heap_push)
            _heap_pop = numba.njit(cache=True)(_heap_pop)
            _context_blocks = numba.njit(cache=True)(_context_blocks)
            _preempt = numba.njit(cache=True)(_preempt)
            _KERNEL = numba.njit(cache=True)(_walk)
    return _KERNEL


def _walk(L, P, gid, hit_blocks, bs, cap, budget0, capacity, chunked, k_by_batch, reach, half_life):
    """Every scheduler step of one replica, request by request (see the module docstring).

    ``capacity`` < 0: no KV limit; ``budget0``: the token budget (inf: none); ``k_by_batch[b]``: k
    after a step that scheduled b requests; ``reach[i]``: P(draft positions 1..i+1 accepted) at zero
    context, halved every ``half_life`` context tokens (0: no decay). Returns the per-step records,
    each request's finish and first-admission step, every wait (from, to), the progress knots
    (request, step, tokens), (preemptions, recomputed, prefilled) and (drafted, accepted)."""
    n = len(L)
    limited = capacity >= 0
    g = np.zeros(n)  # tokens generated (an expectation under speculation)
    ctx_mid = np.zeros(n)  # the context at which a residency's acceptance is read: midway to its end
    for i in range(n):
        ctx_mid[i] = P[i] + L[i] / 2
    computed = np.zeros(n, dtype=np.int64)  # prefill progress of the current admission
    target = np.zeros(n, dtype=np.int64)
    held = np.zeros(n, dtype=np.int64)  # private blocks (shared prompt blocks are counted per group)
    prefilling = np.zeros(n, dtype=np.bool_)
    refs = np.zeros(n + 1, dtype=np.int64)
    first_admit = np.full(n, -1, dtype=np.int64)
    finish_idx = np.full(n, -1, dtype=np.int64)
    wait_from = np.zeros(n, dtype=np.int64)
    run = np.zeros(2 * n, dtype=np.int64)  # running requests, admission order: run[:n_run] (room for lazy tombstones)
    n_run = 0
    queue = np.arange(n)  # waiting requests: a ring, head first
    head, n_wait = 0, n
    chunk_req = np.zeros(n, dtype=np.int64)
    chunk_new = np.zeros(n, dtype=np.int64)
    rec_emit, rec_ctx, rec_query = np.zeros(1024), np.zeros(1024), np.zeros(1024)
    rec_k, rec_prefill = np.zeros(1024), np.zeros(1024)
    waits_from, waits_to = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    knot_req, knot_step, knot_tokens = np.zeros(4 * n, dtype=np.int64), np.zeros(4 * n, dtype=np.int64), np.zeros(4 * n)
    n_steps = n_waits = n_knots = 0
    step = used = n_prefilling = last_scheduled = 0
    preemptions = recomputed = prefilled = 0
    drafted = accepted = 0.0
    unfinished = n
    least_left = 0.0  # tokens left to the running request nearest its end, kept by the walked steps
    # Plain decoding, taken in bulk (lazy): without speculation, while every running request decodes (none prefills,
    # the budget covers them all), a step does the same to each running request (one token, a new block every bs
    # tokens, its finish when one token is left), so the walk keeps them by formula instead of visiting them:
    # g = g_base + step, a block opens where (P + g_base + step - 1) % bs == 0 (requests counted per phase
    # (P + g_base) % bs), finishes come off a heap by step (and leave in run order, as the pass would take them), and
    # the context sum is ctx_base + n_lazy · step. A step short of blocks is the pass's: the openers, in run order,
    # take the free blocks and preempt the newest. Such a step costs its events, not its running requests; between a
    # finish and the next, with admission blocked, the steps are written in one loop (quiet). A prefill that spans
    # steps takes the whole budget left, so nobody is admitted behind it: it is the one newest request, last in run
    # order, and the pass's code walks it after the decoding requests (short of blocks, it preempts itself; an
    # opener short of blocks preempts it first). Any other prefilling state leaves the mode, writing every
    # request's g and blocks back. The floats are the pass's: whole numbers, summed exactly.
    plain = True
    for b in range(len(k_by_batch)):
        plain = plain and k_by_batch[b] == 0
    lazy = False
    run_len = 0  # run[:run_len]: the running requests, with finished ones among them while lazy
    g_base = np.zeros(n, dtype=np.int64)
    is_lazy = np.zeros(n, dtype=np.bool_)
    phase_count = np.zeros(bs, dtype=np.int64)
    heap_key, heap_req = np.zeros(4 * n, dtype=np.int64), np.zeros(4 * n, dtype=np.int64)  # stale entries stay
    heap_size = n_lazy = ctx_base = 0
    quiet = False
    just_done = np.zeros(n, dtype=np.int64)  # the requests a lazy step finishes
    admitted_as = np.zeros(n, dtype=np.int64)  # admission count at its admission: run[] is in this order
    n_admissions = 0
    while unfinished:
        if lazy and n_prefilling and not (n_prefilling == 1 and run[run_len - 1] >= 0 and prefilling[run[run_len - 1]]):
            lazy = quiet = False  # write the running requests back and walk the step
            kept = 0
            least_left = np.inf
            for idx in range(run_len):
                i = run[idx]
                if i < 0 or (not is_lazy[i] and not prefilling[i]):  # preempted or finished while lazy
                    continue
                if is_lazy[i]:
                    is_lazy[i] = False
                    g[i] = g_base[i] + step
                    if limited:
                        held[i] = _context_blocks(P[i], g[i], hit_blocks[i], bs)
                least_left = min(least_left, L[i] - g[i])
                run[kept] = i
                kept += 1
            run_len = n_run = kept
        if (not lazy and plain and n_run and not n_prefilling and n_run <= budget0
                and (not limited or capacity - used >= n_run)):
            tight = True  # every running request holds exactly its context's blocks (so a step opens at most one)
            for idx in range(n_run if limited else 0):
                i = run[idx]
                tight = tight and held[i] == _context_blocks(P[i], g[i], hit_blocks[i], bs)
            if tight:
                lazy = True
                heap_size = n_lazy = ctx_base = 0
                phase_count[:] = 0
                for idx in range(n_run):
                    i = run[idx]
                    g_base[i] = int(g[i]) - step
                    is_lazy[i] = True
                    phase_count[(P[i] + g_base[i]) % bs] += 1
                    ctx_base += P[i] + g_base[i]
                    n_lazy += 1
                    heap_size = _heap_push(heap_key, heap_req, heap_size, L[i] - 1 - g_base[i], i)
        while lazy and heap_size and not (is_lazy[heap_req[0]] and heap_key[0] == L[heap_req[0]] - 1 - g_base[heap_req[0]]):
            heap_size = _heap_pop(heap_key, heap_req, heap_size)  # a preempted request's entry
        if lazy and quiet and heap_size:  # decoding alone up to the next finish, while its new blocks are free
            quiet = False
            stop = heap_key[0]
            while n_steps + (stop - step) + 1 > len(rec_emit):
                rec_emit, rec_ctx, rec_query = (np.concatenate((rec_emit, rec_emit)), np.concatenate((rec_ctx, rec_ctx)),
                                                np.concatenate((rec_query, rec_query)))
                rec_k, rec_prefill = np.concatenate((rec_k, rec_k)), np.concatenate((rec_prefill, rec_prefill))
            while step < stop:
                if limited:
                    opened = phase_count[(1 - step) % bs]
                    if opened > capacity - used:
                        break
                    used += opened
                rec_emit[n_steps], rec_ctx[n_steps], rec_query[n_steps] = n_lazy, float(ctx_base + n_lazy * step), n_lazy
                rec_k[n_steps], rec_prefill[n_steps] = 0, 0
                n_steps += 1
                step += 1
            last_scheduled = n_lazy
            continue
        span = 0
        if not lazy:
            span = _quiet_steps(L, P, gid, hit_blocks, g, held, refs, run, n_run, queue, head, n_wait, n_prefilling,
                                bs, cap, budget0, capacity, used, chunked, k_by_batch, last_scheduled, least_left)
        while n_steps + span + 1 > len(rec_emit):  # room for the records: a step adds at most n waits, 4n knots
            rec_emit, rec_ctx, rec_query = (np.concatenate((rec_emit, rec_emit)), np.concatenate((rec_ctx, rec_ctx)),
                                            np.concatenate((rec_query, rec_query)))
            rec_k, rec_prefill = np.concatenate((rec_k, rec_k)), np.concatenate((rec_prefill, rec_prefill))
        if span:  # every running request decodes one token a step, nobody finishes, nothing is admitted
            base = 0.0
            for idx in range(n_run):
                i = run[idx]
                base += P[i] + g[i]  # whole tokens: the sums below are exact, as the walk's would be
                g[i] += span
                if limited:
                    more = max(_context_blocks(P[i], g[i], hit_blocks[i], bs) - held[i], 0)
                    held[i] += more
                    used += more
            for s in range(span):
                rec_emit[n_steps + s], rec_ctx[n_steps + s], rec_query[n_steps + s] = n_run, base + s * n_run, n_run
                rec_k[n_steps + s], rec_prefill[n_steps + s] = 0, 0
            n_steps += span
            step += span
            last_scheduled = n_run
            least_left -= span
            continue
        if n_waits + n > len(waits_from):
            waits_from, waits_to = np.concatenate((waits_from, waits_from)), np.concatenate((waits_to, waits_to))
        if n_knots + 4 * n > len(knot_req):
            knot_req, knot_step = np.concatenate((knot_req, knot_req)), np.concatenate((knot_step, knot_step))
            knot_tokens = np.concatenate((knot_tokens, knot_tokens))
        budget = budget0
        k = k_by_batch[last_scheduled]
        flat_rate = 1.0  # tokens a decoding request gains at depth k without decay (per request with it)
        for d in range(k):
            flat_rate += reach[d] * 1.0 ** (d + 1)
        n_dec = n_chunks = 0
        preempted = done = False
        ctx_sum = 0.0
        least_left = np.inf
        if lazy:  # every running request decodes one token and takes the block its token opens, if any
            if run_len > n:  # drop the entries of requests that left, keeping run order
                kept = 0
                for idx in range(run_len):
                    i = run[idx]
                    if i >= 0 and (is_lazy[i] or prefilling[i]):
                        run[kept] = i
                        kept += 1
                run_len = kept
            opening = (1 - step) % bs
            if limited and phase_count[opening] > capacity - used:
                # short of blocks: as the pass does, the openers in run order take the free ones, and one that finds
                # none preempts the newest running request until a block is free or it is itself the newest
                newest = run_len - 1
                for idx in range(run_len):
                    i = run[idx]
                    if i < 0 or not is_lazy[i] or (P[i] + g_base[i]) % bs != opening:
                        continue
                    while capacity - used < 1:
                        while run[newest] < 0 or not (is_lazy[run[newest]] or prefilling[run[newest]]):
                            newest -= 1
                        j = run[newest]
                        run[newest] = -1  # its entry: the request may come back, at the end
                        preempted = True
                        n_run -= 1
                        if prefilling[j]:  # the newest, still prefilling: its chunk is not scheduled yet
                            prefilling[j] = False
                            n_prefilling -= 1
                        else:
                            is_lazy[j] = False
                            g[j] = g_base[j] + step
                            phase_count[(P[j] + g_base[j]) % bs] -= 1
                            ctx_base -= P[j] + g_base[j]
                            n_lazy -= 1
                            held[j] = _context_blocks(P[j], g[j], hit_blocks[j], bs)
                        used, head, n_wait, n_knots = _preempt(j, step, gid, hit_blocks, g, held, computed, refs, queue,
                                                               wait_from, knot_req, knot_step, knot_tokens, used, head,
                                                               n_wait, n_knots)
                        preemptions += 1
                        if j == i:
                            break
                    if not is_lazy[i]:
                        break  # it was the newest: every later opener went before it
                    used += 1
            elif limited:
                used += phase_count[opening]
            n_dec = n_lazy
            ctx_sum = float(ctx_base + n_lazy * step)
            budget -= n_lazy
        idx, end = (run_len - n_prefilling, run_len) if lazy else (0, n_run)  # run[idx:end]: the requests to visit
        while idx < end and budget > 0:  # running requests first, oldest first (lazy: the one still prefilling)
            i = run[idx]
            if prefilling[i]:
                new = int(min(target[i] - computed[i], budget))
                tokens = computed[i] + new + k
            else:
                new = int(min(1 + k, budget))
                tokens = P[i] + g[i] + (new - 1)
            if limited:
                more = max(max(int(math.ceil(tokens / bs)) - hit_blocks[i], 0) - held[i], 0)
                while more > capacity - used:  # short of blocks: preempt the newest (recompute)
                    preempted = True
                    end -= 1
                    j = run[end]
                    n_run -= 1
                    if prefilling[j]:
                        prefilling[j] = False
                        n_prefilling -= 1
                    used, head, n_wait, n_knots = _preempt(j, step, gid, hit_blocks, g, held, computed, refs, queue,
                                                           wait_from, knot_req, knot_step, knot_tokens, used, head,
                                                           n_wait, n_knots)
                    preemptions += 1
                    if j == i:
                        break
                if end <= idx:  # the request itself was preempted
                    break
                held[i] += more
                used += more
            if prefilling[i]:
                chunk_req[n_chunks], chunk_new[n_chunks] = i, new
                n_chunks += 1
            else:  # decodes: its tokens now (a request already scheduled is never preempted in its step)
                n_dec += 1
                ctx_sum += P[i] + g[i]
                rate = flat_rate
                if k and half_life > 0:
                    decay = 2.0 ** (-ctx_mid[i] / half_life)
                    rate = 1.0
                    for d in range(k):
                        rate += reach[d] * decay ** (d + 1)
                left = L[i] - g[i]
                last = math.ceil(left / rate - 1e-9) <= 1
                gained = left if last else rate
                if k:
                    drafted += k
                    accepted += gained - 1
                g[i] = L[i] if last else g[i] + gained
                done = done or last
                if not last:
                    least_left = min(least_left, L[i] - g[i])
            budget -= new
            idx += 1
        for rest in range(idx, end):  # left out of the step by the budget
            least_left = min(least_left, L[run[rest]] - g[run[rest]])
        if lazy:
            run_len = end
        admitted = 0
        if not preempted:  # FCFS admission while a slot, budget and the whole sequence's blocks are free
            while n_wait and budget > 0 and n_run + admitted < cap:
                i = queue[head]
                if L[i] == 0:  # nothing to generate: done on admission, holds nothing
                    head = (head + 1) % n
                    n_wait -= 1
                    first_admit[i] = finish_idx[i] = step
                    waits_from[n_waits], waits_to[n_waits] = wait_from[i], step
                    n_waits += 1
                    knot_req[n_knots], knot_step[n_knots], knot_tokens[n_knots] = i, step, 0.0
                    n_knots += 1
                    unfinished -= 1
                    continue
                seq = P[i] + int(g[i])
                shared = refs[gid[i]] > 0
                hit = hit_blocks[i] * bs if shared else 0
                new = seq - hit
                if not chunked and new > budget:
                    break
                chunk = int(min(new, budget))
                if limited:
                    gate = max(int(math.ceil(seq / bs)) - hit_blocks[i], 0) + (0 if shared else hit_blocks[i])
                    if gate > capacity - used:
                        break
                    if not shared:
                        used += hit_blocks[i]
                    held[i] = max(int(math.ceil((hit + chunk + k) / bs)) - hit_blocks[i], 0)
                    used += held[i]
                head = (head + 1) % n
                n_wait -= 1
                run[run_len + admitted] = i
                admitted += 1
                admitted_as[i] = n_admissions
                n_admissions += 1
                refs[gid[i]] += 1
                computed[i], target[i] = hit, seq
                ctx_mid[i] = P[i] + (g[i] + L[i]) / 2
                prefilling[i] = True
                n_prefilling += 1
                if first_admit[i] < 0:
                    first_admit[i] = step
                else:
                    recomputed += new
                waits_from[n_waits], waits_to[n_waits] = wait_from[i], step
                n_waits += 1
                knot_req[n_knots], knot_step[n_knots], knot_tokens[n_knots] = i, step, g[i]
                n_knots += 1
                chunk_req[n_chunks], chunk_new[n_chunks] = i, chunk
                n_chunks += 1
                budget -= chunk
            n_run += admitted
            run_len += admitted
        # the chunks prefilled; a request whose prefill completes emits its first token
        emitting, query, prefill = n_dec, n_dec * (1 + k), 0
        n_just_done = 0
        for j in range(n_chunks):
            i = chunk_req[j]
            computed[i] += chunk_new[j]
            prefill += chunk_new[j]
            if computed[i] >= target[i]:  # prefill done: the step emits its first token
                ctx_sum += P[i] + g[i]
                emitting += 1
                query += 1
                g[i] = min(g[i] + 1, L[i])
                done = done or g[i] >= L[i]
                prefilling[i] = False
                n_prefilling -= 1
                knot_req[n_knots], knot_step[n_knots], knot_tokens[n_knots] = i, step + 1, g[i]
                n_knots += 1
            if g[i] < L[i]:
                least_left = min(least_left, L[i] - g[i])
            if lazy and not prefilling[i]:  # decodes from the next step on, by formula; or is done already
                if g[i] >= L[i]:
                    just_done[n_just_done] = i
                    n_just_done += 1
                else:
                    if heap_size == len(heap_key):  # full of preempted requests' entries: the live ones only
                        heap_size = 0
                        for live in range(run_len):
                            if run[live] >= 0 and is_lazy[run[live]]:
                                heap_size = _heap_push(heap_key, heap_req, heap_size,
                                                       L[run[live]] - 1 - g_base[run[live]], run[live])
                    g_base[i] = int(g[i]) - (step + 1)
                    is_lazy[i] = True
                    phase_count[(P[i] + g_base[i]) % bs] += 1
                    ctx_base += P[i] + g_base[i]
                    n_lazy += 1
                    heap_size = _heap_push(heap_key, heap_req, heap_size, L[i] - 1 - g_base[i], i)
        prefilled += prefill
        last_scheduled = n_dec + n_chunks
        rec_emit[n_steps], rec_ctx[n_steps], rec_query[n_steps] = emitting, ctx_sum, query
        rec_k[n_steps], rec_prefill[n_steps] = k, prefill
        n_steps += 1
        step += 1
        if lazy:  # the requests whose last token this step emitted leave, and those done on their first token
            while heap_size and heap_key[0] <= step - 1:
                i, key = heap_req[0], heap_key[0]
                heap_size = _heap_pop(heap_key, heap_req, heap_size)
                if not is_lazy[i] or key != L[i] - 1 - g_base[i]:
                    continue  # a preempted request's entry
                is_lazy[i] = False
                g[i] = L[i]
                phase_count[(P[i] + g_base[i]) % bs] -= 1
                ctx_base -= P[i] + g_base[i]
                n_lazy -= 1
                just_done[n_just_done] = i
                n_just_done += 1
            for j in range(1, n_just_done):  # into run order, as the walk's pass takes them (insertion sort: a few)
                i = just_done[j]
                while j and admitted_as[just_done[j - 1]] > admitted_as[i]:
                    just_done[j] = just_done[j - 1]
                    j -= 1
                just_done[j] = i
            for j in range(n_just_done):  # the last of a group to leave frees its prompt blocks
                i = just_done[j]
                refs[gid[i]] -= 1
                if limited:
                    used -= _context_blocks(P[i], L[i], hit_blocks[i], bs) + (hit_blocks[i] if refs[gid[i]] == 0 else 0)
                    held[i] = 0
                knot_req[n_knots], knot_step[n_knots], knot_tokens[n_knots] = i, step, L[i]
                n_knots += 1
                finish_idx[i] = step
                unfinished -= 1
            n_run -= n_just_done
            quiet = admitted == 0 and n_just_done == 0 and not preempted and not n_prefilling  # decoding alone
            continue
        kept = 0  # finished requests leave (their group's prompt blocks with the last holder)
        for idx in range(n_run if done else 0):
            i = run[idx]
            if g[i] >= L[i] and not prefilling[i]:
                refs[gid[i]] -= 1
                if limited:
                    used -= held[i] + (hit_blocks[i] if refs[gid[i]] == 0 else 0)
                    held[i] = 0
                knot_req[n_knots], knot_step[n_knots], knot_tokens[n_knots] = i, step, L[i]
                n_knots += 1
                finish_idx[i] = step
                unfinished -= 1
            else:
                run[kept] = i
                kept += 1
        n_run = kept if done else n_run
        run_len = n_run
    return (rec_emit[:n_steps], rec_ctx[:n_steps], rec_query[:n_steps], rec_k[:n_steps], rec_prefill[:n_steps],
            finish_idx, first_admit, waits_from[:n_waits], waits_to[:n_waits], knot_req[:n_knots],
            knot_step[:n_knots], knot_tokens[:n_knots], np.array([preemptions, recomputed, prefilled]),
            np.array([drafted, accepted]))


def _context_blocks(prompt, generated, hit, bs):
    """Private blocks of a decoding request after the step that generated its last token: its context less that
    token's successor slot, beyond the ``hit`` prompt blocks its group shares."""
    return max(int(math.ceil((prompt + generated - 1) / bs)) - hit, 0)


def _preempt(j, step, gid, hit_blocks, g, held, computed, refs, queue, wait_from, knot_req, knot_step, knot_tokens,
             used, head, n_wait, n_knots):
    """Request j preempted (recompute): its blocks freed (its group's prompt blocks with the last holder), its
    prefill progress dropped, back at the front of the waiting queue. Returns (used, head, n_wait, n_knots)."""
    refs[gid[j]] -= 1
    used -= held[j] + (hit_blocks[j] if refs[gid[j]] == 0 else 0)
    held[j] = 0
    computed[j] = 0
    head = (head - 1) % len(queue)
    queue[head] = j
    wait_from[j] = step
    knot_req[n_knots], knot_step[n_knots], knot_tokens[n_knots] = j, step, g[j]
    return used, head, n_wait + 1, n_knots + 1


def _heap_push(keys, reqs, size, key, req):
    """Push (key, req) on the binary min-heap keys[:size] (ties: either first); returns the new size."""
    j = size
    while j:
        parent = (j - 1) // 2
        if keys[parent] <= key:
            break
        keys[j], reqs[j] = keys[parent], reqs[parent]
        j = parent
    keys[j], reqs[j] = key, req
    return size + 1


def _heap_pop(keys, reqs, size):
    """Drop the top of the binary min-heap keys[:size]; returns the new size."""
    size -= 1
    key, req = keys[size], reqs[size]
    j = 0
    while 2 * j + 1 < size:
        child = 2 * j + 1
        if child + 1 < size and keys[child + 1] < keys[child]:
            child += 1
        if keys[child] >= key:
            break
        keys[j], reqs[j] = keys[child], reqs[child]
        j = child
    keys[j], reqs[j] = key, req
    return size


def _quiet_steps(L, P, gid, hit_blocks, g, held, refs, run, n_run, queue, head, n_wait, n_prefilling, bs, cap, budget0,
                 capacity, used, chunked, k_by_batch, last_scheduled, least_left):
    """Steps from now that the walk would spend with every running request decoding one token and
    nothing else happening (no speculation, no prefill, no finish, no admission, every new block
    free), so that :func:`_walk` can take them at once; 0 when the next step needs the scheduler.
    Without speculation every count is a whole number, so the shortcut gives the walk's floats.
    ``least_left``: the fewest tokens any running request has left (the walk keeps it as it goes)."""
    if not n_run or n_prefilling or k_by_batch[last_scheduled] or k_by_batch[n_run] or n_run > budget0:
        return 0
    if n_wait and n_run < cap and budget0 - n_run > 0:  # could the head be admitted (used only grows)?
        i = queue[head]
        if L[i] == 0:
            return 0
        seq = P[i] + int(g[i])
        shared = refs[gid[i]] > 0
        if not (not chunked and seq - (hit_blocks[i] * bs if shared else 0) > budget0 - n_run):
            if capacity < 0 or max(int(math.ceil(seq / bs)) - hit_blocks[i], 0) + (0 if shared else hit_blocks[i]) \
                    <= capacity - used:
                return 0
    span = int(least_left) - 1  # the step a request finishes in is walked
    if span <= 0 or capacity < 0:
        return max(span, 0)
    lo, hi = 0, span  # the most steps whose new blocks (tokens P + g + s at step s) fit in the free ones
    mid = span  # the whole span first: its blocks are usually free, and then one pass decides
    while lo < hi:
        taken = 0
        for idx in range(n_run):
            i = run[idx]
            taken += max(max(int(math.ceil((P[i] + g[i] + mid - 1) / bs)) - hit_blocks[i], 0) - held[i], 0)
        if taken <= capacity - used:
            lo = mid
        else:
            hi = mid - 1
        mid = (lo + hi + 1) // 2
    return lo
