"""Which path a step takes: the CPU kernels under vmap, and a switch JAX's caches see.

`use_cpu_kernels` is part of the key of JAX's trace and compilation caches, so a
function traced with the kernels is traced again when called, jitted afresh or
exported under `use_cpu_kernels(False)`. Under `jax.vmap` the kernels run once
per batch element and give the same results as an unbatched loop.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._backends.cpu import kernels as _cpu_kernel
from tests._helpers import train_step

ADAM_KERNEL = "optax_sparse_adam_fused_adam_f32"
ADD_KERNEL = "optax_sparse_adam_scatter_add_rows_f32"

needs_kernels = pytest.mark.skipif(
  jax.default_backend() != "cpu" or not _cpu_kernel.available(),
  reason=f"the CPU kernels run on the CPU only (backend: {jax.default_backend()}) "
  "and only where they were built",
)

SHAPE = (30, 4)
NUM_MODELS = 3


def _batched_inputs(rng):
  """Params of NUM_MODELS models and one gradient each (repeated and padding rows)."""
  params = jnp.asarray(rng.standard_normal((NUM_MODELS,) + SHAPE), jnp.float32)
  idx = rng.integers(0, SHAPE[0], (NUM_MODELS, 12, 1)).astype(np.int32)
  idx[:, 1:4] = idx[:, :1]
  idx[:, -1] = -1
  data = rng.standard_normal((NUM_MODELS, 12, SHAPE[1])).astype(np.float32)
  return params, jnp.asarray(idx), jnp.asarray(data)


def _bcoo(idx, data):
  return sparse.BCOO((data, idx), shape=SHAPE)


def _assert_same(a, b):
  """Every bit on the CPU; close elsewhere (a GPU scatter-add may reorder duplicate sums)."""
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
  else:
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# Eagerly (op by op under vmap) in the slow tier; jitted in the default one.
@pytest.mark.parametrize(
  "use_jit", [pytest.param(False, marks=pytest.mark.slow), True], ids=["eager", "jit"]
)
def test_vmap_of_update_and_apply_updates_equals_a_loop(use_jit):
  """`jax.vmap(opt.update)`, `jax.vmap(osa.apply_updates)` (kernels on): as a loop over models."""
  rng = np.random.default_rng(0)
  params, idx, data = _batched_inputs(rng)
  opt = osa.sparse_adam(1e-2)

  def one_model(param, idx, data):
    state = opt.init(param)
    for _ in range(2):
      updates, state = opt.update(_bcoo(idx, data), state, param)
      param = osa.apply_updates(param, updates)
    return param, state

  def batched(params, idx, data):
    states = jax.vmap(opt.init)(params)
    for _ in range(2):
      grads = jax.vmap(_bcoo)(idx, data)
      updates, states = jax.vmap(opt.update)(grads, states, params)
      params = jax.vmap(osa.apply_updates)(params, updates)
    return params, states

  run = jax.jit(batched) if use_jit else batched
  got_params, got_states = run(params, idx, data)
  for k in range(NUM_MODELS):
    want_param, want_state = one_model(params[k], idx[k], data[k])
    _assert_same(got_params[k], want_param)
    _assert_same(got_states.mu[k], want_state.mu)
    _assert_same(got_states.nu[k], want_state.nu)


@needs_kernels
def test_vmapped_step_runs_the_kernels():
  rng = np.random.default_rng(1)
  params, idx, data = _batched_inputs(rng)
  opt = osa.sparse_adam(1e-2)
  states = jax.vmap(opt.init)(params)
  grads = jax.vmap(_bcoo)(idx, data)
  text = jax.jit(jax.vmap(train_step(opt))).lower(params, states, grads).as_text()
  assert ADAM_KERNEL in text and ADD_KERNEL in text


def _inputs():
  opt = osa.sparse_adam(1e-3)
  params = {"w": jnp.zeros(SHAPE, jnp.float32)}
  grads = {"w": sparse.BCOO.fromdense(jnp.zeros(SHAPE).at[3].set(1.0), n_dense=1)}
  return opt, params, opt.init(params), grads


@needs_kernels
def test_switch_applies_to_a_function_traced_before_it():
  opt, params, state, grads = _inputs()
  step = train_step(opt)
  assert ADAM_KERNEL in jax.jit(step).lower(params, state, grads).as_text()
  with osa.use_cpu_kernels(False):
    # A fresh jit of the same function, and the very same jitted object.
    assert ADAM_KERNEL not in jax.jit(step).lower(params, state, grads).as_text()
  jitted = jax.jit(step)
  assert ADD_KERNEL in jitted.lower(params, state, grads).as_text()
  with osa.use_cpu_kernels(False):
    assert ADD_KERNEL not in jitted.lower(params, state, grads).as_text()
  # And back: the kernels again once the block is left.
  assert ADAM_KERNEL in jax.jit(step).lower(params, state, grads).as_text()


@needs_kernels
def test_switch_applies_to_calls_of_an_already_compiled_step():
  """Results are equal either way (bit for bit), but the compiled program differs."""
  opt, params, state, grads = _inputs()
  jitted = jax.jit(train_step(opt))
  with_kernels = jitted(params, state, grads)
  with osa.use_cpu_kernels(False):
    without = jitted(params, state, grads)
    assert jitted._cache_size() == 2  # compiled again under the switch
  for a, b in zip(jax.tree.leaves(with_kernels), jax.tree.leaves(without), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@needs_kernels
def test_export_under_the_switch_after_tracing_with_the_kernels():
  """The README's recipe: `jax.export` refuses the kernels' custom calls, so it needs the switch."""
  opt, params, state, grads = _inputs()
  step = train_step(opt)
  jax.jit(step).lower(params, state, grads)  # traced (and cached) with the kernels
  with pytest.raises(ValueError, match="no compatibility guarantees"):
    jax.export.export(jax.jit(step))(params, state, grads)
  with osa.use_cpu_kernels(False):
    exported = jax.export.export(jax.jit(step))(params, state, grads)
  new_params, _ = exported.call(params, state, grads)
  want_params, _ = jax.jit(step)(params, state, grads)
  np.testing.assert_array_equal(np.asarray(new_params["w"]), np.asarray(want_params["w"]))
