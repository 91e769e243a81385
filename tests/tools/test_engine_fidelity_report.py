"""The shipped engine-fidelity results are what the script's summary makes of their own steps, and
the host's repeat noise is scored like the model (each repetition against the others' median)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fidelity():
    spec = importlib.util.spec_from_file_location("engine_fidelity", ROOT / "scripts/experiments/engine_fidelity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_repeat_noise_scores_each_repetition_against_the_median_of_the_others(fidelity):
    rows = {"case": [{"measured_s": 1.0}, {"measured_s": 1.1}, {"measured_s": 1.3}], "single": [{"measured_s": 2.0}]}
    assert fidelity.repeat_noise(rows) == pytest.approx([0.2, 0.05 / 1.1, 0.25 / 1.3])


@pytest.mark.parametrize("run", ["", "run1_loaded", "run2_loaded"])
def test_shipped_fidelity_summaries_follow_from_their_steps(fidelity, run):
    report = json.loads((ROOT / "scripts/results/engine_model" / run / "fidelity.json").read_text())
    assert fidelity.summarize(report["steps"]) == report["regimes"]
    assert set(report["regimes"]) == {"plain", "concurrency_limit", "kv_pressure", "speculation", "dynamic_sd"}
    text = (ROOT / "scripts/results/engine_model" / run / "fidelity.txt").read_text()
    assert text == fidelity.text_summary(report)
