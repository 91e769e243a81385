"""Performance models: linear closed form, measured tables reproduced, spec errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tailsieve_verl.core.engine.perf import (BUNDLED_TABLES, Calibration, FittedPerf, LinearPerf, PerfModelError, TablePerf,
                                      parse_perf_model)
from tailsieve_verl.core.engine.replica import simulate_replica


def _models_of(name: str) -> list[str]:
    import importlib.resources as resources

    filename = BUNDLED_TABLES[name][0]
    rows = json.loads(resources.files("tailsieve_verl.data").joinpath(filename).read_text())["rows"]
    return sorted({r["model"] for r in rows})


@pytest.mark.parametrize("seed", range(5))
def test_linear_closed_form(seed):
    rng = np.random.default_rng(seed)
    a, c = rng.uniform(0.001, 0.05), rng.uniform(1e-5, 1e-3)
    lengths = rng.integers(0, 2000, size=rng.integers(1, 40))
    run = simulate_replica(lengths, LinearPerf(a, c))
    assert run.completion_s == pytest.approx(a * lengths.max() + c * lengths.sum(), rel=1e-12)


@pytest.mark.parametrize("name", list(BUNDLED_TABLES))
def test_table_reproduces_every_measured_point(name):
    for model in _models_of(name):
        cal = Calibration.load(name, model)
        perf = TablePerf(cal)
        got = perf.step_time(cal.batch, cal.context)
        np.testing.assert_allclose(got, cal.step_s, rtol=1e-9)
        for b, ctx, s in zip(cal.batch, cal.context, cal.step_s):  # scalar path too
            assert perf.step_time(float(b), float(ctx)) == pytest.approx(s, rel=1e-9)


def test_table_is_zero_without_requests_and_positive_beyond_the_table():
    perf = parse_perf_model("table:h200-dense")
    assert perf.step_time(0, 1024.0) == 0.0
    far = perf.step_time(np.array([1024.0, 2048.0]), np.array([32768.0, 32768.0]))
    assert np.all(far > 0) and far[1] > far[0]


def test_parse_specs():
    assert isinstance(parse_perf_model("linear:a=0.01,c=0.0002"), LinearPerf)
    assert isinstance(parse_perf_model("table:h200-moe"), TablePerf)
    assert parse_perf_model("table:h200-dense:qwen3-4b").calibration.model == "qwen3-4b"
    assert isinstance(parse_perf_model("fitted:h200-dense"), FittedPerf)


@pytest.mark.parametrize("spec, needle", [
    ("linear:a=0.01", "exactly a and c"),
    ("linear:a=x,c=1", "expected linear:a=A,c=C"),
    ("linear:a=-1,c=0.1", "0 <= a <= 60 s"),
    ("linear:a=1e200,c=1", "0 <= a <= 60 s"),
    ("table:nope", "unknown calibration"),
    ("table:h200-dense:gpt-9", "no rows for model"),
    ("quadratic:1", "unknown performance model"),
])
def test_bad_specs_name_the_problem(spec, needle):
    with pytest.raises(PerfModelError, match=needle):
        parse_perf_model(spec)


def test_bad_calibration_files(tmp_path):
    bad_json = tmp_path / "a.json"
    bad_json.write_text("{not json")
    with pytest.raises(PerfModelError, match="not valid JSON"):
        parse_perf_model(f"table:{bad_json}")
    no_rows = tmp_path / "b.json"
    no_rows.write_text(json.dumps({"rows": []}))
    with pytest.raises(PerfModelError, match="non-empty 'rows'"):
        parse_perf_model(f"table:{no_rows}")
    bad_row = tmp_path / "c.json"
    bad_row.write_text(json.dumps({"rows": [{"batch": 1, "context": 0, "step_ms": 0}]}))
    with pytest.raises(PerfModelError, match="row 0"):
        parse_perf_model(f"table:{bad_row}")
