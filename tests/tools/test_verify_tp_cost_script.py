"""scripts/gpu/verify_tp_cost.py: its restated model is the engine model's, it refuses a box without 2 GPUs in
one line, and a tiny run on CPU (2 ranks over gloo) writes every width's rows beside the model's. Timings on CPU
mean nothing; a multi-GPU run is the measurement."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tailsieve_verl.core.engine.perf import LinearPerf, TensorParallel, TensorParallelPerf  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "verify_tp_cost.py"


@pytest.fixture(scope="module")
def vt():
    """The script imported by its own name from its folder: the ranks it spawns import their entry point so."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        yield importlib.import_module(SCRIPT.stem)
    finally:
        sys.path.remove(str(SCRIPT.parent))
        sys.modules.pop(SCRIPT.stem, None)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("batch", [1, 64])
def test_the_restated_model_is_the_engine_models(vt, width, batch):
    one_ms, floor_ms = 6.0, 1.9
    tp = TensorParallel() if width == 1 else TensorParallel(size=width, floor_s=floor_ms / 1000, layers=36, hidden=4096)
    engine = 1000 * float(TensorParallelPerf(LinearPerf(one_ms / 1000, 0.0), tp).step_time(batch))
    assert vt.model_ms(one_ms, floor_ms, width, 36, 4096, batch) == pytest.approx(engine, rel=1e-12)


def test_without_two_gpus_it_says_so_and_measures_nothing(vt, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(vt.torch.cuda, "device_count", lambda: 1)
    out = tmp_path / "tp.json"
    assert vt.main(["--out", str(out)]) == 2
    assert "needs at least 2 CUDA GPUs, found 1" in capsys.readouterr().err
    assert not out.exists()


def test_a_tiny_run_writes_each_width_beside_the_model(vt, tmp_path):
    out = tmp_path / "tiny.json"
    assert vt.main(["--tiny", "--batches", "1,4", "--contexts", "16", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {(r["width"], r["batch"]) for r in data["rows"]} == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert all(r["step_ms"] > 0 and r["model_ms"] > 0 for r in data["rows"])
    assert {(a["width"], a["bytes"]) for a in data["allreduce"]} == {(2, 1 * 64 * 4), (2, 4 * 64 * 4)}
