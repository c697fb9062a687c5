"""The generic CPU row store (`row_store.cc`): any rule and table dtype, in place, in XLA's bits.

A rule with no fused kernel (FTRL, a rule written here) runs its math as XLA
ops on the CPU and stores its slots' rows with the generic kernel; the apply
stores a bfloat16 table's rows and any rule's set rows with it. Checked: the
same bits as the XLA ops (the kernels switched off) over several jitted,
donated steps for float32, bfloat16 and float16 tables, and no table-sized
temporary or copy in the compiled step (`test_memory._table_copies`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from benchmarks._user_rule import UserHyper, UserRowwiseAdagrad
from optax_sparse_adam._backends.cpu import kernels
from tests._helpers import BACKEND, train_step
from tests.backends.test_memory import DIM, NUM_ROWS, _compile, _grad, _table_copies

pytestmark = pytest.mark.skipif(
  BACKEND != "cpu" or not kernels.available(), reason="the CPU kernels run on the CPU only"
)


OPTS = {
  "ftrl": lambda: osa.sparse_ftrl(0.2, l1_regularization_strength=0.05),
  "user_rule": lambda: osa.sparse_rule_transformation(UserRowwiseAdagrad(), UserHyper(0.1)),
  "adam_f32_moments": lambda: osa.sparse_adam(1e-2, mu_dtype="float32", nu_dtype="float32"),
}
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
ROWS, WIDTH = 50, 6
# Adam's float32 table runs Adam's own kernel, and a float32 per-row slot is also covered by
# FTRL's float32 case: in the slow tier, so that the default tier stays short.
_SLOW = {("adam_f32_moments", "float32"), ("user_rule", "float32")}
CASES = [
  pytest.param(
    name,
    dtype,
    id=f"{name}-{jnp.dtype(dtype).name}",
    marks=[pytest.mark.slow] if (name, jnp.dtype(dtype).name) in _SLOW else [],
  )
  for name in sorted(OPTS)
  for dtype in DTYPES
]


def _bits(x):
  x = jnp.asarray(x)
  return np.asarray(jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 4: jnp.uint32}[x.itemsize]))


@pytest.mark.parametrize("name,dtype", CASES)
def test_the_row_store_equals_the_xla_ops_bit_for_bit(name, dtype):
  opt = OPTS[name]()
  rng = np.random.default_rng(3)
  table0 = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
  batches = []
  for _ in range(4):
    ids = rng.integers(0, ROWS, 12).astype(np.int32)
    ids[:3] = ids[3]  # repeated rows
    ids[-1] = -1  # padding
    batches.append((ids, rng.standard_normal((12, WIDTH)).astype(np.float32)))
  runs = {}
  for on in (True, False):
    params = {"t": jnp.asarray(table0, dtype)}
    state = opt.init(params)
    step = jax.jit(train_step(opt), donate_argnums=(0, 1))
    with kernels.use_cpu_kernels(on):
      for ids, vals in batches:
        grad = sparse.BCOO(
          (jnp.asarray(vals, dtype), jnp.asarray(ids)[:, None]), shape=(ROWS, WIDTH)
        )
        params, state = step(params, state, {"t": grad})
    runs[on] = (params, state)
  for kernel_leaf, xla_leaf in zip(
    jax.tree.leaves(runs[True]), jax.tree.leaves(runs[False]), strict=True
  ):
    np.testing.assert_array_equal(_bits(kernel_leaf), _bits(xla_leaf))
  assert not np.array_equal(np.asarray(runs[True][0]["t"], np.float32), table0)


@pytest.mark.parametrize("name,dtype", CASES)
def test_no_table_sized_temporary_or_copy_in_the_donated_step(name, dtype):
  rng = np.random.default_rng(0)
  params = {"t": jnp.zeros((NUM_ROWS, DIM), dtype)}
  grads = {"t": _grad((NUM_ROWS, DIM), 1, rng, dtype)}
  compiled = _compile(OPTS[name](), params, grads)
  hlo = compiled.as_text()
  assert _table_copies(hlo) == []
  if name == "adam_f32_moments":
    # Adam's own kernel (a gradient of the table's dtype); a 16-bit table's apply in place.
    if dtype != jnp.float32:
      assert "optax_sparse_adam_add_rows_in_place" in hlo
  elif name == "user_rule" and dtype == jnp.float32:
    # Its row sum is `osa.row_sum`: a float32 table runs the row program (rows in place).
    assert "optax_sparse_adam_row_program" in hlo
  else:
    assert "optax_sparse_adam_store_rows" in hlo  # the generic kernel stores the rows
