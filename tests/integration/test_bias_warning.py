"""The trainer warns when the length-bias monitor's KS exceeds its noise for several steps in a row
(issue 20: a routing that loses the longest prompts shows up as a lasting length shift)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np

from tailsieve_verl.core.tailsieve.bias import LengthBiasMonitor
from tailsieve_verl.integration.trainer import TailSieveTrainer


def _steps(rng, scale: float, n_steps: int) -> list[list[tuple[int, ...]]]:
    return [[tuple(int(x) for x in rng.lognormal(np.log(100 * scale), 0.3, size=4)) for _ in range(16)]
            for _ in range(n_steps)]


def _watch(trainer, monitor, steps, rng) -> None:
    """Each step's consumed groups against the population the run pulls (stationary, scale 1)."""
    for consumed in steps:
        trainer.global_steps += 1
        TailSieveTrainer._watch_bias(trainer, monitor.update(consumed))
        monitor.add_reference(_steps(rng, 1.0, 1)[0])


def test_a_lasting_length_shift_warns_once_and_noise_does_not(caplog):
    rng = np.random.default_rng(0)
    trainer = SimpleNamespace(settings=SimpleNamespace(bias_warning_steps=3), bias_streak=0, global_steps=0)
    monitor = LengthBiasMonitor(window=8)
    with caplog.at_level(logging.WARNING, logger="tailsieve_verl.integration.trainer"):
        _watch(trainer, monitor, _steps(rng, 1.0, 8), rng)  # a stationary stream: KS about its noise
        assert not [r for r in caplog.records if "beyond sampling noise" in r.message]
        _watch(trainer, monitor, _steps(rng, 0.5, 4), rng)  # the consumed batches lose their long responses
    warnings = [r.message for r in caplog.records if "beyond sampling noise" in r.message]
    assert len(warnings) == 1 and "3 steps in a row" in warnings[0] and "max_deferral_steps" in warnings[0]


def test_no_warning_when_switched_off(caplog):
    rng = np.random.default_rng(1)
    trainer = SimpleNamespace(settings=SimpleNamespace(bias_warning_steps=0), bias_streak=0, global_steps=0)
    monitor = LengthBiasMonitor(window=8)
    with caplog.at_level(logging.WARNING, logger="tailsieve_verl.integration.trainer"):
        _watch(trainer, monitor, _steps(rng, 1.0, 4) + _steps(rng, 0.5, 6), rng)
    assert trainer.bias_streak >= 3
    assert not [r for r in caplog.records if "beyond sampling noise" in r.message]


def test_a_loss_of_long_prompts_from_the_first_step_on_warns(caplog):
    """Against earlier consumed batches a loss present from the start could never show: the reference
    is the population pulled (issue 31)."""
    rng = np.random.default_rng(2)
    trainer = SimpleNamespace(settings=SimpleNamespace(bias_warning_steps=3), bias_streak=0, global_steps=0)
    monitor = LengthBiasMonitor(window=8)
    with caplog.at_level(logging.WARNING, logger="tailsieve_verl.integration.trainer"):
        _watch(trainer, monitor, _steps(rng, 0.5, 8), rng)
    warnings = [r.message for r in caplog.records if "beyond sampling noise" in r.message]
    assert len(warnings) == 1 and "aborted ones included" in warnings[0]
