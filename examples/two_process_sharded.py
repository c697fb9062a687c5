"""Two processes, one row-sharded table: the multi-host setup, rehearsed on one machine.

The script starts two worker processes of 4 CPU devices each. They join with
`jax.distributed.initialize` (gloo CPU collectives), build one mesh over all
8 devices, and train an embedding table row-sharded over it, each process
feeding its own half of every batch. Each worker then checks the table and
moments against the same training on one local device.

On a real cluster, run the worker part once per host with that host's
coordinator address, process count and id (or none of them, where JAX detects
the cluster: SLURM, Cloud TPU, ...).

  python examples/two_process_sharded.py

Gallery:
  title: Two processes, one sharded table
  extras: none
  shows: the multi-host setup rehearsed on one machine: two jax.distributed processes train one
    row-sharded table and match one device
  run time: 13.9 s on the 2-core shared CPU VM of the project, under nice, 2026-11-23
"""

import _gallery  # the extras this example needs, read from the Gallery block above

_gallery.require_extras(__doc__, __file__)

import argparse
import json
import os
import socket
import subprocess
import sys
import time

NUM_PROCESSES, DEVICES_PER_PROCESS = 2, 4
NUM_ROWS, DIM, BATCH, STEPS = 4096, 16, 64, 3


def worker(process_id: int, port: int) -> None:
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils, sparse
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import optax_sparse_adam as osa

  jax.distributed.initialize(
    coordinator_address=f"localhost:{port}",
    num_processes=NUM_PROCESSES,
    process_id=process_id,
  )
  mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(AxisType.Auto,))

  # Every process knows the initial table (same seed) and keeps its rows only;
  # each reads its own half of every batch, as hosts read their data shards.
  rng = np.random.default_rng(0)
  table0 = rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32)
  popular = rng.choice(NUM_ROWS, size=24, replace=False)
  batches = [
    (popular[rng.integers(0, 24, size=BATCH)].astype(np.int32), rng.normal(size=BATCH))
    for _ in range(STEPS)
  ]
  local = slice(process_id * BATCH // NUM_PROCESSES, (process_id + 1) * BATCH // NUM_PROCESSES)

  optimizer = osa.sparse_adam(1e-2)

  def lookup(table, ids):
    if not jax.sharding.get_abstract_mesh().explicit_axes:
      return table[ids]
    # Under Explicit axes the gather's output sharding is named: rows split like the ids.
    return jax.sharding.auto_axes(lambda t, i: t[i], out_sharding=P("x", None))(table, ids)

  def step(table, state, ids, targets):
    # Gradient of the loss with respect to the gathered rows, as the table's BCOO gradient.
    grad_rows = jax.grad(lambda rows: jnp.mean((rows.sum(-1) - targets) ** 2))(lookup(table, ids))
    grad = sparse.BCOO((grad_rows, ids[:, None]), shape=table.shape)
    updates, state = optimizer.update({"table": grad}, state)
    return osa.apply_updates({"table": table}, updates)["table"], state

  def train(mesh):
    table_sharding = NamedSharding(mesh, P("x", None))
    batch_sharding = NamedSharding(mesh, P("x"))
    train_step = jax.jit(step, donate_argnums=(0, 1))
    table = jax.make_array_from_callback(table0.shape, table_sharding, lambda index: table0[index])
    state = optimizer.init({"table": table})
    for ids, targets in batches:
      table, state = train_step(
        table,
        state,
        jax.make_array_from_process_local_data(batch_sharding, ids[local]),
        jax.make_array_from_process_local_data(batch_sharding, targets[local].astype(np.float32)),
      )
    return table, state

  # Both routed, each row's gradient sent to the process and device that own the
  # row: under Auto axes from the shardings XLA's partitioner chose, under Explicit
  # axes from the values' types.
  table, state = train(mesh)
  explicit_mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(AxisType.Explicit,))
  # Buckets as large as a device's 8 entries: no step overflows, every row's sum
  # crosses processes in the all-to-all.
  with jax.set_mesh(explicit_mesh), osa.sharded_routing(capacity_factor=8.0):
    routed_table, routed_state = train(explicit_mesh)

  # The same training on one local device, for comparison.
  device = jax.local_devices()[0]
  ref_table = jax.device_put(table0, device)
  ref_state = optimizer.init({"table": ref_table})
  ref_step = jax.jit(step)
  for ids, targets in batches:
    ref_table, ref_state = ref_step(
      ref_table,
      ref_state,
      jax.device_put(ids, device),
      jax.device_put(targets.astype(np.float32), device),
    )

  def max_diff(sharded, reference):
    full = multihost_utils.process_allgather(sharded, tiled=True)
    return float(np.max(np.abs(full - np.asarray(reference))))

  print(
    json.dumps(
      {
        "process": jax.process_index(),
        "global_devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "local_rows": sum(s.data.shape[0] for s in table.addressable_shards),
        "moments_spec": str(state.mu["table"].sharding.spec),
        "max_abs_diff": {
          "table": max_diff(table, ref_table),
          "mu": max_diff(state.mu["table"], ref_state.mu["table"]),
          "nu": max_diff(state.nu["table"], ref_state.nu["table"]),
        },
        "routed_max_abs_diff": {
          "table": max_diff(routed_table, ref_table),
          "mu": max_diff(routed_state.mu["table"], ref_state.mu["table"]),
          "nu": max_diff(routed_state.nu["table"], ref_state.nu["table"]),
        },
      }
    ),
    flush=True,
  )
  jax.distributed.shutdown()


def free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


def launch(timeout: float) -> list[dict]:
  """Runs the workers and returns their reports; raises if one fails."""
  port = free_port()
  workers = [
    subprocess.Popen(
      [sys.executable, __file__, "--process-id", str(pid), "--port", str(port)],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for pid in range(NUM_PROCESSES)
  ]
  reports = []
  deadline = time.monotonic() + timeout
  for pid, proc in enumerate(workers):
    try:
      out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      for other in workers:
        other.kill()
      raise
    if proc.returncode != 0:
      for other in workers:
        other.kill()
      raise RuntimeError(f"worker {pid} failed:\n{err[-3000:]}")
    reports.append(json.loads(out.strip().splitlines()[-1]))
  return reports


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--process-id", type=int, help="run as this worker (internal)")
  parser.add_argument("--port", type=int, help="coordinator port (internal)")
  parser.add_argument("--json", action="store_true", help="print the reports as JSON")
  args = parser.parse_args()
  if args.process_id is not None:
    worker(args.process_id, args.port)
    return
  start = time.perf_counter()
  reports = launch(timeout=240)
  if args.json:
    print(json.dumps(reports))
    return
  for report in reports:
    diffs = ", ".join(f"{k} {v:.1e}" for k, v in report["max_abs_diff"].items())
    routed = ", ".join(f"{k} {v:.1e}" for k, v in report["routed_max_abs_diff"].items())
    print(
      f"process {report['process']}: {report['local_devices']} of "
      f"{report['global_devices']} devices, holds {report['local_rows']} of {NUM_ROWS} rows "
      f"(moments {report['moments_spec']}); max |sharded - one device|: {diffs}; "
      f"routed (Explicit axes): {routed}"
    )
  print(f"{STEPS} steps on {NUM_PROCESSES} processes in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  main()
