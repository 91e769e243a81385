"""What a within-step signal could act on (issue 33, item 3), on the engine model under stock verl's routing
and verl 0.9.1's rollout defaults, one step at a time.

The idea: a sample that passes T tokens marks its group as long, and its siblings not yet admitted are bound
to the tail pool when they start instead of at t = 0. That pays only if long groups still have queued
samples then. Stock verl submits a step's requests group-major, all at t = 0, each to the replica with the
fewest in flight, so a group's n samples sit at nearly the same queue position on every replica and start
together. Per cell, for T = 1, 2, 4 × the step's median sample length:

* *reach*: the share of the longest groups' tokens (top ``--longest`` by work) still queued when their
  group is flagged: what late binding could move;
* *load*: the share of all groups flagged while a sibling is still queued: what the tail pool would be sent;
* *precision*: the share of those among the longest.

``--scouts K`` submits K samples of every group first, then the other n − K group-major: the order a scout
scheme would need (routing unchanged). ``--bound-at T`` also prints speedups over stock verl (group-major
submission) of: the submission order alone (*order*, no split); the signal bounded optimistically (*scout*:
the flagged groups' queued siblings run on a tail pool of m = 1, 2 replicas from t = 0, not from when they
were flagged); the same move chosen clairvoyantly (every non-scout sample of as many groups, those with the
longest samples). A sample's tokens grow linearly from its admission to its finish (preemptions make that
approximate).

    python scripts/experiments/within_step_signal.py --seeds 2 --steps 3 --bound-at 2 [--scouts 2]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from signal_gap import CELLS, SHAPES, cell_setting  # scripts/experiments/ is this script's import path
from tailsieve_verl.core.data.trace import Group
from tailsieve_verl.core.data.workload import PromptPool, get_preset
from tailsieve_verl.core.engine.replica import evaluate_samples
from tailsieve_verl.core.routing.policies import least_inflight_assignment

MULTIPLES = (1, 2, 4)  # the "runs long" threshold T, in medians of the step's sample lengths


def submitted(groups: list[Group], scouts: int) -> tuple[list[Group], np.ndarray]:
    """The step as submitted: with scouts, every group's first ``scouts`` samples, then the rest group-major
    (each part its own Group, so it keeps its place in the admission order); and each sample's flat index in
    ``groups``' group-major order."""
    if not scouts:
        return groups, np.arange(sum(g.n for g in groups))
    offsets = np.concatenate([[0], np.cumsum([g.n for g in groups])[:-1]])
    heads = [Group(g.prompt_id, g.lengths[:scouts], g.prompt_len) for g in groups]
    rests = [Group(g.prompt_id, g.lengths[scouts:], g.prompt_len) for g in groups if g.n > scouts]
    order = np.concatenate([np.concatenate([o + np.arange(min(scouts, g.n)) for o, g in zip(offsets, groups)]),
                            np.concatenate([o + np.arange(scouts, g.n) for o, g in zip(offsets, groups)])])
    return heads + rests, order


def split_makespan(parts, to_tail: np.ndarray, m: int, n_replicas: int, perf, engine, rng) -> float:
    """Makespan with the samples ``to_tail`` (submitted order) on replicas 0..m-1 and the rest on m..R-1,
    each pool routed as stock verl routes (bound at t = 0)."""
    assignment = np.empty(len(to_tail), dtype=np.int64)
    assignment[to_tail] = least_inflight_assignment(int(to_tail.sum()), m, rng=rng)
    assignment[~to_tail] = least_inflight_assignment(int((~to_tail).sum()), n_replicas - m, offset=m, rng=rng)
    return evaluate_samples(parts, assignment, n_replicas, perf, engine).makespan_s


def bound(groups, parts, order, queued, flagged, scouts, submitted_s, n_replicas, perf, engine, rng) -> dict:
    """Speedups over stock verl, per tail-pool size m, of the signal bound optimistically: the siblings still
    queued when their group was flagged run on the tail pool *from t = 0* (really they would start there only
    when flagged); beside it the same move chosen clairvoyantly: every non-scout sample of as many groups,
    those with the longest samples (what sets a sample-routed group's finish); and the submission order alone
    (``submitted_s``: the step in that order without a split), which moves the makespan under KV pressure."""
    stock = evaluate_samples(groups, least_inflight_assignment(len(order), n_replicas, rng=rng), n_replicas, perf,
                             engine).makespan_s
    out = {"order": stock / submitted_s}
    if not flagged.any():  # nothing to move: both read stock verl
        return {**out, **{m: (1.0, 1.0) for m in (1, 2)}}
    longest = np.zeros(len(groups), dtype=bool)
    longest[np.argsort(-np.array([g.max_len for g in groups]))[:int(flagged.sum())]] = True
    siblings = np.concatenate([np.arange(g.n) >= scouts for g in groups]) & np.repeat(longest, [g.n for g in groups])
    for m in (1, 2):
        scout = split_makespan(parts, queued[order], m, n_replicas, perf, engine, rng)
        clairvoyant = split_makespan(parts, siblings[order], m, n_replicas, perf, engine, rng)
        out[m] = (stock / scout, stock / clairvoyant)
    return out


def one_step(groups, n_replicas, perf, engine, rng, longest_share: float, scouts: int, bound_at: int) -> dict:
    parts, order = submitted(groups, scouts)
    assignment = least_inflight_assignment(len(order), n_replicas, rng=rng)
    ev = evaluate_samples(parts, assignment, n_replicas, perf, engine)
    finish, admit = np.empty(len(order)), np.empty(len(order))
    finish[order], admit[order] = np.concatenate(ev.response_finish_s), np.asarray(ev.admit_s, dtype=float)
    lengths = np.concatenate([np.asarray(g.lengths, dtype=float) for g in groups])
    sizes = [g.n for g in groups]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    group_of = np.repeat(np.arange(len(groups)), sizes)
    spread = np.maximum.reduceat(admit, starts) - np.minimum.reduceat(admit, starts)
    queued_at_t0 = float(np.mean(admit > 0))
    work = np.add.reduceat(lengths, starts)
    longest = np.argsort(-work)[:max(1, int(round(longest_share * len(groups))))]
    median = float(np.median(lengths))
    in_longest = np.isin(group_of, longest)
    out = {"queued_at_t0": queued_at_t0, "spread_s": spread, "makespan_s": ev.makespan_s}
    for multiple in MULTIPLES:
        threshold = multiple * median
        # when each sample passes the threshold (inf if it never does)
        passes = np.where(lengths >= threshold,
                          admit + (finish - admit) * threshold / np.maximum(lengths, 1.0), np.inf)
        signal = np.minimum.reduceat(passes, starts)  # when the group first shows it runs long
        queued = admit > signal[group_of]
        flagged_early = np.zeros(len(groups), dtype=bool)  # flagged while some sibling is still queued
        flagged_early[np.unique(group_of[queued])] = True
        out[multiple] = {
            "longest_tokens_queued": float(lengths[in_longest & queued].sum() / lengths[in_longest].sum()),
            "groups_flagged_early": float(flagged_early.mean()),
            "precision": float(flagged_early[longest].sum() / max(flagged_early.sum(), 1)),
        }
        if multiple == bound_at:
            out["bound"] = bound(groups, parts, order, queued, flagged_early, scouts, ev.makespan_s, n_replicas, perf, engine, rng)
    return out


def bound_column(rows: list[dict]) -> str:
    means = {m: np.mean([r["bound"][m] for r in rows], axis=0) for m in (1, 2)}
    order = np.mean([r["bound"]["order"] for r in rows])
    return f"{order:>8.3f}{' '.join(f'{s:.3f}/{c:.3f}' for s, c in means.values()):>30}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--pool", type=int, default=17000)
    ap.add_argument("--scouts", type=int, default=0, help="submit this many samples of every group first")
    ap.add_argument("--bound-at", type=int, default=0, choices=(0,) + MULTIPLES,
                    help="also bound the signal's speedup at this threshold (0 = no bound)")
    ap.add_argument("--longest", type=float, default=0.03, help="share of the step's groups counted as its longest "
                    "(best-static isolates 2-6 %%)")
    args = ap.parse_args()
    order = f"{args.scouts} scouts per group first" if args.scouts else "group-major (stock verl)"
    print(f"stock verl routing, submission {order}, verl 0.9.1 rollout defaults, {args.seeds} seeds x {args.steps} steps, "
          f"longest = top {args.longest:.0%} of groups by work; T = multiple x the step's median sample length")
    print(f"{'cell':16}{'shape':14}{'queued at 0':>12}{'spread p50/p99 s':>18}{'makespan s':>11}"
          + "".join(f"{f'T={k}x: reach / load / precision':>34}" for k in MULTIPLES)
          + (f"{'order':>8}{'m=1, 2: scout / clairvoyant':>30}" if args.bound_at else ""))
    for shape in args.shapes.split(","):
        for cell in args.cells.split(","):
            rows = []
            for seed in range(args.seeds):
                cfg, perf, preset, cap = cell_setting({"cell": cell, "shape": shape, "seed": seed, "steps": 1}, ("verl",))
                pool = PromptPool(get_preset(preset, max_response_length=cap), args.pool, seed=seed)
                rng = np.random.default_rng(seed)
                for step in range(args.steps):
                    groups = pool.sample_batch(cfg.batch_size, cfg.n, step, rng)
                    rows.append(one_step(groups, cfg.n_replicas, perf, cfg.engine, rng, args.longest, args.scouts, args.bound_at))
            spread = np.concatenate([r["spread_s"] for r in rows])
            cols = []
            for k in MULTIPLES:
                mean = {key: np.mean([r[k][key] for r in rows]) for key in rows[0][k]}
                cols.append(f"{mean['longest_tokens_queued']:.0%} / {mean['groups_flagged_early']:.0%} / "
                            f"{mean['precision']:.0%}")
            print(f"{cell:16}{shape:14}{np.mean([r['queued_at_t0'] for r in rows]):>12.0%}"
                  f"{f'{np.percentile(spread, 50):.2f} / {np.percentile(spread, 99):.2f}':>18}"
                  f"{np.mean([r['makespan_s'] for r in rows]):>11.1f}" + "".join(f"{c:>34}" for c in cols)
                  + (bound_column(rows) if args.bound_at else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
