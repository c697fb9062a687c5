"""Short versions of the soak run (tests/core/soak.py): finite inputs never give NaN/Inf
state, moments stay within their gradient bounds, params track a float64 reference."""

import pytest

from tests.core import soak


def _check(result, steps):
  assert result.steps == steps
  assert result.finite
  assert result.within_bounds
  assert result.max_drift <= result.drift_bound
  assert result.max_abs_grad > 1e3  # the run did see large gradients
  assert abs(result.final_loss - result.final_loss_reference) <= 1e-3


def test_soak_short():
  _check(soak.run_soak(steps=2_000, chunk=500), 2_000)


@pytest.mark.slow
def test_soak_long():
  _check(soak.run_soak(steps=20_000, chunk=1_000, seed=1), 20_000)
