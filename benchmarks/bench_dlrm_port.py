"""Step time of the DLRM port (issue 45) against torch's, interleaved in one run.

The model and data are `examples/dlrm_side_by_side.py`'s with `--ragged` (DLRM's
generator: every bag 1 to 2k ids) and one optimizer for every parameter (SGD by
default). Each round runs `--steps` steps of each, in turn:

- torch:     `torch.optim.SGD(model.parameters())`, `nn.EmbeddingBag(sparse=True)`;
- nnx.jit:   the NNX port, `osa.sparse_sgd` in one `nnx.jit` step (the example's form);
- jax.jit:   the same step under `jax.jit` over `nnx.split` state, donated (docs/flax.md's
             faster form);
- adapter:   `torch_compat.SGD` over the Flax model's parameters (`tc.named_parameters`):
             a jitted loss-and-gradients, then `opt.step()`.

The ids are padded with `osa.pad_ids`, so the JAX steps compile a few times before the
first round (warm-up, not timed). It prints each's median time per step and the median
over rounds of its ratio to torch's. On a shared machine only ratios measured in one run
mean anything.

Run: python -m benchmarks.bench_dlrm_port [--rounds 5 --steps 20 --optimizer sgd]
"""

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

import optax_sparse_adam as osa

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import dlrm_side_by_side as dlrm  # noqa: E402


def split_trainer(model, lr, name):
  """The NNX port under `jax.jit` over split state (model and optimizer), donated."""
  tx = {"sgd": osa.sparse_sgd, "adagrad": osa.sparse_adagrad}[name](lr)
  optimizer = osa.SparseOptimizer(model, tx, wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  @jax.jit(donate_argnums=0)
  def step(state, dense, bags, clicks):
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(model):
      return optax.sigmoid_binary_cross_entropy(model(dense, bags), clicks).mean()

    loss, grads = osa.sparse_value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss, nnx.state((model, optimizer))

  holder = {"state": state}

  def run(dense, bags, clicks):
    loss, holder["state"] = step(holder["state"], dense, bags, clicks)
    return loss

  return run


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--optimizer", choices=["sgd", "adagrad"], default="sgd")
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--rows", type=int, nargs="+", default=[3000, 2000, 1000, 500])
  options = parser.parse_args()
  args = dlrm.parse_args(
    [
      "--ragged",
      "--dtype",
      "float32",
      "--optimizer",
      options.optimizer,
      "--lr",
      "0.1",
      "--batch-size",
      str(options.batch_size),
      "--steps",
      str(options.steps),
      "--rows",
      *map(str, options.rows),
    ]
  )
  torch.set_num_threads(1)
  batches = dlrm.make_batches(args)
  jax_batches = [
    (
      jnp.asarray(dense),
      [(jnp.asarray(osa.pad_ids(ids)), jnp.asarray(offsets)) for ids, offsets in bags],
      jnp.asarray(clicks),
    )
    for dense, bags, clicks in batches
  ]
  torch_batches = [
    (
      torch.from_numpy(dense),
      [(torch.from_numpy(ids), torch.from_numpy(offsets)) for ids, offsets in bags],
      torch.from_numpy(clicks),
    )
    for dense, bags, clicks in batches
  ]
  model = dlrm.DLRM(args, nnx.Rngs(0))
  torch_step = dlrm.torch_trainer(dlrm.TorchDLRM(model, args), args.lr, args.optimizer)
  nnx_step = dlrm.jax_trainer(model, args.lr, args.optimizer)[0]
  split_step = split_trainer(dlrm.DLRM(args, nnx.Rngs(0)), args.lr, args.optimizer)
  adapter_step = dlrm.adapter_trainer(dlrm.DLRM(args, nnx.Rngs(0)), args.lr, args.optimizer)
  ways = {
    "torch": (torch_step, torch_batches, float),
    "nnx.jit": (nnx_step, jax_batches, jax.block_until_ready),
    "jax.jit": (split_step, jax_batches, jax.block_until_ready),
    "adapter": (adapter_step, jax_batches, jax.block_until_ready),
  }
  for step, data, sync in ways.values():  # warm-up: every id-count bucket compiled
    for batch in data:
      sync(step(*batch))
  times = {name: [] for name in ways}
  for _ in range(options.rounds):
    for name, (step, data, sync) in ways.items():
      start = time.perf_counter()
      for batch in data:
        loss = step(*batch)
      sync(loss)
      times[name].append((time.perf_counter() - start) / len(data))
  print(
    f"DLRM port, {options.optimizer}, batch {options.batch_size}, tables {options.rows} x 16, "
    f"{options.rounds} rounds of {options.steps} steps (median ms/step, ratio to torch)"
  )
  for name, values in times.items():
    ratio = np.median(np.array(values) / np.array(times["torch"]))
    print(f"  {name:<8} {1e3 * np.median(values):8.3f} ms   {ratio:5.2f}x torch")


if __name__ == "__main__":
  main()
