"""The routed step of a row-sharded 16-bit table against the float32 table's, on 4 CPU devices.

One jitted, donated `sparse_adam` step (float32 moments, `update` + `apply_updates`)
of a table split by rows over 4 forced CPU devices, routed (`osa.sharded_routing`):
a float32 table; bfloat16 and float16 tables rounded stochastically
(`param_rounding="stochastic"`, the gradient in the table's dtype); a bfloat16 table
rounded to nearest. Each is timed against the float32 table's step in interleaved
rounds (one run of `--steps` steps of each in turn, cycling 8 batches), and printed is
the median (range) of the per-round ratio, with the CPU kernels each compiled step
calls. Rows are placed in blocks (stochastic rounding keys on block rows): Zipf ids
then overflow the routing's capacity and take the all-gather path (warned).

  python -m benchmarks.bench_routed_tables                 # V = 1M, D = 64, B = 4096
  python -m benchmarks.bench_routed_tables --dist uniform
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import sparse  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402
from benchmarks import _common as c  # noqa: E402

# (label, table dtype, param_rounding); the first is the reference.
CASES = [
  ("float32 table", jnp.float32, "nearest"),
  ("bfloat16 table, stochastic", jnp.bfloat16, "stochastic"),
  ("float16 table, stochastic", jnp.float16, "stochastic"),
  ("bfloat16 table, nearest", jnp.bfloat16, "nearest"),
]


def _stepper(dtype, rounding, batches, *, num_rows, dim, mesh):
  """`(run(n) -> seconds per step, the kernels the compiled step calls)`."""
  opt = osa.sparse_adam(1e-3, mu_dtype="float32", nu_dtype="float32", param_rounding=rounding)

  def step(table, state, ids, rows):
    grad = sparse.BCOO((rows.astype(table.dtype), ids[:, None]), shape=table.shape)
    updates, state = opt.update({"t": grad}, state, {"t": table})
    return osa.apply_updates({"t": table}, updates)["t"], state

  def put(x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))

  with osa.sharded_routing(True):
    jitted = jax.jit(step, donate_argnums=(0, 1))
    table = put(jnp.zeros((num_rows, dim), dtype), P("x", None))
    state = opt.init({"t": table})
    data = [(put(jnp.asarray(i), P("x")), put(jnp.asarray(r), P("x", None))) for i, r in batches]
    hlo = jitted.lower(table, state, *data[0]).compile().as_text()
  box = {"table": table, "state": state}

  def run(n: int) -> float:
    with osa.sharded_routing(True):  # the switch is part of the cache key
      start = time.perf_counter()
      for k in range(n):
        box["table"], box["state"] = jitted(box["table"], box["state"], *data[k % len(data)])
      jax.block_until_ready(box["table"])
      return (time.perf_counter() - start) / n

  run(3)  # warm up
  return run, sorted(set(re.findall(r"optax_sparse_adam_\w+", hlo)))


def main(argv=None) -> None:
  parser = c.table_parser(__doc__)  # --vocab, --dim, --batch (ids a step, all devices)
  parser.add_argument("--steps", type=int, default=10, help="steps per timed run")
  parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
  parser.add_argument("--dist", default="zipf", choices=("zipf", "uniform"), help="ids")
  args = parser.parse_args(argv)
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("x",), axis_types=(AxisType.Auto,))
  ids = c.id_batches(args.dist, args.vocab, args.batch)
  values = c.grad_values(args.batch, args.dim)
  batches = [
    (np.asarray(i, np.int32), np.asarray(v, np.float32)) for i, v in zip(ids, values, strict=True)
  ]
  runs = {}
  for label, dtype, rounding in CASES:
    runs[label], called = _stepper(
      dtype, rounding, batches, num_rows=args.vocab, dim=args.dim, mesh=mesh
    )
    print(f"  {label}: the compiled step calls {', '.join(called) or 'no CPU kernel'}")
  times = {label: [] for label in runs}
  for _ in range(args.rounds):
    for label, run in runs.items():
      times[label].append(run(args.steps))
  base = times[CASES[0][0]]
  print(
    f"{c.machine()}; routed over {len(devices)} forced CPU devices, V={args.vocab:,} "
    f"D={args.dim} B={args.batch} ({args.dist} ids); median (range) of {args.rounds} rounds"
  )
  for label, seconds in times.items():
    ratios = [t / b for t, b in zip(seconds, base, strict=True)]
    print(
      f"  {label:30s} {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
      f" x the float32 table's routed step; fastest {min(seconds) * 1e3:.2f} ms"
    )


if __name__ == "__main__":
  main()
