"""What a vLLM server's Prometheus ``/metrics`` text says about its engine (``tailsieve calibrate``).

Two facts the engine model needs and only the server knows:

* its KV cache: ``vllm:cache_config_info`` carries ``num_gpu_blocks`` and ``block_size`` as labels
  (vLLM v1; on CPU the block size is 128 and the blocks follow ``VLLM_CPU_KVCACHE_SPACE``);
* what speculation did: the counters ``vllm:spec_decode_num_drafts_total`` (request-steps that
  drafted), ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total`` and
  ``..._num_accepted_tokens_per_pos_total{position="i"}``. Their difference over a measured window
  gives k and the accepted tokens per step at that window's batch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..core.errors import TailSieveError


class MetricsError(TailSieveError):
    """A /metrics text that does not say what is needed."""


_SAMPLE = re.compile(r'^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(?P<key>[A-Za-z_][A-Za-z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition → {metric name: [(labels, value), ...]} (comments skipped)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        labels = {m["key"]: m["value"] for m in _LABEL.finditer(match["labels"] or "")}
        out.setdefault(match["name"], []).append((labels, value))
    return out


@dataclass(frozen=True)
class KVCapacity:
    num_gpu_blocks: int
    block_size: int

    @property
    def tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


def kv_capacity(metrics: dict) -> KVCapacity:
    """The KV cache of the server's engine from ``vllm:cache_config_info`` (engine 0)."""
    samples = metrics.get("vllm:cache_config_info", [])
    if not samples:
        raise MetricsError("the server's /metrics has no vllm:cache_config_info (not a vLLM v1 server?)")
    labels = min(samples, key=lambda s: s[0].get("engine", ""))[0]
    try:
        blocks, block_size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (KeyError, ValueError):
        raise MetricsError(f"vllm:cache_config_info lacks integer num_gpu_blocks/block_size: "
                           f"{ {k: labels.get(k) for k in ('num_gpu_blocks', 'block_size')} }") from None
    if blocks < 1 or block_size < 1:
        raise MetricsError(f"vllm:cache_config_info reports {blocks} blocks of {block_size} tokens")
    return KVCapacity(blocks, block_size)


def _total(metrics: dict, name: str) -> float:
    return sum(value for _, value in metrics.get(name, []))


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's spec-decode counters, summed over engines; subtract two readings for a window."""

    drafts: float = 0.0  # request-steps that verified a draft
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: tuple[float, ...] = ()

    @classmethod
    def from_metrics(cls, metrics: dict) -> "SpecCounters":
        per_pos: dict[int, float] = {}
        for labels, value in metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos_total", []):
            pos = int(labels.get("position", 0))
            per_pos[pos] = per_pos.get(pos, 0.0) + value
        return cls(_total(metrics, "vllm:spec_decode_num_drafts_total"),
                   _total(metrics, "vllm:spec_decode_num_draft_tokens_total"),
                   _total(metrics, "vllm:spec_decode_num_accepted_tokens_total"),
                   tuple(per_pos.get(i, 0.0) for i in range(max(per_pos, default=-1) + 1)))

    def __sub__(self, before: "SpecCounters") -> "SpecCounters":
        width = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        pad = lambda t: t + (0.0,) * (width - len(t))  # noqa: E731
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted,
                            tuple(a - b for a, b in zip(pad(self.accepted_per_pos), pad(before.accepted_per_pos))))

    def __add__(self, other: "SpecCounters") -> "SpecCounters":
        negated = SpecCounters(-other.drafts, -other.draft_tokens, -other.accepted,
                               tuple(-a for a in other.accepted_per_pos))
        return self - negated

    @property
    def active(self) -> bool:
        return self.drafts > 0

    @property
    def k(self) -> float:
        """Draft tokens per drafting request-step (the k the server used in the window)."""
        return self.draft_tokens / self.drafts if self.drafts else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a request gained per verify step: 1 + accepted drafts per step."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    def conditional_acceptance(self) -> list[float]:
        """P(position i accepted | positions < i accepted): per_pos[i] / per_pos[i-1], drafts for i = 0
        (a position is only tried after its predecessors were accepted). NaN where nothing was tried."""
        out, tried = [], self.drafts
        for accepted in self.accepted_per_pos:
            out.append(accepted / tried if tried > 0 else math.nan)
            tried = accepted
        return out
