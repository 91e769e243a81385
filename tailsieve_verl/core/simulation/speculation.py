"""Speculative decoding in the simulator: the depths and schedules stock verl can switch on, the
stock speculative engines, and the per-pool engines of TailSieve with speculation."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Sequence


from ..engine.engine import EngineConfig, SpeculativeConfig

if TYPE_CHECKING:
    from .config import SimConfig


SPEC_DEPTHS = (1, 2, 3, 4, 5, 6)  # verl-spec's depths, the best in hindsight reported


# Speculation assumed when none is given (MTP, from public figures, not measured here): conditional
# acceptance per draft position (DeepSeek-V3's 2nd token 85-90 %, vLLM PR #48892's per-position fall), a
# one-layer drafter at 1/28 of a decode step per draft token (one of a 28-layer model's layers), k = 3.
DEFAULT_SPECULATION = SpeculativeConfig(3, (0.85, 0.8, 0.75), draft_cost=1 / 28)


def vllm_doc_schedule(k: int) -> tuple[tuple[int, int, int], ...]:
    """vLLM's dynamic-SD documentation schedule (k = 3 for batch 1-64, 1 for 65-128, 0 above), its depths
    scaled to ``k`` (3 → 3, 1, 0)."""
    return ((1, 64, k), (65, 128, max(1, round(k / 3))), (129, 256, 0))


def schedule_grid(k_max: int) -> dict[str, tuple[tuple[int, int, int], ...]]:
    """``verl-dynsd-best``'s schedules: deep depth d ≤ ``k_max`` up to batch b, depth 1 up to 2b, 0 above
    (vLLM's documented shape at other depths and batch thresholds), named like ``--spec-schedule``."""
    grid = {}
    for d in sorted({min(k_max, x) for x in (2, 3, 4, 6)}):
        for b in (16, 32, 64, 128):
            off = (2 * b + 1, max(2 * b + 1, 256), 0)  # 256: verl's max_num_seqs; above it k stays 0
            schedule = ((1, b, d), (b + 1, 2 * b, 1), off) if d > 1 else ((1, 2 * b, 1), off)
            grid[schedule_text(schedule)] = schedule
    return grid


def schedule_text(schedule: Sequence[Sequence[int]]) -> str:
    """A schedule in ``--spec-schedule`` words, e.g. 1-64:3,65-128:1,129-129:0."""
    return ",".join(f"{lo}-{hi}:{k}" for lo, hi, k in schedule)


def with_speculation(engine: EngineConfig, profile: SpeculativeConfig, k: int,
                     schedule: tuple = ()) -> EngineConfig:
    """``engine`` with ``profile``'s acceptance and draft cost at depth ``k`` (or a schedule whose
    deepest k is the depth)."""
    depth = max([k] + [entry[2] for entry in schedule])
    return replace(engine, speculative=replace(profile, num_speculative_tokens=depth, schedule=tuple(schedule)))


def engine_label(engine: EngineConfig) -> str:
    """An engine's speculation in ``--spec-schedule`` words: ``off``, ``k=K`` or a schedule."""
    spec = engine.speculative
    if spec is None:
        return "off"
    return schedule_text(spec.schedule) if spec.schedule else f"k={spec.num_speculative_tokens}"


def stock_engines(cfg: SimConfig, kind: str = "all") -> dict[str, EngineConfig]:
    """Stock speculative engines by name: ``k=K`` for each depth of ``cfg.spec_depths`` (``depths``:
    verl-spec's), every schedule of :func:`schedule_grid` (``grid``: verl-dynsd-best's), or those and
    vLLM's documented schedule (``all``: what ``tailsieve-auto`` falls back to)."""
    profile = cfg.speculation
    engines: dict[str, EngineConfig] = {}
    if kind in ("depths", "all"):
        engines.update({f"k={k}": with_speculation(cfg.engine, profile, k) for k in cfg.spec_depths})
    schedules = dict(schedule_grid(max(cfg.spec_depths))) if kind in ("grid", "all") else {}
    if kind == "all":
        doc = vllm_doc_schedule(profile.num_speculative_tokens)
        schedules[schedule_text(doc)] = doc
    engines.update({label: with_speculation(cfg.engine, profile, 0, schedule) for label, schedule in schedules.items()})
    return engines


def tailsieve_spec_config(cfg: SimConfig, name: str) -> SimConfig:
    """The engines of TailSieve with speculation: ``tailsieve-spec`` speculates at the deepest of
    ``cfg.spec_depths`` in the tail pool (pinned at ``cfg.fixed_m`` replicas, as a deployment sets engines
    at launch) and runs vLLM's documented schedule in the bulk pool, or the pool engines ``cfg`` gives
    (``--tail-*`` / ``--bulk-*`` flags); ``tailsieve-dynsd`` runs that schedule on every replica, so the
    tail pool's small batch picks the deep k by itself and the split stays free."""
    profile = cfg.speculation
    scheduled = with_speculation(cfg.engine, profile, 0, vllm_doc_schedule(profile.num_speculative_tokens))
    if name == "tailsieve-dynsd":
        return replace(cfg, engine=scheduled, tail_engine=None, bulk_engine=None)
    return replace(cfg, tail_engine=cfg.tail_engine or with_speculation(cfg.engine, profile, max(cfg.spec_depths)),
                   bulk_engine=cfg.bulk_engine or scheduled)


def spec_label(cfg: SimConfig) -> str:
    """What a TailSieve speculation run's engines do: ``tail K_OR_SCHEDULE / bulk K_OR_SCHEDULE`` or one
    schedule."""
    if cfg.tail_engine is None:
        return schedule_text(cfg.engine.speculative.schedule)
    return f"tail {engine_label(cfg.tail_engine)} / bulk {engine_label(cfg.bulk_engine)}"
