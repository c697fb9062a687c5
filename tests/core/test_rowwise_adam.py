"""The row-wise second moment (`rowwise_second_moment=True`) against FBGEMM's formula.

`FbgemmPartialRowwiseAdam` is written from FBGEMM's PARTIAL_ROWWISE_ADAM
reference update (`fbgemm_gpu/codegen/genscript/optimizers.py`), in float64
NumPy with dense bookkeeping (a boolean mask of touched rows, a Python loop over
them), and shares no code with the package:

  m = b1 * m + (1 - b1) * g
  v = b2 * v + (1 - b2) * mean(g^2)            (one value per row)
  w -= lr * (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd * w)

with the package's extensions where FBGEMM has none: L2 weight decay (`g += wd
* w` first, as FBGEMM's row-wise Adagrad), maximize, amsgrad (a running max of
`v`) and per-row step counts.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._backends.cpu import kernels
from tests._helpers import STEP_PATHS, assert_paths_agree, cpu_only, on_path, tiered, train_step

ROWS, DIM, NSE, STEPS = 30, 6, 12, 4


class FbgemmPartialRowwiseAdam:
  """FBGEMM's PARTIAL_ROWWISE_ADAM for one table, in float64 (module docstring)."""

  def __init__(
    self,
    param,
    *,
    lr,
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    weight_decay=0.0,
    decoupled=False,
    amsgrad=False,
    maximize=False,
    per_row_steps=False,
  ):
    self.w = np.array(param, np.float64)
    rows = self.w.shape[0]
    self.m = np.zeros_like(self.w)
    self.v = np.zeros(rows)
    self.v_max = np.zeros(rows)
    self.iter = 0
    self.row_iter = np.zeros(rows, np.int64)
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
    self.weight_decay, self.decoupled = weight_decay, decoupled
    self.amsgrad, self.maximize, self.per_row_steps = amsgrad, maximize, per_row_steps

  def step(self, indices, values, lr=None):
    lr = self.lr if lr is None else lr
    b1, b2 = self.b1, self.b2
    self.iter += 1
    values = np.asarray(values, np.float64)
    indices = np.asarray(indices)[:, 0]
    keep = (indices >= 0) & (indices < self.w.shape[0])
    grad = np.zeros_like(self.w)
    np.add.at(grad, indices[keep], values[keep])
    touched = np.zeros(self.w.shape[0], bool)
    touched[indices[keep]] = True
    for r in np.nonzero(touched)[0]:
      g = -grad[r] if self.maximize else grad[r]
      if self.weight_decay and not self.decoupled:
        g = g + self.weight_decay * self.w[r]
      self.m[r] = b1 * self.m[r] + (1 - b1) * g
      self.v[r] = b2 * self.v[r] + (1 - b2) * np.mean(g**2)
      self.v_max[r] = max(self.v_max[r], self.v[r])
      self.row_iter[r] += 1
      t = self.row_iter[r] if self.per_row_steps else self.iter
      v_hat = (self.v_max[r] if self.amsgrad else self.v[r]) / (1 - b2**t)
      adam = self.m[r] / (1 - b1**t) / (np.sqrt(v_hat) + self.eps)
      decay = self.weight_decay * self.w[r] if self.decoupled else 0.0
      self.w[r] = self.w[r] - lr * (adam + decay)


def _grads(shape, seed, *, steps=STEPS, nse=NSE):
  """BCOO gradients with a row repeated, padding entries and rows touched in some steps only."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    idx = rng.integers(0, shape[0] // 2 + 3, (nse, 1))
    idx[1:4] = idx[0]
    idx[-1] = -1
    idx[-2] = shape[0] + 1
    val = rng.standard_normal((nse,) + shape[1:]).astype(np.float32)
    out.append(sparse.BCOO((jnp.asarray(val), jnp.asarray(idx, jnp.int32)), shape=shape))
  return out


def _schedule(count):
  return 0.05 / (1.0 + count)


# name: (osa factory keywords, reference keywords)
OPTIONS = {
  "default": ({}, {}),
  "maximize": ({"maximize": True}, {"maximize": True}),
  "l2": ({"weight_decay": 0.3}, {"weight_decay": 0.3}),
  "adamw": ({"adamw": True, "weight_decay": 0.3}, {"weight_decay": 0.3, "decoupled": True}),
  "amsgrad": ({"amsgrad": True}, {"amsgrad": True}),
  "per_row_bias_correction": ({"per_row_bias_correction": True}, {"per_row_steps": True}),
  "schedule": ({"learning_rate": _schedule}, {"lr": _schedule}),
  # eps of the size of sqrt(v): shows where it is added (to the corrected root).
  "betas_large_eps": (
    {"b1": 0.5, "b2": 0.9, "eps": 0.3},
    {"b1": 0.5, "b2": 0.9, "eps": 0.3},
  ),
}


def _opt(options, **extra):
  options = {"learning_rate": 0.05, **options, **extra}
  factory = osa.sparse_adamw if options.pop("adamw", False) else osa.sparse_adam
  options.setdefault("weight_decay", 0.0)
  return factory(rowwise_second_moment=True, **options)


def _reference(param, grads, ref_options):
  lr = ref_options.pop("lr", 0.05)
  ref = FbgemmPartialRowwiseAdam(param, lr=0.0 if callable(lr) else lr, **ref_options)
  for count, g in enumerate(grads):
    ref.step(np.asarray(g.indices), np.asarray(g.data), lr=lr(count) if callable(lr) else None)
  return ref


def _run(opt, param, grads, *, jit, path=None):
  step = train_step(opt)
  if jit:
    step = jax.jit(step)
  params = {"table": param}
  state = opt.init(params)
  with on_path(path):
    for g in grads:
      params, state = step(params, state, {"table": g})
  return params["table"], state


def _initial(shape, seed=7):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_matches_fbgemm_formula(name, jit):
  options, ref_options = OPTIONS[name]
  param = _initial((ROWS, DIM))
  grads = _grads((ROWS, DIM), seed=1)
  got, state = _run(_opt(options), param, grads, jit=jit)
  ref = _reference(param, grads, dict(ref_options))
  np.testing.assert_allclose(got, ref.w, rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(state.mu["table"], ref.m, rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(state.nu["table"], ref.v, rtol=2e-5, atol=1e-12)
  assert state.nu["table"].shape == (ROWS,)
  untouched = ~np.isin(np.arange(ROWS), np.concatenate([np.asarray(g.indices) for g in grads]))
  assert untouched.any()
  np.testing.assert_array_equal(np.asarray(got)[untouched], np.asarray(param)[untouched])
  np.testing.assert_array_equal(np.asarray(state.nu["table"])[untouched], 0.0)
  if name == "amsgrad":
    np.testing.assert_allclose(state.nu_max["table"], ref.v_max, rtol=2e-5, atol=1e-12)
    assert state.nu_max["table"].shape == (ROWS,)


# name: (parameter shape)
LAYOUTS = {"n_dense_0": (40,), "n_dense_2": (20, 3, 5), "odd_row": (25, 13)}


LAYOUT_PATHS = [(layout, path) for layout in sorted(LAYOUTS) for path in STEP_PATHS]


# Each layout and each path once in the default tier (a diagonal), the crossings slow.
@pytest.mark.parametrize(
  "layout, path",
  tiered(LAYOUT_PATHS, lambda c: STEP_PATHS.index(c[1]) != sorted(LAYOUTS).index(c[0])),
  ids=[f"{layout}-{path}" for layout, path in LAYOUT_PATHS],
)
def test_every_layout_and_path_matches_fbgemm_formula(layout, path):
  shape = LAYOUTS[layout]
  param = _initial(shape)
  grads = _grads(shape, seed=2)
  got, state = _run(_opt({}), param, grads, jit=True, path=path)
  ref = _reference(param, grads, {})
  np.testing.assert_allclose(got, ref.w, rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(state.nu["table"], ref.v, rtol=2e-5, atol=1e-12)


def _bits(tree):
  return [(np.asarray(x).dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


PATH_CASES = [
  (name, jit)
  for name in ["default", "maximize", "amsgrad", "adamw", "per_row_bias_correction"]
  for jit in (True, False)
]


@pytest.mark.parametrize(
  ("name", "jit"),
  tiered(PATH_CASES, lambda case: not case[1]),  # eager: test_sparse_adam's in the default tier
  ids=[f"{name}-{'jit' if jit else 'eager'}" for name, jit in PATH_CASES],
)
def test_paths_agree_bit_for_bit(name, jit):
  """The fused CPU kernel (where it applies), the XLA ops and the accelerator step: the same
  bits on the CPU, close elsewhere (`assert_paths_agree`)."""
  options, _ = OPTIONS[name]
  param = _initial((ROWS, DIM))
  grads = _grads((ROWS, DIM), seed=3)
  opt = _opt(options)
  runs = {
    p: _run(opt, param, grads, jit=jit, path=p) for p in ("default", "xla_ops", "accelerator")
  }
  assert_paths_agree(runs["default"], runs["xla_ops"])
  assert_paths_agree(runs["accelerator"], runs["xla_ops"])


@cpu_only("the fused CPU kernels run")
@pytest.mark.skipif(not kernels.available(), reason="the CPU kernels were not built")
def test_cpu_kernel_runs_the_plain_rowwise_step():
  params = {"table": jnp.zeros((ROWS, DIM))}
  opt = _opt({})
  grads = {"table": _grads((ROWS, DIM), seed=4, steps=1)[0]}
  lowered = jax.jit(train_step(opt)).lower(params, opt.init(params), grads).as_text()
  assert "optax_sparse_adam_fused_rowwise_adam_f32" in lowered
  with kernels.use_cpu_kernels(False):
    lowered = jax.jit(train_step(opt)).lower(params, opt.init(params), grads).as_text()
  assert "optax_sparse_adam_fused_rowwise_adam_f32" not in lowered


def test_default_keeps_full_second_moment_and_same_bits():
  """`rowwise_second_moment=False` is the torch-parity default: full `nu`, same bits as before."""
  param = _initial((ROWS, DIM))
  grads = _grads((ROWS, DIM), seed=5)
  default, default_state = _run(osa.sparse_adam(0.05), param, grads, jit=True)
  explicit, explicit_state = _run(
    osa.sparse_adam(0.05, rowwise_second_moment=False), param, grads, jit=True
  )
  assert default_state.nu["table"].shape == (ROWS, DIM)
  assert _bits((default, default_state)) == _bits((explicit, explicit_state))
  rowwise, _ = _run(_opt({}), param, grads, jit=True)
  assert not np.array_equal(np.asarray(rowwise), np.asarray(default))


def test_first_moment_is_full_adams_bit_for_bit():
  """Only the second moment is row-wise: `mu` is the same table as full Adam's."""
  param = _initial((ROWS, DIM))
  grads = _grads((ROWS, DIM), seed=6)
  _, full = _run(osa.sparse_adam(0.05), param, grads, jit=True)
  _, rowwise = _run(_opt({}), param, grads, jit=True)
  assert _bits(full.mu) == _bits(rowwise.mu)


def test_nu_dtype_sets_the_per_row_dtype():
  opt = osa.sparse_adam(rowwise_second_moment=True, amsgrad=True, nu_dtype=jnp.bfloat16)
  state = opt.init({"table": jnp.zeros((ROWS, DIM))})
  assert state.nu["table"].shape == (ROWS,) and state.nu["table"].dtype == jnp.bfloat16
  assert state.nu_max["table"].shape == (ROWS,) and state.nu_max["table"].dtype == jnp.bfloat16
  assert state.mu["table"].shape == (ROWS, DIM) and state.mu["table"].dtype == jnp.float32


def test_refuses_gradients_that_index_more_than_the_leading_dim():
  opt = osa.sparse_adam(rowwise_second_moment=True)
  params = {"emb": {"table": jnp.zeros((6, 4, 3))}}
  state = opt.init(params)
  grad = sparse.BCOO((jnp.ones((2, 3)), jnp.array([[1, 2], [3, 0]])), shape=(6, 4, 3))
  with pytest.raises(
    ValueError, match=r"\['emb'\]\['table'\].*24 rows.*'rowwise_adam'.*n_sparse=1"
  ):
    opt.update({"emb": {"table": grad}}, state, params)


def test_vmap_over_independent_tables():
  """Two tables stepped under `jax.vmap` equal two separate steps."""
  opt = _opt({})
  params = jnp.stack([_initial((ROWS, DIM), 1), _initial((ROWS, DIM), 2)])
  g0, g1 = _grads((ROWS, DIM), seed=8, steps=2)
  data = jnp.stack([g0.data, g1.data])
  indices = jnp.stack([g0.indices, g1.indices])

  def step(param, data, indices):
    grad = sparse.BCOO((data, indices), shape=(ROWS, DIM))
    state = opt.init(param)
    update, state = opt.update(grad, state, param)
    return osa.apply_updates(param, update), state.nu

  batched = jax.jit(jax.vmap(step))(params, data, indices)
  for k in range(2):
    single = jax.jit(step)(params[k], data[k], indices[k])
    np.testing.assert_array_equal(batched[0][k], single[0])
    np.testing.assert_array_equal(batched[1][k], single[1])


def test_differentiable_through_the_step():
  """d(param after one step)/d(learning rate) through `optax.inject_hyperparams`."""
  param = _initial((ROWS, DIM))
  grad = _grads((ROWS, DIM), seed=9, steps=1)[0]

  def after(lr):
    opt = optax.inject_hyperparams(osa.sparse_adam, static_args=("rowwise_second_moment",))(
      learning_rate=lr, rowwise_second_moment=True
    )
    update, _ = opt.update({"t": grad}, opt.init({"t": param}), {"t": param})
    return jnp.sum(osa.apply_updates({"t": param}, update)["t"])

  got = jax.grad(after)(0.05)
  ref = _reference(param, [grad], {"lr": 1.0})  # the step is linear in lr
  np.testing.assert_allclose(got, (ref.w - np.asarray(param, np.float64)).sum(), rtol=1e-4)


def test_optax_chain_with_a_lifted_scale():
  param = _initial((ROWS, DIM))
  grads = _grads((ROWS, DIM), seed=10)
  opt = optax.chain(osa.lift_to_bcoo(optax.scale(0.5)), _opt({}))
  got, _ = _run(opt, param, grads, jit=True)
  halved = [sparse.BCOO((g.data * 0.5, g.indices), shape=g.shape) for g in grads]
  ref = _reference(param, halved, {})
  np.testing.assert_allclose(got, ref.w, rtol=2e-5, atol=1e-7)


def test_sparse_multi_steps_equals_mean_gradient_step():
  param = _initial((ROWS, DIM))
  k = 2
  micro = _grads((ROWS, DIM), seed=11, steps=2 * k)
  opt = osa.sparse_multi_steps(_opt({}), every_k=k, max_nse=2 * NSE)
  got, state = _run(opt, param, micro, jit=True)
  assert int(state.gradient_step) == 2
  ref = FbgemmPartialRowwiseAdam(param, lr=0.05)
  for cycle in range(2):
    gs = micro[cycle * k : (cycle + 1) * k]
    indices = np.concatenate([np.asarray(g.indices) for g in gs])
    values = np.concatenate([np.asarray(g.data) for g in gs]) / k
    ref.step(indices, values)
  np.testing.assert_allclose(got, ref.w, rtol=2e-5, atol=1e-7)
