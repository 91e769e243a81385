"""What a simulation reports: per-step records, per-policy results, speedups, bias and warnings."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..tailsieve.bias import ks_distance, ks_noise
from ..engine.verify_cost import VerifyTable
from ..kinds import Pool
from .config import BASELINE, SPEC_POLICIES, STOCK_POLICIES, STOCK_TP, SimConfig


def _settings_json(settings) -> dict:
    """An engine or speculation config as JSON; a measured verify table by its name (file:model)."""
    return asdict(settings, dict_factory=lambda items: {k: v.name if isinstance(v, VerifyTable) else v
                                                        for k, v in items})


@dataclass(frozen=True)
class GroupSpan:
    """One sample's run in the kept step, for the Gantt chart."""

    replica: int
    finish_s: float  # when it finished (or the abort moment)
    route: Pool  # TAIL or BULK
    aborted: bool


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One policy's step (keyword-only: fourteen fields, several of the same type)."""

    step: int
    makespan_s: float
    q: int  # the isolation target of this step (the controller's q)
    m: int  # tail-pool replicas used this step (0 = one shared pool)
    n_tail: int  # carried groups regenerated this step
    tail_s: float  # tail pool done (0 without a tail pool)
    bulk_s: float  # the bulk pool's end (its last consumed group), or the shared pool's end
    wasted_tokens: int  # the aborted groups' work at the abort (core.tailsieve.selector.StepOutcome.aborted_work)
    consumed_tokens: int
    consumed_lengths: tuple[int, ...]  # response lengths of the B consumed groups (bias monitor)
    replica_busy_s: tuple[float, ...]
    next_q: int
    next_m: int
    n_requeued: int = 0  # carried candidates drained through the bulk pool (run to completion)
    deferred_s: float = 0.0  # how much longer the step would have run had it aborted nothing (its aborted groups
    #   decoding on to their end beside the rest): the work it carried out, as
    #   :meth:`PolicyResult.window_mean_s` charges it (0 for a policy that carries nothing)
    record_planned: bool = False  # TailSieve planned this step's split from its per-prompt record
    record_rho: float | None = None  # the record's Spearman rho, predicted against measured group work (None: < 3)
    spans: tuple[GroupSpan, ...] = ()  # only for the kept step


@dataclass
class PolicyResult:
    name: str
    records: list[StepRecord] = field(default_factory=list)
    lost: int = 0
    duplicated: int = 0
    stale: int = 0  # consumed groups generated under an older policy version
    max_deferral_steps: int = 0  # the most steps a prompt waited between its pull and its consumption
    choice: str = ""  # a best-in-hindsight policy's pick (best-static's split, verl-spec's k, a schedule)
    alternatives: dict = field(default_factory=dict)  # a best-in-hindsight policy's choices that ran to the end (the
    #   pick among them; a screen stops the rest), by key: their steps without spans or lengths, for window_mean_s

    @property
    def makespans(self) -> np.ndarray:
        return np.array([r.makespan_s for r in self.records])

    @property
    def mean_makespan_s(self) -> float:
        return self.window_mean_s(slice(None))

    def window_mean_s(self, window: slice) -> float:
        """Mean makespan over the steps of ``window``, deferred work charged: its last step is paid as if it ran
        its aborted groups to their end (``deferred_s``), so a run that aborts groups it never regenerates
        inside the window does not count that work as saved (a 3-step plan of 64 prompts predicted 1.16x over
        stock verl, above the per-prompt oracle, from exactly that). Work carried into the window is paid
        inside it (regenerated), not credited: steady carrying costs one step's deferral per window, a
        conservative bias (0-10 s of deferral against 34-s steps at 64 x 8: under 1 % on a 20-step window)."""
        steps = range(len(self.records))[window]
        if not steps:
            raise ValueError(f"window {window} holds none of the {len(self.records)} steps")
        total = sum(self.records[t].makespan_s for t in steps) + self.records[steps[-1]].deferred_s
        return float(total / len(steps))

    @property
    def record_rho(self) -> float | None:
        """The mean of the steps' record rho (None where no step had one)."""
        values = [r.record_rho for r in self.records if r.record_rho is not None]
        return float(np.mean(values)) if values else None

    @property
    def consumed_lengths(self) -> np.ndarray:
        """Every consumed response length of the run."""
        return np.fromiter((x for r in self.records for x in r.consumed_lengths), dtype=float)

    def length_bias(self, reference: "PolicyResult", batch_size: int) -> tuple[float, float]:
        """KS distance of this run's consumed lengths to ``reference``'s, and that distance's noise for
        two unbiased samples of as many groups (:mod:`core.tailsieve.bias`; groups, not responses, are independent)."""
        return (ks_distance(self.consumed_lengths, reference.consumed_lengths),
                ks_noise(batch_size * len(self.records), batch_size * len(reference.records)))

    @property
    def wasted_fraction(self) -> float:
        wasted = sum(r.wasted_tokens for r in self.records)
        return wasted / max(1, wasted + sum(r.consumed_tokens for r in self.records))


@dataclass
class SimResult:
    config: SimConfig
    workload: str
    perf: str
    policies: dict[str, PolicyResult]

    def speedup_vs(self, baseline: str, window: slice | None = None) -> dict[str, float]:
        """Mean-makespan speedup of every policy over ``baseline`` ({} when it did not run), deferred work
        charged (:meth:`PolicyResult.window_mean_s`)."""
        if baseline not in self.policies:
            return {}
        window = window or slice(None)
        base = self.policies[baseline].window_mean_s(window)
        return {name: float(base / r.window_mean_s(window)) for name, r in self.policies.items()}

    @property
    def best_stock(self) -> str | None:
        """The fastest stock configuration that ran (:data:`STOCK_POLICIES`: stock verl with or without
        speculation; ``verl-tp``, its best single width), the bar TailSieve must clear; None when none ran."""
        stock = [name for name in (*STOCK_POLICIES, STOCK_TP) if name in self.policies]
        return min(stock, key=lambda name: self.policies[name].mean_makespan_s, default=None)

    def length_bias(self) -> dict[str, tuple[float, float]]:
        """(KS distance, its noise) of every policy's consumed lengths against stock verl's on the same
        stream ({} when stock verl did not run): a routing-induced length bias shows as a KS well above
        its noise."""
        if BASELINE not in self.policies:
            return {}
        base = self.policies[BASELINE]
        return {name: r.length_bias(base, self.config.batch_size) for name, r in self.policies.items()}

    def warnings(self) -> list[str]:
        """What a reader must check before trusting the speedups."""
        out = []
        vs_verl = self.speedup_vs(BASELINE)
        ceiling = vs_verl.get("clairvoyant-sample")
        for name, r in self.policies.items():
            if r.max_deferral_steps > 1:
                out.append(f"{name}: a prompt waited {r.max_deferral_steps} steps between its pull and its "
                           "consumption (more than one step: its consumed batches lose long prompts)")
            if ceiling is not None and name.startswith("tailsieve") and vs_verl[name] > ceiling:
                out.append(f"{name} is {vs_verl[name]:.3f}x stock verl, above the clairvoyant per-sample reference "
                           f"({ceiling:.3f}x): check max_deferral_steps first ({r.max_deferral_steps}: a prompt "
                           "deferred to a later step makes this step look short), then the reference's "
                           "--oracle-time-limit")
        for name, (ks, noise) in self.length_bias().items():
            if ks > 2 * noise:
                out.append(f"{name}: consumed lengths differ from stock verl's (KS {ks:.3f}, noise {noise:.3f}): a "
                           "length bias in what the policy trains on")
        return out

    def to_json(self) -> dict:
        final = {name: r.records[-1] for name, r in self.policies.items()}
        bias = self.length_bias()
        return {
            "workload": self.workload, "perf_model": self.perf,
            "steps": self.config.steps, "replicas": self.config.n_replicas,
            "batch": self.config.batch_size, "n": self.config.n, "seed": self.config.seed,
            "group_atomic": self.config.group_atomic,
            "engine": _settings_json(self.config.engine),
            "tail_engine": _settings_json(self.config.tail_engine) if self.config.tail_engine else None,
            "bulk_engine": _settings_json(self.config.bulk_engine) if self.config.bulk_engine else None,
            "stock_widths": [_settings_json(e) for e in self.config.stock_widths],
            "speculation": (_settings_json(self.config.speculation)
                            if any(p in SPEC_POLICIES for p in self.policies) else None),
            "policies": {name: {"mean_makespan_s": r.mean_makespan_s, "choice": r.choice or None,
                                "final_q": final[name].next_q, "final_m": final[name].next_m,
                                "wasted_token_fraction": r.wasted_fraction,
                                "prompts_lost": r.lost, "prompts_duplicated": r.duplicated,
                                "stale_responses": r.stale, "max_deferral_steps": r.max_deferral_steps,
                                "consumed_mean_length": float(r.consumed_lengths.mean()),
                                "length_bias_ks": bias[name][0] if name in bias else None,
                                "length_bias_ks_noise": bias[name][1] if name in bias else None,
                                "record_planned_steps": sum(x.record_planned for x in r.records),
                                "record_rho": r.record_rho,
                                "makespan_s": [round(x, 4) for x in r.makespans.tolist()],
                                "q": [x.q for x in r.records], "m": [x.m for x in r.records]}
                         for name, r in self.policies.items()},
            "speedup_vs_verl": self.speedup_vs("verl"),
            "speedup_vs_uniform": self.speedup_vs("uniform"),
            "best_stock": self.best_stock,
            "speedup_vs_best_stock": self.speedup_vs(self.best_stock) if self.best_stock else {},
            "warnings": self.warnings(),
        }
