"""core.engine.verify_cost on a hand-made table whose answers are known: a linear decode table
T(b, c) = 1 + 0.25·b + 0.001·b·c ms (TablePerf reproduces it everywhere), verify steps at k = 1 equal
to the first-order price and at k = 2 half again as dear, draft steps a quarter of a decode step."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tailsieve_verl.cli import main
from tailsieve_verl.core.engine.engine import EngineConfig, EngineConfigError, SpeculativeConfig
from tailsieve_verl.core.engine.perf import Calibration, PerfModelError, TablePerf
from tailsieve_verl.core.engine.replica import simulate_replica
from tailsieve_verl.core.engine.scheduler import step_seconds
from tailsieve_verl.core.engine.verify_cost import VerifyTable

BATCHES, CONTEXTS, VERIFY_BATCHES, VERIFY_CONTEXTS = (1, 2, 4, 8, 16, 32), (0, 1000, 4000), (1, 2, 4, 8), (1000, 4000)
K_PRICE = {1: 1.0, 2: 1.5}  # measured verify step over the first-order price


def decode_ms(b, c):
    return 1 + 0.25 * b + 0.001 * b * c


def first_order_ms(b, c, k):
    return decode_ms(b * (k + 1), 0) + decode_ms(b, c) - decode_ms(b, 0)


def rows(model="m"):
    out = [{"model": model, "kind": "decode", "batch": b, "context": c, "k": 0, "step_ms": decode_ms(b, c)}
           for b in BATCHES for c in CONTEXTS]
    for b in VERIFY_BATCHES:
        for c in VERIFY_CONTEXTS:
            out += [{"model": model, "kind": "verify", "batch": b, "context": c, "k": k,
                     "step_ms": price * first_order_ms(b, c, k)} for k, price in K_PRICE.items()]
            out.append({"model": model, "kind": "draft", "batch": b, "context": c, "k": 1,
                        "step_ms": 0.25 * decode_ms(b, c)})
    return out


@pytest.fixture
def table():
    return VerifyTable(rows(), "hand-made")


def test_report_puts_the_first_order_price_next_to_the_measurement(table):
    report = table.report()
    assert len(report) == len(VERIFY_BATCHES) * len(VERIFY_CONTEXTS) * len(K_PRICE)
    for r in report:
        b, c, k = r["batch"], r["context"], r["k"]
        assert r["decode_ms"] == pytest.approx(decode_ms(b, c))
        assert r["first_order_ms"] == pytest.approx(first_order_ms(b, c, k))
        assert r["verify_ms"] == pytest.approx(K_PRICE[k] * first_order_ms(b, c, k))
        assert r["first_order_error"] == pytest.approx(1 / K_PRICE[k] - 1)
        assert r["draft_fraction"] == pytest.approx(0.25)


def test_ratio_is_one_at_k0_and_linear_in_k_between_measured_depths(table):
    b, c = np.array([2.0, 8.0]), np.array([1000.0, 4000.0])
    k1 = np.array([first_order_ms(*p, 1) / decode_ms(*p) for p in zip(b, c)])
    k2 = np.array([1.5 * first_order_ms(*p, 2) / decode_ms(*p) for p in zip(b, c)])
    np.testing.assert_allclose(table.ratio(b, c, [0, 0]), [1, 1])
    np.testing.assert_allclose(table.ratio(b, c, [1, 1]), k1)
    np.testing.assert_allclose(table.ratio(b, c, [2, 2]), k2)
    np.testing.assert_allclose(table.ratio(b, c, [1.5, 0.5]), [(k1[0] + k2[0]) / 2, (1 + k1[1]) / 2])


def test_the_scheduler_prices_verify_steps_with_the_table(table):
    perf = TablePerf(Calibration.from_rows([r for r in rows() if r["kind"] == "decode"], "decode"))
    spec = SpeculativeConfig(2, (0.8,), draft_cost=0.1, verify_table=table)
    cfg, first_order = EngineConfig(speculative=spec), EngineConfig(speculative=SpeculativeConfig(2, (0.8,), draft_cost=0.1))
    # 4 requests at context 1000: k = 1 is priced first-order; k = 2 half again; a step with one newly
    # admitted request (10 query tokens for 4 emitting: mean depth 1.5) halfway between the two
    args = [np.array([4.0, 4.0, 4.0]), np.array([4000.0] * 3), np.array([8.0, 12.0, 10.0]), np.array([1.0, 2.0, 2.0]),
            np.zeros(3)]
    t = decode_ms(4, 1000) / 1000
    fo = [first_order_ms(4, 1000, k) / 1000 for k in (1, 2)]
    want = [fo[0] + 0.1 * t, 1.5 * fo[1] + 0.2 * t, (fo[0] + 1.5 * fo[1]) / 2 + 0.2 * t]
    np.testing.assert_allclose(step_seconds(perf, cfg, *args), want)
    np.testing.assert_allclose(step_seconds(perf, first_order, *args)[:2], [fo[0] + 0.1 * t, fo[1] + 0.2 * t])
    # a whole run at k = 1, where the table equals the first-order price, matches it exactly; at k = 2 it is dearer
    lengths, prompts = [40, 25, 60, 33], [700, 900, 1100, 800]
    runs = {name: simulate_replica(lengths, perf, prompts, engine=EngineConfig(speculative=SpeculativeConfig(
        k, (0.8,), draft_cost=0.1, verify_table=table if name[0] == "t" else None)))
        for name, k in (("t1", 1), ("f1", 1), ("t2", 2), ("f2", 2))}
    assert runs["t1"].completion_s == pytest.approx(runs["f1"].completion_s, rel=1e-12)
    assert runs["t2"].steps == runs["f2"].steps
    assert runs["t2"].completion_s > 1.3 * runs["f2"].completion_s


def test_bad_tables_get_one_clear_line(table, tmp_path):
    with pytest.raises(EngineConfigError, match="measures k up to 2"):
        SpeculativeConfig(3, (0.8,), verify_table=table)
    with pytest.raises(PerfModelError, match="needs kind in"):
        VerifyTable([{"model": "m", "batch": 1, "context": 0, "step_ms": 1.0}], "x")
    with pytest.raises(PerfModelError, match="several models"):
        VerifyTable(rows("a") + rows("b"), "x")
    one_batch = [r for r in rows() if not (r["kind"] == "verify" and r["k"] == 2 and r["batch"] > 1)]
    with pytest.raises(PerfModelError, match="two batch sizes.*--budget-s"):
        VerifyTable(one_batch, "x")
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"device": "hand", "rows": rows("a") + rows("b")}))
    assert VerifyTable.load(f"{path}:b").model == "b"
    with pytest.raises(PerfModelError, match="no rows for model 'c'"):
        VerifyTable.load(f"{path}:c")


def test_cli_prints_the_report(tmp_path, capsys):
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"rows": rows()}))
    assert main(["verify-cost", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["first_order_error"] for r in report[:2]] == pytest.approx([0.0, 1 / 1.5 - 1])
    # against a linear perf model (0.5 ms + 0.1 ms per request, whatever the context): its first-order
    # verify price is the step at b·(k+1) requests
    assert main(["verify-cost", str(path), "--json", "--decode-table", "linear:a=0.0005,c=0.0001"]) == 0
    for r in json.loads(capsys.readouterr().out):
        assert r["perf_decode_ms"] == pytest.approx(0.5 + 0.1 * r["batch"])
        assert r["perf_first_order_ms"] == pytest.approx(0.5 + 0.1 * r["batch"] * (r["k"] + 1))
    assert main(["verify-cost", str(tmp_path / "missing.json")]) == 2
    assert "no such calibration file" in capsys.readouterr().err


def test_simulate_prices_speculation_with_the_table_and_records_which(tmp_path, capsys):
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"rows": rows()}))
    common = ["simulate", "--steps", "2", "--replicas", "2", "--batch", "4", "--n", "2", "--policies", "verl",
              "--num-speculative-tokens", "2", "--spec-acceptance", "0.8", "--no-plots", "--json"]
    reports = {}
    for name, extra in (("table", ["--spec-verify-table", str(path)]), ("first_order", [])):
        assert main(common + extra + ["--out", str(tmp_path / name)]) == 0
        reports[name] = json.loads(capsys.readouterr().out)
    assert reports["table"]["engine"]["speculative"]["verify_table"] == f"{path}:m"
    assert reports["first_order"]["engine"]["speculative"]["verify_table"] is None
    table, first = (reports[n]["policies"]["verl"]["mean_makespan_s"] for n in ("table", "first_order"))
    assert table != pytest.approx(first)
