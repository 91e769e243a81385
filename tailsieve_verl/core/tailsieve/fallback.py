"""TailSieve's fallback to stock verl, decided online from steps already run (``tailsieve-auto``).

Two arms: SPLIT (TailSieve: the controller's tail pool with deep speculation, the bulk pool on the
stock engine) and STOCK (one shared pool: stock verl's routing with the stock engine on every
replica; :meth:`core.tailsieve.cycle.TailSieveCycle.hold_shared`). Every step is judged against one yardstick:
the engine model's makespan of stock verl (with the stock engine in use) on the very groups the step
consumed, lengths known once the step ended — a replay of an observed step, no look ahead. A step's
ratio is its measured makespan over that yardstick. Stock steps measure the yardstick's own bias
(1.0 when the model is the truth, as in the simulator; a real engine's calibration error otherwise);
split steps that ran a tail pool measure the split. So the two arms are compared on equal work, not
on the luck of different steps' prompts.

The run starts on STOCK (stock is the bar; nothing is known about the split yet), probes the split
after ``first_probe`` steps — only while the split's best case on the steps observed so far (the same
replay with the longest groups put in the tail pool, known once a step ended) beats stock: a probe
where even that ceiling loses would only cost — holds it while its recent ratio beats stock's by ``margin``, and else
returns to stock and probes again after ``reprobe_steps`` stock steps, twice as long after each lost
probe. A losing probe costs about one step at the split's loss; the switch itself loses nothing: the
first stock step drains every carried prompt through the shared pool (consumed there, never aborted
again), so no prompt waits more than one step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from ..errors import TailSieveError


class FallbackError(TailSieveError):
    """An impossible fallback setting."""


class Arm(enum.Enum):
    STOCK = "stock"
    SPLIT = "split"


@dataclass(frozen=True)
class FallbackConfig:
    first_probe: int = 2
    """Stock steps before the first probe of the split (the stock engine's pick needs observed steps)."""
    probe_steps: int = 1
    """Split steps with a tail pool a probe judges."""
    max_probe_steps: int = 3
    """Split steps a probe may run waiting for a tail pool (the first split step after stock has
    nothing carried); a probe that never gets one is lost."""
    reprobe_steps: int = 8
    """Stock steps before the next probe after a lost one; doubles after each lost probe."""
    margin: float = 0.01
    """The split must beat stock's ratio by this fraction to be held (noise and the probe's cost)."""
    window: int = 3
    """Recent ratios averaged per arm."""

    def validate(self) -> None:
        for name in ("first_probe", "probe_steps", "max_probe_steps", "reprobe_steps", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "first_probe" else 1):
                raise FallbackError(f"fallback {name} must be an integer >= {0 if name == 'first_probe' else 1}, "
                                    f"got {value!r}")
        if self.max_probe_steps < self.probe_steps:
            raise FallbackError(f"fallback max_probe_steps ({self.max_probe_steps}) must be >= probe_steps "
                                f"({self.probe_steps})")
        if not 0 <= self.margin < 1:
            raise FallbackError(f"fallback margin must be in [0, 1), got {self.margin}")


class StockFallback:
    """Which arm the next step runs, from each observed step's ratio to the stock yardstick."""

    def __init__(self, config: FallbackConfig = FallbackConfig()):
        config.validate()
        self.config = config
        self.arm = Arm.STOCK
        self.ratios: dict[Arm, list[float]] = {Arm.STOCK: [], Arm.SPLIT: []}
        self.next_probe = config.first_probe
        self.backoff = config.reprobe_steps
        self.probing = False
        self.probe_steps_run = 0
        self.probe_judged = 0
        self.split_steps = 0
        self.probes = 0
        self.gated = 0  # steps a due probe waited because the split's ceiling did not beat stock

    def stock_ratio(self) -> float:
        """Stock's recent ratio to its own yardstick (1.0 before any stock step)."""
        recent = self.ratios[Arm.STOCK][-self.config.window:]
        return float(np.mean(recent)) if recent else 1.0

    def observe(self, step: int, ratio: float, had_tail: bool, split_may_win: bool = True) -> Arm:
        """Fold in step ``step`` (run on :attr:`arm`): measured makespan / yardstick, whether a tail
        pool ran, and whether the split's ceiling on the steps so far beats stock (a due probe waits
        while it does not). Returns the arm of step ``step + 1``."""
        if not np.isfinite(ratio) or ratio <= 0:
            raise FallbackError(f"step {step}: a makespan ratio must be a positive number, got {ratio}")
        cfg = self.config
        if self.arm is Arm.STOCK:
            self.ratios[Arm.STOCK].append(ratio)
            if step + 1 >= self.next_probe and not split_may_win:
                self.gated += 1
            elif step + 1 >= self.next_probe:
                self.arm, self.probing, self.probe_steps_run, self.probe_judged = Arm.SPLIT, True, 0, 0
                self.probes += 1
            return self.arm
        self.split_steps += 1
        if had_tail:
            self.ratios[Arm.SPLIT].append(ratio)
        if self.probing:
            self.probe_steps_run += 1
            self.probe_judged += had_tail
            if self.probe_judged >= cfg.probe_steps:
                won = np.mean(self.ratios[Arm.SPLIT][-self.probe_judged:]) < self.stock_ratio() * (1 - cfg.margin)
                if won:
                    self.probing = False
                else:
                    self._back_to_stock(step, lost_probe=True)
            elif self.probe_steps_run >= cfg.max_probe_steps:
                self._back_to_stock(step, lost_probe=True)
        elif had_tail and np.mean(self.ratios[Arm.SPLIT][-cfg.window:]) >= self.stock_ratio():
            self._back_to_stock(step, lost_probe=False)
        return self.arm

    def _back_to_stock(self, step: int, lost_probe: bool) -> None:
        self.arm, self.probing = Arm.STOCK, False
        self.next_probe = step + 1 + self.backoff
        if lost_probe:
            self.backoff *= 2
