"""Device time of one sparse_adam step on whatever backend JAX has (GPU, TPU or CPU), with peers.

For each table size V, id stream (Zipf s=1.2 or uniform) and batch of B ids,
D = 64 float32, the time per step of:

- sparse_adam + apply_updates, the path this backend runs by default (CUDA,
  ROCm, TPU: the accelerator step; CPU: the fused kernels), and the same step
  forced onto the accelerator step and onto the generic XLA step (private
  switch; on a GPU the generic step is what main ran before the accelerator
  step existed);
- the plain formulation of issue 15: `jnp.unique(size=B, return_inverse=True)`,
  `segment_sum`, gathers of the distinct rows, three scatters;
- torch.optim.SparseAdam on the same device (when torch is installed; on a GPU
  only when torch sees one);
- dense optax.adam + optax.apply_updates on the dense V x D gradient, where the
  tables fit in memory.

Device time: `--steps` steps run unrolled inside one jitted, donated call, and
the fastest of `--repeats` calls counts (dispatch is amortised; for torch, a
Python loop of steps ended by a device synchronisation). Then NVIDIA's recsys
shape (10 tables of 1.68M x 128 float32, about 1M lookups and 350k distinct rows
a step) with the effective bandwidth over the minimum traffic (read and write
param, m and v of each distinct row, one gradient read per lookup), and the
Flax NNX two-tower step (two V x 64 tables) against nnx.Embed + optax.adam.
All ratios are between timings of this one run.

  python -m benchmarks.bench_accelerator            # the full sizes (a GPU: minutes)
  python -m benchmarks.bench_accelerator --small    # small sizes: a CPU smoke run
"""

import argparse
import contextlib
import functools
import itertools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import sparse

import optax_sparse_adam as osa
from benchmarks._timing import best_seconds, ratio
from optax_sparse_adam._backends import choice

try:
  import torch
except ImportError:  # torch is optional: its rows are left out.
  torch = None

ZIPF_EXPONENT = 1.2
NUM_BATCHES = 4  # distinct gradients cycled through
LR, B1, B2, EPS = 1e-3, 0.9, 0.999, 1e-8


def ids_of(dist: str, num_rows: int, batch: int, rng: np.random.Generator) -> np.ndarray:
  """`batch` ids in [0, num_rows): Zipf ranks (spread over the table by a fixed hash) or uniform."""
  if dist == "uniform":
    return rng.integers(0, num_rows, batch, dtype=np.int64).astype(np.int32)
  # Inverse-CDF sampling of a bounded Zipf law: no V-sized table needed.
  u = rng.random(batch)
  a = 1.0 - ZIPF_EXPONENT
  ranks = ((u * (num_rows**a - 1.0) + 1.0) ** (1.0 / a)).astype(np.int64) - 1
  ranks = np.clip(ranks, 0, num_rows - 1)
  return ((ranks * 2_654_435_761) % num_rows).astype(np.int32)


def time_sparse_adam(num_rows, dim, ids, values, *, steps, repeats, forced=None, opt=None) -> float:
  """Seconds per step of `opt` (sparse_adam) update + apply_updates, `steps` per jitted call."""
  opt = opt or osa.sparse_adam(LR, B1, B2, EPS)

  def run(params, state, ids, values):
    for k in range(steps):
      j = k % ids.shape[0]
      grad = sparse.BCOO((values[j], ids[j][:, None]), shape=(num_rows, dim))
      updates, state = opt.update({"t": grad}, state, params)
      params = osa.apply_updates(params, updates)
    return params, state

  params = {"t": jnp.zeros((num_rows, dim), jnp.float32)}
  carry = [params, opt.init(params)]
  setting = contextlib.nullcontext() if forced is None else choice.choose(forced=forced)
  with setting:
    jitted = jax.jit(run, donate_argnums=(0, 1))

    def call():
      carry[:] = jitted(*carry, ids, values)
      jax.block_until_ready(carry)

    seconds = best_seconds(call, repeats)
  del carry[:]
  return seconds / steps


def time_plain(num_rows, dim, ids, values, *, steps, repeats) -> float:
  """The plain formulation of issue 15, the same arithmetic, `steps` steps per jitted call."""

  def one_step(p, m, v, t, ids, values):
    batch = ids.shape[0]
    unique, inverse = jnp.unique(ids, size=batch, return_inverse=True, fill_value=num_rows)
    g = jax.ops.segment_sum(values, inverse.reshape(-1), num_segments=batch)
    m_rows = m.at[unique].get(mode="fill", fill_value=0)
    v_rows = v.at[unique].get(mode="fill", fill_value=0)
    m_rows = m_rows + (1 - B1) * (g - m_rows)
    v_rows = v_rows + (1 - B2) * (g * g - v_rows)
    t = t + 1
    step_size = LR * jnp.sqrt(1 - B2**t) / (1 - B1**t)
    p = p.at[unique].add(-step_size * m_rows / (jnp.sqrt(v_rows) + EPS), mode="drop")
    m = m.at[unique].set(m_rows, mode="drop")
    v = v.at[unique].set(v_rows, mode="drop")
    return p, m, v, t

  def run(p, m, v, t, ids, values):
    for k in range(steps):
      j = k % ids.shape[0]
      p, m, v, t = one_step(p, m, v, t, ids[j], values[j])
    return p, m, v, t

  carry = [jnp.zeros((num_rows, dim), jnp.float32) for _ in range(3)] + [jnp.float32(0)]
  jitted = jax.jit(run, donate_argnums=(0, 1, 2))

  def call():
    carry[:] = jitted(*carry, ids, values)
    jax.block_until_ready(carry)

  seconds = best_seconds(call, repeats)
  del carry[:]
  return seconds / steps


def time_dense_adam(num_rows, dim, ids, values, *, steps, repeats) -> float:
  """optax.adam + optax.apply_updates on dense V x D gradients (built before timing)."""
  opt = optax.adam(LR, B1, B2, EPS)
  grads = jnp.stack(
    [jnp.zeros((num_rows, dim), jnp.float32).at[ids[j]].add(values[j]) for j in range(2)]
  )

  def run(params, state, grads):
    for k in range(steps):
      updates, state = opt.update(grads[k % 2], state, params)
      params = optax.apply_updates(params, updates)
      # Without a barrier XLA:GPU fuses the unrolled element-wise steps into one pass
      # over the tables, which no training loop (a forward and backward between
      # steps) allows: measured 0.09 ms a step at V = 1M on an H100, below its
      # bandwidth floor for one step.
      params, state = jax.lax.optimization_barrier((params, state))
    return params, state

  params = jnp.zeros((num_rows, dim), jnp.float32)
  carry = [params, opt.init(params)]
  jitted = jax.jit(run, donate_argnums=(0, 1))

  def call():
    carry[:] = jitted(*carry, grads)
    jax.block_until_ready(carry)

  seconds = best_seconds(call, repeats)
  del carry[:]
  return seconds / steps


def torch_device() -> str | None:
  """torch's device matching JAX's backend, or None where torch cannot run there."""
  if torch is None:
    return None
  backend = jax.default_backend()
  if backend == "cpu":
    return "cpu"
  if backend == "gpu" and torch.cuda.is_available():
    return "cuda"
  return None


def time_torch(num_rows, dim, ids, values, *, steps, repeats) -> float | None:
  """torch.optim.SparseAdam.step on uncoalesced sparse gradients, on JAX's device kind."""
  device = torch_device()
  if device is None:
    return None
  param = torch.nn.Parameter(torch.zeros(num_rows, dim, device=device))
  opt = torch.optim.SparseAdam([param], lr=LR, betas=(B1, B2), eps=EPS)
  grads = [
    torch.sparse_coo_tensor(
      torch.from_numpy(np.asarray(ids[j]).astype(np.int64))[None].to(device),
      torch.from_numpy(np.asarray(values[j])).to(device),
      (num_rows, dim),
      check_invariants=False,
    )
    for j in range(ids.shape[0])
  ]

  def synchronize():
    if device == "cuda":
      torch.cuda.synchronize()

  def call():
    with torch.no_grad():
      for k in range(steps):
        param.grad = grads[k % len(grads)]
        opt.step()
    synchronize()

  seconds = best_seconds(call, repeats)
  return seconds / steps


def fits(num_rows: int, dim: int, arrays: int, share: float = 0.5) -> bool:
  """Whether `arrays` float32 V x D arrays fit in `share` of the device's memory (CPU: 8 GiB)."""
  need = arrays * num_rows * dim * 4
  stats = jax.devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit", 8 * 2**30)
  return need <= limit * share


def ms(seconds: float | None) -> str:
  return "—" if seconds is None else f"{seconds * 1e3:9.3f}"


def single_table_rows(args) -> None:
  rng = np.random.default_rng(0)
  paths = [("default path", None), ("accelerator step", choice.ACCELERATOR)]
  paths.append(("generic XLA step", choice.GENERIC_XLA))
  ours_by_size: dict[tuple[str, int], dict[int, float]] = {}
  print(
    f"\nsparse_adam + apply_updates, D={args.dim} float32, ms per step "
    f"({args.steps} steps per jitted call, best of {args.repeats})"
  )
  header = f"{'V':>11} {'ids':>8} {'B':>6} {'distinct':>8} | "
  header += " ".join(f"{name:>17}" for name, _ in paths)
  header += f" {'plain':>9} {'torch':>9} {'dense':>9} | plain/ours torch/ours dense/ours"
  print(header)
  for num_rows in args.vocab:
    for dist in ("zipf", "uniform"):
      for batch in args.batch:
        ids = np.stack([ids_of(dist, num_rows, batch, rng) for _ in range(NUM_BATCHES)])
        values = rng.standard_normal((NUM_BATCHES, batch, args.dim), dtype=np.float32)
        distinct = np.mean([np.unique(i).size for i in ids])
        ids_j, values_j = jnp.asarray(ids), jnp.asarray(values)
        kw = dict(steps=args.steps, repeats=args.repeats)
        times = [
          time_sparse_adam(num_rows, args.dim, ids_j, values_j, forced=forced, **kw)
          for _, forced in paths
        ]
        plain = time_plain(num_rows, args.dim, ids_j, values_j, **kw)
        peer = None if args.no_torch else time_torch(num_rows, args.dim, ids, values, **kw)
        dense = None
        if not args.no_dense and fits(num_rows, args.dim, 6):
          dense = time_dense_adam(num_rows, args.dim, ids_j, values_j, **kw)
        ours = times[0]
        ours_by_size.setdefault((dist, batch), {})[num_rows] = ours
        print(
          f"{num_rows:>11,} {dist:>8} {batch:>6} {distinct:>8.0f} | "
          + " ".join(f"{ms(t):>17}" for t in times)
          + f" {ms(plain)} {ms(peer)} {ms(dense)} | {ratio(plain, ours):>10} "
          f"{ratio(peer, ours):>10} {ratio(dense, ours):>10}",
          flush=True,
        )
  if len(args.vocab) > 1:
    small, large = min(args.vocab), max(args.vocab)
    print(f"\nflat in V (default path): time at V={large:,} / time at V={small:,}")
    for (dist, batch), by_rows in ours_by_size.items():
      print(f"  {dist:>8} B={batch:>6}: {ratio(by_rows[large], by_rows[small])}")


RULES = {
  "sparse_adam": lambda: osa.sparse_adam(LR, B1, B2, EPS),
  "sparse_adamw wd=1e-2": lambda: osa.sparse_adamw(LR, B1, B2, EPS, weight_decay=1e-2),
  "sparse_adam amsgrad": lambda: osa.sparse_adam(LR, B1, B2, EPS, amsgrad=True),
  "sparse_adam per-row": lambda: osa.sparse_adam(LR, B1, B2, EPS, per_row_bias_correction=True),
  "sparse_adam catch-up": lambda: osa.sparse_adam(LR, B1, B2, EPS, catch_up_idle_rows=True),
  "sparse_adam row-wise nu": lambda: osa.sparse_adam(LR, B1, B2, EPS, rowwise_second_moment=True),
  "sparse_sgd momentum": lambda: osa.sparse_sgd(LR, momentum=0.9, lazy_momentum=True),
  "sparse_adagrad": lambda: osa.sparse_adagrad(LR),
  "sparse_rowwise_adagrad": lambda: osa.sparse_rowwise_adagrad(LR),
}


def rule_rows(args) -> None:
  """Every rule and Adam option on the default path, at the smallest V and B."""
  num_rows, batch = min(args.vocab), min(args.batch)
  rng = np.random.default_rng(2)
  print(f"\nevery rule, default path, V={num_rows:,}, B={batch}, D={args.dim}: ms per step")
  print(f"{'rule':>24} {'zipf':>9} {'uniform':>9} | ratio to sparse_adam")
  streams = {}
  for dist in ("zipf", "uniform"):
    ids = np.stack([ids_of(dist, num_rows, batch, rng) for _ in range(NUM_BATCHES)])
    values = rng.standard_normal((NUM_BATCHES, batch, args.dim), dtype=np.float32)
    streams[dist] = jnp.asarray(ids), jnp.asarray(values)
  kw = dict(steps=args.steps, repeats=args.repeats)
  base = None
  for name, make in RULES.items():
    times = [
      time_sparse_adam(num_rows, args.dim, *streams[dist], opt=make(), **kw)
      for dist in ("zipf", "uniform")
    ]
    base = base or times
    ratios = " ".join(ratio(t, b) for t, b in zip(times, base, strict=True))
    print(f"{name:>24} {ms(times[0])} {ms(times[1])} | {ratios}", flush=True)


def candidate_rows(lookups: int, distinct: float) -> int:
  """The pool size c whose `lookups` uniform draws hit `distinct` rows: c (1 - e^(-lookups/c))."""
  low, high = distinct, 100.0 * distinct
  for _ in range(100):
    mid = (low + high) / 2
    if mid * -math.expm1(-lookups / mid) < distinct:
      low = mid
    else:
      high = mid
  return int(round(high))


def recsys_rows(args) -> None:
  """NVIDIA recsys-examples' shape: many tables, one step, effective bandwidth."""
  tables, num_rows, dim = args.recsys_tables, args.recsys_rows, args.recsys_dim
  lookups, distinct_target = args.recsys_lookups, args.recsys_distinct
  # param, m and v, donated: the step's other arrays are lookup-sized.
  if not fits(num_rows * tables, dim, 3, share=0.8):
    print(f"\nrecsys shape: {tables} x {num_rows:,} x {dim} does not fit here; skipped")
    return
  rng = np.random.default_rng(1)
  per_table = lookups // tables
  pool = candidate_rows(per_table, distinct_target / tables)
  ids, values, distinct = {}, {}, 0
  for t in range(tables):
    # Lookups drawn uniformly from `pool` candidate rows: about the target number of
    # distinct rows (350k of 1M lookups over 10 tables at the full shape).
    candidates = rng.choice(num_rows, pool, replace=False).astype(np.int32)
    batch = np.stack([rng.choice(candidates, per_table) for _ in range(2)])
    ids[f"table_{t}"] = jnp.asarray(batch)
    values[f"table_{t}"] = jnp.asarray(rng.standard_normal((2, per_table, dim), dtype=np.float32))
    distinct += np.mean([np.unique(b).size for b in batch])
  opt = osa.sparse_adam(LR, B1, B2, EPS)
  steps = max(1, args.steps // 2)

  def run(params, state, ids, values):
    for k in range(steps):
      grads = {
        name: sparse.BCOO((values[name][k % 2], ids[name][k % 2][:, None]), shape=(num_rows, dim))
        for name in params
      }
      updates, state = opt.update(grads, state, params)
      params = osa.apply_updates(params, updates)
    return params, state

  params = {name: jnp.zeros((num_rows, dim), jnp.float32) for name in ids}
  carry = [params, opt.init(params)]
  jitted = jax.jit(run, donate_argnums=(0, 1))

  def call():
    carry[:] = jitted(*carry, ids, values)
    jax.block_until_ready(carry)

  seconds = best_seconds(call, args.repeats) / steps
  del carry[:]
  min_bytes = distinct * dim * 4 * 6 + per_table * tables * dim * 4
  print(
    f"\nrecsys shape: {tables} tables x {num_rows:,} x {dim} float32, "
    f"{per_table * tables:,} lookups, {distinct:,.0f} distinct rows per step"
  )
  print(
    f"  sparse_adam + apply_updates: {seconds * 1e3:.3f} ms per step; minimum traffic "
    f"{min_bytes / 1e9:.3f} GB -> effective bandwidth {min_bytes / seconds / 1e12:.3f} TB/s"
  )


def nnx_rows(args) -> None:
  """The Flax NNX two-tower step (two tables) against nnx.Embed + optax.adam."""
  try:
    from flax import nnx

    from benchmarks._two_tower import TwoTower, dense_step, sparse_step
  except ImportError:
    print("\nFlax NNX two-tower: flax is not installed; skipped")
    return
  print(f"\nFlax NNX two-tower step, 2 tables x D={args.dim}, batch {args.nnx_batch}")
  for num_rows in args.nnx_vocab:
    rng = np.random.default_rng(2)
    batches = [
      (
        jnp.asarray(ids_of("zipf", num_rows, args.nnx_batch, rng)),
        jnp.asarray(ids_of("zipf", num_rows, args.nnx_batch, rng)),
        jnp.asarray(rng.standard_normal(args.nnx_batch, dtype=np.float32)),
      )
      for _ in range(NUM_BATCHES)
    ]
    timings: dict[tuple[str, bool], float | None] = {}
    for (name, embed_cls, step), cached in itertools.product(
      (
        ("SparseEmbed + sparse_adam", osa.SparseEmbed, sparse_step),
        ("nnx.Embed + optax.adam", nnx.Embed, dense_step),
      ),
      (False, True),
    ):
      if embed_cls is nnx.Embed and not fits(num_rows * 2, args.dim, 5):
        timings[name, cached] = None
        continue
      model = TwoTower(num_rows, num_rows, args.dim, 64, embed_cls=embed_cls, rngs=nnx.Rngs(0))
      if embed_cls is osa.SparseEmbed:
        tx = optax.multi_transform(
          {"sparse": osa.sparse_adam(LR), "dense": optax.adam(LR)}, osa.table_labels(model)
        )
        opt = osa.SparseOptimizer(model, tx, wrt=nnx.Param)
      else:
        opt = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)

      # nnx.cached_partial skips nnx.jit's walk over the model's graph at each call,
      # which on a GPU can cost more than the step's device time.
      run = nnx.cached_partial(step, model, opt) if cached else functools.partial(step, model, opt)

      def call(run=run, batches=batches):
        for k in range(args.steps):
          loss = run(*batches[k % len(batches)])
        jax.block_until_ready(loss)

      timings[name, cached] = best_seconds(call, args.repeats) / args.steps
    for cached in (False, True):
      sparse_s = timings["SparseEmbed + sparse_adam", cached]
      dense_s = timings["nnx.Embed + optax.adam", cached]
      how = "nnx.cached_partial" if cached else "nnx.jit"
      print(
        f"  V={num_rows:>11,} {how:>18}: sparse {ms(sparse_s)} ms, dense {ms(dense_s)} ms, "
        f"dense/sparse {ratio(dense_s, sparse_s)}",
        flush=True,
      )


def describe_machine() -> str:
  device = jax.devices()[0]
  text = f"jax {jax.__version__}, backend {jax.default_backend()}, device {device.device_kind}"
  if torch is not None:
    text += f", torch {torch.__version__} on {torch_device() or 'no matching device'}"
  return text + f", {os.cpu_count()} CPUs"


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--small", action="store_true", help="small sizes: a CPU smoke run")
  parser.add_argument("--vocab", type=int, nargs="+", help="table sizes V")
  parser.add_argument("--batch", type=int, nargs="+", help="ids per gradient B")
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--steps", type=int, default=10, help="steps per jitted call")
  parser.add_argument("--repeats", type=int, default=5, help="timed calls; the fastest counts")
  parser.add_argument("--no-torch", action="store_true")
  parser.add_argument("--no-dense", action="store_true")
  parser.add_argument("--no-rules", action="store_true")
  parser.add_argument("--no-recsys", action="store_true")
  parser.add_argument("--no-nnx", action="store_true")
  args = parser.parse_args(argv)
  if args.small:
    args.vocab = args.vocab or [10_000, 100_000]
    args.batch = args.batch or [256, 2048]
    args.dim = 16 if args.dim == 64 else args.dim
    args.steps, args.repeats = min(args.steps, 3), min(args.repeats, 2)
    args.recsys_tables, args.recsys_rows, args.recsys_dim = 2, 20_000, 32
    args.recsys_lookups, args.recsys_distinct = 10_000, 3_500
    args.nnx_vocab, args.nnx_batch = [10_000], 256
  else:
    args.vocab = args.vocab or [1_000_000, 10_000_000]
    args.batch = args.batch or [4096, 65536]
    args.recsys_tables, args.recsys_rows, args.recsys_dim = 10, 1_680_000, 128
    args.recsys_lookups, args.recsys_distinct = 1_000_000, 350_000
    args.nnx_vocab, args.nnx_batch = [1_000_000, 10_000_000], 4096
  return args


def main(argv=None) -> None:
  args = parse_args(argv)
  print(describe_machine())
  single_table_rows(args)
  if not args.no_rules:
    rule_rows(args)
  if not args.no_recsys:
    recsys_rows(args)
  if not args.no_nnx:
    nnx_rows(args)


if __name__ == "__main__":
  main()
