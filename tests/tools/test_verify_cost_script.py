"""scripts/gpu/verify_cost.py at tiny shapes, eagerly on CPU: the JSON has every row the checker needs
and the checker reads it; the verify step (k + 1 tokens at once) computes what k + 1 decode steps do.
Timings on CPU mean nothing; the H200 run is the measurement."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tailsieve_verl.core.engine.perf import PerfModelError  # noqa: E402
from tailsieve_verl.core.engine.verify_cost import VerifyTable  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "verify_cost.py"


@pytest.fixture(scope="module")
def vc():
    spec = importlib.util.spec_from_file_location("verify_cost_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the script's annotations through it
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_tiny_run_writes_every_kind_and_the_checker_reads_it(vc, tmp_path):
    out = tmp_path / "tiny.json"
    assert vc.main(["--tiny", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["torch"] == torch.__version__ and data["date"].endswith("Z")
    assert data["stopped_early"] is False and data["skipped"] == []
    for model in vc.TINY_SHAPES:
        rows = [r for r in data["rows"] if r["model"] == model]
        points = {(r["kind"], r["batch"], r["context"], r["k"]) for r in rows}
        # context 0 up to batch max(batches)·(k_max + 1) = 6, in powers of two; the grid at 16 and 32
        want = {("decode", b, 0, 0) for b in (1, 2, 4, 8)}
        for b in (1, 2):
            for c in (16, 32):
                want |= {("decode", b, c, 0), ("draft", b, c, 1)} | {("verify", b, c, k) for k in (1, 2)}
        assert points == want and len(rows) == len(want)
        assert all(r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"] for r in rows)
        assert all(r["query_tokens"] == r["batch"] * (r["k"] + 1) for r in rows if r["kind"] == "verify")
        table = VerifyTable.load(f"{out}:{model}")
        report = table.report()
        assert table.max_k == 2 and len(report) == 8
        assert all(r["first_order_ms"] > 0 and r["draft_fraction"] > 0 for r in report)


def test_a_spent_budget_stops_cleanly_and_writes_what_it_has(vc, tmp_path):
    out = tmp_path / "cut.json"
    assert vc.main(["--tiny", "--budget-s", "1e-9", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["stopped_early"] is True and data["rows"] == []
    with pytest.raises(PerfModelError, match="non-empty 'rows'"):
        VerifyTable.load(str(out))


@pytest.mark.parametrize("shape", ["tiny-dense", "tiny-moe"])
def test_a_verify_step_computes_what_k_plus_1_decode_steps_do(vc, shape):
    torch.manual_seed(0)
    model = vc.Model(vc.TINY_SHAPES[shape], torch.device("cpu"), torch.float32)
    context, k = 5, 3
    tokens = torch.randint(0, model.s.vocab, (2, k + 1))
    cache = model.new_cache(2, context + k + 1, model.s.layers)
    step_cache = [(a.clone(), b.clone()) for a, b in cache]
    verified, _ = model.target_step(tokens, cache, context, "default")
    stepped = [model.target_step(tokens[:, i:i + 1], step_cache, context + i, "default")[0] for i in range(k + 1)]
    assert torch.equal(verified, torch.cat(stepped, dim=1))
    for (a, b), (c, d) in zip(cache, step_cache):  # both wrote the same K/V
        assert torch.allclose(a, c, atol=1e-5) and torch.allclose(b, d, atol=1e-5)


def test_verify_attention_is_lower_right_causal(vc):
    q, kv = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 9, 16)
    want = vc.reference_attend(q, kv, kv)
    assert torch.allclose(vc.attend(q, kv, kv, "default"), want, atol=1e-5)
    top_left = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    assert not torch.allclose(top_left, want, atol=1e-3)  # the mask a naive is_causal gives is caught


def test_a_backend_without_a_kernel_is_skipped_and_out_of_memory_is_not(vc):
    cpu = torch.device("cpu")
    ran = []

    def step(fails, error=RuntimeError):
        def fn(backend):
            if backend in fails:
                raise error(f"No available kernel for {backend}")
            ran.append(backend)
        return fn

    times, backend = vc.best_of(step({"flash"}), ("flash", "cudnn"), cpu, 3, graphs=False)
    assert backend == "cudnn" and len(times) == 3
    assert vc.best_of(step({"flash", "cudnn"}), ("flash", "cudnn"), cpu, 2, graphs=False)[1] == "default"
    with pytest.raises(RuntimeError, match="no attention backend ran this step: default"):
        vc.best_of(step({"flash", "cudnn", "default"}), ("flash", "cudnn"), cpu, 2, graphs=False)
    with pytest.raises(torch.cuda.OutOfMemoryError):  # a grid point too big for memory, not a missing kernel
        vc.best_of(step({"flash"}, torch.cuda.OutOfMemoryError), ("flash", "cudnn"), cpu, 2, graphs=False)


def test_grid_points_that_do_not_fit_are_listed_and_the_rest_measured(vc, tmp_path, monkeypatch):
    out = tmp_path / "skip.json"
    monkeypatch.setattr(vc.Run, "fits", lambda self, model, batch, slots, layers: slots < 32)
    assert vc.main(["--tiny", "--models", "tiny-dense", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {(s["batch"], s["context"]) for s in data["skipped"]} == {(1, 32), (2, 32)}
    assert {r["context"] for r in data["rows"]} == {0, 16}
