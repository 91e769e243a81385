"""The one tabulation of the step model: the grid is the model pointwise, the separable split is
exact where the model is linear and never negative where it is not."""

from __future__ import annotations

import numpy as np
import pytest

from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.engine.step_table import StepTimeGrid, separable_cums


@pytest.mark.parametrize("spec", ["table:h200-dense", "table:h200-moe", "fitted:h200-dense", "linear:a=0.01,c=0.001"])
def test_grid_is_the_model_pointwise(spec):
    perf = parse_perf_model(spec)
    actives, contexts = np.array([0, 1, 3, 64, 700]), np.array([0.0, 100.5, 4096.0, 300000.0])
    grid = StepTimeGrid(perf, actives, contexts)
    assert grid.values.shape == (len(actives), len(contexts))
    for i, a in enumerate(actives):
        for j, c in enumerate(contexts):
            assert grid.values[i, j] == perf.step_time(np.array([float(a)]), np.array([c]))[0]
    assert np.all(grid.values[0] == 0.0)


def test_separable_parts_are_exact_for_a_linear_model():
    a, c = 0.01, 0.001
    one, top = StepTimeGrid(parse_perf_model(f"linear:a={a},c={c}"), [1, 9], np.arange(50.0)).values
    replica_cum, request_cum = separable_cums(one, (top - one) / 8)
    steps = np.arange(51)
    np.testing.assert_allclose(replica_cum, a * steps, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(request_cum, c * steps, rtol=1e-12, atol=1e-15)


def test_separable_parts_never_go_negative():
    first = np.array([1.0, 1.0, 2.0])
    replica_cum, request_cum = separable_cums(first, np.array([-0.5, 3.0, 0.5]))
    np.testing.assert_array_equal(np.diff(request_cum), [0.0, 1.0, 0.5])
    np.testing.assert_array_equal(np.diff(replica_cum), [1.0, 0.0, 1.5])
