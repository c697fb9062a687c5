"""SparseEmbedBag / LinenSparseEmbedBag against real torch nn.EmbeddingBag.

Forward values and table gradients for every mode and input form (offsets,
include_last_offset, 2-D ids), with padding_idx, empty bags and per_sample_weights;
training over several steps with `sparse_adam` against torch's EmbeddingBag +
SparseAdam, NNX and Linen, jit and no-jit; the compiled step has no V x D
temporary. torch refuses `sparse=True` with mode 'max': there its dense gradient,
restricted to the looked-up rows (every id in a bag, as a sparse gradient would list
them), is given to SparseAdam.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._helpers import dense_table_temporaries, tiered

torch = pytest.importorskip("torch")
pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import sparse  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402

NUM_ROWS, DIM, NUM_BAGS, NUM_IDS, BAG_LEN, LR, STEPS = 29, 4, 5, 14, 3, 0.05, 3
PADDING = 3


def make_batch(form, seed, padding_idx=None, weights=False):
  """`(ids, offsets, per_sample_weights, loss_weights)`; an empty bag and a padding-only bag."""
  rng = np.random.default_rng(seed)
  if form == "2d":
    ids = rng.integers(0, 10, size=(NUM_BAGS, BAG_LEN))
    offsets = None
    if padding_idx is not None:
      ids[2] = padding_idx  # a bag of padding only: zeros, as an empty bag
      ids[0, 1] = padding_idx
  else:
    ids = rng.integers(0, 10, size=NUM_IDS)
    cuts = np.sort(rng.choice(np.arange(2, NUM_IDS - 1), 3, replace=False))
    offsets = np.array([0, cuts[0], cuts[0], cuts[1], cuts[2]])  # bag 1 is empty
    if padding_idx is not None:
      ids[cuts[1] : cuts[2]] = padding_idx
      ids[0] = padding_idx
    if form == "last_offset":
      offsets = np.append(offsets, NUM_IDS)
  psw = rng.normal(size=ids.shape).astype(np.float32) if weights else None
  loss_weights = rng.normal(size=(NUM_BAGS, DIM)).astype(np.float32)
  return ids, offsets, psw, loss_weights


def torch_loss(out, w):
  return (torch.sin(out) * w).sum() + (out**2).sum()


def jax_loss(out, w):
  return jnp.sum(jnp.sin(out) * w) + jnp.sum(out**2)


def torch_bag(initial, mode, form, options):
  sparse_ok = mode != "max"
  bag = torch.nn.EmbeddingBag(
    NUM_ROWS,
    DIM,
    mode=mode,
    sparse=sparse_ok,
    include_last_offset=form == "last_offset",
    **options,
  )
  with torch.no_grad():
    bag.weight.copy_(torch.tensor(np.asarray(initial)))
  return bag, sparse_ok


def torch_forward_backward(bag, sparse_ok, batch):
  ids, offsets, psw, w = batch
  out = bag(
    torch.from_numpy(ids),
    None if offsets is None else torch.from_numpy(offsets),
    per_sample_weights=None if psw is None else torch.from_numpy(psw),
  )
  torch_loss(out, torch.from_numpy(w)).backward()
  if not sparse_ok:  # the dense gradient on the rows a sparse one would list
    keep = np.unique(ids)
    if bag.padding_idx is not None:
      keep = keep[keep != bag.padding_idx]
    keep = torch.from_numpy(keep)
    bag.weight.grad = torch.sparse_coo_tensor(
      keep[None, :], bag.weight.grad[keep], bag.weight.shape, check_invariants=True
    )
  return out.detach().numpy().copy()


def call_args(batch):
  ids, offsets, psw, _ = batch
  return (
    jnp.asarray(ids),
    None if offsets is None else jnp.asarray(offsets),
    None if psw is None else jnp.asarray(psw),
  )


FORMS = ["offsets", "last_offset", "2d"]


FORWARD_CASES = [
  (mode, form, padding_idx, jit)
  for mode in ("sum", "mean", "max")
  for form in FORMS
  for padding_idx in (None, PADDING)
  for jit in (False, True)
]


# Eager cells op by op: one per mode in the default tier, the rest in the slow tier.
@pytest.mark.parametrize(
  ("mode", "form", "padding_idx", "jit"),
  tiered(FORWARD_CASES, lambda case: not case[3] and (case[1], case[2]) != ("offsets", None)),
  ids=[f"{m}-{f}-{p}-{'jit' if j else 'eager'}" for m, f, p, j in FORWARD_CASES],
)
def test_forward_and_gradient_equal_torch(mode, form, padding_idx, jit):
  model = osa.SparseEmbedBag(
    NUM_ROWS,
    DIM,
    mode=mode,
    padding_idx=padding_idx,
    include_last_offset=form == "last_offset",
    rngs=nnx.Rngs(0),
  )
  batch = make_batch(form, 1, padding_idx, weights=mode == "sum")
  ids, offsets, psw = call_args(batch)

  def value_and_grad(model, ids, offsets, psw, w):
    def loss(model):
      out = model(ids, offsets, psw)
      return jax_loss(out, w), out

    return osa.sparse_value_and_grad(loss, has_aux=True)(model)

  if jit:
    value_and_grad = nnx.jit(value_and_grad)
  (_, out), grads = value_and_grad(model, ids, offsets, psw, jnp.asarray(batch[3]))
  bag, sparse_ok = torch_bag(
    model.embedding[...], mode, form, {} if padding_idx is None else {"padding_idx": padding_idx}
  )
  torch_out = torch_forward_backward(bag, sparse_ok, batch)
  np.testing.assert_allclose(out, torch_out, rtol=1e-6, atol=1e-6)
  empty_bag = 1 if form != "2d" else (2 if padding_idx is not None else None)
  if empty_bag is not None:  # an empty bag, or one of padding only: zeros, as torch
    np.testing.assert_array_equal(out[empty_bag], 0.0)
  grad = grads["embedding"].get_value()
  assert isinstance(grad, sparse.BCOO) and grad.nse == ids.size  # one entry per id
  np.testing.assert_allclose(
    grad.todense(), bag.weight.grad.to_dense().numpy(), rtol=1e-5, atol=1e-6
  )
  if padding_idx is not None:
    assert padding_idx not in np.asarray(grad.indices)
    np.testing.assert_array_equal(grad.data[np.asarray(grad.indices[:, 0]) == NUM_ROWS], 0.0)


def test_max_mode_gradient_goes_to_the_first_maximum_only():
  model = osa.SparseEmbedBag(NUM_ROWS, 2, mode="max", rngs=nnx.Rngs(0))
  table = np.zeros((NUM_ROWS, 2), np.float32)
  table[1] = [1.0, 0.0]
  table[2] = [1.0, 5.0]  # ties row 1 on feature 0
  model.embedding[...] = jnp.asarray(table)
  ids = jnp.array([[1, 2, 2]])
  grad = osa.sparse_grad(lambda m: jnp.sum(m(ids)))(model)["embedding"].get_value()
  np.testing.assert_array_equal(grad.data, [[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
  bag = torch.nn.EmbeddingBag(NUM_ROWS, 2, mode="max")
  with torch.no_grad():
    bag.weight.copy_(torch.from_numpy(table))
  bag(torch.tensor([[1, 2, 2]])).sum().backward()
  np.testing.assert_array_equal(grad.todense(), bag.weight.grad.numpy())


def test_out_of_range_ids_are_left_out_like_padding():
  model = osa.SparseEmbedBag(NUM_ROWS, DIM, mode="mean", padding_idx=PADDING, rngs=nnx.Rngs(0))
  with_minus_one = model(jnp.array([[4, -1, 5, NUM_ROWS]]))
  with_padding = model(jnp.array([[4, PADDING, 5, PADDING]]))
  np.testing.assert_array_equal(with_minus_one, with_padding)
  np.testing.assert_allclose(
    with_padding[0], (model.embedding[...][4] + model.embedding[...][5]) / 2, rtol=1e-6
  )


class LinenBags(nn.Module):
  """Two bags (different options) summed: a Linen model of the thing under test."""

  mode: str
  form: str
  options: dict

  @nn.compact
  def __call__(self, ids, offsets, psw):
    bag = osa.LinenSparseEmbedBag(
      NUM_ROWS,
      DIM,
      mode=self.mode,
      include_last_offset=self.form == "last_offset",
      name="bag",
      **self.options,
    )
    return bag(ids, offsets, psw)


TRAIN_CASES = {
  "sum_offsets_weights": ("sum", "offsets", {}, True),
  "mean_last_offset_padding": ("mean", "last_offset", {"padding_idx": PADDING}, False),
  "max_2d_padding": ("max", "2d", {"padding_idx": PADDING}, False),
  "mean_offsets_max_norm": ("mean", "offsets", {"padding_idx": PADDING, "max_norm": 0.5}, False),
  "sum_2d_max_norm_inf": ("sum", "2d", {"max_norm": 0.4, "norm_type": float("inf")}, True),
}


def nnx_train(mode, form, options, batches, jit):
  model = osa.SparseEmbedBag(
    NUM_ROWS, DIM, mode=mode, include_last_offset=form == "last_offset", rngs=nnx.Rngs(0), **options
  )
  initial = np.asarray(model.embedding[...])
  optimizer = osa.SparseOptimizer(model, osa.sparse_adam(LR), wrt=nnx.Param)

  def step(model, optimizer, ids, offsets, psw, w):
    def loss(model):
      out = model(ids, offsets, psw)
      return jax_loss(out, w), out

    (_, out), grads = osa.sparse_value_and_grad(loss, has_aux=True)(model)
    optimizer.update(model, grads)
    return out

  if jit:
    step = nnx.jit(step, donate_argnums=(0, 1))
  outs, tables = [], []
  for batch in batches:
    outs.append(np.asarray(step(model, optimizer, *call_args(batch), jnp.asarray(batch[3]))))
    tables.append(np.asarray(model.embedding[...]))
  if jit:
    assert step.jitted_fn._cache_size() == 1  # new offsets, same shapes: no recompilation
  return initial, outs, tables


def linen_train(mode, form, options, batches, jit):
  model = LinenBags(mode, form, options)
  params = model.init(jax.random.key(0), *call_args(batches[0]))["params"]
  initial = np.asarray(params["bag"]["embedding"].value)
  state = osa.SparseTrainState.create(apply_fn=model.apply, params=params, tx=osa.sparse_adam(LR))
  renorms = options.get("max_norm") is not None

  def step(state, ids, offsets, psw, w):
    def loss(params):
      if renorms:
        out, mutated = model.apply({"params": params}, ids, offsets, psw, mutable=["params"])
        new_params = mutated["params"]
      else:
        out, new_params = model.apply({"params": params}, ids, offsets, psw), params
      return jax_loss(out, w), (out, new_params)

    (_, (out, new_params)), grads = osa.sparse_value_and_grad(loss, has_aux=True)(state.params)
    return state.replace(params=new_params).apply_gradients(grads=grads), out

  if jit:
    step = jax.jit(step, donate_argnums=0)
  outs, tables = [], []
  for batch in batches:
    state, out = step(state, *call_args(batch), jnp.asarray(batch[3]))
    outs.append(np.asarray(out))
    tables.append(np.asarray(state.params["bag"]["embedding"].value))
  if jit:
    assert step._cache_size() == 1
  return initial, outs, tables


TRAINING_CASES = [
  (case, front_end, jit)
  for case in TRAIN_CASES
  for front_end in ("nnx", "linen")
  for jit in (False, True)
]


# Eager cells: the first case per front end in the default tier, the rest in the slow tier.
@pytest.mark.parametrize(
  ("case", "front_end", "jit"),
  tiered(TRAINING_CASES, lambda c: not c[2] and c[0] != next(iter(TRAIN_CASES))),
  ids=[f"{c}-{f}-{'jit' if j else 'eager'}" for c, f, j in TRAINING_CASES],
)
def test_training_matches_torch_embedding_bag_and_sparse_adam(case, front_end, jit):
  mode, form, options, weights = TRAIN_CASES[case]
  batches = [
    make_batch(form, 10 + s, options.get("padding_idx"), weights=weights) for s in range(STEPS)
  ]
  train = nnx_train if front_end == "nnx" else linen_train
  initial, outs, tables = train(mode, form, options, batches, jit)
  bag, sparse_ok = torch_bag(initial, mode, form, options)
  opt = torch.optim.SparseAdam(bag.parameters(), lr=LR)
  for step, batch in enumerate(batches):
    opt.zero_grad()
    torch_out = torch_forward_backward(bag, sparse_ok, batch)
    opt.step()
    np.testing.assert_allclose(outs[step], torch_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(tables[step], bag.weight.detach().numpy(), rtol=1e-6, atol=1e-6)
  if "padding_idx" in options:
    np.testing.assert_array_equal(tables[-1][PADDING], 0.0)  # never touched


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_compiled_step_has_no_dense_table_temporary(mode):
  num_rows, dim = 1013, 7
  model = osa.SparseEmbedBag(num_rows, dim, mode=mode, padding_idx=0, rngs=nnx.Rngs(0))
  optimizer = osa.SparseOptimizer(model, osa.sparse_adam(0.01), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def step(state, ids, offsets):
    model, optimizer = nnx.merge(graphdef, state)
    grads = osa.sparse_grad(lambda m: jnp.sum(m(ids, offsets) ** 2))(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  ids, offsets = jnp.arange(40) % 17, jnp.array([0, 5, 5, 21])
  compiled = jax.jit(step, donate_argnums=0).lower(state, ids, offsets).compile()
  assert dense_table_temporaries(compiled, f"f32[{num_rows},{dim}]", 3) == []


def test_dtype_and_exports():
  from optax_sparse_adam import flax as osa_flax

  assert osa_flax.SparseEmbedBag is osa.SparseEmbedBag
  assert osa_flax.LinenSparseEmbedBag is osa.LinenSparseEmbedBag
  assert osa_flax.embedding_bag_lookup is osa.embedding_bag_lookup
  model = osa.SparseEmbedBag(NUM_ROWS, DIM, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  out = model(jnp.array([[1, 2]]))
  assert out.dtype == jnp.bfloat16
  grad = osa.sparse_grad(lambda m: jnp.sum(m(jnp.array([[1, 2]])).astype(jnp.float32)))(model)
  assert grad["embedding"].get_value().dtype == jnp.bfloat16


@pytest.mark.parametrize(
  "kwargs, call, error, match",
  [
    (dict(mode="median"), None, ValueError, "mode must be one of"),
    (dict(padding_idx=NUM_ROWS), None, ValueError, "padding_idx=29 is outside"),
    ({}, ([[1, 2]], [0]), ValueError, "offsets must be None when the ids are 2-D"),
    ({}, ([1, 2],), ValueError, "1-D ids need offsets"),
    ({}, ([1, 2], [1]), ValueError, r"offsets\[0\] must be 0"),
    ({}, ([1, 2], [0, 2, 1]), ValueError, "non-decreasing"),
    ({}, ([1, 2], [0, 3]), ValueError, r"offsets\[-1\]=3 is beyond the 2 ids"),
    ({}, ([1.0, 2.0], [0]), TypeError, "ids must be integers"),
    ({}, ([[[1]]],), ValueError, "ids must be 1-D"),
    (dict(mode="mean"), ([1, 2], [0], [1.0, 1.0]), ValueError, "only supported for mode='sum'"),
    (dict(mode="sum"), ([1, 2], [0], [1.0]), ValueError, "per_sample_weights must have the shape"),
  ],
)
def test_bad_inputs_name_the_parameter(kwargs, call, error, match):
  if call is None:
    with pytest.raises(error, match=match):
      osa.SparseEmbedBag(NUM_ROWS, DIM, rngs=nnx.Rngs(0), **kwargs)
    with pytest.raises(error, match=match):
      osa.LinenSparseEmbedBag(NUM_ROWS, DIM, **kwargs).init(jax.random.key(0), jnp.array([[1]]))
    return
  model = osa.SparseEmbedBag(NUM_ROWS, DIM, rngs=nnx.Rngs(0), **kwargs)
  before = np.asarray(model.embedding[...])
  with pytest.raises(error, match=match):
    model(*[jnp.asarray(x) for x in call])
  np.testing.assert_array_equal(model.embedding[...], before)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_left_out_ids_are_zero_padding_that_check_sparse_grads_accepts(mode):
  model = osa.SparseEmbedBag(NUM_ROWS, DIM, mode=mode, padding_idx=PADDING, rngs=nnx.Rngs(0))
  ids = jnp.array([[4, -1, 5, PADDING], [PADDING, NUM_ROWS + 3, -1, 6]])
  grads = osa.sparse_grad(lambda m: jnp.sum(jnp.cos(m(ids))))(model)
  grad = grads["embedding"].get_value()
  left_out = np.asarray(grad.indices[:, 0]) == NUM_ROWS
  assert left_out.sum() == 5
  np.testing.assert_array_equal(np.asarray(grad.data)[left_out], 0.0)
  osa.check_sparse_grads({"t": grad}, {"t": model.embedding[...]})  # raises if not


def test_linen_bag_seen_through_a_transform_or_a_copy_raises_as_linen_embed_does():
  """The Linen bag names its module and refuses, as LinenSparseEmbed does, rather than go dense."""
  ids = jnp.array([[1, 2], [3, 3]])

  class Remat(nn.Module):
    @nn.compact
    def __call__(self, q):
      return jnp.sum(nn.remat(osa.LinenSparseEmbedBag)(NUM_ROWS, DIM, mode="sum", name="a")(q))

  class Plain(nn.Module):
    @nn.compact
    def __call__(self, q):
      return jnp.sum(osa.LinenSparseEmbedBag(NUM_ROWS, DIM, mode="sum", name="a")(q))

  remat, plain = Remat(), Plain()
  params = remat.init(jax.random.PRNGKey(0), ids)["params"]
  with pytest.raises(
    ValueError, match=r"the table of the LinenSparseEmbedBag at a.*nested transform"
  ):
    osa.sparse_grad(lambda p: remat.apply({"params": p}, ids))(params)

  def cast_loss(p):
    low = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
    return plain.apply({"params": low}, ids).astype(jnp.float32)

  with pytest.raises(
    ValueError, match=r"the table of the LinenSparseEmbedBag at a.*cast to bfloat16"
  ):
    osa.sparse_grad(cast_loss)(params)
