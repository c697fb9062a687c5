"""Node2Vec on a graph networkx ships: skip-gram embeddings of its nodes, trained with sparse_adam.

Biased random walks over the graph (Grover & Leskovec, 2016: a walk returns to
the node it came from with weight 1/p and moves away from it with weight 1/q),
then skip-gram with negative sampling (Mikolov et al., 2013) on the (node,
context) pairs of each walk's windows. Two tables, the nodes' embeddings and the
contexts', are looked up by each batch; each table's gradient is a BCOO of the
rows the batch read (its nodes, or its contexts and negative samples), stepped
by sparse_adam in a jitted, donated step.

A tenth of the edges is held out before the walks. The script prints the loss,
the nearest neighbours of a few nodes, how well the embeddings predict the
communities (Zachary's karate club: the club each member joined after the
split; the other graphs: greedy-modularity communities) by a leave-one-out vote
of the 5 nearest nodes, and the link-prediction AUC of the held-out edges
against every node pair that is not an edge.

  python examples/node2vec.py
  python examples/node2vec.py --graph les_miserables --p 0.5 --q 2

Gallery:
  title: Node2Vec on a networkx graph
  extras: examples
  shows: biased random walks and skip-gram with negative sampling, two tables stepped by
    sparse_adam; nearest neighbours, community accuracy and held-out link-prediction AUC
  run time: 2.4 s on the 2-core shared CPU VM of the project, under nice, 2026-11-25
"""

import _gallery  # the extras this example needs, read from the Gallery block above

_gallery.require_extras(__doc__, __file__)

import argparse
import json
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
from jax.experimental import sparse
from tqdm import trange

import optax_sparse_adam as osa

GRAPHS = {
  "karate": nx.karate_club_graph,
  "les_miserables": nx.les_miserables_graph,
  "davis": nx.davis_southern_women_graph,
}


class GraphData(NamedTuple):
  """A graph with its nodes numbered 0..n-1, held-out edges and community labels."""

  names: list
  train_edges: np.ndarray  # (E, 2), the edges the walks may use
  test_edges: np.ndarray  # (T, 2), held out
  test_non_edges: np.ndarray  # (M, 2), every node pair that is not an edge
  labels: np.ndarray  # (n,) community of each node
  neighbours: list  # neighbours[v]: the training graph's neighbours of v, as an array


def load_graph(name: str, rng: np.random.Generator, test_fraction: float = 0.1) -> GraphData:
  """The graph `name`, with a fraction of its edges held out (none that would strand a node)."""
  graph = nx.convert_node_labels_to_integers(GRAPHS[name](), label_attribute="name")
  n = graph.number_of_nodes()
  names = [graph.nodes[v]["name"] for v in range(n)]
  if name == "karate":
    clubs = [graph.nodes[v]["club"] for v in range(n)]
    labels = np.array([sorted(set(clubs)).index(c) for c in clubs])
  else:
    labels = np.zeros(n, int)
    for k, members in enumerate(nx.community.greedy_modularity_communities(graph)):
      labels[list(members)] = k
  train = graph.copy()
  test = []
  for u, v in rng.permutation(np.array(graph.edges())):
    if len(test) >= test_fraction * graph.number_of_edges():
      break
    if train.degree(u) > 1 and train.degree(v) > 1:
      train.remove_edge(u, v)
      test.append((u, v))
  non_edges = list(nx.non_edges(graph))  # every one: the graphs are small
  neighbours = [np.array(sorted(train.neighbors(v))) for v in range(n)]
  return GraphData(
    names, np.array(train.edges()), np.array(test), np.array(non_edges), labels, neighbours
  )


def random_walks(data: GraphData, rng, *, walks_per_node: int, length: int, p: float, q: float):
  """Node2Vec's second-order walks: from t to v, the next node x has weight 1/p if x = t,
  1 if x is a neighbour of t, 1/q otherwise."""
  n = len(data.neighbours)
  walks = np.empty((walks_per_node * n, length), np.int32)
  for w, start in enumerate(np.tile(np.arange(n), walks_per_node)):
    walk = [start, rng.choice(data.neighbours[start])]
    while len(walk) < length:
      prev, here = walk[-2], walk[-1]
      options = data.neighbours[here]
      weights = np.where(
        options == prev, 1 / p, np.where(np.isin(options, data.neighbours[prev]), 1.0, 1 / q)
      )
      walk.append(rng.choice(options, p=weights / weights.sum()))
    walks[w] = walk
  return walks


def skipgram_pairs(walks: np.ndarray, window: int) -> np.ndarray:
  """(node, context) pairs: each position of each walk with the nodes up to `window` away."""
  pairs = []
  for offset in range(1, window + 1):
    pairs.append(np.stack([walks[:, :-offset], walks[:, offset:]], -1).reshape(-1, 2))
    pairs.append(np.stack([walks[:, offset:], walks[:, :-offset]], -1).reshape(-1, 2))
  return np.concatenate(pairs)


def negative_sampler(walks: np.ndarray, num_nodes: int, rng):
  """Draws negative contexts from the walks' node frequencies to the power 3/4 (word2vec's)."""
  weights = np.bincount(walks.ravel(), minlength=num_nodes) ** 0.75
  weights = weights / weights.sum()
  return lambda shape: rng.choice(num_nodes, size=shape, p=weights).astype(np.int32)


def sgns_loss(node_rows, context_rows, negative_rows):
  """Skip-gram with negative sampling: -log s(u.c) - sum_k log s(-u.n_k), mean over the batch."""
  positive = jax.nn.log_sigmoid(jnp.sum(node_rows * context_rows, -1))
  negative = jax.nn.log_sigmoid(-jnp.einsum("bd,bkd->bk", node_rows, negative_rows)).sum(-1)
  return -jnp.mean(positive + negative)


def loss_and_row_grads(params, nodes, contexts, negatives):
  """The loss, and each table's looked-up ids with the gradient of its looked-up rows."""
  rows = params["nodes"][nodes], params["contexts"][contexts], params["contexts"][negatives]
  loss, (g_nodes, g_contexts, g_negatives) = jax.value_and_grad(sgns_loss, argnums=(0, 1, 2))(*rows)
  dim = g_nodes.shape[-1]
  context_ids = jnp.concatenate([contexts, negatives.ravel()])
  context_grads = jnp.concatenate([g_contexts, g_negatives.reshape(-1, dim)])
  return loss, {"nodes": (nodes, g_nodes), "contexts": (context_ids, context_grads)}


def bcoo_grads(row_grads, num_nodes):
  """The BCOO gradient of each table from its looked-up ids and the gradient of those rows."""
  return {
    name: sparse.BCOO((g, ids[:, None]), shape=(num_nodes, g.shape[-1]))
    for name, (ids, g) in row_grads.items()
  }


def init_params(key, num_nodes: int, dim: int):
  """Node rows small and random, context rows zero (word2vec's initialisation)."""
  return {
    "nodes": jax.random.uniform(key, (num_nodes, dim), minval=-0.5, maxval=0.5) / dim,
    "contexts": jnp.zeros((num_nodes, dim)),
  }


def cosine(embeddings: np.ndarray) -> np.ndarray:
  unit = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
  return unit @ unit.T


def community_accuracy(embeddings: np.ndarray, labels: np.ndarray, k: int = 5) -> float:
  """Leave-one-out: each node's community by the vote of its k most cosine-similar nodes."""
  similarity = cosine(embeddings)
  np.fill_diagonal(similarity, -np.inf)
  nearest = np.argsort(-similarity, axis=1)[:, :k]
  votes = np.array([np.bincount(labels[row], minlength=labels.max() + 1) for row in nearest])
  return float(np.mean(votes.argmax(1) == labels))


def link_auc(embeddings: np.ndarray, edges: np.ndarray, non_edges: np.ndarray) -> float:
  """The probability that a held-out edge scores above a non-edge (cosine similarity; ties 1/2)."""
  similarity = cosine(embeddings)
  pos = similarity[edges[:, 0], edges[:, 1]]
  neg = similarity[non_edges[:, 0], non_edges[:, 1]]
  return float(np.mean((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])))


class Problem(NamedTuple):
  """A graph's data, walks and the batches of `steps` training steps."""

  data: GraphData
  batches: list  # (nodes (B,), contexts (B,), negatives (B, K)) per step
  eval_batch: tuple  # a fixed sample of pairs with negatives, to score the objective


def make_problem(args, seed: int) -> Problem:
  """Everything random in a run, from `seed`: held-out edges, walks, batches."""
  rng = np.random.default_rng(seed)
  data = load_graph(args.graph, rng)
  n = len(data.names)
  walks = random_walks(
    data, rng, walks_per_node=args.walks_per_node, length=args.walk_length, p=args.p, q=args.q
  )
  pairs = skipgram_pairs(walks, args.window)
  draw_negatives = negative_sampler(walks, n, rng)

  def batch(size):
    picked = pairs[rng.integers(0, len(pairs), size)]
    return picked[:, 0], picked[:, 1], draw_negatives((size, args.negatives))

  batches = [batch(args.batch_size) for _ in range(args.steps)]
  return Problem(data, batches, batch(4096))


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--graph", choices=list(GRAPHS), default="karate")
  parser.add_argument("--dim", type=int, default=16)
  parser.add_argument("--walks-per-node", type=int, default=20)
  parser.add_argument("--walk-length", type=int, default=20)
  parser.add_argument("--window", type=int, default=3)
  parser.add_argument("--p", type=float, default=1.0, help="return parameter")
  parser.add_argument("--q", type=float, default=1.0, help="in-out parameter")
  parser.add_argument("--negatives", type=int, default=5, help="negative samples per pair")
  parser.add_argument("--batch-size", type=int, default=32, help="(node, context) pairs")
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--lr", type=float, default=0.02)
  parser.add_argument("--catch-up", action="store_true", help="catch_up_idle_rows=True")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", action="store_true", help="print the results as JSON only")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  start = time.perf_counter()
  problem = make_problem(args, args.seed)
  data = problem.data
  n = len(data.names)
  if not args.json:
    print(
      f"graph {args.graph}: {n} nodes, {len(data.train_edges)} edges for the walks, "
      f"{len(data.test_edges)} held out; {args.walks_per_node * n} walks of {args.walk_length}; "
      f"tables 2 x {n} x {args.dim}"
    )

  opt = osa.sparse_adam(args.lr, catch_up_idle_rows=args.catch_up)

  @jax.jit
  def objective(params, nodes, contexts, negatives):
    rows = params["nodes"][nodes], params["contexts"][contexts], params["contexts"][negatives]
    return sgns_loss(*rows)

  def train_step(params, state, nodes, contexts, negatives):
    if args.catch_up:  # read the batch's rows as dense Adam would have them
      ids = {"nodes": nodes, "contexts": jnp.concatenate([contexts, negatives.ravel()])}
      params, state = osa.catch_up_rows(opt, params, state, ids)
    loss, row_grads = loss_and_row_grads(params, nodes, contexts, negatives)
    updates, state = opt.update(bcoo_grads(row_grads, n), state, params)
    return osa.apply_updates(params, updates), state, loss

  train_step = jax.jit(train_step, donate_argnums=(0, 1))
  params = init_params(jax.random.key(args.seed), n, args.dim)
  state = opt.init(params)
  initial_loss = float(objective(params, *problem.eval_batch))
  curve = []
  every = max(1, args.steps // 10)
  bar = trange(args.steps, desc="training", unit="step", mininterval=1.0, disable=args.json)
  for step in bar:
    params, state, loss = train_step(params, state, *problem.batches[step])
    if (step + 1) % every == 0:
      seen = osa.catch_up_all_rows(opt, params, state)[0] if args.catch_up else params
      curve.append((step + 1, float(objective(seen, *problem.eval_batch))))
      bar.set_postfix(loss=f"{curve[-1][1]:.4f}")
  if args.catch_up:
    params, state = osa.catch_up_all_rows(opt, params, state)
  embeddings = np.asarray(params["nodes"])
  results = {
    "loss": [initial_loss] + [loss for _, loss in curve],
    "community_accuracy": community_accuracy(embeddings, data.labels),
    "link_auc": link_auc(embeddings, data.test_edges, data.test_non_edges),
    "seconds": time.perf_counter() - start,
  }
  if args.json:
    json.dump(results, sys.stdout)
    print()
    return

  print(f"\nskip-gram loss on a fixed sample of 4,096 pairs: step 0  {initial_loss:.4f}")
  for step, loss in curve:
    print(f"{'':34}step {step:<5d}{loss:.4f}")
  similarity = cosine(embeddings)
  print("\nnearest neighbours (cosine similarity of the node embeddings) [community]:")
  for v in sorted({0, n - 1, int(np.argmax([len(nb) for nb in data.neighbours]))}):
    nearest = [u for u in np.argsort(-similarity[v]) if u != v][:5]
    names = ", ".join(f"{data.names[u]} [{data.labels[u]}]" for u in nearest)
    print(f"  {data.names[v]} [{data.labels[v]}]: {names}")
  majority = np.bincount(data.labels).max() / n
  print(
    f"\ncommunity accuracy (leave-one-out vote of the 5 nearest nodes): "
    f"{results['community_accuracy']:.1%} (the largest community alone: {majority:.1%})"
  )
  print(
    f"link prediction, {len(data.test_edges)} held-out edges against "
    f"{len(data.test_non_edges)} non-edges: "
    f"AUC {results['link_auc']:.3f} (chance: 0.5)"
  )
  print(f"{args.steps} steps of {args.batch_size} pairs in {results['seconds']:.1f} s")


if __name__ == "__main__":
  main()
