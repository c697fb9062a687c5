"""Differentiating through a step (e.g. to tune the learning rate) works on every path.

The CPU kernels are FFI calls with no JVP rule of their own; the dispatcher
differentiates them as the generic XLA ops, which they equal bit for bit. The
reference is a dense JAX computation of the same two masked Adam steps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._backends import choice
from tests._helpers import tiered

ROWS, DIM = 8, 4
B1, B2, EPS = 0.9, 0.999, 1e-3  # a large eps makes the update depend on the gradient's size
IDS = [jnp.array([[1], [3], [1]]), jnp.array([[3], [5], [6]])]


def _sparse_loss(lr, params, data):
  opt = osa.sparse_adam(lr, B1, B2, EPS)
  state = opt.init(params)
  for ids, values in zip(IDS, data, strict=True):
    grad = sparse.BCOO((values * params[ids[:, 0]], ids), shape=(ROWS, DIM))
    updates, state = opt.update(grad, state, params)
    params = osa.apply_updates(params, updates)
  return jnp.sum(params**2)


def _dense_loss(lr, params, data):
  """The same two steps with dense arrays and a touched-rows mask: no library code."""
  m = v = jnp.zeros_like(params)
  for t, (ids, values) in enumerate(zip(IDS, data, strict=True), start=1):
    g = jnp.zeros_like(params).at[ids[:, 0]].add(values * params[ids[:, 0]])
    touched = jnp.zeros((ROWS, 1), bool).at[ids[:, 0]].set(True)
    m = jnp.where(touched, m + (1 - B1) * (g - m), m)
    v = jnp.where(touched, v + (1 - B2) * (g * g - v), v)
    step_size = lr * jnp.sqrt(1 - B2**t) / (1 - B1**t)
    params = jnp.where(touched, params - step_size * m / (jnp.sqrt(v) + EPS), params)
  return jnp.sum(params**2)


PATHS = {
  "kernels": dict(cpu_kernels=True),
  "xla": dict(cpu_kernels=False),
  "accelerator": dict(forced=choice.ACCELERATOR),  # the GPU/TPU step, forced onto the CPU
}


GRAD_CASES = [(use_jit, path) for path in sorted(PATHS) for use_jit in (False, True)]


# Eagerly on one path in the default tier (op by op, and grad of it: slow), the rest: slow tier.
@pytest.mark.parametrize(
  ("use_jit", "path"),
  tiered(GRAD_CASES, lambda case: not case[0] and case[1] != "kernels"),
  ids=[f"{path}-{'jit' if j else 'eager'}" for j, path in GRAD_CASES],
)
def test_grad_through_two_steps_equals_a_dense_reference(use_jit, path):
  params = jnp.linspace(-1.0, 1.0, ROWS * DIM, dtype=jnp.float32).reshape(ROWS, DIM)
  data = [jnp.full((3, DIM), 0.5, jnp.float32), jnp.full((3, DIM), -2.0, jnp.float32)]
  lr = jnp.float32(0.05)
  grad_fn = jax.grad(_sparse_loss, argnums=(0, 1, 2))
  if use_jit:
    grad_fn = jax.jit(grad_fn)
  with choice.choose(**PATHS[path]):
    got = grad_fn(lr, params, data)
  want = jax.grad(_dense_loss, argnums=(0, 1, 2))(lr, params, data)
  assert float(jnp.abs(want[0])) > 1e-3  # a control: the lr matters to the loss
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)


def test_kernels_and_xla_give_the_same_derivatives():
  params = jnp.linspace(-1.0, 1.0, ROWS * DIM, dtype=jnp.float32).reshape(ROWS, DIM)
  data = [jnp.full((3, DIM), 0.5, jnp.float32), jnp.full((3, DIM), -2.0, jnp.float32)]
  lr = jnp.float32(0.05)
  grads = {}
  for cpu_kernels in (True, False):
    with osa.use_cpu_kernels(cpu_kernels):
      grads[cpu_kernels] = jax.jit(jax.grad(_sparse_loss, argnums=(0, 1)))(lr, params, data)
  for a, b in zip(jax.tree.leaves(grads[True]), jax.tree.leaves(grads[False]), strict=True):
    np.testing.assert_array_equal(a, b)
