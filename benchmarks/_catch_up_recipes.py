"""The recipes `catch_up_quality` trains with lazy, catch-up and dense Adam, written as functions.

Each recipe holds its embedding tables apart from its other parameters (an
MLP, or none), so one training loop can step the tables with `sparse_adam`
(lazy or catch-up) or with dense Adam on the densified gradient, and the rest
with `optax.adam`:

- `matrix_factorisation`: user and item tables of D values, ratings from
  hidden embeddings plus noise, Zipf(1.3) user and item ids, MSE on the dot
  product; the metric is the held-out MSE. `convex=True` fixes the item table
  (the hidden one) and trains the user table only: a convex problem.
- `dlrm`: examples/dlrm_side_by_side.py's model in float32 (bottom MLP, three
  sum-pooled embedding bags, dot interaction, top MLP) with its data and its
  initial weights; the metric is the progressive validation log loss (each
  fresh batch's loss before it trains).
- `node2vec`: examples/node2vec.py (biased walks, skip-gram with negative
  sampling, node and context tables); the metric is the skip-gram loss on a
  fixed sample of pairs, and the final community accuracy and held-out link AUC.
"""

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


class Recipe(NamedTuple):
  """One seed's problem. `loss_and_row_grads(tables, other, constants, batch)` returns the
  loss, `{table: (ids, row_grads)}` and the gradient of `other`; it must see the seed only
  through its arguments (one compiled step serves every seed). `metric(tables, other)` is
  the held-out metric (None: the progressive loss of the steps is the metric)."""

  name: str
  lr: float
  tables: dict  # name: initial (rows, D) array
  other: Any  # the other parameters (a pytree), or None
  batches: list
  batch_ids: Callable  # batch -> {table: the ids it looks up}, for `catch_up_rows`
  loss_and_row_grads: Callable
  metric: Callable | None
  final_scores: Callable | None = None  # (tables, other) -> {score: value}, higher is better
  constants: Any = None  # arrays of this seed the step reads but does not train


def _mf_loss(rows_u, rows_i, y):
  return jnp.mean((jnp.sum(rows_u * rows_i, axis=1) - y) ** 2)


def matrix_factorisation(
  seed: int, *, users=5000, items=2000, dim=16, steps=1000, batch=256, convex=False
) -> Recipe:
  rng = np.random.default_rng(seed)
  true_u = rng.normal(size=(users, dim)) / dim**0.25
  true_i = rng.normal(size=(items, dim)) / dim**0.25

  def draw(n, size):
    return np.minimum(rng.zipf(1.3, size=size) - 1, n - 1).astype(np.int32)

  def ratings(u, i):
    noise = 0.1 * rng.normal(size=u.shape)
    return (np.sum(true_u[u] * true_i[i], axis=1) + noise).astype(np.float32)

  batches = []
  for _ in range(steps):
    u, i = draw(users, batch), draw(items, batch)
    batches.append((u, i, ratings(u, i)))
  u, i = draw(users, 8 * batch), draw(items, 8 * batch)
  held_out = (u, i, ratings(u, i))
  fixed_items = jnp.asarray(true_i, jnp.float32)
  key_u, key_i = jax.random.split(jax.random.key(seed))
  tables = {"u": 0.1 * jax.random.normal(key_u, (users, dim))}
  if not convex:
    tables["i"] = 0.1 * jax.random.normal(key_i, (items, dim))

  def items_of(tables, constants):
    return tables["i"] if "i" in tables else constants

  def loss_and_row_grads(tables, other, constants, batch):
    u, i, y = batch
    rows = tables["u"][u], items_of(tables, constants)[i]
    loss, (g_u, g_i) = jax.value_and_grad(_mf_loss, argnums=(0, 1))(*rows, y)
    row_grads = {"u": (u, g_u), "i": (i, g_i)}
    return loss, {name: row_grads[name] for name in tables}, None

  def metric(tables, other):
    u, i, y = held_out
    return _mf_loss(tables["u"][u], items_of(tables, fixed_items)[i], y)

  def batch_ids(batch):
    ids = {"u": batch[0], "i": batch[1]}
    return {name: ids[name] for name in tables}

  return Recipe(
    "mf", 0.05, tables, None, batches, batch_ids, loss_and_row_grads, metric,
    constants=None if not convex else fixed_items,
  )  # fmt: skip


def dlrm(seed: int, *, steps=300) -> Recipe:
  import dlrm_side_by_side as d
  from flax import nnx

  args = d.parse_args(["--dtype", "float32", "--seed", str(seed), "--steps", str(steps)])
  model = d.DLRM(args, nnx.Rngs(seed))  # its initial weights, as the example makes them
  tables = {f"t{k}": jnp.asarray(bag.embedding[...]) for k, bag in enumerate(model.bags)}

  def linear(layer):
    return {"w": jnp.asarray(layer.kernel[...]), "b": jnp.asarray(layer.bias[...])}

  other = {
    "bottom": [linear(layer) for layer in model.bottom],
    "top": [linear(layer) for layer in model.top],
  }
  batches = []
  for dense, bags, clicks in d.make_batches(args):
    flat = []
    for ids, offsets in bags:
      bag_of_id = np.searchsorted(offsets, np.arange(len(ids)), side="right") - 1
      flat += [ids, bag_of_id.astype(np.int32)]
    batches.append((dense, clicks, *flat))
  pairs = d.upper_pairs(len(tables) + 1)

  def forward(pooled, other, dense):
    x = dense
    for layer in other["bottom"]:
      x = jax.nn.relu(x @ layer["w"] + layer["b"])
    vectors = jnp.stack([x, *pooled], axis=1)
    dots = jnp.einsum("bid,bjd->bij", vectors, vectors)
    z = jnp.concatenate([x, dots[:, pairs[0], pairs[1]]], axis=1)
    hidden = jax.nn.relu(z @ other["top"][0]["w"] + other["top"][0]["b"])
    return (hidden @ other["top"][1]["w"] + other["top"][1]["b"])[:, 0]

  def loss_fn(rows, other, batch):
    dense, clicks, *flat = batch
    pooled = [
      jax.ops.segment_sum(r, bag_of_id, num_segments=dense.shape[0])
      for r, bag_of_id in zip(rows, flat[1::2], strict=True)
    ]
    return optax.sigmoid_binary_cross_entropy(forward(pooled, other, dense), clicks).mean()

  def loss_and_row_grads(tables, other, constants, batch):
    ids = batch[2::2]
    rows = [tables[f"t{k}"][i] for k, i in enumerate(ids)]
    loss, (g_rows, g_other) = jax.value_and_grad(loss_fn, argnums=(0, 1))(rows, other, batch)
    row_grads = {f"t{k}": (i, g) for k, (i, g) in enumerate(zip(ids, g_rows, strict=True))}
    return loss, row_grads, g_other

  def batch_ids(batch):
    return {f"t{k}": ids for k, ids in enumerate(batch[2::2])}

  return Recipe("dlrm", args.lr, tables, other, batches, batch_ids, loss_and_row_grads, None)


def node2vec(seed: int, *, graph="les_miserables", steps=2000) -> Recipe:
  import node2vec as n2v

  args = n2v.parse_args(["--graph", graph, "--steps", str(steps), "--seed", str(seed)])
  problem = n2v.make_problem(args, seed)
  n = len(problem.data.names)
  tables = n2v.init_params(jax.random.key(seed), n, args.dim)

  def loss_and_row_grads(tables, other, constants, batch):
    loss, row_grads = n2v.loss_and_row_grads(tables, *batch)
    return loss, row_grads, None

  def metric(tables, other):
    nodes, contexts, negatives = problem.eval_batch
    rows = tables["nodes"][nodes], tables["contexts"][contexts], tables["contexts"][negatives]
    return n2v.sgns_loss(*rows)

  def final_scores(tables, other):
    embeddings = np.asarray(tables["nodes"])
    data = problem.data
    return {
      "community accuracy": n2v.community_accuracy(embeddings, data.labels),
      "link AUC": n2v.link_auc(embeddings, data.test_edges, data.test_non_edges),
    }

  def batch_ids(batch):
    nodes, contexts, negatives = batch
    return {"nodes": nodes, "contexts": jnp.concatenate([contexts, negatives.ravel()])}

  return Recipe(
    "node2vec",
    args.lr,
    tables,
    None,
    problem.batches,
    batch_ids,
    loss_and_row_grads,
    metric,
    final_scores,
  )
