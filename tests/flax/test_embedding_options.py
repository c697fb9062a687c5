"""nn.Embedding's options on SparseEmbed / LinenSparseEmbed, trained against real torch.

padding_idx, max_norm + norm_type and scale_grad_by_freq, alone and combined, NNX and
Linen, jit and no-jit: the same forward, and the same table after several steps of
`sparse_adam` as torch's `nn.Embedding` + `torch.optim.SparseAdam`. torch refuses
`scale_grad_by_freq` with `sparse=True`, so there its dense gradient, restricted to the
looked-up rows, is the sparse gradient given to SparseAdam.
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

NUM_ROWS, DIM, LR, STEPS = 23, 5, 0.05, 4

OPTIONS = {
  "padding_idx": dict(padding_idx=3),
  "negative_padding_idx": dict(padding_idx=-2),
  "max_norm": dict(max_norm=0.6),
  "max_norm_p1": dict(max_norm=1.1, norm_type=1.0),
  "max_norm_inf": dict(max_norm=0.3, norm_type=float("inf")),
  "scale_grad_by_freq": dict(scale_grad_by_freq=True),
  "all": dict(padding_idx=3, max_norm=0.7, norm_type=3.0, scale_grad_by_freq=True),
}


def batches():
  rng = np.random.default_rng(0)
  out = []
  for _ in range(STEPS):
    ids = rng.integers(0, 8, size=(3, 4))  # duplicates on purpose
    ids[0, 0] = ids[2, 3] = 3  # the padding row (3, and -2 + 23 = 21 below)
    ids[1, 1] = 21
    weights = rng.normal(size=ids.shape + (DIM,)).astype(np.float32)
    out.append((ids, weights))
  return out


def torch_loss(rows, weights):
  return (torch.sin(rows) * weights).sum() + (rows**2).sum()


def jax_loss(rows, weights):
  return jnp.sum(jnp.sin(rows) * weights) + jnp.sum(rows**2)


def torch_train(initial, options, data):
  """Tables after each step of torch's nn.Embedding + SparseAdam."""
  sparse_ok = not options.get("scale_grad_by_freq", False)
  embed = torch.nn.Embedding(NUM_ROWS, DIM, sparse=sparse_ok, **options)
  with torch.no_grad():
    embed.weight.copy_(torch.tensor(np.asarray(initial)))
  opt = torch.optim.SparseAdam(embed.parameters(), lr=LR)
  tables, outputs = [], []
  for ids, weights in data:
    opt.zero_grad()
    ids_t = torch.from_numpy(ids)
    rows = embed(ids_t)
    outputs.append(rows.detach().numpy().copy())
    torch_loss(rows, torch.from_numpy(weights)).backward()
    if not sparse_ok:
      keep = np.unique(ids)
      if embed.padding_idx is not None:
        keep = keep[keep != embed.padding_idx]
      keep = torch.from_numpy(keep)
      embed.weight.grad = torch.sparse_coo_tensor(
        keep[None, :], embed.weight.grad[keep], embed.weight.shape, check_invariants=True
      )
    opt.step()
    tables.append(embed.weight.detach().numpy().copy())
  return tables, outputs


def nnx_train(options, data, jit):
  model = osa.SparseEmbed(NUM_ROWS, DIM, rngs=nnx.Rngs(0), **options)
  initial = np.asarray(model.embedding[...])
  optimizer = osa.SparseOptimizer(model, osa.sparse_adam(LR), wrt=nnx.Param)

  def step(model, optimizer, ids, weights):
    def loss(model):
      rows = model(ids)
      return jax_loss(rows, weights), rows

    (_, rows), grads = osa.sparse_value_and_grad(loss, has_aux=True)(model)
    optimizer.update(model, grads)
    return rows, grads

  if jit:
    step = nnx.jit(step, donate_argnums=(0, 1))
  tables, outputs, grads = [], [], []
  for ids, weights in data:
    rows, g = step(model, optimizer, jnp.asarray(ids), jnp.asarray(weights))
    outputs.append(np.asarray(rows))
    grads.append(g["embedding"].get_value())
    tables.append(np.asarray(model.embedding[...]))
  if jit:
    assert step.jitted_fn._cache_size() == 1
  state = optimizer.opt_state
  return initial, tables, outputs, grads, state


class LinenWrapper(nn.Module):
  options: dict

  @nn.compact
  def __call__(self, ids):
    return osa.LinenSparseEmbed(NUM_ROWS, DIM, name="embed", **self.options)(ids)


def linen_train(options, data, jit):
  model = LinenWrapper(options)
  params = model.init(jax.random.key(0), jnp.asarray(data[0][0]))["params"]
  initial = np.asarray(params["embed"]["embedding"].value)
  state = osa.SparseTrainState.create(apply_fn=model.apply, params=params, tx=osa.sparse_adam(LR))
  renorms = options.get("max_norm") is not None

  def step(state, ids, weights):
    def loss(params):
      if renorms:  # torch renormalises in place: the params come back written
        rows, mutated = model.apply({"params": params}, ids, mutable=["params"])
        new_params = mutated["params"]
      else:
        rows, new_params = model.apply({"params": params}, ids), params
      return jax_loss(rows, weights), (rows, new_params)

    (_, (rows, new_params)), grads = osa.sparse_value_and_grad(loss, has_aux=True)(state.params)
    return state.replace(params=new_params).apply_gradients(grads=grads), rows, grads

  if jit:
    step = jax.jit(step, donate_argnums=0)
  tables, outputs, grads = [], [], []
  for ids, weights in data:
    state, rows, g = step(state, jnp.asarray(ids), jnp.asarray(weights))
    outputs.append(np.asarray(rows))
    grads.append(g["embed"]["embedding"].value)
    tables.append(np.asarray(state.params["embed"]["embedding"].value))
  if jit:
    assert step._cache_size() == 1
  return initial, tables, outputs, grads, state.opt_state


TRAINING_CASES = [
  (name, front_end, jit)
  for name in OPTIONS
  for front_end in ("nnx", "linen")
  for jit in (False, True)
]


def _slow_training_case(name, front_end, jit):
  """Default tier: each option jitted on one front end in turn ("all" on both), and eagerly
  the first option on both; the other cells (same lookup, other front end) in the slow tier."""
  if not jit:
    return name != next(iter(OPTIONS))
  index = list(OPTIONS).index(name)
  return name != "all" and front_end != ("nnx", "linen")[index % 2]


@pytest.mark.parametrize(
  ("name", "front_end", "jit"),
  tiered(TRAINING_CASES, lambda c: _slow_training_case(*c)),
  ids=[f"{n}-{f}-{'jit' if j else 'eager'}" for n, f, j in TRAINING_CASES],
)
def test_training_matches_torch_embedding_and_sparse_adam(name, front_end, jit):
  options, data = OPTIONS[name], batches()
  train = nnx_train if front_end == "nnx" else linen_train
  initial, tables, outputs, grads, _ = train(options, data, jit)
  torch_tables, torch_outputs = torch_train(initial, options, data)
  for step in range(STEPS):
    np.testing.assert_allclose(outputs[step], torch_outputs[step], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(tables[step], torch_tables[step], rtol=1e-6, atol=1e-6)
    assert isinstance(grads[step], sparse.BCOO)
  padding_idx = options.get("padding_idx")
  if padding_idx is not None:
    row = padding_idx % NUM_ROWS
    np.testing.assert_array_equal(initial[row], 0.0)  # zeroed at init, as torch
    for step in range(STEPS):
      np.testing.assert_array_equal(tables[step][row], initial[row])
      # The padding entries carry nothing for the row: out of range, zero valued.
      indices = np.asarray(grads[step].indices[:, 0])
      assert row not in indices
      np.testing.assert_array_equal(np.asarray(grads[step].data)[indices == NUM_ROWS], 0.0)


def moments(opt_state):
  leaves = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, osa.SparseTableBox))
  return [
    np.asarray(getattr(x, "value", x)) for x in leaves if np.ndim(getattr(x, "value", x)) == 2
  ]


@pytest.mark.parametrize("front_end", ["nnx", "linen"])
def test_padding_row_and_its_moments_stay_bit_exact(front_end):
  options = dict(padding_idx=3, max_norm=0.7)
  train = nnx_train if front_end == "nnx" else linen_train
  initial, tables, _, _, opt_state = train(options, batches(), jit=True)
  mus = moments(opt_state)
  assert len(mus) == 2  # mu and nu
  for mu in mus:
    np.testing.assert_array_equal(mu[3], 0.0)
    assert np.any(mu[4] != 0.0)  # a looked-up row moved
  np.testing.assert_array_equal(tables[-1][3], initial[3])


def test_padding_row_is_read_in_the_forward_even_when_nonzero():
  model = osa.SparseEmbed(NUM_ROWS, DIM, padding_idx=3, rngs=nnx.Rngs(0))
  model.embedding[...] = model.embedding[...].at[3].set(2.5)
  ids = jnp.array([3, 4, 3])
  np.testing.assert_array_equal(model(ids)[0], 2.5)
  grad = osa.sparse_grad(lambda m: jnp.sum(m(ids) ** 2))(model)["embedding"].get_value()
  dense = np.asarray(grad.todense())
  np.testing.assert_array_equal(dense[3], 0.0)
  np.testing.assert_allclose(dense[4], 2 * model.embedding[...][4], rtol=1e-6)


def test_max_norm_renormalises_only_the_looked_up_rows_in_place():
  model = osa.SparseEmbed(NUM_ROWS, DIM, max_norm=0.1, rngs=nnx.Rngs(0))
  before = np.asarray(model.embedding[...])
  model(jnp.array([1, 1, 5]))  # a plain forward renormalises too, as torch's
  after = np.asarray(model.embedding[...])
  for row in (1, 5):
    np.testing.assert_allclose(np.linalg.norm(after[row]), 0.1, rtol=1e-5)
  untouched = [r for r in range(NUM_ROWS) if r not in (1, 5)]
  np.testing.assert_array_equal(after[untouched], before[untouched])


def test_dense_nnx_grad_with_scale_grad_by_freq_equals_torch_dense_gradient():
  ids = np.array([1, 1, 1, 4, 6, 6])
  model = osa.SparseEmbed(NUM_ROWS, DIM, scale_grad_by_freq=True, rngs=nnx.Rngs(1))
  weights = np.random.default_rng(2).normal(size=(6, DIM)).astype(np.float32)
  grad = nnx.grad(lambda m: jax_loss(m(jnp.asarray(ids)), weights))(model)["embedding"][...]
  embed = torch.nn.Embedding(NUM_ROWS, DIM, scale_grad_by_freq=True)
  with torch.no_grad():
    embed.weight.copy_(torch.tensor(np.asarray(model.embedding[...])))
  torch_loss(embed(torch.from_numpy(ids)), torch.from_numpy(weights)).backward()
  np.testing.assert_allclose(grad, embed.weight.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_linen_max_norm_without_mutable_params_raises_before_anything_changes():
  model = osa.LinenSparseEmbed(NUM_ROWS, DIM, max_norm=0.5)
  params = model.init(jax.random.key(0), jnp.array([1]))
  before = np.asarray(params["params"]["embedding"].value)
  with pytest.raises(ValueError, match=r"mutable=\['params'\]"):
    model.apply(params, jnp.array([1]))
  np.testing.assert_array_equal(params["params"]["embedding"].value, before)
  # init does not renormalise: the table is the initializer's.
  fresh = osa.LinenSparseEmbed(NUM_ROWS, DIM).init(jax.random.key(0), jnp.array([1]))
  np.testing.assert_array_equal(fresh["params"]["embedding"].value, before)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(padding_idx=NUM_ROWS), ValueError, "padding_idx=23 is outside"),
    (dict(padding_idx=-NUM_ROWS - 1), ValueError, "padding_idx=-24 is outside"),
    (dict(padding_idx=1.0), TypeError, "padding_idx must be an int"),
    (dict(max_norm=0.0), ValueError, "max_norm must be a positive number"),
    (dict(max_norm=1.0, norm_type=-1.0), ValueError, "norm_type must be a positive number"),
  ],
)
def test_bad_options_name_the_parameter(kwargs, error, match):
  with pytest.raises(error, match=match):
    osa.SparseEmbed(NUM_ROWS, DIM, rngs=nnx.Rngs(0), **kwargs)
  with pytest.raises(error, match=match):
    osa.LinenSparseEmbed(NUM_ROWS, DIM, **kwargs).init(jax.random.key(0), jnp.array([1]))


def test_compiled_step_with_options_has_no_dense_table_temporary():
  model = osa.SparseEmbed(
    1013, 7, padding_idx=0, max_norm=1.0, scale_grad_by_freq=True, rngs=nnx.Rngs(0)
  )
  optimizer = osa.SparseOptimizer(model, osa.sparse_adam(0.01), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def step(state, ids):
    model, optimizer = nnx.merge(graphdef, state)
    grads = osa.sparse_grad(lambda m: jnp.sum(m(ids) ** 2))(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  compiled = jax.jit(step, donate_argnums=0).lower(state, jnp.arange(12).reshape(3, 4)).compile()
  assert dense_table_temporaries(compiled, "f32[1013,7]", 3) == []


def test_dense_nnx_grad_with_max_norm_renormalises_and_equals_torch_dense_gradient():
  ids = np.array([1, 2, 2, 7])
  model = osa.SparseEmbed(NUM_ROWS, DIM, max_norm=0.3, rngs=nnx.Rngs(0))
  before = np.asarray(model.embedding[...])
  grad = nnx.grad(lambda m: jnp.sum(jnp.sin(m(jnp.asarray(ids)))))(model)["embedding"][...]
  embed = torch.nn.Embedding(NUM_ROWS, DIM, max_norm=0.3)
  with torch.no_grad():
    embed.weight.copy_(torch.tensor(before))
  torch.sin(embed(torch.from_numpy(ids))).sum().backward()
  np.testing.assert_allclose(grad, embed.weight.grad.numpy(), rtol=1e-6, atol=1e-7)
  # The in-place renorm reached the module, as torch's reaches its weight.
  np.testing.assert_allclose(model.embedding[...], embed.weight.detach().numpy(), atol=1e-7)
  assert not np.array_equal(model.embedding[...], before)
