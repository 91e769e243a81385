"""Measure a live server's decode step time over concurrency × context (``tailsieve calibrate``).

One sample of a point (batch b, prompt length p): submit b forced-length requests together, once
with D1 and once with D2 > D1 generated tokens, and time until the last one returns. Everything that does not
scale with the number of decode steps (HTTP, scheduling, prefill, detokenisation of the last
chunk) cancels in the difference, so

    step_s = (T(D2) − T(D1)) / (D2 − D1)

is the time of one decode step with b requests active at a mean context of p + (D1 + D2)/2 tokens
(the context the requests hold during the D1..D2 window). With speculation on, that difference is
the time per generated token; the spec-decode counters of ``/metrics`` read around each sample give
k and the tokens a request gains per step at that batch, hence the engine's verify step time, and the
acceptance per draft position at the requests' sampling temperature (``--temperature``, recorded).

The engine facts go under ``"engine"`` (read by :func:`core.engine.engine.engine_from_calibration`): the KV
cache (``vllm:cache_config_info``), a prefill rate — b requests of one generated token with a long
and a short prompt, ``(T(long) − T(short)) / (b · Δprompt)`` — and the speculation rows. Short and long runs alternate, every
repeat sweeps all points, and the median over repeats is kept, so a noisy machine's slow spells
are discarded rather than written into a few points. The result is the calibration
JSON that :class:`tailsieve_verl.core.engine.perf.Calibration` reads (``table:PATH`` / ``fitted:PATH``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..core.errors import TailSieveError
from ..core.engine.engine import measured_engine_fields
from ..core.engine.perf import Calibration
from .openai_client import EndpointError, ForcedRequest, OpenAIServer, synthetic_prompt
from .vllm_metrics import MetricsError, SpecCounters, kv_capacity, parse_metrics


class CalibrationPlanError(TailSieveError):
    """A sweep that cannot be measured (bad sizes, or longer than the server's context)."""


@dataclass(frozen=True)
class SweepPlan:
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    prompt_lens: tuple[int, ...] = (16, 448)
    decode_short: int = 16
    decode_long: int = 64
    repeats: int = 3
    prefill_lens: tuple[int, int] = (16, 1024)  # short and long prompt of the prefill measurement
    prefill_batch: int = 2  # requests per prefill sample (0: do not measure prefill)

    def __post_init__(self) -> None:
        if len(set(self.batches)) < 2 or min(self.batches) < 1:
            raise CalibrationPlanError(f"need at least two distinct batch sizes >= 1, got {list(self.batches)}")
        if not self.prompt_lens or min(self.prompt_lens) < 1:
            raise CalibrationPlanError(f"prompt lengths must be >= 1 token, got {list(self.prompt_lens)}")
        if not 1 <= self.decode_short < self.decode_long:
            raise CalibrationPlanError(f"need 1 <= decode_short < decode_long, got {self.decode_short}, "
                                       f"{self.decode_long}")
        if self.repeats < 1:
            raise CalibrationPlanError(f"repeats must be >= 1, got {self.repeats}")
        if len(self.prefill_lens) != 2 or not 1 <= self.prefill_lens[0] < self.prefill_lens[1]:
            raise CalibrationPlanError(f"prefill_lens must be (short, long) with 1 <= short < long, "
                                       f"got {list(self.prefill_lens)}")
        if self.prefill_batch < 0:
            raise CalibrationPlanError(f"prefill_batch must be >= 0, got {self.prefill_batch}")

    @property
    def points(self) -> list[tuple[int, int]]:
        return [(b, p) for p in sorted(set(self.prompt_lens)) for b in sorted(set(self.batches))]

    def context_of(self, prompt_len: int) -> float:
        """Mean KV context (tokens per request) during the measured decode window."""
        return prompt_len + (self.decode_short + self.decode_long) / 2.0


def _batch_seconds(server: OpenAIServer, batch: int, prompt_len: int, length: int, key: str) -> float:
    # Fresh prompts every run: a prefix-cache hit would skip one run's prefill and not the other's.
    requests = [ForcedRequest(synthetic_prompt(prompt_len, (key, i)), length) for i in range(batch)]
    return max(t.finish_s for t in server.run_together(requests))


def measure_step(server: OpenAIServer, batch: int, prompt_len: int, plan: SweepPlan, rep: int) -> float:
    """One estimate of the step time: a short and a long run back to back (which goes first
    alternates with ``rep``, so drift on a shared machine does not bias the difference)."""
    lengths = (plan.decode_short, plan.decode_long) if rep % 2 == 0 else (plan.decode_long, plan.decode_short)
    seconds = {n: _batch_seconds(server, batch, prompt_len, n, key=f"cal:{batch}:{prompt_len}:{rep}:{n}")
               for n in lengths}
    return (seconds[plan.decode_long] - seconds[plan.decode_short]) / (plan.decode_long - plan.decode_short)


def calibration_row(model: str, batch: int, prompt_len: int, plan: SweepPlan, steps: list[float]) -> dict:
    """The row of one point from its per-repeat step estimates (median kept, spread recorded)."""
    step_s = statistics.median(steps)
    if step_s <= 0:
        raise TailSieveError(f"batch {batch}, prompt {prompt_len}: the longer runs were not slower than the "
                             "shorter ones; the machine is too noisy or decode_long is too close to decode_short "
                             "— raise --decode-long or --repeats")
    return {
        "model": model,
        "batch": batch,
        "context": plan.context_of(prompt_len),
        "step_ms": round(step_s * 1000.0, 4),
        "prompt_len": prompt_len,
        "step_ms_spread": [round(min(steps) * 1000, 4), round(max(steps) * 1000, 4)],
        "per_request_tok_s": round(1.0 / step_s, 2),
        "repeats": len(steps),
    }


# Vector extensions that decide CPU decode speed (vLLM's bf16 matmuls need AVX-512 or AMX; with AVX2
# alone it falls back to a slow path), best first.
SIMD_LEVELS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def describe_local_host() -> str:
    cpu, simd = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
        flags = next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())
        cpu = names[0] if names else cpu
        simd = next((f", {level}" for level in SIMD_LEVELS if level in flags), "")
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores{simd} (host of the client)"


def read_metrics(server: OpenAIServer) -> dict | None:
    """The server's parsed /metrics, or None when it serves none (not a vLLM server)."""
    try:
        return parse_metrics(server.metrics_text())
    except EndpointError:
        return None


def measure_prefill(server: OpenAIServer, plan: SweepPlan) -> dict:
    """Seconds per prefilled token: ``prefill_batch`` requests of one generated token, with the long
    and the short prompt back to back (order alternating), median over ``repeats``. The short batch's
    time (HTTP, scheduling, a short prefill and one step) is recorded as well."""
    short, long_ = plan.prefill_lens
    if server.max_model_len:
        long_ = min(long_, int(server.max_model_len) - 2)
    b = plan.prefill_batch
    if long_ <= short:
        raise CalibrationPlanError(f"the server's max_model_len {server.max_model_len} leaves no room for a "
                                   f"prefill prompt longer than {short} tokens")
    rates, short_s = [], []
    for rep in range(plan.repeats):
        seconds = {}
        for p in ((short, long_) if rep % 2 == 0 else (long_, short)):
            requests = [ForcedRequest(synthetic_prompt(p, ("prefill", rep, p, i)), 1) for i in range(b)]
            seconds[p] = max(t.finish_s for t in server.run_together(requests))
        rates.append((seconds[long_] - seconds[short]) / (b * (long_ - short)))
        short_s.append(seconds[short])
    return {"prefill_s_per_token": max(statistics.median(rates), 0.0),
            "prefill": {"batch": b, "prompt_lens": [short, long_], "repeats": plan.repeats,
                        "s_per_token_samples": [round(r, 9) for r in rates],
                        "short_batch_s": statistics.median(short_s),
                        "method": "(T(long) - T(short)) / (batch * (long - short)), one generated token, "
                                  "median over repeats"}}


def speculation_rows(model_rows: list[dict], windows: dict[tuple[int, int], SpecCounters]) -> list[dict] | None:
    """Per point, what speculation did in its measured windows: k, tokens per verify step, the
    conditional per-position acceptance, and the engine step (per-token step × tokens per step)."""
    if not any(w.active for w in windows.values()):
        return None
    out = []
    for row in model_rows:
        w = windows[(row["batch"], row["prompt_len"])]
        out.append({"batch": row["batch"], "context": row["context"], "k": round(w.k, 3),
                    "tokens_per_step": round(w.tokens_per_step, 4),
                    "acceptance": [None if a != a else round(a, 4) for a in w.conditional_acceptance()],
                    "drafts": w.drafts, "draft_tokens": w.draft_tokens, "accepted": w.accepted,
                    "accepted_per_pos": list(w.accepted_per_pos),
                    "step_ms": round(row["step_ms"] * w.tokens_per_step, 4)})
    return out


def engine_facts(metrics: dict | None, prefill: dict | None, spec_rows: list[dict] | None,
                 temperature: float | None = None) -> dict:
    """The ``"engine"`` section: what the server's engine is, as the engine model reads it. With
    speculation, the acceptance per draft position pooled over the points (as the engine model pools
    it) and the sampling temperature it was measured at: acceptance depends on it."""
    facts: dict = {}
    if metrics is None:
        facts["kv_note"] = "the server has no /metrics: KV capacity unknown"
    else:
        try:
            kv = kv_capacity(metrics)
            facts.update(num_gpu_blocks=kv.num_gpu_blocks, block_size=kv.block_size)
        except MetricsError as e:
            facts["kv_note"] = str(e)
    if prefill:
        facts.update(prefill)
    if spec_rows:
        measured = measured_engine_fields({"speculative": {"rows": spec_rows}})["speculative"]
        facts["speculative"] = {"temperature": temperature, "k": measured.num_speculative_tokens,
                                "acceptance": [round(a, 4) for a in measured.acceptance],
                                "drafts": sum(r["drafts"] for r in spec_rows), "rows": spec_rows,
                                "method": "vllm:spec_decode_* counter differences over each point's measured runs; "
                                          "acceptance: conditional per draft position, pooled over the points "
                                          "that drafted the deepest k"}
    return facts


def calibrate(server: OpenAIServer, plan: SweepPlan, device: str | None = None,
              on_sample: Callable[[int, int, int, float, float], None] | None = None) -> dict:
    """Sweep the plan against ``server`` and return the calibration document.

    Repeat-major order: every repeat visits every point (odd repeats in reverse), so a slow spell
    of a shared machine lands on one sample of many points instead of on all samples of a few;
    the per-point median then discards it. ``on_sample(done, total, batch, context, step_s)`` is
    called after every sample."""
    server.complete(ForcedRequest(synthetic_prompt(max(plan.prompt_lens), "warm-up"), plan.decode_short))
    metrics = read_metrics(server)
    points = plan.points
    steps: dict[tuple[int, int], list[float]] = {point: [] for point in points}
    windows = {point: SpecCounters() for point in points}
    done = 0
    for rep in range(plan.repeats):
        for batch, prompt_len in (points if rep % 2 == 0 else points[::-1]):
            before = SpecCounters.from_metrics(read_metrics(server)) if metrics is not None else None
            step_s = measure_step(server, batch, prompt_len, plan, rep)
            if before is not None:
                windows[(batch, prompt_len)] += SpecCounters.from_metrics(read_metrics(server)) - before
            steps[(batch, prompt_len)].append(step_s)
            done += 1
            if on_sample:
                on_sample(done, plan.repeats * len(points), batch, plan.context_of(prompt_len), step_s)
    rows = [calibration_row(server.model, *point, plan, steps[point]) for point in points]
    prefill = measure_prefill(server, plan) if plan.prefill_batch else None
    return {
        "device": device or describe_local_host(),
        "source": "tailsieve calibrate",
        "url": server.url,
        "server_version": server.version(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "method": "step_ms = (T(decode_long) - T(decode_short)) / (decode_long - decode_short), median over repeats; "
                  "context = prompt_len + (decode_short + decode_long) / 2",
        "plan": {"batches": list(plan.batches), "prompt_lens": list(plan.prompt_lens),
                 "decode_short": plan.decode_short, "decode_long": plan.decode_long, "repeats": plan.repeats,
                 "prefill_lens": list(plan.prefill_lens), "prefill_batch": plan.prefill_batch,
                 "temperature": server.temperature},
        "rows": rows,
        "engine": engine_facts(metrics, prefill, speculation_rows(rows, windows), server.temperature),
    }


def write_calibration(doc: dict, path: str | os.PathLike) -> Calibration:
    """Write the document and read it back the way ``table:PATH`` will (fails loudly if it cannot)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return Calibration.load(str(path))
