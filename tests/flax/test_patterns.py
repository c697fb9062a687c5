"""Catalogue of Flax usage patterns: each is CORRECT against a reference, or a CLEAR ERROR.

Every pattern of docs/flax/patterns.md has a test here, for NNX and for Linen:
- CORRECT patterns train a few steps and are compared with an independent reference:
  real torch (`nn.Embedding(sparse=True)` + `torch.optim.SparseAdam`) where torch has
  the behaviour (detached and unused lookups), else the dense JAX gradient of the same
  model (`nnx.grad` / `jax.grad`, where a table is an ordinary array) fed to the NumPy
  masked Adam of `tests/_helpers.py` on the rows the pattern touches.
- ERROR patterns assert the message (the table's path and the way out) and that the
  params and the optimizer state are unchanged after the error.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.experimental import checkify

from tests._helpers import NumpySparseAdam

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402

V, V2, D, LR = 12, 9, 3, 0.05
W = jnp.asarray(np.random.default_rng(7).normal(size=(D,)), jnp.float32)
NESTED = r"nested transform within sparse_value_and_grad.*Look the table up in the differentiated"


def ids(*values):
  return jnp.asarray(values, jnp.int32)


def arrays_of(tree):
  return [np.array(x) for x in jax.tree.leaves(tree)]


def assert_unchanged(before, after):
  assert len(before) == len(after)
  for b, a in zip(before, after, strict=True):
    np.testing.assert_array_equal(b, a)


# ---------------------------------------------------------------------------
# NNX: model, training loop, reference.


class Tables(nnx.Module):
  """Two tables; every other array of the patterns is a constant, so the tables are all params."""

  def __init__(self, seed=0, param_dtype=jnp.float32):
    rngs = nnx.Rngs(seed)
    self.a = osa.SparseEmbed(V, D, param_dtype=param_dtype, rngs=rngs)
    self.b = osa.SparseEmbed(V2, D, param_dtype=param_dtype, rngs=rngs)


def nnx_train(loss_fn, batches, *, jit, model=None, tx=None, has_aux=False):
  """Trains `model` (default `Tables()`) with `SparseOptimizer`; returns (model, optimizer)."""
  model = Tables() if model is None else model
  optimizer = osa.SparseOptimizer(model, tx or osa.sparse_adam(LR), wrt=nnx.Param)

  def step(model, optimizer, batch):
    _, grads = osa.sparse_value_and_grad(loss_fn, has_aux=has_aux)(model, batch)
    optimizer.update(model, grads)

  step = nnx.jit(step) if jit else step
  for batch in batches:
    step(model, optimizer, batch)
  return model, optimizer


def nnx_reference(loss_fn, batches, touched, *, model=None):
  """NumPy masked Adam on the dense `nnx.grad` of the same model: {'a': table, 'b': table}.

  `touched(batch)` gives, per table, the rows the step touches, or None for no step.
  """
  model = Tables() if model is None else model
  refs = {
    name: NumpySparseAdam(np.asarray(getattr(model, name).embedding[...], np.float64), lr=LR)
    for name in ("a", "b")
  }
  for batch in batches:
    for name, ref in refs.items():
      table = getattr(model, name).embedding
      table[...] = jnp.asarray(ref.param, table.dtype)
    grads = nnx.grad(loss_fn)(model, batch)
    for name, rows in touched(batch).items():
      if rows is None:
        continue
      rows = np.unique(np.asarray(rows))
      dense = np.asarray(grads[name]["embedding"][...], np.float64)
      refs[name].step(rows[:, None], dense[rows])
  return {name: ref.param for name, ref in refs.items()}


def assert_tables(model, expected, atol=1e-5):
  for name, table in expected.items():
    np.testing.assert_allclose(
      np.asarray(getattr(model, name).embedding[...], np.float64), table, atol=atol, rtol=0
    )


def assert_nnx_error(loss_fn, batch, match, *, jit=False):
  model = Tables()
  optimizer = osa.SparseOptimizer(model, osa.sparse_adam(LR), wrt=nnx.Param)
  before = arrays_of(nnx.state(model)) + arrays_of(nnx.state(optimizer))

  def step(model, optimizer, batch):
    _, grads = osa.sparse_value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)

  with pytest.raises(ValueError, match=match):
    (nnx.jit(step) if jit else step)(model, optimizer, batch)
  assert_unchanged(before, arrays_of(nnx.state(model)) + arrays_of(nnx.state(optimizer)))


# ---------------------------------------------------------------------------
# Torch: detached and unused lookups (torch has the behaviour).


def torch_train(initial, batches, loss_fn):
  """`nn.Embedding(sparse=True)` + `torch.optim.SparseAdam`; returns the tables."""
  torch = pytest.importorskip("torch")
  embeds = {
    name: torch.nn.Embedding.from_pretrained(
      torch.tensor(np.asarray(table)), freeze=False, sparse=True
    )
    for name, table in initial.items()
  }
  opt = torch.optim.SparseAdam([e.weight for e in embeds.values()], lr=LR)
  w = torch.tensor(np.asarray(W))
  for batch in batches:
    opt.zero_grad(set_to_none=True)
    loss_fn(embeds, w, *(torch.tensor(np.asarray(x)).long() for x in batch)).backward()
    opt.step()
  return {name: e.weight.detach().numpy() for name, e in embeds.items()}


QT_BATCHES = [
  (ids(1, 2, 2), ids(3, 4, 1)),
  (ids(5, 1, 6), ids(7, 7, 0)),
  (ids(2, 3, 8), ids(4, 8, 0)),
]


def nnx_detach_loss(m, batch):
  q, t = batch
  target = lax.stop_gradient(m.a(t))  # a target: in-batch, detached
  negatives = lax.stop_gradient(m.b(t))  # table b only detached: no gradient at all
  return jnp.mean((m.a(q) - target) ** 2) + jnp.mean(m.a(q) @ W * (negatives @ W))


def torch_detach_loss(e, w, q, t):
  target = e["a"](t).detach()
  negatives = e["b"](t).detach()
  return ((e["a"](q) - target) ** 2).mean() + ((e["a"](q) @ w) * (negatives @ w)).mean()


def nnx_unused_loss(m, batch):
  q, t = batch
  m.a(t)  # looked up, never used
  metric = jnp.sum(m.b(q))  # used only in aux: not differentiated
  return jnp.sum((m.a(q) @ W) ** 2), metric


def torch_unused_loss(e, w, q, t):
  e["a"](t)
  e["b"](q).sum()
  return ((e["a"](q) @ w) ** 2).sum()


def initial_tables(seed=0):
  model = Tables(seed)
  return {name: np.asarray(getattr(model, name).embedding[...]) for name in ("a", "b")}


@pytest.mark.parametrize("jit", [False, True])
def test_nnx_detached_lookup_adds_no_entries_as_torch_detach(jit):
  grads = osa.sparse_grad(nnx_detach_loss)(Tables(), QT_BATCHES[0])
  assert grads["b"]["embedding"].get_value() is None
  q, t = QT_BATCHES[0]  # a(q) twice, a(t) detached: entries of q only
  np.testing.assert_array_equal(
    np.sort(grads["a"]["embedding"].get_value().indices[:, 0]), np.sort(np.concatenate([q, q]))
  )
  model, optimizer = nnx_train(nnx_detach_loss, QT_BATCHES, jit=jit)
  expected = torch_train(initial_tables(), QT_BATCHES, torch_detach_loss)
  assert_tables(model, expected, atol=1e-6)
  assert int(optimizer.opt_state.step["b"]["embedding"][...]) == 0


@pytest.mark.parametrize("jit", [False, True])
def test_nnx_unused_lookup_adds_no_entries_as_torch(jit):
  model, _ = nnx_train(nnx_unused_loss, QT_BATCHES, jit=jit, has_aux=True)
  expected = torch_train(initial_tables(), QT_BATCHES, torch_unused_loss)
  assert_tables(model, expected, atol=1e-6)


# ---------------------------------------------------------------------------
# NNX: tied projection, padding, bf16, and the ways out of the nested transforms.


def nnx_tied_loss(m, batch):
  q, t = batch
  logits = m.a(q) @ m.a.embedding[...].T  # the output projection is the embedding table
  return optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()


@pytest.mark.parametrize("jit", [False, True])
def test_nnx_tied_projection_gets_the_full_gradient(jit):
  grad = osa.sparse_grad(nnx_tied_loss)(Tables(), QT_BATCHES[0])["a"]["embedding"].get_value()
  dense = nnx.grad(nnx_tied_loss)(Tables(), QT_BATCHES[0])["a"]["embedding"][...]
  np.testing.assert_allclose(grad.todense(), dense, atol=1e-7)
  model, _ = nnx_train(nnx_tied_loss, QT_BATCHES, jit=jit)
  expected = nnx_reference(nnx_tied_loss, QT_BATCHES, lambda b: {"a": np.arange(V), "b": None})
  assert_tables(model, expected)


PAD_BATCHES = [
  (jnp.asarray([[1, -1, -1], [2, 3, V], [4, 4, -5]]), jnp.asarray([0.5, -1.0, 2.0])),
  (jnp.asarray([[5, 6, -1], [-1, -1, -1], [1, V + 3, 2]]), jnp.asarray([1.0, 0.0, -0.5])),
]


def valid_rows(bags):
  bags = np.asarray(bags).ravel()
  return bags[(bags >= 0) & (bags < V)]


@pytest.mark.parametrize("pooling", ["mean", "sum"])
def test_nnx_padding_with_pooling_passes_check_sparse_grads(pooling):
  def loss(m, batch):
    bags, y = batch
    rows = m.a(bags)  # padding ids read zero rows
    pooled = jnp.mean(rows, axis=1) if pooling == "mean" else jnp.sum(rows, axis=1)
    return jnp.mean((pooled @ W - y) ** 2)

  grads = osa.sparse_grad(loss)(Tables(), PAD_BATCHES[0])
  err, _ = checkify.checkify(lambda g: osa.check_sparse_grads(g))(grads)
  assert err.get() is None
  model, _ = nnx_train(loss, PAD_BATCHES, jit=True)
  expected = nnx_reference(loss, PAD_BATCHES, lambda b: {"a": valid_rows(b[0]), "b": None})
  assert_tables(model, expected)


def test_nnx_bf16_table_trains_like_the_reference():
  model, _ = nnx_train(nnx_tied_loss, QT_BATCHES, jit=True, model=Tables(param_dtype=jnp.bfloat16))
  assert model.a.embedding[...].dtype == jnp.bfloat16

  def loss(m, batch):
    q, _ = batch
    return jnp.sum((m.a(q).astype(jnp.float32) @ W) ** 2)

  model, _ = nnx_train(loss, QT_BATCHES, jit=True, model=Tables(param_dtype=jnp.bfloat16))
  start = Tables(param_dtype=jnp.bfloat16)
  expected = nnx_reference(loss, QT_BATCHES, lambda b: {"a": b[0], "b": None}, model=start)
  # bfloat16 keeps 8 bits of mantissa: the table moves as the float64 reference, to bf16 rounding.
  assert_tables(model, expected, atol=3e-2)
  initial = np.asarray(Tables(param_dtype=jnp.bfloat16).a.embedding[...], np.float32)
  moved = np.abs(np.asarray(model.a.embedding[...], np.float32) - initial)
  assert moved[[1, 2, 3, 5, 6, 8]].max(axis=1).min() > 1e-2  # the looked-up rows train
  assert moved[[0, 4, 7, 9, 10, 11]].max() == 0  # the others are untouched


def nnx_block(h):
  return jnp.tanh(h) @ W


def test_nnx_remat_after_the_lookup_is_correct():
  def loss(m, batch):
    q, _ = batch
    return jnp.sum(nnx.remat(nnx_block)(m.a(q)) ** 2)

  model, _ = nnx_train(loss, QT_BATCHES, jit=True)
  assert_tables(model, nnx_reference(loss, QT_BATCHES, lambda b: {"a": b[0], "b": None}))


TIME_BATCHES = [
  (jnp.asarray([[1, 2], [3, 1], [4, 4]]), jnp.asarray([0.5, -1.0])),
  (jnp.asarray([[5, 6], [1, 7], [8, 0]]), jnp.asarray([1.0, 0.2])),
]


def test_nnx_scan_over_gathered_rows_is_correct():
  def loss(m, batch):
    seq, y = batch  # (time, batch)
    rows = m.a(seq)  # one lookup of every time step, then the scan over the rows

    def cell(carry, x):
      carry = jnp.tanh(0.5 * carry + x)
      return carry, None

    final, _ = lax.scan(cell, jnp.zeros(rows.shape[1:]), rows)
    return jnp.mean((final @ W - y) ** 2)

  model, _ = nnx_train(loss, TIME_BATCHES, jit=True)
  assert_tables(model, nnx_reference(loss, TIME_BATCHES, lambda b: {"a": b[0].ravel(), "b": None}))


def test_nnx_ensemble_as_one_table_with_offset_ids_is_correct():
  members = 2

  def loss(m, batch):
    q, y = batch  # the member k's rows are k * (V // members) + id
    offsets = jnp.arange(members)[:, None] * (V // members)
    rows = m.a(q[None, :] + offsets)  # (members, batch, D)
    preds = jax.vmap(lambda r: r @ W)(rows)
    return jnp.mean((preds - y) ** 2)

  batches = [
    (ids(0, 1, 5), jnp.asarray([1.0, 0.0, -1.0])),
    (ids(2, 2, 4), jnp.asarray([0.3, 1.0, 2.0])),
  ]
  model, _ = nnx_train(loss, batches, jit=True)

  def touched(b):
    return {
      "a": np.concatenate([np.asarray(b[0]) + k * (V // members) for k in range(members)]),
      "b": None,
    }

  assert_tables(model, nnx_reference(loss, batches, touched))


def test_nnx_cond_on_looked_up_rows_is_correct():
  def loss(m, batch):
    q, t = batch
    rows = m.a(q)  # looked up outside the cond: its rows are touched whichever branch runs
    return lax.cond(t[0] % 2 == 0, lambda r: jnp.sum(r @ W), lambda r: jnp.sum((r @ W) ** 2), rows)

  model, _ = nnx_train(loss, QT_BATCHES, jit=True)
  assert_tables(model, nnx_reference(loss, QT_BATCHES, lambda b: {"a": b[0], "b": None}))


# NNX errors: each raised before any state changes, naming the table and the way out.

NNX_ERRORS = {
  "remat": lambda m, b: jnp.sum(nnx.remat(lambda e, q: e(q))(m.a, b[0])),
  "jit_in_module": lambda m, b: jnp.sum(nnx.jit(lambda e, q: e(q))(m.a, b[0])),
  "lax_scan_over_time": lambda m, b: lax.scan(
    lambda c, q: (c + jnp.sum(m.a(q)), None), 0.0, b[0][:, None]
  )[0],
  "nnx_scan_over_time": lambda m, b: jnp.sum(
    nnx.scan(lambda e, q: (e, jnp.sum(e(q))), in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(
      m.a, b[0][:, None]
    )[1]
  ),
  "vmap_broadcast_module": lambda m, b: jnp.sum(
    nnx.vmap(lambda e, q: jnp.sum(e(q)), in_axes=(None, 0))(m.a, b[0][:, None])
  ),
  "jax_vmap_closed_over": lambda m, b: jnp.sum(jax.vmap(lambda q: jnp.sum(m.a(q)))(b[0])),
  "lax_cond": lambda m, b: lax.cond(b[1][0] > 2, lambda: jnp.sum(m.a(b[0])), lambda: 0.0),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("pattern", sorted(NNX_ERRORS))
def test_nnx_lookup_in_nested_transform_raises_before_any_change(pattern, jit):
  assert_nnx_error(
    NNX_ERRORS[pattern], QT_BATCHES[0], r"\['a'\]\['embedding'\].*" + NESTED, jit=jit
  )


def test_nnx_vmap_ensemble_of_tables_raises_naming_the_stacked_table():
  @nnx.vmap(in_axes=0, out_axes=0)
  def make(key):
    return osa.SparseEmbed(V, D, rngs=nnx.Rngs(key))

  class Ensemble(nnx.Module):
    def __init__(self):
      self.members = make(jax.random.split(jax.random.key(0), 2))

  model = Ensemble()
  optimizer = osa.SparseOptimizer(model, osa.sparse_adam(LR), wrt=nnx.Param)
  before = arrays_of(nnx.state(model)) + arrays_of(nnx.state(optimizer))

  def loss(m, q):
    return jnp.sum(nnx.vmap(lambda e, q: e(q), in_axes=(0, None))(m.members, q))

  with pytest.raises(ValueError, match=r"\['members'\]\['embedding'\].*" + NESTED):
    _, grads = osa.sparse_value_and_grad(loss)(model, ids(1, 2))
    optimizer.update(model, grads)
  assert_unchanged(before, arrays_of(nnx.state(model)) + arrays_of(nnx.state(optimizer)))


# ---------------------------------------------------------------------------
# Accumulation with tables missing from some mini-steps.

# Per mini-step: ids of table a and of table b, None where the table is not looked up.
# b is missing at the last mini-step of the first cycle (whose rows were dropped
# before), a at the first mini-step of the third (whose slot held the previous
# cycle's rows), and b from the whole fourth cycle (its step count must not advance).
# Every lookup of two ids (a row may repeat): each jitted step traces one of three
# shapes, (a, b), (a, None) and (None, b), so the test compiles three steps, not six.
ACC_STEPS = [
  (ids(1, 2), ids(5, 5)),
  (ids(1, 1), None),
  (ids(3, 3), None),
  (None, ids(6, 6)),
  (None, ids(7, 7)),
  (ids(4, 4), None),
  (ids(2, 2), None),  # b is looked up in no mini-step of this cycle: no step for it, as torch
  (ids(5, 5), None),
  (ids(8, 8), ids(1, 6)),
  (None, ids(6, 6)),
]


def acc_loss(m, batch):
  qa, qb = batch
  loss = jnp.zeros(())
  if qa is not None:
    loss = loss + jnp.sum((m.a(qa) @ W - 1.0) ** 2)
  if qb is not None:
    loss = loss + jnp.sum((m.b(qb) @ W + 1.0) ** 2)
  return loss


def acc_reference(initial, every_k):
  """Mean of the dense gradients of a cycle, masked Adam on the rows touched in the cycle."""
  refs = {name: NumpySparseAdam(np.asarray(t, np.float64), lr=LR) for name, t in initial.items()}
  model = Tables()
  for start in range(0, len(ACC_STEPS), every_k):
    for name, ref in refs.items():
      getattr(model, name).embedding[...] = jnp.asarray(ref.param, jnp.float32)
    cycle = ACC_STEPS[start : start + every_k]
    for j, name in enumerate(("a", "b")):
      looked_up = [np.asarray(step[j]) for step in cycle if step[j] is not None]
      if not looked_up:
        continue
      grad = (
        sum(
          np.asarray(nnx.grad(acc_loss)(model, step)[name]["embedding"][...], np.float64)
          for step in cycle
        )
        / every_k
      )
      rows = np.unique(np.concatenate(looked_up))
      refs[name].step(rows[:, None], grad[rows])
  return {name: ref.param for name, ref in refs.items()}


@pytest.mark.parametrize("jit", [True])  # eagerly: the Linen test below
def test_nnx_accumulation_with_missing_tables(jit):
  tx = osa.sparse_multi_steps(osa.sparse_adam(LR), every_k=2, max_nse=2)
  model, optimizer = Tables(), None
  optimizer = osa.SparseOptimizer(model, tx, wrt=nnx.Param)

  def step(model, optimizer, qa, qb):
    _, grads = osa.sparse_value_and_grad(acc_loss)(model, (qa, qb))
    optimizer.update(model, grads)

  step = nnx.jit(step) if jit else step
  for qa, qb in ACC_STEPS:
    step(model, optimizer, qa, qb)
  assert_tables(model, acc_reference(initial_tables(), every_k=2))


# ---------------------------------------------------------------------------
# Linen.


class LinenTables(nn.Module):
  param_dtype: jnp.dtype = jnp.float32

  def setup(self):
    self.a = osa.LinenSparseEmbed(V, D, param_dtype=self.param_dtype)
    self.b = osa.LinenSparseEmbed(V2, D, param_dtype=self.param_dtype)

  def __call__(self, q):
    return self.a(q), self.b(q)


LINEN_TABLES = LinenTables()


def linen_params(model=None):
  model = LINEN_TABLES if model is None else model
  return model.init(jax.random.key(0), ids(0))["params"]


def linen_loss(method, model=None):
  """The loss over the params of `model`, whose body `method(module, batch)` sees the module."""
  model = LINEN_TABLES if model is None else model

  def loss(params, batch):
    return model.apply({"params": params}, batch, method=method)

  return loss


def linen_train(loss, batches, *, jit, params=None, tx=None):
  params = linen_params() if params is None else params
  state = osa.SparseTrainState.create(apply_fn=None, params=params, tx=tx or osa.sparse_adam(LR))

  def step(state, batch):
    grads = osa.sparse_grad(loss)(state.params, batch)
    return state.apply_gradients(grads=grads)

  step = jax.jit(step) if jit else step
  for batch in batches:
    state = step(state, batch)
  return state


def unbox(tree):
  return nn.meta.unbox(tree)


def linen_reference(loss, batches, touched, params=None):
  params = unbox(linen_params() if params is None else params)
  refs = {
    name: NumpySparseAdam(np.asarray(params[name]["embedding"], np.float64), lr=LR)
    for name in ("a", "b")
  }
  for batch in batches:
    current = {n: {"embedding": jnp.asarray(r.param, jnp.float32)} for n, r in refs.items()}
    # The same model with plain-array tables: jax.grad gives the dense gradient.
    grads = jax.grad(loss)(current, batch)
    for name, rows in touched(batch).items():
      if rows is None:
        continue
      rows = np.unique(np.asarray(rows))
      refs[name].step(rows[:, None], np.asarray(grads[name]["embedding"], np.float64)[rows])
  return {name: ref.param for name, ref in refs.items()}


def assert_linen_tables(state, expected, atol=1e-5):
  params = unbox(state.params)
  for name, table in expected.items():
    np.testing.assert_allclose(
      np.asarray(params[name]["embedding"], np.float64), table, atol=atol, rtol=0
    )


def linen_initial():
  params = unbox(linen_params())
  return {name: np.asarray(params[name]["embedding"]) for name in ("a", "b")}


def linen_detach(m, batch):
  q, t = batch
  target = lax.stop_gradient(m.a(t))
  negatives = lax.stop_gradient(m.b(t))
  return jnp.mean((m.a(q) - target) ** 2) + jnp.mean(m.a(q) @ W * (negatives @ W))


def linen_unused(m, batch):
  q, t = batch
  m.a(t)
  return jnp.sum((m.a(q) @ W) ** 2)


@pytest.mark.parametrize("jit", [False, True])
def test_linen_detached_lookup_adds_no_entries_as_torch_detach(jit):
  state = linen_train(linen_loss(linen_detach), QT_BATCHES, jit=jit)
  assert_linen_tables(state, torch_train(linen_initial(), QT_BATCHES, torch_detach_loss), atol=1e-6)


def test_linen_unused_lookup_adds_no_entries_as_torch():
  state = linen_train(linen_loss(linen_unused), QT_BATCHES, jit=True)
  assert_linen_tables(state, torch_train(linen_initial(), QT_BATCHES, torch_unused_loss), atol=1e-6)


def linen_tied(m, batch):
  q, t = batch
  table = nn.meta.unbox(m.a.variables["params"]["embedding"])
  logits = m.a(q) @ table.T
  return optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()


@pytest.mark.parametrize("jit", [False, True])
def test_linen_tied_projection_gets_the_full_gradient(jit):
  loss = linen_loss(linen_tied)
  state = linen_train(loss, QT_BATCHES, jit=jit)
  expected = linen_reference(loss, QT_BATCHES, lambda b: {"a": np.arange(V), "b": None})
  assert_linen_tables(state, expected)


@pytest.mark.parametrize("pooling", ["mean", "sum"])
def test_linen_padding_with_pooling_passes_check_sparse_grads(pooling):
  def body(m, batch):
    bags, y = batch
    rows = m.a(bags)
    pooled = jnp.mean(rows, axis=1) if pooling == "mean" else jnp.sum(rows, axis=1)
    return jnp.mean((pooled @ W - y) ** 2)

  loss = linen_loss(body)
  grads = osa.sparse_grad(loss)(linen_params(), PAD_BATCHES[0])
  err, _ = checkify.checkify(lambda g: osa.check_sparse_grads(g))(grads)
  assert err.get() is None
  state = linen_train(loss, PAD_BATCHES, jit=True)
  assert_linen_tables(
    state, linen_reference(loss, PAD_BATCHES, lambda b: {"a": valid_rows(b[0]), "b": None})
  )


def test_linen_bf16_param_dtype_trains_like_the_reference():
  model = LinenTables(param_dtype=jnp.bfloat16)

  def body(m, batch):
    return jnp.sum((m.a(batch[0]).astype(jnp.float32) @ W) ** 2)

  loss = linen_loss(body, model)
  params = linen_params(model)
  state = linen_train(loss, QT_BATCHES, jit=True, params=params)
  assert unbox(state.params)["a"]["embedding"].dtype == jnp.bfloat16
  expected = linen_reference(loss, QT_BATCHES, lambda b: {"a": b[0], "b": None}, params=params)
  assert_linen_tables(state, expected, atol=3e-2)


class RematAfter(nn.Module):
  @nn.compact
  def __call__(self, q):
    h = osa.LinenSparseEmbed(V, D, name="a")(q)
    return nn.remat(nn.Dense)(1, use_bias=False, name="head")(h)


def test_linen_remat_after_the_lookup_is_correct():
  model = RematAfter()
  params = model.init(jax.random.key(0), ids(0))["params"]

  def loss(p, batch):
    return jnp.sum(model.apply({"params": p}, batch[0]) ** 2)

  # The dense head trains with plain Adam; the table with sparse_adam.
  tx = optax.multi_transform(
    {"sparse": osa.sparse_adam(LR), "dense": optax.sgd(0.0)}, osa.table_labels
  )
  state = linen_train(loss, QT_BATCHES, jit=True, params=params, tx=tx)
  ref = NumpySparseAdam(np.asarray(unbox(params)["a"]["embedding"], np.float64), lr=LR)
  for batch in QT_BATCHES:
    current = {
      "a": {"embedding": jnp.asarray(ref.param, jnp.float32)},
      "head": unbox(params)["head"],
    }
    grad = np.asarray(jax.grad(loss)(current, batch)["a"]["embedding"], np.float64)
    rows = np.unique(np.asarray(batch[0]))
    ref.step(rows[:, None], grad[rows])
  np.testing.assert_allclose(unbox(state.params)["a"]["embedding"], ref.param, atol=1e-5)


# Linen errors: the transform around the LinenSparseEmbed, and params cast in the loss.


class Remat(nn.Module):
  @nn.compact
  def __call__(self, q):
    return jnp.sum(nn.remat(osa.LinenSparseEmbed)(V, D, name="a")(q))


class Jit(nn.Module):
  @nn.compact
  def __call__(self, q):
    return jnp.sum(nn.jit(osa.LinenSparseEmbed)(V, D, name="a")(q))


class ScanCell(nn.Module):
  @nn.compact
  def __call__(self, carry, q):
    return carry + jnp.sum(osa.LinenSparseEmbed(V, D, name="a")(q)), None


class Scan(nn.Module):
  @nn.compact
  def __call__(self, q):
    scan = nn.scan(ScanCell, variable_broadcast="params", split_rngs={"params": False})
    carry, _ = scan(name="cell")(jnp.zeros(()), q[:, None])
    return carry


class VmapEnsemble(nn.Module):
  @nn.compact
  def __call__(self, q):
    ensemble = nn.vmap(
      osa.LinenSparseEmbed,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      in_axes=None,
      axis_size=2,
    )
    return jnp.sum(ensemble(V, D, name="a")(q))


class VmapBroadcast(nn.Module):
  @nn.compact
  def __call__(self, q):
    embed = nn.vmap(
      osa.LinenSparseEmbed, variable_axes={"params": None}, split_rngs={"params": False}
    )
    return jnp.sum(embed(V, D, name="a")(q[:, None]))


class Cond(nn.Module):
  @nn.compact
  def __call__(self, q):
    embed = osa.LinenSparseEmbed(V, D, name="a")
    if self.is_initializing():
      return jnp.sum(embed(q))
    return lax.cond(q[0] > 2, lambda: jnp.sum(embed(q)), lambda: 0.0)


LINEN_ERRORS = {
  "remat": (Remat, "a"),
  "jit_in_module": (Jit, "a"),
  "scan_over_time": (Scan, "cell/a"),  # module path; or ['cell']['a']['embedding']
  "vmap_ensemble": (VmapEnsemble, "a"),
  "vmap_broadcast": (VmapBroadcast, "a"),
  "cond": (Cond, "a"),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("pattern", sorted(LINEN_ERRORS))
def test_linen_lookup_in_lifted_transform_raises_before_any_change(pattern, jit):
  cls, path = LINEN_ERRORS[pattern]
  model = cls()
  params = model.init(jax.random.key(0), ids(1, 2))["params"]
  state = osa.SparseTrainState.create(apply_fn=None, params=params, tx=osa.sparse_adam(LR))
  before = arrays_of(state)

  def step(state, q):
    grads = osa.sparse_grad(lambda p: model.apply({"params": p}, q))(state.params)
    return state.apply_gradients(grads=grads)

  # Named by the module's path, or by the params path when the lookup saw the table itself.
  params_path = "".join(f"\\['{p}'\\]" for p in path.split("/")) + r"\['embedding'\]"
  with pytest.raises(ValueError, match=f"(LinenSparseEmbed at {path}|{params_path}).*" + NESTED):
    state = (jax.jit(step) if jit else step)(state, ids(1, 2))
  assert_unchanged(before, arrays_of(state))


def test_linen_params_cast_inside_the_loss_raise_before_any_change():
  model = LinenTables()
  state = osa.SparseTrainState.create(apply_fn=None, params=linen_params(), tx=osa.sparse_adam(LR))
  before = arrays_of(state)

  def loss(params, q):
    low = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    rows, _ = model.apply({"params": low}, q)
    return jnp.sum(rows.astype(jnp.float32))

  with pytest.raises(ValueError, match=r"LinenSparseEmbed at a.*cast to bfloat16.*dtype="):
    grads = osa.sparse_grad(loss)(state.params, ids(1, 2))
    state = state.apply_gradients(grads=grads)
  assert_unchanged(before, arrays_of(state))


@pytest.mark.parametrize("jit", [False])  # jitted: the NNX test above
def test_linen_accumulation_with_missing_tables(jit):
  def body(m, batch):
    return acc_loss(m, batch)

  model = LinenTables()
  loss = linen_loss(body, model)
  tx = osa.sparse_multi_steps(osa.sparse_adam(LR), every_k=2, max_nse=2)
  state = osa.SparseTrainState.create(apply_fn=None, params=linen_params(), tx=tx)

  def step(state, qa, qb):
    grads = osa.sparse_grad(loss)(state.params, (qa, qb))
    return state.apply_gradients(grads=grads)

  step = jax.jit(step) if jit else step
  for qa, qb in ACC_STEPS:
    state = step(state, qa, qb)
  assert_linen_tables(state, acc_reference(linen_initial(), every_k=2))


# ---------------------------------------------------------------------------
# vmap ensembles: the whole train step vmapped over the members is correct,
# on the fused CPU kernels (batched under vmap: one kernel call per member) and
# on the XLA path.

ENSEMBLE_IDS = jnp.asarray(
  [[[1, 2], [3, 3]], [[2, 5], [1, 1]], [[7, 2], [2, 0]]]
)  # (step, member, batch)


def ensemble_reference(initial, loss_of_table):
  """Per member: NumPy masked Adam on the dense gradient of the plain-array loss."""
  result = []
  for member, table in enumerate(np.asarray(initial)):
    ref = NumpySparseAdam(np.asarray(table, np.float64), lr=LR)
    for step_ids in ENSEMBLE_IDS:
      q = step_ids[member]
      grad = np.asarray(jax.grad(loss_of_table)(jnp.asarray(ref.param, jnp.float32), q), np.float64)
      rows = np.unique(np.asarray(q))
      ref.step(rows[:, None], grad[rows])
    result.append(ref.param)
  return np.stack(result)


def member_loss(table, q):
  return jnp.sum((table[q] @ W) ** 2)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "xla"])
def test_nnx_vmap_of_the_train_step_over_an_ensemble_is_correct(cpu_kernels):
  @nnx.vmap(in_axes=0, out_axes=0)
  def make(key):
    return osa.SparseEmbed(V, D, rngs=nnx.Rngs(key))

  ensemble = make(jax.random.split(jax.random.key(0), 2))
  initial = np.asarray(ensemble.embedding[...])
  optimizers = nnx.vmap(lambda m: osa.SparseOptimizer(m, osa.sparse_adam(LR), wrt=nnx.Param))(
    ensemble
  )

  @nnx.jit
  @nnx.vmap(in_axes=(0, 0, 0))
  def step(model, optimizer, q):
    _, grads = osa.sparse_value_and_grad(lambda m: jnp.sum((m(q) @ W) ** 2))(model)
    optimizer.update(model, grads)

  with osa.use_cpu_kernels(cpu_kernels):  # the default (True) batches the kernels under vmap
    for step_ids in ENSEMBLE_IDS:
      step(ensemble, optimizers, step_ids)
  expected = ensemble_reference(initial, member_loss)
  np.testing.assert_allclose(ensemble.embedding[...], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "xla"])
def test_linen_vmap_of_the_train_step_over_an_ensemble_is_correct(cpu_kernels):
  model = osa.LinenSparseEmbed(V, D)

  def create(key):
    params = model.init(key, ids(0))["params"]
    return osa.SparseTrainState.create(apply_fn=None, params=params, tx=osa.sparse_adam(LR))

  states = jax.vmap(create)(jax.random.split(jax.random.key(0), 2))
  initial = np.asarray(unbox(states.params)["embedding"])

  def step(state, q):
    loss = lambda p: jnp.sum((model.apply({"params": p}, q) @ W) ** 2)  # noqa: E731
    return state.apply_gradients(grads=osa.sparse_grad(loss)(state.params))

  step = jax.jit(jax.vmap(step))
  with osa.use_cpu_kernels(cpu_kernels):  # the default (True) batches the kernels under vmap
    for step_ids in ENSEMBLE_IDS:
      states = step(states, step_ids)
  expected = ensemble_reference(initial, member_loss)
  np.testing.assert_allclose(unbox(states.params)["embedding"], expected, atol=1e-5, rtol=0)
