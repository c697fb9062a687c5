"""The fused CPU kernels equal the XLA ops bit for bit, work in place, and stay where they apply.

Every step here runs twice, once with the kernels and once with the XLA ops
that every other backend runs, from the same inputs; parameters, moments, step
counts and the update BCOO must agree in every bit (compared as integers, so
-0.0 and NaN payloads count too).
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._backends.cpu import kernels
from tests._helpers import cpu_only, tiered, train_step

pytestmark = cpu_only("the fused CPU kernels run, and equal the XLA ops bit for bit,")

# CI sets this: there the kernels must have been built, not silently skipped.
REQUIRE_KERNELS = os.environ.get("OPTAX_SPARSE_ADAM_REQUIRE_CPU_KERNELS") == "1"

needs_kernels = pytest.mark.skipif(
  not kernels.available() and not REQUIRE_KERNELS,
  reason="the CPU kernels were not built (no C++ compiler at install time)",
)


def test_kernels_are_built_and_enabled():
  if not kernels.available():
    assert not REQUIRE_KERNELS, "the CPU kernels were not built; see setup.py"
    pytest.skip("the CPU kernels were not built (no C++ compiler at install time)")
  assert kernels.enabled()
  with kernels.use_cpu_kernels(False):
    assert not kernels.enabled()


def _bits(x):
  x = np.asarray(x)
  if x.dtype.kind == "f":
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))
  return x


def _assert_same_bits(a, b):
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b, strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(_bits(x), _bits(y))


# name: (parameter shape, n_sparse)
LAYOUTS = {
  "embedding": ((50, 8), 1),
  "odd_row_size": ((40, 13), 1),
  "n_dense_0": ((60,), 1),
  "n_dense_2": ((20, 3, 5), 1),
  "n_sparse_2": ((20, 3, 5), 2),
  "n_sparse_2_n_dense_0": ((9, 7), 2),
}


def _batches(shape, n_sparse, rng, *, steps=4, nse=40):
  """Index and value batches with duplicates, padding (negative and past the end),
  signed zeros, subnormals, and large values."""
  out = []
  for _ in range(steps):
    idx = np.stack([rng.integers(0, shape[k], nse) for k in range(n_sparse)], 1)
    idx[1:6] = idx[0]  # a row repeated six times
    idx[-3, 0] = -1
    idx[-2, -1] = shape[n_sparse - 1] + 2
    idx[-1] = idx[-4]
    val = rng.standard_normal((nse,) + shape[n_sparse:]).astype(np.float32)
    flat = val.reshape(-1)
    flat[:3] = [-0.0, 1e-40, -3e-39]
    flat[5] = 3e18
    out.append((idx.astype(np.int32), val))
  return out


def _train(opt, shape, batches, *, use_jit, cpu_kernels):
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.standard_normal(shape), jnp.float32)}
  state = opt.init(params)

  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return osa.apply_updates(params, updates), state, updates

  if use_jit:
    step = jax.jit(step, donate_argnums=(0, 1))
  updates = []
  with kernels.use_cpu_kernels(cpu_kernels):
    for idx, val in batches:
      grads = {"w": sparse.BCOO((jnp.asarray(val), jnp.asarray(idx)), shape=shape)}
      params, state, update = step(params, state, grads)
      updates.append((update["w"].data, update["w"].indices))
  return params, state, updates


# Every layout jitted; eagerly (op by op: seconds a cell) the embedding and the smallest
# layout in the default tier, the others in the slow one.
EAGER_DEFAULT = ("embedding", "n_sparse_2_n_dense_0")


@needs_kernels
@pytest.mark.parametrize(
  "layout, use_jit",
  tiered(
    [(layout, use_jit) for layout in LAYOUTS for use_jit in (False, True)],
    lambda case: not case[1] and case[0] not in EAGER_DEFAULT,
  ),
  ids=[f"{layout}-{'jit' if j else 'eager'}" for layout in LAYOUTS for j in (False, True)],
)
def test_kernels_equal_xla_ops_bit_for_bit(layout, use_jit):
  shape, n_sparse = LAYOUTS[layout]
  batches = _batches(shape, n_sparse, np.random.default_rng(1))
  opt = osa.sparse_adam(1e-2)
  with_kernels = _train(opt, shape, batches, use_jit=use_jit, cpu_kernels=True)
  with_xla = _train(opt, shape, batches, use_jit=use_jit, cpu_kernels=False)
  _assert_same_bits(with_kernels, with_xla)


OPTIONS = {
  "maximize": lambda: osa.sparse_adam(3e-2, b1=0.8, b2=0.95, eps=1e-6, maximize=True),
  "schedule": lambda: osa.sparse_adam(optax.linear_schedule(1e-2, 1e-3, 5)),
  "injected": lambda: optax.inject_hyperparams(osa.sparse_adam)(learning_rate=2e-2),
  "chained": lambda: optax.chain(osa.lift_to_bcoo(optax.clip(0.5)), osa.sparse_adam(1e-2)),
}


@needs_kernels
@pytest.mark.parametrize("option", list(OPTIONS))
def test_kernels_equal_xla_ops_with_options(option):
  shape, n_sparse = LAYOUTS["embedding"]
  batches = _batches(shape, n_sparse, np.random.default_rng(2), steps=5)
  batches[2][1][7, 3] = np.nan  # NaN and inf propagate alike on both paths, sign bits too
  batches[3][1][9, 1] = -np.inf
  with_kernels = _train(OPTIONS[option](), shape, batches, use_jit=True, cpu_kernels=True)
  with_xla = _train(OPTIONS[option](), shape, batches, use_jit=True, cpu_kernels=False)
  _assert_same_bits(with_kernels, with_xla)


@needs_kernels
@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_apply_updates_kernel_adds_duplicates_in_input_order(use_jit):
  """A hand-made update (unsorted, repeated, padded rows) adds up as XLA's scatter-add."""
  rng = np.random.default_rng(3)
  param = jnp.asarray(rng.standard_normal((30, 6)), jnp.float32)
  idx = np.array([[7], [2], [7], [29], [-1], [30], [2], [7]], np.int32)
  val = (rng.standard_normal((8, 6)) * 10.0 ** rng.integers(-8, 8, (8, 1))).astype(np.float32)
  update = sparse.BCOO((jnp.asarray(val), jnp.asarray(idx)), shape=(30, 6))
  apply = jax.jit(osa.apply_updates) if use_jit else osa.apply_updates
  results = []
  for cpu_kernels in (True, False):
    with kernels.use_cpu_kernels(cpu_kernels):
      results.append(apply(param, update))
  _assert_same_bits(results[0], results[1])
  expected = np.asarray(param).copy()
  for i, v in zip(idx[:, 0], val, strict=True):
    if 0 <= i < 30:
      expected[i] += v
  _assert_same_bits(results[0], expected)


def _compiled_text(opt, *, shape=(50, 8), dtype=jnp.float32, cpu_kernels=True):
  params = {"w": jnp.zeros(shape, dtype)}
  grads = {"w": sparse.BCOO.fromdense(jnp.zeros(shape, dtype).at[3].set(1.0), n_dense=1)}

  with kernels.use_cpu_kernels(cpu_kernels):
    lowered = jax.jit(train_step(opt), donate_argnums=(0, 1)).lower(params, opt.init(params), grads)
  return lowered.compile().as_text()


ADAM_KERNEL = "optax_sparse_adam_fused_adam_f32"
ADAM_OPTIONS_KERNEL = "optax_sparse_adam_fused_adam_options_f32"
ADAM_16_BIT_KERNEL = "optax_sparse_adam_fused_adam_rounded_f32"
ADD_KERNEL = "optax_sparse_adam_scatter_add_rows_f32"


@needs_kernels
def test_kernels_appear_in_the_cpu_step_only_where_they_apply():
  assert ADAM_KERNEL in _compiled_text(osa.sparse_adam(1e-3))
  assert ADD_KERNEL in _compiled_text(osa.sparse_adam(1e-3))
  # Switched off: the XLA ops only.
  off = _compiled_text(osa.sparse_adam(1e-3), cpu_kernels=False)
  assert ADAM_KERNEL not in off and ADD_KERNEL not in off
  # The pipeline's options run in the Adam kernel with options (test_cpu_kernel_options.py).
  for opt in (
    osa.sparse_adam(1e-3, amsgrad=True),
    osa.sparse_adam(1e-3, weight_decay=0.1),
    osa.sparse_adamw(1e-3),
    osa.sparse_adam(1e-3, per_row_bias_correction=True),
  ):
    text = _compiled_text(opt)
    assert ADAM_KERNEL not in text and ADAM_OPTIONS_KERNEL in text
  # bf16 moments are stored in place by the kernel, rounded either way.
  for rounding in ("nearest", "stochastic"):
    opt = osa.sparse_adam(1e-3, mu_dtype=jnp.bfloat16, moment_rounding=rounding)
    assert ADAM_KERNEL in _compiled_text(opt)
  # A bf16 table and gradient: the Adam kernel with 16-bit rows out (its sums rounded to
  # bf16 at every add; its delta converted to bf16 in its pass, not by an XLA convert), and
  # the apply by the 16-bit kernel, not the float32 one.
  bf16 = _compiled_text(osa.sparse_adam(1e-3), dtype=jnp.bfloat16)
  assert ADAM_16_BIT_KERNEL in bf16 and ADD_KERNEL not in bf16
  assert "optax_sparse_adam_add_rows_in_place" in bf16
  assert re.search(r"= bf16\[1,8\]\S* convert\(f32", bf16) is None  # the delta's convert
  # The kernels read a float32 parameter only (decoupled weight decay here).
  bf16 = _compiled_text(osa.sparse_adamw(1e-3), dtype=jnp.bfloat16)
  assert ADAM_OPTIONS_KERNEL not in bf16


@needs_kernels
def test_possibly_sharded_tables_leave_the_choice_to_the_lowering(monkeypatch):
  """A custom call cannot be partitioned: with several CPU devices, a traced table whose
  sharding the trace does not show is stepped by a choice made when the program is
  lowered (`_backends.one_device`): here it is lowered for one device, so the kernels
  run. A table sharded over several devices keeps the XLA ops (test_one_device.py)."""
  devices = jax.devices("cpu")
  monkeypatch.setattr(jax, "devices", lambda *a, **k: devices * 2)
  opt = osa.sparse_adam(1e-3)
  params = {"w": jnp.zeros((50, 8))}
  grads = {"w": sparse.BCOO.fromdense(jnp.zeros((50, 8)).at[3].set(1.0), n_dense=1)}
  jaxpr = str(jax.make_jaxpr(train_step(opt))(params, opt.init(params), grads))
  assert "optax_sparse_adam_one_device_index" in jaxpr  # deferred to the lowering
  text = _compiled_text(opt)
  assert ADAM_KERNEL in text and ADD_KERNEL in text and "conditional" not in text


@needs_kernels
def test_more_devices_of_another_backend_keep_the_kernels(monkeypatch):
  """The choice depends on the CPU's devices, not on the process's device count."""
  monkeypatch.setattr(jax, "device_count", lambda *a: 8)
  text = _compiled_text(osa.sparse_adam(1e-3))
  assert ADAM_KERNEL in text and ADD_KERNEL in text


@needs_kernels
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_other_backends_lower_to_xla_ops(platform):
  """Lowered for a GPU or TPU, the same step holds no CPU custom call."""
  opt = osa.sparse_adam(1e-3)
  params = {"w": jnp.zeros((50, 8), jnp.float32)}
  grads = {"w": sparse.BCOO.fromdense(jnp.zeros((50, 8)).at[3].set(1.0), n_dense=1)}

  step = train_step(opt)

  # The kernels' targets promise no serialization compatibility; export refuses
  # them unless told, which lets the check below see whether they are there.
  allow = [jax.export.DisabledSafetyCheck.custom_call(t) for t in (ADAM_KERNEL, ADD_KERNEL)]

  def exported_text(platform):
    export = jax.export.export(jax.jit(step), platforms=[platform], disabled_checks=allow)
    return export(params, opt.init(params), grads).mlir_module()

  text = exported_text(platform)
  assert ADAM_KERNEL not in text and ADD_KERNEL not in text
  assert "scatter" in text
  # The same export for the CPU does use them: the check above can fail.
  cpu_text = exported_text("cpu")
  assert ADAM_KERNEL in cpu_text and ADD_KERNEL in cpu_text


@needs_kernels
def test_multithreaded_steps_equal_xla_ops_and_repeat_exactly():
  """Steps large enough to spread over the intra-op threads (about 2,800 distinct rows
  of 16 values from 8,192 entries, so most rows repeat): the same bits as the XLA ops,
  and the same bits run to run."""
  shape = (3000, 16)
  rng = np.random.default_rng(5)
  batches = []
  for _ in range(3):
    idx = rng.integers(-5, shape[0] + 5, (8192, 1)).astype(np.int32)
    batches.append((idx, rng.standard_normal((8192, 16)).astype(np.float32)))
  opt = osa.sparse_adam(1e-2)
  first = _train(opt, shape, batches, use_jit=True, cpu_kernels=True)
  again = _train(opt, shape, batches, use_jit=True, cpu_kernels=True)
  with_xla = _train(opt, shape, batches, use_jit=True, cpu_kernels=False)
  _assert_same_bits(first, again)
  _assert_same_bits(first, with_xla)
