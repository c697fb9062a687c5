r"""The geometric sums that the rules' closed forms of idle steps are written with.

Catching a row up means taking, at once, the `k` steps of zero gradient that a
dense optimizer would have taken while the row was idle. Each rule declares
its closed form (its `catch_up` hook, `rules.CatchUp`): Adam's decays the
moments and discharges the first moment (`row_rules/adam.idle_rows`), SGD's
momentum discharges its buffer (`row_rules/sgd`), and Adagrad's idle rows do
not move. The sums here are exact for any `k` (no loop over the idle steps),
without overflow, in `exp`/`expm1` of `k log x`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def _pow(log_base: Any, k: jax.Array) -> jax.Array:
  """`base^k` for a float `k >= 0` as `exp(k log base)`: 1 at k = 0, also for base 0."""
  return jnp.where(k == 0, 1.0, jnp.exp(k * jnp.where(k == 0, 0.0, log_base)))


def _geometric_sum(log_ratio: jax.Array, k: jax.Array) -> jax.Array:
  """`sum_{i<k} q^i = expm1(k log q) / expm1(log q)`, `k` at q = 1; for log q <= 0."""
  safe = jnp.where(log_ratio == 0, -1.0, log_ratio)
  return jnp.where(log_ratio == 0, k, jnp.expm1(k * safe) / jnp.expm1(safe))


def decayed_sum(log_x: Any, log_d: Any, k: jax.Array) -> jax.Array:
  """`sum_{j=1..k} d^(k-j) x^j` for `x, d > 0` (or x = 0), without overflow.

  Written around the larger base: `d^(k-1) x sum_{i<k} (x/d)^i` if x <= d,
  else `x^k sum_{i<k} (d/x)^i`, so the geometric factor stays in [1, k].
  """
  log_ratio = jnp.asarray(log_x - log_d, k.dtype)
  x_below = log_ratio <= 0
  small = -jnp.abs(jnp.where(jnp.isfinite(log_ratio), log_ratio, -jnp.inf))
  geometric = _geometric_sum(small, k)
  lead = jnp.where(x_below, (k - 1) * log_d + log_x, k * log_x)
  return jnp.where(k == 0, 0.0, jnp.exp(jnp.where(k == 0, 0.0, lead)) * geometric)


def _centroid(log_x: Any, k: jax.Array) -> jax.Array:
  """The integer `j` in [1, k] nearest to the centroid `sum j x^j / sum x^j` of the window."""
  log_x = jnp.asarray(log_x, k.dtype)
  one_minus_x = -jnp.expm1(log_x)
  x_k = _pow(log_x, k)
  safe = jnp.where(x_k == 1, 1.0, 1.0 - x_k)
  centroid = 1.0 / one_minus_x - k * x_k / safe
  return jnp.clip(
    jnp.round(jnp.where(jnp.isfinite(centroid), centroid, 1.0)), 1.0, jnp.maximum(k, 1)
  )
