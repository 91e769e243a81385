"""Synthetic rollout workloads with persistent prompt difficulty, and the seed's tail transform.

Response length model (log space, before the transform and truncation)::

    log L = log(median) + prompt_i + checkpoint_t + interaction_{i,t} + sampling_{i,t,j}

with variance shares taken from the seed's measurement of response-length variance
(prompt 64.8 %, sampling 26.1 %, checkpoint 2.2 %, prompt×checkpoint interaction 6.9 %) of a total
log-variance ``log_sigma²``. The prompt effect is fixed per prompt (what makes a tail prompt a tail
prompt again next step); the checkpoint and interaction effects drift slowly as AR(1) processes over
training steps (``drift_corr`` per step); sampling noise is fresh for every response.

The *tail transform* (seed, appendix) then changes only lengths above the median, keeps their order
and the median, and maps the original P90 to ``r × median`` so that P90/P50 = r (presets: weak
r = 1.5, strong r = 6; ``real`` keeps the model's own ratio, ≈ 3.6). Finally lengths are rounded and
truncated at ``max_response_length``, which leaves the point mass a real rollout shows there.

:class:`PromptPool` serves both the offline study (one step's groups) and the multi-step simulator
(fresh lengths on every regeneration of a prompt, drifting with the checkpoint); it can also draw
from an observed trace (per prompt, lengths resampled with replacement).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from statistics import NormalDist
from typing import Sequence

import numpy as np

from ..errors import TailSieveError
from .trace import Group, Trace

# Seed measurement: shares of response-length variance.
SEED_VARIANCE_SHARES = {"prompt": 0.648, "sampling": 0.261, "checkpoint": 0.022, "interaction": 0.069}
Z90 = 1.2815515655446004  # standard normal 90th percentile


class WorkloadError(TailSieveError):
    """A bad workload preset, parameter or prompt source."""


@dataclass(frozen=True)
class WorkloadSpec:
    """Parameters of a synthetic workload; ``tail_ratio`` None keeps the model's own P90/P50."""

    name: str
    median_len: float = 1024.0
    log_sigma: float = 1.0
    tail_ratio: float | None = None
    max_response_length: int = 16384
    drift_corr: float = 0.9
    prompt_share: float = SEED_VARIANCE_SHARES["prompt"]
    sampling_share: float = SEED_VARIANCE_SHARES["sampling"]
    checkpoint_share: float = SEED_VARIANCE_SHARES["checkpoint"]
    interaction_share: float = SEED_VARIANCE_SHARES["interaction"]
    prompt_len: int = 0
    length_trend: float = 0.0  # growth of every prompt's log length per step: RL responses lengthen over training

    def __post_init__(self) -> None:
        shares = (self.prompt_share, self.sampling_share, self.checkpoint_share, self.interaction_share)
        if any(s < 0 for s in shares) or abs(sum(shares) - 1.0) > 1e-6:
            raise WorkloadError(f"workload {self.name!r}: variance shares must be >= 0 and sum to 1, got {shares}")
        if self.median_len < 1 or self.log_sigma < 0:
            raise WorkloadError(f"workload {self.name!r}: need median_len >= 1 and log_sigma >= 0")
        if self.max_response_length < 1 or self.max_response_length < self.median_len:
            raise WorkloadError(f"workload {self.name!r}: max_response_length ({self.max_response_length}) must be "
                                f">= the median length ({self.median_len:g}); raise the cap (--max-response-length)")
        if self.tail_ratio is not None and self.tail_ratio <= 1:
            raise WorkloadError(f"workload {self.name!r}: tail ratio P90/P50 must be > 1, got {self.tail_ratio}")
        if not 0 <= self.drift_corr <= 1:
            raise WorkloadError(f"workload {self.name!r}: drift_corr must lie in [0, 1], got {self.drift_corr}")
        if not abs(self.length_trend) < 1:
            raise WorkloadError(f"workload {self.name!r}: length_trend (log growth per step) must be a number in "
                                f"(-1, 1), got {self.length_trend}")

    @property
    def model_p90_ratio(self) -> float:
        """P90/P50 of the untransformed length model (its marginal is log-normal)."""
        return float(np.exp(Z90 * self.log_sigma))


PRESETS: dict[str, WorkloadSpec] = {
    "weak": WorkloadSpec("weak", tail_ratio=1.5),
    "real": WorkloadSpec("real"),
    "strong": WorkloadSpec("strong", tail_ratio=6.0),
}


@dataclass(frozen=True)
class LengthProfile:
    """What says which preset a pool of response lengths is like: its tail (P90/P50), its mean against its
    median, and the share of samples at the response cap (a truncated tail piles up there)."""

    p50: float
    p90: float
    mean: float
    cap: int  # the response cap the share is counted at
    cap_share: float  # share of samples at or above ``cap``

    @property
    def tail_ratio(self) -> float:
        return self.p90 / self.p50

    @property
    def mean_ratio(self) -> float:
        return self.mean / self.p50

    @classmethod
    def of(cls, lengths: Sequence[float], cap: int | None = None) -> "LengthProfile":
        """The profile of observed ``lengths``; ``cap`` defaults to the longest of them."""
        x = np.asarray(lengths, dtype=float)
        if x.size == 0:
            raise WorkloadError("a length profile needs at least one length")
        if not np.percentile(x, 50) > 0:
            raise WorkloadError("a length profile needs a median length above 0")
        cap = int(cap if cap is not None else x.max())
        return cls(float(np.percentile(x, 50)), float(np.percentile(x, 90)), float(x.mean()), cap,
                   float(np.mean(x >= cap)))

    def closest_preset(self) -> str:
        """The preset whose P90/P50 is nearest in log space (the presets differ by that ratio alone)."""
        return min(PRESETS, key=lambda name: abs(np.log(self.tail_ratio / preset_profile(name).tail_ratio)))

    def to_json(self) -> dict:
        return {"p50": self.p50, "p90": self.p90, "p90_p50": self.tail_ratio, "mean": self.mean,
                "mean_p50": self.mean_ratio, "cap": self.cap, "cap_share": self.cap_share}


@lru_cache(maxsize=None)
def preset_profile(name: str, points: int = 20_000) -> LengthProfile:
    """A preset's length profile over training (its marginal: log-normal of ``log_sigma`` around the median,
    through the tail transform, rounded and capped), from ``points`` evenly spaced quantiles: no sampling."""
    spec = get_preset(name)
    normal = np.array([NormalDist().inv_cdf((i + 0.5) / points) for i in range(points)])
    raw = spec.median_len * np.exp(spec.log_sigma * normal)
    if spec.tail_ratio is not None:
        raw = TailTransform.fit(spec.median_len, spec.median_len * spec.model_p90_ratio, spec.tail_ratio)(raw)
    lengths = np.clip(np.rint(raw), 1, spec.max_response_length)
    return LengthProfile.of(lengths, spec.max_response_length)


def get_preset(name: str, **overrides) -> WorkloadSpec:
    """A preset by name, optionally with fields replaced (e.g. ``max_response_length``)."""
    if name not in PRESETS:
        raise WorkloadError(f"unknown workload preset {name!r}; choose one of {', '.join(PRESETS)} "
                            "or give a trace file")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class TailTransform:
    """Monotone map that stretches (or squeezes) lengths above ``median`` by ``scale``."""

    median: float
    scale: float

    @classmethod
    def fit(cls, median: float, p90: float, ratio: float) -> "TailTransform":
        """The map that sends ``p90`` to ``ratio × median`` and fixes everything up to the median."""
        if ratio <= 1:
            raise WorkloadError(f"tail ratio P90/P50 must be > 1, got {ratio}")
        if not p90 > median:
            raise WorkloadError(f"cannot reshape the tail: P90 ({p90:g}) is not above the median ({median:g}); "
                                "the lengths have no upper tail")
        return cls(float(median), float((ratio - 1.0) * median / (p90 - median)))

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        x = np.asarray(lengths, dtype=float)
        return np.where(x > self.median, self.median + (x - self.median) * self.scale, x)


def tail_transform(lengths: Sequence[float], ratio: float, max_response_length: int | None = None) -> np.ndarray:
    """The seed's transform on an observed set of lengths: empirical median and P90, P90/P50 → ratio."""
    x = np.asarray(lengths, dtype=float)
    if x.size == 0:
        raise WorkloadError("tail transform needs at least one length")
    transform = TailTransform.fit(float(np.median(x)), float(np.percentile(x, 90)), ratio)
    out = np.rint(transform(x)).astype(np.int64)
    return np.minimum(out, max_response_length) if max_response_length is not None else out


class PromptPool:
    """A dataset of prompts with persistent difficulty; each call samples fresh response lengths.

    ``sample_group(prompt_id, n, step, rng)`` draws n lengths for that prompt under the checkpoint of
    training step ``step``: prompt effect fixed, checkpoint/interaction effects drifting with the
    step (a deterministic function of the pool's seed, so every caller sees the same checkpoint),
    sampling noise from ``rng``.
    """

    def __init__(self, spec: WorkloadSpec | str, n_prompts: int, seed: int = 0):
        self.spec = get_preset(spec) if isinstance(spec, str) else spec
        if n_prompts < 1:
            raise WorkloadError(f"a prompt pool needs at least one prompt, got {n_prompts}")
        self._rng = np.random.default_rng(seed)
        self.prompt_ids: tuple[str, ...] = tuple(f"p{i:06d}" for i in range(n_prompts))
        self._index = {pid: i for i, pid in enumerate(self.prompt_ids)}
        var = self.spec.log_sigma ** 2
        self._sd = {name: float(np.sqrt(getattr(self.spec, f"{name}_share") * var))
                    for name in ("prompt", "sampling", "checkpoint", "interaction")}
        self.difficulty = self._rng.normal(0.0, self._sd["prompt"], n_prompts)
        self._checkpoint: list[float] = []
        self._interaction: list[np.ndarray] = []
        self._observed: list[np.ndarray] | None = None
        self._transform = (TailTransform.fit(self.spec.median_len, self.spec.median_len * self.spec.model_p90_ratio,
                                             self.spec.tail_ratio) if self.spec.tail_ratio is not None else None)

    @classmethod
    def from_trace(cls, trace: Trace, tail_ratio: float | None = None, max_response_length: int | None = None,
                   seed: int = 0) -> "PromptPool":
        """Prompts of an observed trace; lengths resampled with replacement per prompt, no drift.

        With ``tail_ratio`` the seed's transform is fitted on the trace's pooled lengths.
        """
        lengths = np.asarray(trace.lengths, dtype=float)
        cap = int(max_response_length or lengths.max())
        spec = WorkloadSpec(f"trace:{trace.name}", median_len=max(1.0, float(np.median(lengths))), log_sigma=0.0,
                            tail_ratio=tail_ratio, max_response_length=max(cap, int(np.ceil(np.median(lengths)))),
                            prompt_len=0)
        pool = cls.__new__(cls)
        pool.spec = spec
        pool._rng = np.random.default_rng(seed)
        pool.prompt_ids = tuple(g.prompt_id for g in trace)
        pool._index = {pid: i for i, pid in enumerate(pool.prompt_ids)}
        pool._observed = [np.asarray(g.lengths, dtype=np.int64) for g in trace]
        pool._prompt_lens = [g.prompt_len for g in trace]
        pool._sd = dict.fromkeys(("prompt", "sampling", "checkpoint", "interaction"), 0.0)
        pool._checkpoint, pool._interaction = [], []
        pool.difficulty = np.array([np.log(max(1.0, float(np.mean(x)))) for x in pool._observed])
        pool._transform = (TailTransform.fit(float(np.median(lengths)), float(np.percentile(lengths, 90)), tail_ratio)
                           if tail_ratio is not None else None)
        return pool

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def _effects_at(self, step: int) -> tuple[float, np.ndarray]:
        if step < 0:
            raise WorkloadError(f"training step must be >= 0, got {step}")
        rho = self.spec.drift_corr
        innovation = np.sqrt(1.0 - rho * rho)
        while len(self._checkpoint) <= step:
            if not self._checkpoint:
                c = self._rng.normal(0.0, self._sd["checkpoint"])
                inter = self._rng.normal(0.0, self._sd["interaction"], len(self.prompt_ids))
            else:
                c = rho * self._checkpoint[-1] + innovation * self._rng.normal(0.0, self._sd["checkpoint"])
                inter = rho * self._interaction[-1] + innovation * self._rng.normal(
                    0.0, self._sd["interaction"], len(self.prompt_ids))
            self._checkpoint.append(float(c))
            self._interaction.append(inter)
        return self._checkpoint[step], self._interaction[step]

    def log_lengths(self, prompt_id: str, n: int, step: int, rng: np.random.Generator) -> np.ndarray:
        """Untransformed, untruncated log lengths (the variance-share model; for diagnostics)."""
        if self._observed is not None:
            raise WorkloadError("a trace-backed pool has no length model; use sample_group")
        return self._log_median(self._prompt_index(prompt_id), step) + rng.normal(0.0, self._sd["sampling"], n)

    def _log_median(self, i: int, step: int, history_only: bool = False) -> float:
        """Log median length of prompt ``i`` under the checkpoint of ``step``: its prompt and checkpoint
        effects and the run's length trend, no sampling noise; ``history_only``: without this step's
        prompt × checkpoint interaction (see :meth:`typical_group`)."""
        checkpoint, interaction = self._effects_at(step)
        return (np.log(self.spec.median_len) + self.spec.length_trend * step + self.difficulty[i] + checkpoint
                + (0.0 if history_only else interaction[i]))

    def _as_lengths(self, raw: np.ndarray) -> np.ndarray:
        """Raw lengths as the pool hands them out: transformed, whole tokens, 1..max_response_length."""
        if self._transform is not None:
            raw = self._transform(raw)
        return np.clip(np.rint(raw), 1, self.spec.max_response_length).astype(np.int64)

    def typical_length(self, prompt_id: str, step: int, history_only: bool = False) -> int:
        """The prompt's median response length under the checkpoint of ``step``: all that can be known
        of its lengths before sampling (prompt and checkpoint effects, no sampling noise), so the best
        any per-prompt predictor can do; ``history_only``: what earlier steps can tell (:meth:`typical_group`).
        A trace-backed pool gives the median it observed."""
        i = self._prompt_index(prompt_id)
        raw = (np.median(self._observed[i]) if self._observed is not None
               else np.exp(self._log_median(i, step, history_only)))
        return int(self._as_lengths(np.array([raw], dtype=float))[0])  # the transform is monotone: median to median

    def typical_group(self, prompt_id: str, n: int, step: int, history_only: bool = False) -> Group:
        """n lengths at evenly spaced quantiles of the prompt's length distribution under the checkpoint
        of ``step`` (no sampling luck): what a perfect per-prompt predictor expects a group to look like.

        ``history_only``: the distribution as far as the prompt's earlier steps can tell it, however many:
        its difficulty, the checkpoint and the trend, but not this step's prompt × checkpoint interaction,
        which decorrelates within an epoch (``drift_corr`` 0.9 a step: 0.9³³ ≈ 0.03) and so joins the
        sampling spread. The ceiling of any per-prompt record of past lengths."""
        if n < 1:
            raise WorkloadError(f"group size must be >= 1, got {n}")
        i = self._prompt_index(prompt_id)
        levels = (np.arange(n) + 0.5) / n
        if self._observed is not None:
            raw = np.quantile(self._observed[i].astype(float), levels)
        else:
            normal = np.array([NormalDist().inv_cdf(x) for x in levels])
            sd = np.hypot(self._sd["sampling"], self._sd["interaction"]) if history_only else self._sd["sampling"]
            raw = np.exp(self._log_median(i, step, history_only) + sd * normal)
        return self._group(prompt_id, i, raw)

    def sample_group(self, prompt_id: str, n: int, step: int, rng: np.random.Generator) -> Group:
        """n fresh response lengths for ``prompt_id`` under the checkpoint of ``step``."""
        if n < 1:
            raise WorkloadError(f"group size must be >= 1, got {n}")
        i = self._prompt_index(prompt_id)
        if self._observed is not None:
            if step < 0:
                raise WorkloadError(f"training step must be >= 0, got {step}")
            raw = rng.choice(self._observed[i], size=n, replace=True).astype(float)
        else:
            raw = np.exp(self.log_lengths(prompt_id, n, step, rng))
        return self._group(prompt_id, i, raw)

    def _group(self, prompt_id: str, i: int, raw: np.ndarray) -> Group:
        """Prompt ``i``'s group of these raw lengths, as the pool hands groups out (its prompt length:
        observed for a trace-backed pool, the spec's otherwise)."""
        prompt_len = self._prompt_lens[i] if self._observed is not None else self.spec.prompt_len
        return Group(prompt_id, tuple(int(v) for v in self._as_lengths(raw)), int(prompt_len))

    def sample_groups(self, prompt_ids: Sequence[str], n: int, step: int, rng: np.random.Generator) -> list[Group]:
        return [self.sample_group(pid, n, step, rng) for pid in prompt_ids]

    def sample_batch(self, batch_size: int, n: int, step: int, rng: np.random.Generator) -> list[Group]:
        """``batch_size`` distinct prompts drawn uniformly, n samples each."""
        if not 1 <= batch_size <= len(self):
            raise WorkloadError(f"batch size must be between 1 and the pool size ({len(self)}), got {batch_size}")
        picks = rng.choice(len(self), size=batch_size, replace=False)
        return self.sample_groups([self.prompt_ids[i] for i in picks], n, step, rng)

    def _prompt_index(self, prompt_id: str) -> int:
        try:
            return self._index[prompt_id]
        except KeyError:
            raise WorkloadError(f"unknown prompt {prompt_id!r}; the pool has {len(self)} prompts") from None


def cap_trace(trace: Trace, max_response_length: int | None = None, max_prompt_length: int | None = None) -> Trace:
    """A logged trace under verl's caps (``data.max_response_length``, ``data.max_prompt_length``):
    generation stops at the response cap and a longer prompt is cut to the prompt cap. None: no cap."""
    if max_response_length is None and max_prompt_length is None:
        return trace
    cap_r = max_response_length if max_response_length is not None else max(trace.lengths, default=0)
    cap_p = max_prompt_length if max_prompt_length is not None else max((g.prompt_len for g in trace), default=0)
    return Trace(tuple(Group(g.prompt_id, tuple(min(x, cap_r) for x in g.lengths), min(g.prompt_len, cap_p))
                       for g in trace), name=trace.name)


def rare_extreme_pool(seed: int = 0, n_prompts: int = 192, median_len: float = 155.0, cap: int = 16000,
                      every: int = 32) -> PromptPool:
    """A stress pool for deferral and length bias (issue 20): short responses (median ~``median_len``,
    8 observed per prompt) and every ``every``-th prompt now and then (one draw in 8) at the ``cap``.
    A selector that may abort a drained prompt again keeps exactly these prompts out of the consumed
    batches for many steps."""
    rng = np.random.default_rng(seed)
    groups = []
    for i in range(n_prompts):
        lengths = rng.lognormal(np.log(median_len), 0.35, 8)
        if i % every == 0:
            lengths[0] = cap
        groups.append(Group(f"x{i:03d}", tuple(int(max(1, v)) for v in lengths), 0))
    return PromptPool.from_trace(Trace(tuple(groups), name="rare-extreme"), seed=seed)


def generate_trace(workload: WorkloadSpec | str, n_groups: int, group_size: int, seed: int = 0, step: int = 0,
                   name: str | None = None) -> Trace:
    """One rollout step's groups from a fresh pool of ``n_groups`` prompts."""
    pool = PromptPool(workload, n_groups, seed=seed)
    rng = np.random.default_rng([seed, 1])
    groups = pool.sample_groups(pool.prompt_ids, group_size, step, rng)
    return Trace(tuple(groups), name=name or f"{pool.spec.name}:seed{seed}")
