"""Time of one `torch_compat.SparseAdam.step()` against the optax path on the same recipe.

The default recipe is a small-table port (PyG's Node2Vec: one 1,797 x 128 table,
a BCOO gradient of 28,000 row entries a step, 30 steps a round). It times, in
this one process and interleaved round by round:

- adapter:   `p.grad = g; opt.step()` on `torch_compat.SparseAdam`;
- optax:     `sparse_adam` + `apply_updates` in one jit with params and state donated;
- per-param: the adapter's compiled step dispatched once per parameter (with --params > 1);
- torch:     `torch.optim.SparseAdam` on the same gradients, when torch is installed.

It prints the median time per step of each and the ratio adapter/optax (the
median over rounds of each round's ratio): the adapter's overhead over the plain
optax path. On a shared machine only ratios
measured in one run mean anything.

Run: python -m benchmarks.torch_compat_step [--params 1 --rows 1797 --dim 128 --nse 28000]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam.torch_compat import Parameter, SparseAdam, _step

_FUSED = _step.fused_step


def _one_call_per_param(params, exp_avgs, exp_avg_sqs, grads, scalars, zero, *, maximize):
  """The same compiled step, dispatched once per parameter (what a naive port does)."""
  outs = [
    _FUSED([d], [m], [v], [g], [s], zero, maximize=(flag,))
    for d, m, v, g, s, flag in zip(
      params, exp_avgs, exp_avg_sqs, grads, scalars, maximize, strict=True
    )
  ]
  return tuple([out[k][0] for out in outs] for k in range(3))


def _gradients(args, shape):
  rng = np.random.default_rng(0)
  rows = [
    [rng.integers(0, args.rows, size=args.nse) for _ in range(args.params)]
    for _ in range(args.steps)
  ]
  values = [
    [rng.normal(size=(args.nse, args.dim)).astype(np.float32) for _ in range(args.params)]
    for _ in range(args.steps)
  ]
  jax_grads = [
    [
      sparse.BCOO((jnp.asarray(v), jnp.asarray(r[:, None])), shape=shape)
      for r, v in zip(step_rows, step_values, strict=True)
    ]
    for step_rows, step_values in zip(rows, values, strict=True)
  ]
  return rows, values, jax_grads


def _adapter_runner(args, shape, init, grads, step_fn):
  params = [Parameter(jnp.asarray(init)) for _ in range(args.params)]
  opt = SparseAdam(params, lr=1e-3)

  def run():
    _step.fused_step = step_fn
    try:
      for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
          p.grad = g
        opt.step()
    finally:
      _step.fused_step = _FUSED
    jax.block_until_ready([p.data for p in params])

  return run


def _optax_runner(args, init, grads):
  tx = osa.sparse_adam(1e-3)
  carry = {"params": [jnp.asarray(init) for _ in range(args.params)]}
  carry["state"] = tx.init(carry["params"])

  def train_step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return osa.apply_updates(params, updates), state

  step = jax.jit(train_step, donate_argnums=(0, 1))

  def run():
    params, state = carry["params"], carry["state"]
    for step_grads in grads:
      params, state = step(params, state, step_grads)
    jax.block_until_ready(params)
    carry["params"], carry["state"] = params, state

  return run


def _torch_runner(args, shape, init, rows, values):
  import torch

  params = [torch.nn.Parameter(torch.from_numpy(init.copy())) for _ in range(args.params)]
  grads = [
    [
      torch.sparse_coo_tensor(
        torch.from_numpy(r[None]), torch.from_numpy(v), shape, check_invariants=True
      )
      for r, v in zip(step_rows, step_values, strict=True)
    ]
    for step_rows, step_values in zip(rows, values, strict=True)
  ]
  opt = torch.optim.SparseAdam(params, lr=1e-3)

  def run():
    for step_grads in grads:
      for p, g in zip(params, step_grads, strict=True):
        p.grad = g
      opt.step()

  return run


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--params", type=int, default=1)
  parser.add_argument("--rows", type=int, default=1_797)
  parser.add_argument("--dim", type=int, default=128)
  parser.add_argument("--nse", type=int, default=28_000)
  parser.add_argument("--steps", type=int, default=30, help="steps per timed round")
  parser.add_argument("--rounds", type=int, default=9)
  parser.add_argument(
    "--no-torch", dest="torch", action="store_false", help="skip torch's SparseAdam (slow here)"
  )
  args = parser.parse_args()
  shape = (args.rows, args.dim)
  init = np.random.default_rng(1).normal(size=shape).astype(np.float32)
  rows, values, grads = _gradients(args, shape)

  runners = {
    "adapter": _adapter_runner(args, shape, init, grads, _FUSED),
    "optax": _optax_runner(args, init, grads),
  }
  if args.params > 1:
    runners["per-param"] = _adapter_runner(args, shape, init, grads, _one_call_per_param)
  if args.torch:
    try:
      runners["torch"] = _torch_runner(args, shape, init, rows, values)
    except ImportError:
      print("torch is not installed: timing the JAX paths only.")

  for run in runners.values():
    run()  # compile and warm up
  per_step = {name: [] for name in runners}
  for _ in range(args.rounds):  # interleaved, so that load changes hit every path alike
    for name, run in runners.items():
      start = time.perf_counter()
      run()
      per_step[name].append((time.perf_counter() - start) / args.steps)
  medians = {name: float(np.median(times)) for name, times in per_step.items()}

  print(
    f"\n{args.params} table(s) of {shape}, {args.nse} gradient entries each, "
    f"{jax.default_backend()} backend, CPU kernels "
    f"{'on' if osa.cpu_kernels_available() else 'off'}; median of {args.rounds} rounds "
    f"of {args.steps} steps"
  )
  for name, seconds in medians.items():
    print(f"  {name:>9}: {seconds * 1e3:8.3f} ms/step   {seconds / medians['optax']:5.2f}x optax")
  # Each round's ratio compares two runs seconds apart: steadier than a ratio of medians under load.
  ratios = np.array(per_step["adapter"]) / np.array(per_step["optax"])
  print(
    f"adapter/optax: {np.median(ratios):.2f} (median of the rounds' ratios; "
    f"range {ratios.min():.2f} to {ratios.max():.2f})"
  )


if __name__ == "__main__":
  main()
