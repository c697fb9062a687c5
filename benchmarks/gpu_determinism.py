"""Run-to-run bits and ulps against the CPU of the default step on an accelerator.

Runs `--steps` steps of `sparse_adam` and of `sparse_adamw` (weight decay,
amsgrad) + `apply_updates` on Zipf ids (many duplicates per batch), twice, on
JAX's default backend, and the same steps on the CPU backend, then prints:

- whether the two accelerator runs gave the same bits (parameter, m and v);
- how many elements differ from the CPU run and by how many ulps at most;
- the largest relative error of each against a float64 NumPy Adam written here.

Run it once plain and once with `XLA_FLAGS=--xla_gpu_deterministic_ops=true` to
compare (the flag is read when the backend starts, so it takes a new process):

  JAX_PLATFORMS=cuda,cpu python -m benchmarks.gpu_determinism
  JAX_PLATFORMS=cuda,cpu XLA_FLAGS=--xla_gpu_deterministic_ops=true \
      python -m benchmarks.gpu_determinism

On a CPU-only machine both "runs" are the CPU's and the comparison is trivial.
"""

import argparse
import os

import jax
import numpy as np
from jax.experimental import sparse

import optax_sparse_adam as osa

LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.999, 1e-8, 1e-2


def zipf_batches(num_rows: int, batch: int, steps: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  ranks = np.minimum(rng.zipf(1.2, size=(steps, batch)) - 1, num_rows - 1)
  ids = ((ranks * 2_654_435_761) % num_rows).astype(np.int32)
  values = rng.standard_normal((steps, batch, 8)).astype(np.float32)
  return ids, values


def make_opt(name: str):
  if name == "sparse_adam":
    return osa.sparse_adam(LR, B1, B2, EPS)
  return osa.sparse_adamw(LR, B1, B2, EPS, weight_decay=WD, amsgrad=True)


def run_steps(name: str, ids, values, num_rows: int, device) -> dict[str, np.ndarray]:
  opt = make_opt(name)

  @jax.jit
  def step(params, state, ids, values):
    grad = sparse.BCOO((values, ids[:, None]), shape=(num_rows, values.shape[-1]))
    updates, state = opt.update({"t": grad}, state, params)
    return osa.apply_updates(params, updates), state

  rng = np.random.default_rng(7)
  params = {"t": jax.device_put(rng.standard_normal((num_rows, 8)).astype(np.float32), device)}
  state = opt.init(params)
  for k in range(ids.shape[0]):
    params, state = step(
      params, state, jax.device_put(ids[k], device), jax.device_put(values[k], device)
    )
  leaves = {"param": params["t"], "mu": state.mu["t"], "nu": state.nu["t"]}
  return {key: np.asarray(jax.device_get(value)) for key, value in leaves.items()}


def reference(name: str, ids, values, num_rows: int) -> np.ndarray:
  """Torch's SparseAdam (and AdamW with amsgrad over the touched rows) in float64."""
  p = np.random.default_rng(7).standard_normal((num_rows, 8)).astype(np.float32).astype(np.float64)
  m, v, vmax = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)
  for t in range(1, ids.shape[0] + 1):
    g = np.zeros_like(p)
    np.add.at(g, ids[t - 1], values[t - 1].astype(np.float64))
    rows = np.unique(ids[t - 1])
    gr = g[rows]
    m[rows] = B1 * m[rows] + (1 - B1) * gr
    v[rows] = B2 * v[rows] + (1 - B2) * gr * gr
    second = v[rows]
    if name != "sparse_adam":
      p[rows] *= 1 - LR * WD
      vmax[rows] = np.maximum(vmax[rows], v[rows])
      second = vmax[rows]
    step_size = LR * np.sqrt(1 - B2**t) / (1 - B1**t)
    p[rows] -= step_size * m[rows] / (np.sqrt(second) + EPS)
  return p


def ulps(a: np.ndarray, b: np.ndarray) -> int:
  ia = a.view(np.int32).astype(np.int64)
  ib = b.view(np.int32).astype(np.int64)
  ia = np.where(ia < 0, np.int64(-(2**31)) - ia, ia)
  ib = np.where(ib < 0, np.int64(-(2**31)) - ib, ib)
  return int(np.max(np.abs(ia - ib))) if a.size else 0


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", type=int, default=50_000)
  parser.add_argument("--batch", type=int, default=65_536)
  parser.add_argument("--steps", type=int, default=20)
  args = parser.parse_args(argv)
  accelerator = jax.devices()[0]
  cpu = jax.devices("cpu")[0]
  print(
    f"device {accelerator.device_kind} ({accelerator.platform}), jax {jax.__version__}, "
    f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
  )
  ids, values = zipf_batches(args.rows, args.batch, args.steps)
  distinct = np.mean([np.unique(batch).size for batch in ids])
  print(f"V={args.rows:,}, B={args.batch:,} Zipf ids ({distinct:,.0f} distinct a step), D=8")
  for name in ("sparse_adam", "sparse_adamw+amsgrad"):
    first = run_steps(name, ids, values, args.rows, accelerator)
    second = run_steps(name, ids, values, args.rows, accelerator)
    on_cpu = run_steps(name, ids, values, args.rows, cpu)
    same = all(np.array_equal(first[k].view(np.int32), second[k].view(np.int32)) for k in first)
    exact = reference(name, ids, values, args.rows)
    print(f"{name}, {args.steps} steps:")
    print(f"  run to run on {accelerator.platform}: {'same bits' if same else 'DIFFERENT bits'}")
    for key in ("param", "mu", "nu"):
      a, c = first[key], on_cpu[key]
      differ = int(np.count_nonzero(a.view(np.int32) != c.view(np.int32)))
      print(
        f"  {key:>5} vs cpu: {differ:,} of {a.size:,} elements differ, at most {ulps(a, c)} ulp"
      )
    scale = np.maximum(np.abs(exact), 1e-3)
    for label, got in (("accelerator", first["param"]), ("cpu", on_cpu["param"])):
      error = np.max(np.abs(got.astype(np.float64) - exact) / scale)
      print(f"  param vs float64 reference ({label}): max relative error {error:.2e}")


if __name__ == "__main__":
  main()
