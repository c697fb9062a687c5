"""A DLRM-style model in Flax NNX, trained side by side with its PyTorch original.

DLRM (Naumov et al., 2019): dense features through a bottom MLP, sparse features
pooled by `nn.EmbeddingBag`s, the pairwise dot products of all those vectors
(the "interaction"), then a top MLP to a click logit. The PyTorch half uses
`nn.EmbeddingBag(mode='sum', sparse=True)` + `torch.optim.SparseAdam` for the
tables and `torch.optim.Adam` for the MLPs; the JAX half uses
`SparseEmbedBag` (BCOO table gradients) + `sparse_adam` and `optax.adam`, in one
donated `nnx.jit` step. Same synthetic data, same initial weights: the two loss
curves are the same curve.

By default both run in float64, where they agree to ~1e-12 for the whole run.
In float32 (`--dtype float32`) they agree to rounding for the first steps, then
drift apart by a few percent: Adam's step is nearly the sign of the gradient for a
row or weight whose gradient is tiny, so a rounding difference that flips such a
sign moves a parameter by about 2 x lr, and the training dynamics amplify that
(two torch builds differ the same way). float64 shows that the models and
optimizers are the same; float32 shows what to expect of any port.

The bags come as 1-D ids with `offsets`, each batch with a different split of a
fixed number of ids into a fixed number of bags (some empty): the JAX step
compiles once, as the offsets are data and only their count is static.

`--ragged` draws each bag's size instead, as DLRM's random generator does, so the
number of ids changes every batch; the JAX step pads them with `osa.pad_ids` to a
power of two (padding is left out of every bag: the same numbers) and compiles once
or twice instead of every step. `--optimizer sgd` / `adagrad` is DLRM's own recipe:
one `torch.optim.SGD(model.parameters(), lr)` for the tables and the MLPs, and one
`osa.sparse_sgd(lr)` (or `sparse_adagrad`) for every JAX parameter, BCOO and dense
gradients alike, with no `multi_transform`.

  python examples/dlrm_side_by_side.py
  python examples/dlrm_side_by_side.py --dtype float32
  python examples/dlrm_side_by_side.py --ragged --optimizer sgd --lr 0.1

Gallery:
  title: DLRM with EmbeddingBags, side by side with PyTorch
  extras: flax, torch, examples
  shows: SparseEmbedBag + sparse_adam against nn.EmbeddingBag(sparse=True) + torch.optim.SparseAdam
    from the same weights and data: both loss curves and their largest difference
  run time: 26 s on the 2-core shared CPU VM of the project, 2026-11-23
"""

import _gallery  # the extras this example needs, read from the Gallery block above

_gallery.require_extras(__doc__, __file__)

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx
from tqdm import tqdm

import optax_sparse_adam as osa
from optax_sparse_adam import torch_compat as tc


def make_batches(args):
  """Synthetic clicks: a hidden linear model of the dense features and per-id biases."""
  dtype = np.dtype(args.dtype)
  rng = np.random.default_rng(args.seed)
  true_dense = rng.normal(size=args.dense_features).astype(np.float32)
  true_bias = [rng.normal(size=rows).astype(np.float32) for rows in args.rows]
  batches = []
  for _ in range(args.steps):
    dense = rng.normal(size=(args.batch_size, args.dense_features)).astype(np.float32)
    logit = dense @ true_dense / np.sqrt(args.dense_features)
    bags = []
    for rows, bias in zip(args.rows, true_bias, strict=True):
      if args.ragged:  # DLRM's generator: each bag 1 to 2k ids, so the count varies
        sizes = rng.integers(1, 2 * args.ids_per_bag + 1, size=args.batch_size)
        num_ids = int(sizes.sum())
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
      else:
        num_ids = args.batch_size * args.ids_per_bag
        cuts = np.sort(rng.integers(0, num_ids + 1, size=args.batch_size - 1))
        offsets = np.concatenate([[0], cuts])
      ids = rng.zipf(1.3, size=num_ids) % rows  # a few hot ids, as in real logs
      bag_of_id = np.searchsorted(offsets, np.arange(num_ids), side="right") - 1
      logit = logit + np.bincount(bag_of_id, bias[ids], minlength=args.batch_size) / 3.0
      bags.append((ids.astype(np.int32), offsets.astype(np.int32)))
    clicks = (rng.random(args.batch_size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    batches.append((dense.astype(dtype), bags, clicks.astype(dtype)))
  return batches


def upper_pairs(num_vectors):
  return np.triu_indices(num_vectors, k=1)


class DLRM(nnx.Module):
  """Bottom MLP, sum-pooled sparse bags, dot interaction, top MLP."""

  def __init__(self, args, rngs):
    dim, hidden, dtype = args.dim, args.hidden, jnp.dtype(args.dtype)

    def linear(n_in, n_out):
      return nnx.Linear(n_in, n_out, param_dtype=dtype, rngs=rngs)

    self.bottom = nnx.List([linear(args.dense_features, hidden), linear(hidden, dim)])
    self.bags = nnx.List(
      [
        osa.SparseEmbedBag(rows, dim, mode="sum", param_dtype=dtype, rngs=rngs)
        for rows in args.rows
      ]
    )
    num_pairs = len(upper_pairs(len(args.rows) + 1)[0])
    self.top = nnx.List([linear(dim + num_pairs, hidden), linear(hidden, 1)])

  def __call__(self, dense, bags):
    x = jax.nn.relu(self.bottom[1](jax.nn.relu(self.bottom[0](dense))))
    pooled = [bag(ids, offsets) for bag, (ids, offsets) in zip(self.bags, bags, strict=True)]
    vectors = jnp.stack([x, *pooled], axis=1)  # (B, 1 + tables, D)
    dots = jnp.einsum("bid,bjd->bij", vectors, vectors)
    i, j = upper_pairs(vectors.shape[1])
    z = jnp.concatenate([x, dots[:, i, j]], axis=1)
    return self.top[1](jax.nn.relu(self.top[0](z)))[:, 0]


class TorchDLRM(torch.nn.Module):
  """The PyTorch original, with the JAX model's initial weights."""

  def __init__(self, model, args):
    super().__init__()
    dtype = getattr(torch, args.dtype)

    def linear(layer):
      out = torch.nn.Linear(*layer.kernel.shape, dtype=dtype)
      with torch.no_grad():
        out.weight.copy_(torch.tensor(np.asarray(layer.kernel[...]).T))
        out.bias.copy_(torch.tensor(np.asarray(layer.bias[...])))
      return out

    self.bottom = torch.nn.ModuleList([linear(layer) for layer in model.bottom])
    self.top = torch.nn.ModuleList([linear(layer) for layer in model.top])
    self.bags = torch.nn.ModuleList()
    for bag in model.bags:
      torch_bag = torch.nn.EmbeddingBag(
        bag.num_embeddings, args.dim, mode="sum", sparse=True, dtype=dtype
      )
      with torch.no_grad():
        torch_bag.weight.copy_(torch.tensor(np.asarray(bag.embedding[...])))
      self.bags.append(torch_bag)

  def forward(self, dense, bags):
    x = torch.relu(self.bottom[1](torch.relu(self.bottom[0](dense))))
    pooled = [bag(ids, offsets) for bag, (ids, offsets) in zip(self.bags, bags, strict=True)]
    vectors = torch.stack([x, *pooled], dim=1)
    dots = torch.bmm(vectors, vectors.transpose(1, 2))
    i, j = upper_pairs(vectors.shape[1])
    z = torch.cat([x, dots[:, i, j]], dim=1)
    return self.top[1](torch.relu(self.top[0](z)))[:, 0]


def jax_trainer(model, lr, name="adam"):
  if name == "adam":  # torch.optim.SparseAdam for the tables, torch.optim.Adam for the rest
    tx = optax.multi_transform(
      {"sparse": osa.sparse_adam(lr), "dense": optax.adam(lr)}, osa.table_labels(model)
    )
  else:  # one optimizer for every parameter, as one torch.optim.SGD / Adagrad
    tx = {"sgd": osa.sparse_sgd, "adagrad": osa.sparse_adagrad}[name](lr)
  optimizer = osa.SparseOptimizer(model, tx, wrt=nnx.Param)

  @nnx.jit(donate_argnums=(0, 1))
  def step(model, optimizer, dense, bags, clicks):
    def loss_fn(model):
      logits = model(dense, bags)
      return optax.sigmoid_binary_cross_entropy(logits, clicks).mean()

    loss, grads = osa.sparse_value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  return lambda dense, bags, clicks: step(model, optimizer, dense, bags, clicks), step


def adapter_trainer(model, lr, name):
  """The torch recipe unchanged: `torch_compat.SGD(params)` over the Flax model's parameters.

  `tc.named_parameters` makes a `Parameter` of each of the model's arrays (named as torch
  names them), `tc.set_grads` hands them the gradients (BCOO for the tables, dense for the
  MLPs) and `tc.parameters_tree` puts the stepped arrays back into the model.
  """
  state = nnx.state(model, nnx.Param)
  params = tc.named_parameters(state)
  opt = {"sgd": tc.SGD, "adagrad": tc.Adagrad}[name](params.items(), lr=lr)

  @nnx.jit
  def loss_and_grads(model, dense, bags, clicks):
    def loss_fn(model):
      logits = model(dense, bags)
      return optax.sigmoid_binary_cross_entropy(logits, clicks).mean()

    return osa.sparse_value_and_grad(loss_fn)(model)

  def step(dense, bags, clicks):
    loss, grads = loss_and_grads(model, dense, bags, clicks)
    tc.set_grads(params, grads)  # opt.zero_grad(); loss.backward()
    opt.step()
    nnx.update(model, tc.parameters_tree(state, params))
    return loss

  return step


def torch_trainer(model, lr, name="adam"):
  if name == "adam":
    optimizers = [
      torch.optim.SparseAdam(list(model.bags.parameters()), lr=lr),
      torch.optim.Adam(list(model.bottom.parameters()) + list(model.top.parameters()), lr=lr),
    ]
  else:  # DLRM's recipe: one optimizer for everything
    optimizers = [
      {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[name](model.parameters(), lr=lr)
    ]

  def step(dense, bags, clicks):
    for opt in optimizers:
      opt.zero_grad()
    logits = model(dense, bags)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, clicks)
    loss.backward()
    for opt in optimizers:
      opt.step()
    return loss.item()

  return step


def run(args, progress=True):
  """`(jax_losses, torch_losses, max_table_difference, compiles)` after `args.steps` steps."""
  if args.dtype == "float64":
    jax.config.update("jax_enable_x64", True)
  torch.manual_seed(args.seed)
  torch.set_num_threads(1)  # small ops: threads only contend
  batches = make_batches(args)
  model = DLRM(args, nnx.Rngs(args.seed))
  torch_model = TorchDLRM(model, args)
  jax_step, compiled = jax_trainer(model, args.lr, args.optimizer)
  torch_step = torch_trainer(torch_model, args.lr, args.optimizer)
  jax_losses, torch_losses, adapter_losses = [], [], []
  if args.adapter:
    if args.optimizer == "adam":
      raise SystemExit("--adapter runs torch_compat.SGD or Adagrad: pass --optimizer sgd/adagrad")
    adapter_model = DLRM(args, nnx.Rngs(args.seed))  # the same initial weights
    adapter_step = adapter_trainer(adapter_model, args.lr, args.optimizer)
  bar = tqdm(batches, desc="DLRM, JAX and torch side by side", disable=not progress)
  for dense, bags, clicks in bar:
    # Ragged ids padded to a power of two: a handful of shapes, so a handful of compiles.
    jax_bags = [(jnp.asarray(osa.pad_ids(ids)), jnp.asarray(offsets)) for ids, offsets in bags]
    jax_losses.append(float(jax_step(jnp.asarray(dense), jax_bags, jnp.asarray(clicks))))
    if args.adapter:
      adapter_losses.append(float(adapter_step(jnp.asarray(dense), jax_bags, jnp.asarray(clicks))))
    torch_bags = [(torch.from_numpy(ids), torch.from_numpy(offsets)) for ids, offsets in bags]
    torch_losses.append(torch_step(torch.from_numpy(dense), torch_bags, torch.from_numpy(clicks)))
    bar.set_postfix(jax=f"{jax_losses[-1]:.4f}", torch=f"{torch_losses[-1]:.4f}")
  compiles = compiled.jitted_fn._cache_size()
  assert args.ragged or compiles == 1, "the JAX step recompiled"
  table_difference = max(
    float(np.max(np.abs(np.asarray(bag.embedding[...]) - torch_bag.weight.detach().numpy())))
    for bag, torch_bag in zip(model.bags, torch_model.bags, strict=True)
  )
  if args.adapter:  # the adapter's port and the NNX port: the same bits
    same = all(
      np.array_equal(np.asarray(a), np.asarray(b))
      for a, b in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)),
        jax.tree.leaves(nnx.state(adapter_model, nnx.Param)),
        strict=True,
      )
    )
    run.adapter = {"losses_equal": adapter_losses == jax_losses, "params_equal": same}
  return np.array(jax_losses), np.array(torch_losses), table_difference, compiles


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=256)
  parser.add_argument("--rows", type=int, nargs="+", default=[5000, 2000, 500])
  parser.add_argument("--ids-per-bag", type=int, default=4, help="average; bags vary, some empty")
  parser.add_argument("--dim", type=int, default=16)
  parser.add_argument("--hidden", type=int, default=64)
  parser.add_argument("--dense-features", type=int, default=13)
  parser.add_argument("--lr", type=float, default=0.01)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
  parser.add_argument("--optimizer", choices=["adam", "sgd", "adagrad"], default="adam")
  parser.add_argument("--ragged", action="store_true", help="bag sizes drawn: ragged id counts")
  parser.add_argument(
    "--adapter", action="store_true", help="also train with torch_compat.SGD/Adagrad"
  )
  parser.add_argument("--json", action="store_true", help="print the curves as JSON only")
  return parser.parse_args(argv)


def main():
  args = parse_args()
  start = time.perf_counter()
  jax_losses, torch_losses, table_difference, compiles = run(args, progress=not args.json)
  if args.json:
    curves = {"jax": jax_losses.tolist(), "torch": torch_losses.tolist()}
    report = {**curves, "table_difference": table_difference, "compiles": compiles}
    json.dump({**report, "adapter": getattr(run, "adapter", None)}, sys.stdout)
    return
  every = max(1, args.steps // 10)
  print(f"{'step':>6} {'jax loss':>12} {'torch loss':>12}   ({args.dtype})")
  for step in list(range(0, args.steps - 1, every)) + [args.steps - 1]:
    print(f"{step + 1:>6} {jax_losses[step]:>12.8f} {torch_losses[step]:>12.8f}")
  relative = np.abs(jax_losses - torch_losses) / np.abs(torch_losses)
  print(f"max relative difference of the loss curves: {relative.max():.2e}")
  print(f"max |table difference| after {args.steps} steps: {table_difference:.2e}")
  print(f"the JAX step compiled {compiles} time(s)")
  if args.adapter:
    print(f"torch_compat.{args.optimizer} against the NNX port, bit for bit: {run.adapter}")
  print(f"both trained in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  main()
