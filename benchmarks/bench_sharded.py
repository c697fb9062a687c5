"""Sharded sparse_adam step against the single-device step, on 8 forced CPU devices.

One training step of an embedding table (gather rows, gradient of the rows as a
BCOO, sparse_adam, scatter-add), jitted with the table and its state donated,
in five layouts:

  1 device            everything on one device (the reference);
  rows                table, m, v split by rows, P('x', None), batch over 'x';
  columns             split on the embedding dim, P(None, 'x'), batch over 'x';
  replicated          table on every device, data-parallel batch;
  replicated, dense   the same with a dense gradient and optax.adam: the usual
                      data-parallel recipe, for contrast.

For each it prints the step time (median over interleaved rounds), the memory
the compiled step holds per device (its inputs plus scratch, from XLA's
memory analysis), and the bytes of the arrays its collectives produce (from
the compiled HLO). The last two are the compiler's own accounting and carry
over to GPUs and TPUs; the times do not (see the note printed at the end).

  python -m benchmarks.bench_sharded              # about a minute
  python -m benchmarks.bench_sharded --rows 1000000 --rounds 10

Weak scaling (`--weak-scaling`): a fixed local batch (2048 ids per device) on
N = 1, 2, 4, 8 forced CPU devices, one process per N, the table row-sharded
P('x', None); the step left to XLA's partitioner and the routed step
(`osa.sharded_routing`) side by side: collective bytes per device (from the
compiled HLO; the routed step's overflow path counted apart), scratch memory per
device and step time, for the optimizer step (`update` + `apply_updates`) and
for the whole train step (lookup, gradient, update, apply; the lookup is
`osa.sharded_lookup`, which is `table[ids]` where routing is off).

  python -m benchmarks.bench_sharded --weak-scaling     # a few minutes

Skew (`--skew`): the routed train step (`osa.sharded_lookup`, gradient, update,
apply) with 2048 ids per device on N = 2, 4, 8 forced CPU devices, uniform ids and
Zipf ids (exponents 1.05, 1.2) over a vocabulary sorted by frequency (id 0 the
hottest), the rows placed in blocks and cyclically (`row_placement="cyclic"`):
the share of steps that overflowed (`osa.routing_stats`), bytes per device per
step (the routed path's, plus the overflow path's on the steps that took it),
and step times as ratios within one N. Then (`--compile-devices`) the routed
train step compiled, not run, for N up to 64: its bytes per device.

  python -m benchmarks.bench_sharded --skew              # a few minutes
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import sparse  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402

COLLECTIVE = re.compile(
  r"=\s*(?P<type>.*?)\s+(?P<op>all-gather|all-reduce|all-to-all|reduce-scatter|"
  r"collective-permute)(?:-start)?\("
)
ARRAY_TYPE = re.compile(r"(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=262_144)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--batch", type=int, default=8192)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps-per-round", type=int, default=5)
  parser.add_argument("--weak-scaling", action="store_true", help="the weak-scaling mode")
  parser.add_argument("--local-batch", type=int, default=2048, help="ids per device (weak scaling)")
  parser.add_argument("--ids", choices=("uniform", "zipf"), default="uniform")
  parser.add_argument("--skew", action="store_true", help="the skewed-ids mode")
  parser.add_argument("--skew-steps", type=int, default=8, help="batches per workload (skew)")
  parser.add_argument(
    "--compile-devices", type=int, nargs="*", default=[2, 4, 8, 16, 32, 64], help="(skew)"
  )
  parser.add_argument("--plot", default=None, help="(skew) draw bytes per device vs N here (png)")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--skew-worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
  return parser.parse_args()


def collective_bytes(hlo_text, *, skip_scope=None):
  """Total bytes of the arrays that the collectives of an HLO module produce.

  Collectives whose op name holds `skip_scope` (e.g. the routed step's overflow
  path) are left out.
  """
  total = 0
  for line in hlo_text.splitlines():
    match = COLLECTIVE.search(line)
    if match is None or (skip_scope is not None and skip_scope in line):
      continue
    for array in ARRAY_TYPE.finditer(match["type"]):
      dims = [int(d) for d in array["dims"].split(",") if d]
      total += int(np.prod(dims)) * DTYPE_BYTES.get(array["dtype"], 4)
  return total


def loss_of_rows(rows, targets):
  return jnp.mean((jnp.sum(rows, axis=-1) - targets) ** 2)


def sparse_step(optimizer):
  def step(table, state, ids, targets):
    # Gradient with respect to the gathered rows: with the ids it is the
    # table's gradient as a BCOO, never a dense table-sized array.
    grad_rows = jax.grad(loss_of_rows)(table[ids], targets)
    grad = sparse.BCOO((grad_rows, ids[:, None]), shape=table.shape)
    updates, state = optimizer.update({"table": grad}, state)
    return osa.apply_updates({"table": table}, updates)["table"], state

  return step


def dense_step(optimizer):
  def step(table, state, ids, targets):
    grad = jax.grad(lambda t: loss_of_rows(t[ids], targets))(table)
    updates, state = optimizer.update({"table": grad}, state)
    return optax.apply_updates({"table": table}, updates)["table"], state

  return step


class Layout:
  """One step function with its inputs placed on devices, compiled once."""

  def __init__(self, name, step, optimizer, table, batch, put_table, put_batch, steps_scale=1.0):
    self.name = name
    self.steps_scale = steps_scale
    self.table = put_table(table)
    self.state = optimizer.init({"table": self.table})
    self.batch = [put_batch(x) for x in batch]
    self.step = jax.jit(step, donate_argnums=(0, 1))
    self.run(1)  # compile and warm up
    compiled = self.step.lower(self.table, self.state, *self.batch).compile()
    memory = compiled.memory_analysis()
    self.input_bytes = memory.argument_size_in_bytes
    self.scratch_bytes = memory.temp_size_in_bytes
    self.collective_bytes = collective_bytes(compiled.as_text())
    self.seconds = []

  def run(self, steps):
    for _ in range(steps):
      self.table, self.state = self.step(self.table, self.state, *self.batch)
    jax.block_until_ready((self.table, self.state))

  def time(self, steps):
    steps = max(1, round(steps * self.steps_scale))
    start = time.perf_counter()
    self.run(steps)
    self.seconds.append((time.perf_counter() - start) / steps)


def optimizer_step(optimizer):
  """`update` + `apply_updates` from the gathered rows' gradient (no lookup)."""

  def step(table, state, ids, grad_rows):
    grad = sparse.BCOO((grad_rows, ids[:, None]), shape=table.shape)
    updates, state = optimizer.update({"table": grad}, state)
    return osa.apply_updates({"table": table}, updates)["table"], state

  return step


def routed_train_step(optimizer):
  """`sparse_step` with the lookup `osa.sharded_lookup` (routed where the step is)."""

  def step(table, state, ids, targets):
    grad_rows = jax.grad(loss_of_rows)(osa.sharded_lookup(table, ids), targets)
    grad = sparse.BCOO((grad_rows, ids[:, None]), shape=table.shape)
    updates, state = optimizer.update({"table": grad}, state)
    return osa.apply_updates({"table": table}, updates)["table"], state

  return step


def nnx_train_step(args, table, ids, targets, mesh):
  """The whole Flax NNX train step (`SparseEmbed` lookup, `sparse_value_and_grad`,
  `SparseOptimizer`), partitioned and routed; None without flax."""
  try:
    from flax import nnx
  except ImportError:
    return None
  from optax_sparse_adam._core.sharded import routed

  class Model(nnx.Module):
    def __init__(self):
      self.embed = osa.SparseEmbed(args.rows, args.dim, rngs=nnx.Rngs(0))

    def __call__(self, ids):
      return self.embed(ids)

  def loss_fn(model, ids, targets):
    return loss_of_rows(model(ids), targets)

  def put(x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))

  runs = []
  for path in ("partitioned", "routed"):
    routing_on = path == "routed"
    with osa.sharded_routing(routing_on):  # routed: from the partitioner's shardings
      model = Model()
      model.embed.embedding.set_value(put(table, P("x", None)))
      optimizer = osa.SparseOptimizer(model, osa.sparse_adam(1e-3), wrt=nnx.Param)

      @nnx.jit(donate_argnums=(0, 1))
      def step(model, optimizer, ids, targets):
        loss, grads = osa.sparse_value_and_grad(loss_fn)(model, ids, targets)
        optimizer.update(model, grads)
        return loss

      batch = (put(ids, P("x")), put(targets, P("x")))
      compiled = step.lower(model, optimizer, *batch).compile()
      hlo = compiled.as_text()
      step(model, optimizer, *batch).block_until_ready()
      seconds = []
      for _ in range(args.rounds):
        start = time.perf_counter()
        step(model, optimizer, *batch).block_until_ready()
        seconds.append(time.perf_counter() - start)
    runs.append(
      {
        "what": "NNX train step",
        "path": path,
        "bytes": collective_bytes(hlo, skip_scope=routed.OVERFLOW_SCOPE),
        "overflow_bytes": collective_bytes(hlo)
        - collective_bytes(hlo, skip_scope=routed.OVERFLOW_SCOPE),
        "scratch": compiled.memory_analysis().temp_size_in_bytes,
        "ms": 1e3 * statistics.median(seconds),
      }
    )
  return runs


def weak_scaling_worker(args):
  """One N: measures the partitioned and the routed step; prints one JSON line."""
  from optax_sparse_adam._core.sharded import routed, routing

  num_devices = jax.device_count()
  rng = np.random.default_rng(0)
  batch = num_devices * args.local_batch
  table = rng.normal(size=(args.rows, args.dim)).astype(np.float32)
  if args.ids == "zipf":
    popularity = 1.0 / np.arange(1, args.rows + 1) ** 1.05
    ids = rng.choice(args.rows, size=batch, p=popularity / popularity.sum())
  else:
    ids = rng.integers(0, args.rows, batch)
  ids = ids.astype(np.int32)
  targets = rng.normal(size=batch).astype(np.float32)
  grad_rows = rng.normal(size=(batch, args.dim)).astype(np.float32)
  mesh = jax.make_mesh((num_devices,), ("x",), axis_types=(AxisType.Auto,))
  put_table = lambda x: jax.device_put(x, NamedSharding(mesh, P("x", None)))  # noqa: E731

  def put_batch(x):
    return jax.device_put(x, NamedSharding(mesh, P("x", *([None] * (x.ndim - 1)))))

  optimizer = osa.sparse_adam(1e-3)
  steps = {
    "optimizer step": (optimizer_step(optimizer), (ids, grad_rows)),
    # The lookup: XLA's table[ids] when left to XLA, osa.sharded_lookup when routed.
    "train step": (routed_train_step(optimizer), (ids, targets)),
  }
  results = []
  nnx_run = nnx_train_step(args, table, ids, targets, mesh)
  for what, (step, inputs) in steps.items():
    for path in ("partitioned", "routed"):
      routing_on = path == "routed"
      with osa.sharded_routing(routing_on):  # routed: from the partitioner's shardings
        jitted = jax.jit(step, donate_argnums=(0, 1))
        table_on = put_table(table)
        state = optimizer.init({"table": table_on})
        batch_on = [put_batch(x) for x in inputs]
        compiled = jitted.lower(table_on, state, *batch_on).compile()
        hlo = compiled.as_text()
        memory = compiled.memory_analysis()
        table_on, state = jitted(table_on, state, *batch_on)  # warm up
        jax.block_until_ready(table_on)
        seconds = []
        for _ in range(args.rounds):
          start = time.perf_counter()
          table_on, state = jitted(table_on, state, *batch_on)
          jax.block_until_ready(table_on)
          seconds.append(time.perf_counter() - start)
      results.append(
        {
          "what": what,
          "path": path,
          "bytes": collective_bytes(hlo, skip_scope=routed.OVERFLOW_SCOPE),
          "overflow_bytes": collective_bytes(hlo)
          - collective_bytes(hlo, skip_scope=routed.OVERFLOW_SCOPE),
          "scratch": memory.temp_size_in_bytes,
          "ms": 1e3 * statistics.median(seconds),
        }
      )
  if nnx_run is not None:
    results.extend(nnx_run)
  # Whether the routed step overflows on this batch (some device holds more
  # distinct rows for one owner than the capacity), counted here in NumPy.
  capacity = routing.capacity(args.local_batch, num_devices, routed.current().capacity_factor)
  rows_per_shard = args.rows // num_devices
  overflows = any(
    np.max(np.bincount(np.unique(local) // rows_per_shard, minlength=num_devices)) > capacity
    for local in ids.reshape(num_devices, args.local_batch)
  )
  print(json.dumps({"devices": num_devices, "overflows": bool(overflows), "runs": results}))


def weak_scaling(args):
  """Runs one worker process per N and prints the table."""
  reports = []
  for num_devices in (1, 2, 4, 8):
    env = dict(
      os.environ,
      XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}",
      JAX_PLATFORMS="cpu",
    )
    command = [sys.executable, "-m", "benchmarks.bench_sharded", "--worker"]
    command += ["--rows", str(args.rows), "--dim", str(args.dim), "--rounds", str(args.rounds)]
    command += ["--local-batch", str(args.local_batch), "--ids", args.ids]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
      raise RuntimeError(f"the worker for N={num_devices} failed:\n{done.stderr[-3000:]}")
    reports.append(json.loads(done.stdout.strip().splitlines()[-1]))
  local_batch_bytes = args.local_batch * (4 + 4 * args.dim)
  print(
    f"\nWeak scaling: table {args.rows} x {args.dim} float32 row-sharded P('x', None), "
    f"{args.local_batch} {args.ids} ids per device; one local batch of entries (ids + rows) "
    f"= {local_batch_bytes / 1e6:.2f} MB; median of {args.rounds} steps\n"
  )
  header = (
    f"{'step':<15} {'path':<12} {'N':>2} | {'collective MB/dev':>17} {'x local batch':>13} "
    f"{'overflow-path MB':>16} | {'scratch MiB/dev':>15} | {'step ms':>8}"
  )
  print(header)
  print("-" * len(header))
  kinds = [
    k
    for k in ("optimizer step", "train step", "NNX train step")
    if any(r["what"] == k for r in reports[0]["runs"])
  ]
  for what in kinds:
    for path in ("partitioned", "routed"):
      for report in reports:
        run = next(r for r in report["runs"] if r["what"] == what and r["path"] == path)
        print(
          f"{what:<15} {path:<12} {report['devices']:>2} | {run['bytes'] / 1e6:>17.3f} "
          f"{run['bytes'] / local_batch_bytes:>12.2f}x {run['overflow_bytes'] / 1e6:>16.3f} | "
          f"{run['scratch'] / 2**20:>15.1f} | {run['ms']:>8.1f}"
        )
  for what in kinds:
    by_n = {
      r["devices"]: next(x for x in r["runs"] if x["what"] == what and x["path"] == "routed")
      for r in reports
    }
    part = {
      r["devices"]: next(x for x in r["runs"] if x["what"] == what and x["path"] == "partitioned")
      for r in reports
    }
    print(
      f"\n{what}: bytes per device N=8 / N=2: routed {by_n[8]['bytes'] / by_n[2]['bytes']:.2f}x, "
      f"partitioned {part[8]['bytes'] / part[2]['bytes']:.2f}x"
    )
  overflowing = [r["devices"] for r in reports if r["overflows"]]
  print(f"routed steps that overflow on this batch: N = {overflowing or 'none'}")
  print(
    "\nBytes and scratch are the compiler's accounting of the per-device program; the\n"
    "times are threads of one process on this machine's cores (see the default mode's note)."
  )


SKEW_IDS = {"uniform": None, "zipf 1.05": 1.05, "zipf 1.2": 1.2}


def sorted_zipf(exponent, rows, size, rng):
  """Ids of a vocabulary sorted by frequency: uniform (exponent None) or Zipf, id 0 hottest."""
  if exponent is None:
    return rng.integers(0, rows, size).astype(np.int32)
  cdf = np.cumsum(1.0 / np.arange(1, rows + 1) ** exponent)
  return np.minimum(np.searchsorted(cdf, rng.random(size) * cdf[-1]), rows - 1).astype(np.int32)


def skew_worker(args):
  """One N: per placement and ids, overflowing steps, bytes per device and step times."""
  from optax_sparse_adam._core.sharded import routed

  num_devices = jax.device_count()
  batch = num_devices * args.local_batch
  mesh = jax.make_mesh((num_devices,), ("x",), axis_types=(AxisType.Auto,))
  optimizer = osa.sparse_adam(1e-3)
  step = routed_train_step(optimizer)
  put_table = lambda x: jax.device_put(x, NamedSharding(mesh, P("x", None)))  # noqa: E731
  put_batch = lambda x: jax.device_put(x, NamedSharding(mesh, P("x")))  # noqa: E731
  if args.compile_only:
    with osa.sharded_routing(row_placement="cyclic"):
      table = jax.ShapeDtypeStruct(
        (args.rows, args.dim), jnp.float32, sharding=NamedSharding(mesh, P("x", None))
      )
      state = jax.eval_shape(optimizer.init, {"table": table})

      def spec(x):  # arrays with a row per table row split like it, counters replicated
        split = x.ndim and x.shape[0] == args.rows
        return P("x", *[None] * (x.ndim - 1)) if split else P()

      state = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec(x))),
        state,
      )
      ids = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=NamedSharding(mesh, P("x")))
      hlo = (
        jax.jit(step).lower(table, state, ids, ids.update(dtype=jnp.float32)).compile().as_text()
      )
    print(
      json.dumps(
        {"devices": num_devices, "bytes": collective_bytes(hlo, skip_scope=routed.OVERFLOW_SCOPE)}
      )
    )
    return
  rng = np.random.default_rng(0)
  table0 = rng.normal(size=(args.rows, args.dim)).astype(np.float32)
  workloads = {
    kind: [
      (sorted_zipf(exponent, args.rows, batch, rng), rng.normal(size=batch).astype(np.float32))
      for _ in range(args.skew_steps + 1)
    ]
    for kind, exponent in SKEW_IDS.items()
  }
  setups = {}
  for placement in ("block", "cyclic"):
    with osa.sharded_routing(row_placement=placement):
      initial = osa.to_cyclic_rows(table0, num_devices) if placement == "cyclic" else table0
      jitted = jax.jit(step, donate_argnums=(0, 1))
      table = put_table(initial)
      state = optimizer.init({"table": table})
      first = [put_batch(x) for x in workloads["uniform"][0]]
      hlo = jitted.lower(table, state, *first).compile().as_text()
      routed_bytes = collective_bytes(hlo, skip_scope=routed.OVERFLOW_SCOPE)
      setups[placement] = [jitted, table, state, routed_bytes, collective_bytes(hlo) - routed_bytes]
  placed = {kind: [[put_batch(x) for x in b] for b in bs] for kind, bs in workloads.items()}
  seconds = {(p, k): [] for p in setups for k in placed}
  counts = {(p, k): np.zeros(3) for p in setups for k in placed}
  # Rounds interleave the workloads (one step each, the first a warm-up), so the machine's
  # load falls alike on every one; each step's overflow counted on its own.
  for round_index in range(args.skew_steps + 1):
    for placement, setup in setups.items():
      for kind, batches in placed.items():
        jitted, table, state = setup[:3]
        osa.routing_stats(reset=True)
        start = time.perf_counter()
        with osa.sharded_routing(row_placement=placement):  # the switch is in the cache key
          table, state = jitted(table, state, *batches[round_index % len(batches)])
        jax.block_until_ready(table)
        elapsed = time.perf_counter() - start
        stats = osa.routing_stats(reset=True)
        setup[1], setup[2] = table, state
        if round_index:
          seconds[placement, kind].append(elapsed)
          counts[placement, kind] += (stats.steps, stats.overflowed_steps, stats.overflowed_lookups)
  results = []
  for (placement, kind), (steps, steps_over, lookups_over) in counts.items():
    routed_bytes, overflow_bytes = setups[placement][3:]
    results.append(
      {
        "placement": placement,
        "ids": kind,
        "overflowed_steps": steps_over / steps,
        "overflowed_lookups": lookups_over / steps,
        "routed_bytes": routed_bytes,
        # The lookup and the step overflow apart: half the overflow path's bytes each.
        "bytes": routed_bytes + (steps_over + lookups_over) / 2 / steps * overflow_bytes,
        "ms": 1e3 * statistics.median(seconds[placement, kind]),
      }
    )
  print(json.dumps({"devices": num_devices, "runs": results}))


def skew(args):
  """Runs one skew worker per N, then the compile-only workers, and prints the tables."""

  def worker(num_devices, *extra):
    env = dict(
      os.environ,
      XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}",
      JAX_PLATFORMS="cpu",
    )
    command = [sys.executable, "-m", "benchmarks.bench_sharded", "--skew-worker", *extra]
    command += ["--rows", str(args.rows), "--dim", str(args.dim)]
    command += ["--local-batch", str(args.local_batch), "--skew-steps", str(args.skew_steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
      raise RuntimeError(f"the worker for N={num_devices} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])

  local_batch_bytes = args.local_batch * (4 + 4 * args.dim)
  print(
    f"\nSkewed ids: routed train step (sharded_lookup, grad, update, apply), table "
    f"{args.rows} x {args.dim} float32 split P('x', None), {args.local_batch} ids per device, "
    f"{args.skew_steps} batches per line; one local batch of entries = "
    f"{local_batch_bytes / 1e6:.2f} MB; bytes: per device per step, the overflow path's "
    "counted on the steps that took it; ms: median over interleaved rounds, a ratio to "
    "uniform ids in blocks within the same N\n"
  )
  header = (
    f"{'placement':<9} {'ids':<9} {'N':>2} | {'overflowed':>10} | {'MB/dev':>7} "
    f"{'x local batch':>13} | {'ms':>7} {'vs uniform block':>16}"
  )
  print(header)
  print("-" * len(header))
  reports = [worker(n) for n in (2, 4, 8)]
  for placement in ("block", "cyclic"):
    for kind in SKEW_IDS:
      for report in reports:
        runs = {(r["placement"], r["ids"]): r for r in report["runs"]}
        run, base = runs[placement, kind], runs["block", "uniform"]
        print(
          f"{placement:<9} {kind:<9} {report['devices']:>2} | "
          f"{100 * run['overflowed_steps']:>9.0f}% | {run['bytes'] / 1e6:>7.3f} "
          f"{run['bytes'] / local_batch_bytes:>12.2f}x | {run['ms']:>7.1f} "
          f"{run['ms'] / base['ms']:>15.2f}x"
        )
  for placement in ("block", "cyclic"):
    for kind in SKEW_IDS:
      by_n = {
        r["devices"]: next(x for x in r["runs"] if (x["placement"], x["ids"]) == (placement, kind))
        for r in reports
      }
      print(f"{placement} {kind}: bytes N=8 / N=2 {by_n[8]['bytes'] / by_n[2]['bytes']:.2f}x")
  if args.compile_devices:
    compiled = [worker(n, "--compile-only") for n in args.compile_devices]
    print(
      "\ncompiled routed train step (cyclic; the routed path, as for blocks), bytes per device:"
    )
    for report in compiled:
      print(
        f"  N = {report['devices']:>2}: {report['bytes'] / 1e6:.3f} MB = "
        f"{report['bytes'] / local_batch_bytes:.2f}x local batch, "
        f"{report['bytes'] / compiled[0]['bytes']:.2f}x N = {compiled[0]['devices']}"
      )
  found = {"skew": reports, "compiled": compiled if args.compile_devices else []}
  print(json.dumps(found))
  if args.plot:
    plot_skew(found, local_batch_bytes, args)


def plot_skew(found, local_batch_bytes, args):
  """Bytes per device per step against N, per placement and ids; the compiled routed path."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.2))
  styles = {"uniform": "o", "zipf 1.05": "s", "zipf 1.2": "^"}
  for placement, line in (("block", "--"), ("cyclic", "-")):
    for kind, marker in styles.items():
      points = [
        (r["devices"], x["bytes"] / local_batch_bytes)
        for r in found["skew"]
        for x in r["runs"]
        if (x["placement"], x["ids"]) == (placement, kind)
      ]
      ax.plot(*zip(*points, strict=True), line, marker=marker, label=f"{placement}, {kind} ids")
  if found["compiled"]:
    points = [(r["devices"], r["bytes"] / local_batch_bytes) for r in found["compiled"]]
    ax.plot(
      *zip(*points, strict=True),
      ":",
      color="gray",
      marker=".",
      label="compiled routed path (compile only)",
    )
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("devices N (forced CPU devices)")
  ax.set_ylabel("bytes per device per step / one local batch")
  ax.set_title(
    f"routed train step, {args.local_batch} ids per device, {args.rows} x {args.dim} table, "
    "frequency-sorted vocabulary",
    fontsize=9,
  )
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(args.plot, dpi=110)
  print(f"wrote {args.plot}")


def main():
  args = parse_args()
  if args.worker:
    weak_scaling_worker(args)
    return
  if args.skew_worker:
    skew_worker(args)
    return
  if args.skew:
    skew(args)
    return
  if args.weak_scaling:
    weak_scaling(args)
    return
  devices = jax.devices()
  rng = np.random.default_rng(0)
  table = rng.normal(size=(args.rows, args.dim)).astype(np.float32)
  # Zipf-like ids: a few rows recur in every batch shard, as in recommenders.
  popularity = 1.0 / np.arange(1, args.rows + 1) ** 1.05
  ids = rng.choice(args.rows, size=args.batch, p=popularity / popularity.sum())
  batch = (ids.astype(np.int32), rng.normal(size=args.batch).astype(np.float32))

  mesh = jax.make_mesh((len(devices),), ("x",), axis_types=(AxisType.Auto,))

  def on_mesh(spec):
    return lambda x: jax.device_put(x, NamedSharding(mesh, spec))

  def on_one_device(x):
    return jax.device_put(x, devices[0])

  sparse_adam = osa.sparse_adam(1e-3)
  layouts = [
    Layout("1 device", sparse_step(sparse_adam), sparse_adam, table, batch, on_one_device,
           on_one_device),
    Layout("rows P('x', None)", sparse_step(sparse_adam), sparse_adam, table, batch,
           on_mesh(P("x", None)), on_mesh(P("x"))),
    Layout("columns P(None, 'x')", sparse_step(sparse_adam), sparse_adam, table, batch,
           on_mesh(P(None, "x")), on_mesh(P("x"))),
    Layout("replicated, data-parallel", sparse_step(sparse_adam), sparse_adam, table, batch,
           on_mesh(P()), on_mesh(P("x"))),
    Layout("replicated, dense optax.adam", dense_step(optax.adam(1e-3)), optax.adam(1e-3),
           table, batch, on_mesh(P()), on_mesh(P("x")), steps_scale=0.2),
  ]  # fmt: skip
  # Rounds interleave the layouts, so that load from other processes on the
  # machine spreads over all of them rather than skewing one.
  for _ in range(args.rounds):
    for layout in layouts:
      layout.time(args.steps_per_round)

  table_mib = table.nbytes / 2**20
  print(
    f"\n{len(devices)} x {devices[0].device_kind} devices; table {args.rows} x {args.dim} "
    f"float32 ({table_mib:.0f} MiB, {3 * table_mib:.0f} MiB with m and v); batch "
    f"{args.batch} ids ({len(np.unique(ids))} distinct); median of {args.rounds} rounds "
    f"of {args.steps_per_round} steps\n"
  )
  reference = layouts[0]
  reference_ms = 1e3 * statistics.median(reference.seconds)
  header = (
    f"{'layout':<29} {'step ms':>8} {'vs 1 dev':>8} | {'inputs MiB':>10} {'vs 1 dev':>8} "
    f"{'scratch MiB':>11} | {'collectives MiB':>15}"
  )
  print(header)
  print("-" * len(header))
  for layout in layouts:
    ms = 1e3 * statistics.median(layout.seconds)
    print(
      f"{layout.name:<29} {ms:>8.1f} {ms / reference_ms:>7.2f}x | "
      f"{layout.input_bytes / 2**20:>10.1f} {layout.input_bytes / reference.input_bytes:>7.3f}x "
      f"{layout.scratch_bytes / 2**20:>11.1f} | {layout.collective_bytes / 2**20:>15.3f}"
    )
  print(
    "\ninputs: table, m, v and batch held per device; scratch: the step's temporaries per\n"
    "device; collectives: bytes of the arrays all collectives of one step produce."
  )
  print(
    "\nWhat this CPU simulation shows: memory per device and bytes exchanged, XLA's own\n"
    "accounting of the compiled step. They follow from the SPMD partitioner's plan, not\n"
    "from the hardware, so they should carry over to GPUs and TPUs (not measured there).\n"
    "What it does not show: speed. The 8 'devices' are threads of one process sharing\n"
    f"this machine's {os.cpu_count()} cores and one memory, and collectives are memory\n"
    "copies, so a sharded step cannot run faster here: its time mostly measures the\n"
    "partitioning overhead (extra collectives, the id sort on every device)."
  )


if __name__ == "__main__":
  main()
