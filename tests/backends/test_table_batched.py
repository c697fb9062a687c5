"""The table-batched accelerator step: every sparse table of one update coalesced by one sort.

Forced onto this backend (`choice.choose(forced=ACCELERATOR)`), the batched step
is compared with the accelerator step of each table alone (`batch_tables=False`),
bit for bit on the CPU (`assert_paths_agree`: a few roundings on a GPU, whose
scatter-adds sum duplicates in their own order), over several steps, rules, row
widths, dtypes and layouts, with duplicate, padding and absent ids; then the
programs: lowered for CUDA from this machine, one sort for the batch where the
per-table step has one per table; lowered for the CPU, each table's CPU kernel as
before.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse
from jax.sharding import AxisType

import optax_sparse_adam as osa
from optax_sparse_adam._backends import choice
from optax_sparse_adam._core import bcoo, coalesce, coalesce_tables
from optax_sparse_adam._core.row_rules.adam import AdamRule
from optax_sparse_adam._core.rules import StepConfig, Tables
from optax_sparse_adam._optax import leaf, table_steps
from tests._helpers import assert_paths_agree, train_step
from tests.backends.test_accelerator import _table_writes
from tests.core._forced_devices import run_checks

# name: (parameter shape, n_sparse, gradient entries, parameter dtype)
TABLES = {
  "a": ((50, 8), 1, 20, jnp.float32),
  "b": ((31, 8), 1, 24, jnp.float32),
  "c": ((40, 4), 1, 16, jnp.float32),  # another row width
  "d": ((60,), 1, 12, jnp.float32),  # one value a row
  "e": ((12, 8), 1, 0, jnp.float32),  # no entries
  "f": ((25, 8), 1, 10, jnp.bfloat16),  # another dtype
}
N_SPARSE_2 = {"g": ((9, 7), 2, 14, jnp.float32)}  # two sparse dims (no per-row state)


def _bits(x):
  x = np.asarray(x)
  return x.view(np.dtype(f"uint{x.dtype.itemsize * 8}")) if x.dtype.kind == "f" else x


def _assert_agree(got, want):
  """Every bit on the CPU; elsewhere a few roundings (a GPU sums duplicates in its own order)."""
  assert_paths_agree(got, want)


def _grads(tables, rng, steps=3):
  """Each step's BCOO gradients: a row six times, ids past the end and negative, a -0.0."""
  out = []
  for _ in range(steps):
    grads = {}
    for name, (shape, n_sparse, nse, dtype) in tables.items():
      idx = np.stack([rng.integers(0, shape[k], nse) for k in range(n_sparse)], 1)
      if nse >= 8:
        idx[1:6] = idx[0]
        idx[-2, 0] = -1
        idx[-1, -1] = shape[n_sparse - 1] + 3
      val = rng.standard_normal((nse, *shape[n_sparse:])).astype(np.float32)
      if nse:
        val.reshape(-1)[0] = -0.0
      grads[name] = sparse.BCOO(
        (jnp.asarray(val, dtype), jnp.asarray(idx.reshape(nse, n_sparse), jnp.int32)), shape=shape
      )
    out.append(grads)
  return out


def _params(tables, rng):
  return {
    name: jnp.asarray(rng.standard_normal(shape), dtype)
    for name, (shape, _, _, dtype) in tables.items()
  }


def _train(opt, params, batches, *, use_jit=True, **switches):
  step = train_step(opt)
  with choice.choose(forced=choice.ACCELERATOR, **switches):
    run = jax.jit(step) if use_jit else step
    state = opt.init(params)
    for grads in batches:
      params, state = run(params, state, grads)
  return params, state


RULES = {
  "adam_amsgrad_l2_per_row": lambda: osa.sparse_adam(
    1e-2, amsgrad=True, weight_decay=0.1, per_row_bias_correction=True
  ),
  "adamw_maximize_catch_up": lambda: osa.sparse_adamw(
    3e-2, weight_decay=0.05, maximize=True, catch_up_idle_rows=True
  ),
  "adam_bf16_stochastic": lambda: osa.sparse_adam(
    1e-2, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16, moment_rounding="stochastic"
  ),
  "sgd_momentum": lambda: osa.sparse_sgd(1e-2, momentum=0.9, lazy_momentum=True),
  "rowwise_adagrad": lambda: osa.sparse_rowwise_adagrad(1e-1, max_norm=1.0),
  "ftrl": lambda: osa.sparse_ftrl(1e-1, l1_regularization_strength=0.01),
}


# The default tier runs two: Adam with per-row state (AMSGrad, L2, per-row bias
# correction) and row-wise Adagrad (a per-row slot, max_norm, an empty table).
SLOW_RULES = ("adamw_maximize_catch_up", "adam_bf16_stochastic", "sgd_momentum", "ftrl")


@pytest.mark.parametrize(
  "rule", [pytest.param(r, marks=pytest.mark.slow) if r in SLOW_RULES else r for r in RULES]
)
def test_batched_step_equals_each_table_alone(rule):
  """Params and state after two jitted steps: the same bits, batched or table by table."""
  rng = np.random.default_rng(0)
  per_row_state = rule in ("adam_amsgrad_l2_per_row", "adamw_maximize_catch_up", "rowwise_adagrad")
  tables = dict(TABLES) if per_row_state else {**TABLES, **N_SPARSE_2}
  params, batches = _params(tables, rng), _grads(tables, rng, steps=2)
  opt = RULES[rule]()
  batched = _train(opt, params, batches)
  alone = _train(opt, params, batches, batch_tables=False)
  _assert_agree(batched, alone)
  moved = [n for n in params if not np.array_equal(_bits(batched[0][n]), _bits(params[n]))]
  assert sorted(moved) == sorted(set(tables) - {"e"})  # a control: every stepped table moved


@pytest.mark.slow
def test_batched_step_eagerly_with_dense_and_absent_gradients():
  """Op by op, a tree with a dense gradient and a None one among the tables."""
  rng = np.random.default_rng(1)
  tables = {k: TABLES[k] for k in ("a", "c")}
  params = {**_params(tables, rng), "dense": jnp.ones((3, 4)), "none": jnp.ones((2,))}
  batches = [
    {**grads, "dense": jnp.full((3, 4), 0.5), "none": None} for grads in _grads(tables, rng, 1)
  ]
  opt = osa.sparse_adagrad(1e-1)
  batched = _train(opt, params, batches, use_jit=False)
  alone = _train(opt, params, batches, use_jit=False, batch_tables=False)
  _assert_agree(batched, alone)
  assert not np.array_equal(batched[0]["dense"], params["dense"])
  np.testing.assert_array_equal(batched[0]["none"], params["none"])


def test_coalesced_tables_equal_each_table_sorted_alone_with_one_key_or_two():
  """The coalescing itself, against `coalesce_by_one_sort` per table; int32 keys or (table, row)."""
  rng = np.random.default_rng(2)
  tables = {k: v for k, v in {**TABLES, **N_SPARSE_2}.items() if v[2]}
  grads = []
  for grad in _grads(tables, rng, 1)[0].values():
    layout = bcoo.row_layout(grad, grad.shape)
    rows = bcoo.linear_rows(grad.indices, layout)
    grads.append(coalesce_tables.TableGrad(rows, grad.data, layout.num_rows))
  assert any(bool(jnp.any(g.rows == g.num_rows)) for g in grads)  # padding is there
  num_rows = [g.num_rows for g in grads]

  @jax.jit
  def each_way(rows_values):
    given = [
      coalesce_tables.TableGrad(r, v, n) for (r, v), n in zip(rows_values, num_rows, strict=True)
    ]
    alone = [coalesce.coalesce_by_one_sort(*g) for g in given]
    one_key = coalesce_tables.coalesce_tables(given)
    two_keys = coalesce_tables.coalesce_tables(given, max_key=10)  # (table, row) keys
    return alone, one_key, two_keys

  alone, one_key, two_keys = each_way([(g.rows, g.values) for g in grads])
  _assert_agree(one_key, alone)
  _assert_agree(two_keys, alone)


def _lowered(opt, tables, platform, **switches):
  rng = np.random.default_rng(3)
  params = _params(tables, rng)
  with choice.choose(**switches):
    traced = jax.jit(train_step(opt), donate_argnums=(0, 1)).trace(
      params, opt.init(params), _grads(tables, rng, 1)[0]
    )
  return traced.lower(lowering_platforms=(platform,))


@pytest.mark.parametrize("rule", ["adam", "rowwise_adagrad"])
def test_lowered_for_cuda_one_sort_for_the_tables(rule):
  """Lowered for CUDA: one sort for all tables; the per-table step sorts once per table.

  Each table and full-width slot is still written once, by one scatter.
  """
  tables = {k: TABLES[k] for k in ("a", "b", "c", "f")}
  opt = osa.sparse_adam(1e-3) if rule == "adam" else osa.sparse_rowwise_adagrad(1e-2)
  batched = _lowered(opt, tables, "cuda")
  alone = _lowered(opt, tables, "cuda", batch_tables=False)
  assert batched.as_text().count('"stablehlo.sort"') == 1
  assert alone.as_text().count('"stablehlo.sort"') == len(tables)
  # param, and m and v for Adam (row-wise Adagrad's one slot is per row)
  per_table = 3 if rule == "adam" else 1
  for lowered in (batched, alone):
    text = lowered.as_text()
    assert "stablehlo.while" not in text and "stablehlo.custom_call" not in text
    for shape, _, _, dtype in tables.values():
      dims = "x".join(map(str, shape))
      writes = _table_writes(
        lowered, f"tensor<{dims}x{jnp.dtype(dtype).name}>".replace("float", "f")
      )
      # "a" and "b" share no shape; "c" and "f" neither: each shape is one table's.
      assert writes.get("stablehlo.scatter") == per_table, (shape, writes)


def test_lowered_for_the_cpu_keeps_each_tables_kernel():
  """The CPU program is unchanged: each table's fused kernel, no sort."""
  if not osa.cpu_kernels_available():
    pytest.skip("the CPU kernels are not built")
  tables = {k: TABLES[k] for k in ("a", "b", "c")}
  text = _lowered(osa.sparse_adam(1e-3), tables, "cpu").as_text()
  assert text.count("optax_sparse_adam_fused_adam_f32") == len(tables)
  assert '"stablehlo.sort"' not in text


def test_grad_and_vmap_through_the_batched_step():
  """`jax.grad` (by the learning rate) and `jax.vmap` (over gradients) agree, batched or not."""
  rng = np.random.default_rng(4)
  tables = {k: TABLES[k] for k in ("a", "b")}
  params = _params(tables, rng)
  grads = _grads(tables, rng, 1)[0]

  def loss(lr, values):
    opt = osa.sparse_sgd(lr)
    g = {n: sparse.BCOO((values[n], grads[n].indices), shape=grads[n].shape) for n in grads}
    updates, _ = opt.update(g, opt.init(params), params)
    return sum(jnp.sum(p**2) for p in jax.tree.leaves(osa.apply_updates(params, updates)))

  values = {n: g.data for n, g in grads.items()}
  stacked = {n: jnp.stack([v, 2 * v]) for n, v in values.items()}
  results = {}
  paths = {
    "batched": dict(forced=choice.ACCELERATOR),
    "alone": dict(forced=choice.ACCELERATOR, batch_tables=False),
    "default": {},  # on the CPU: each table's kernel, differentiated as the XLA ops
  }
  for name, switches in paths.items():
    with choice.choose(**switches):
      d_lr = jax.jit(jax.grad(loss))(jnp.float32(0.05), values)
      mapped = jax.jit(jax.vmap(loss, in_axes=(None, 0)))(jnp.float32(0.05), stacked)
    results[name] = (d_lr, mapped)
  _assert_agree(results["batched"], results["alone"])
  _assert_agree(results["batched"], results["default"])
  d_lr, mapped = results["batched"]
  assert float(jnp.abs(d_lr)) > 0  # a control: the rate moves the loss
  assert mapped[0] != mapped[1]


def test_explicit_mesh_axes_step_each_table_alone_and_say_why():
  """Under Explicit axes the tables are stepped one by one (a stated reason), same bits."""
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,))
  rng = np.random.default_rng(5)
  tables = {k: TABLES[k] for k in ("a", "b")}
  params, batches = _params(tables, rng), _grads(tables, rng, 1)
  opt = osa.sparse_adam(1e-2)
  with jax.set_mesh(mesh):
    assert "Explicit" in table_steps.unbatched_reason(None)
    on_mesh = _train(opt, params, batches)
  assert table_steps.unbatched_reason(None) is None
  _assert_agree(on_mesh, _train(opt, params, batches, batch_tables=False))


def test_a_local_leaf_has_no_reason_to_step_alone():
  rng = np.random.default_rng(6)
  grad = _grads({"a": TABLES["a"]}, rng, 1)[0]["a"]
  tables = Tables({"mu": jnp.zeros((50, 8)), "nu": jnp.zeros((50, 8))})
  ready = leaf.prepare_leaf_step(grad, tables, jnp.int32(0), rule=AdamRule(), config=StepConfig())
  assert table_steps.unbatched_reason(ready) is None


@pytest.mark.slow
def test_a_row_sharded_table_is_stepped_alone_the_others_together():
  """On 2 forced CPU devices (a subprocess): the routed table says why it steps alone; the
  two local tables are batched; the step equals the per-table one bit for bit."""
  got = run_checks("../backends/_table_batched_sharded.py", timeout=300)
  assert got["reasons"] == {
    "sharded": "the table is row-sharded: its step is routed to each row's owner",
    "a": None,
    "b": None,
  }
  assert got["same_bits"] and got["every_table_moved"]
