"""Time of one `torch_compat.SparseAdam.step()`: fused (one compiled call) vs per-parameter calls.

Also times torch.optim.SparseAdam on the same gradients when torch is installed.
All three run in this one process, interleaved, and the script prints ratios. On
a shared machine only the ratios mean anything.

Run: python -m benchmarks.torch_compat_step [--params 16 --rows 100000 --dim 32 --nse 1024]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse
from tqdm import tqdm

from optax_sparse_adam.torch_compat import Parameter, SparseAdam, _step

_FUSED = _step.fused_step


def _one_call_per_param(params, exp_avgs, exp_avg_sqs, grads, scalars, zero):
  """The same compiled step, dispatched once per parameter (what a naive port does)."""
  outs = [
    _FUSED([d], [m], [v], [g], [s], zero)
    for d, m, v, g, s in zip(params, exp_avgs, exp_avg_sqs, grads, scalars, strict=True)
  ]
  return tuple([out[k][0] for out in outs] for k in range(3))


def _timeit(fn, repeats):
  fn()  # compile / warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--params", type=int, default=16)
  parser.add_argument("--rows", type=int, default=100_000)
  parser.add_argument("--dim", type=int, default=32)
  parser.add_argument("--nse", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  shape = (args.rows, args.dim)
  rows = [rng.integers(0, args.rows, size=args.nse) for _ in range(args.params)]
  values = [rng.normal(size=(args.nse, args.dim)).astype(np.float32) for _ in range(args.params)]
  grads = [
    sparse.BCOO((jnp.asarray(v), jnp.asarray(r[:, None])), shape=shape)
    for r, v in zip(rows, values, strict=True)
  ]

  def jax_runner(step_fn):
    params = [Parameter(jnp.zeros(shape)) for _ in range(args.params)]
    opt = SparseAdam(params, lr=1e-3)

    def run():
      for p, g in zip(params, grads, strict=True):
        p.grad = g
      _step.fused_step = step_fn
      try:
        opt.step()
      finally:
        _step.fused_step = _FUSED
      jax.block_until_ready([p.data for p in params])

    return run

  results = {}
  runners = {"fused": jax_runner(_FUSED), "per-param": jax_runner(_one_call_per_param)}
  try:
    import torch

    t_params = [torch.nn.Parameter(torch.zeros(shape)) for _ in range(args.params)]
    t_grads = [
      torch.sparse_coo_tensor(
        torch.from_numpy(r[None]), torch.from_numpy(v), shape, check_invariants=True
      )
      for r, v in zip(rows, values, strict=True)
    ]
    t_opt = torch.optim.SparseAdam(t_params, lr=1e-3)

    def torch_run():
      for p, g in zip(t_params, t_grads, strict=True):
        p.grad = g
      t_opt.step()

    runners["torch"] = torch_run
  except ImportError:
    print("torch is not installed: comparing the two JAX variants only.")
  for name, run in tqdm(runners.items(), desc="timing"):
    results[name] = _timeit(run, args.repeats)

  print(
    f"\n{args.params} tables of {shape}, {args.nse} gradient entries each, "
    f"{jax.default_backend()} backend, median of {args.repeats} steps"
  )
  for name, seconds in results.items():
    ratio = seconds / results["fused"]
    print(f"  {name:>10}: {seconds * 1e3:8.2f} ms/step   {ratio:5.2f}x the fused step")


if __name__ == "__main__":
  main()
