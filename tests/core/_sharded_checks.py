"""Sharded training steps on 8 forced CPU devices, measured and printed as JSON.

Run by tests/core/test_sharding.py in a subprocess, because the device count is fixed
when JAX starts (XLA_FLAGS=--xla_force_host_platform_device_count=8) and the
other tests must keep their single device. It trains an embedding table for a
few steps under each layout and mesh mode, and again on one device, and reports
the differences, the shardings, the collectives in the compiled step and the
per-device memory; the test asserts on them.

  PYTHONPATH=. python tests/core/_sharded_checks.py   # prints one JSON object
"""

from tests.core._forced_devices import force_cpu_devices

force_cpu_devices(8)

import contextlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import sparse  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402
from optax_sparse_adam._backends import choice  # noqa: E402

NUM_DEVICES = 8
NUM_ROWS, DIM, BATCH, STEPS = 32768, 16, 64, 3
# P(None, None), not P(): a jitted step returns a replicated array as P(None, None).
TABLE_SPECS = {"row": P("x", None), "col": P(None, "x"), "replicated": P(None, None)}
COLLECTIVE = re.compile(
  r"=\s*(?P<type>.*?)\s+(?P<op>all-gather|all-reduce|all-to-all|reduce-scatter|"
  r"collective-permute)(?:-start)?\("
)
ARRAY_TYPE = re.compile(r"[a-z]+\d*\[([\d,]*)\]")


def lookup(table, ids, explicit):
  """`table[ids]`, batch-sharded. Under Explicit axes JAX wants the gather's output
  sharding spelled out, and auto_axes lets XLA partition the gather itself."""
  if not explicit:
    return table[ids]
  return jax.sharding.auto_axes(lambda t, i: t[i], out_sharding=P("x", None))(table, ids)


def make_step(opt, projection, explicit):
  def loss_of_rows(rows, targets):
    return jnp.mean((rows @ projection - targets) ** 2)

  def step(table, state, ids, targets):
    # The gradient with respect to the gathered rows is the table's gradient as a
    # BCOO: entry i adds row `grad_rows[i]` at row `ids[i]`.
    rows = lookup(table, ids, explicit)
    loss, grad_rows = jax.value_and_grad(loss_of_rows)(rows, targets)
    grad = sparse.BCOO((grad_rows, ids[:, None]), shape=table.shape)
    updates, state = opt.update({"table": grad}, state, {"table": table})
    return osa.apply_updates({"table": table}, updates)["table"], state, loss

  return step


def make_data():
  rng = np.random.default_rng(0)
  table = rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32)
  projection = rng.normal(size=(DIM,)).astype(np.float32)
  # 24 distinct rows spread over every row shard, so each row recurs across
  # the batch shards: a step is right only if all shards' entries are summed.
  popular = rng.choice(NUM_ROWS, size=24, replace=False)
  ids = [popular[rng.integers(0, 24, size=BATCH)].astype(np.int32) for _ in range(STEPS)]
  targets = [rng.normal(size=(BATCH,)).astype(np.float32) for _ in range(STEPS)]
  return table, projection, ids, targets


def collectives(hlo_text):
  """(op, largest element count among its results) of each collective in the HLO."""
  found = []
  for line in hlo_text.splitlines():
    match = COLLECTIVE.search(line)
    if match is None:
      continue
    sizes = [
      int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
      for dims in ARRAY_TYPE.findall(match["type"])
    ]
    found.append((match["op"], max(sizes, default=0)))
  return found


def spec_str(array):
  spec = getattr(array.sharding, "spec", None)
  return "single device" if spec is None else str(spec)


def state_arrays(state):
  arrays = {"mu": state.mu["table"], "nu": state.nu["table"]}
  if state.nu_max is not None:
    arrays["nu_max"] = state.nu_max["table"]
  if state.row_step is not None:
    arrays["row_step"] = state.row_step["table"]
  return arrays


def train(opt, data, *, mesh=None, table_spec=None, jit_init=False):
  """Trains STEPS steps; on one device when `mesh` is None."""
  table0, projection, ids, targets = data
  explicit = mesh is not None and mesh.axis_types[0] == AxisType.Explicit
  if mesh is None:
    device = jax.devices()[0]
    put_table = put_batch = lambda x: jax.device_put(x, device)  # noqa: E731
  else:
    put_table = lambda x: jax.device_put(x, NamedSharding(mesh, table_spec))  # noqa: E731
    put_batch = lambda x: jax.device_put(x, NamedSharding(mesh, P("x")))  # noqa: E731
  table = put_table(table0)
  init = jax.jit(opt.init) if jit_init else opt.init
  state = init({"table": table})
  init_specs = {name: spec_str(a) for name, a in state_arrays(state).items()}
  step = jax.jit(make_step(opt, jnp.asarray(projection), explicit), donate_argnums=(0, 1))
  losses, first_table = [], None
  for step_ids, step_targets in zip(ids, targets, strict=True):
    table, state, loss = step(table, state, put_batch(step_ids), put_batch(step_targets))
    losses.append(float(loss))
    first_table = np.asarray(table) if first_table is None else first_table
  # The executable the steps ran (from the cache: compiling again is free).
  compiled = step.lower(table, state, put_batch(ids[0]), put_batch(targets[0])).compile()
  arrays = {"table": table, **state_arrays(state)}
  memory = compiled.memory_analysis()
  return {
    "arrays": {name: np.asarray(a) for name, a in arrays.items()},
    "losses": losses,
    "specs": {name: spec_str(a) for name, a in arrays.items()},
    "init_specs": init_specs,
    "shard_shapes": {name: list(a.addressable_shards[0].data.shape) for name, a in arrays.items()},
    "collectives": collectives(compiled.as_text()),
    "argument_bytes": memory.argument_size_in_bytes,
    "temp_bytes": memory.temp_size_in_bytes,
    "first_table": first_table,
    "compilations": step._cache_size(),
    "total_bytes": sum(a.nbytes for a in arrays.values()),
  }


def local_updates_without_combining(opt, data):
  """A wrong data-parallel step: each batch shard updates from its own entries
  and the shards' updates are averaged. It shows that the test data needs the
  entries of all shards summed before the step."""
  table, projection, ids, targets = data
  step = jax.jit(make_step(opt, jnp.asarray(projection), explicit=False))
  per_shard = BATCH // NUM_DEVICES
  tables = []
  for shard in range(NUM_DEVICES):
    part = slice(shard * per_shard, (shard + 1) * per_shard)
    state = opt.init({"table": jnp.asarray(table)})
    new_table, _, _ = step(jnp.asarray(table), state, ids[0][part], targets[0][part])
    tables.append(np.asarray(new_table))
  return np.mean(tables, axis=0)


def main():
  assert jax.device_count() == NUM_DEVICES, jax.devices()
  data = make_data()
  table_bytes = NUM_ROWS * DIM * 4
  results = {"num_devices": jax.device_count(), "table_bytes": table_bytes, "runs": {}}
  optimizers = {
    "plain": osa.sparse_adam(1e-2),
    # A schedule makes the learning rate an array traced from the state's count,
    # which must reach the Explicit-mesh step as an argument, not a closure.
    "amsgrad_per_row_wd": osa.sparse_adamw(
      optax.linear_schedule(1e-2, 5e-3, 3),
      weight_decay=0.1,
      amsgrad=True,
      per_row_bias_correction=True,
    ),
  }
  references = {name: train(opt, data) for name, opt in optimizers.items()}
  runs = [
    (mode, layout, "plain", False, None)
    for mode in ("auto", "explicit")
    for layout in ("row", "col", "replicated")
  ]
  runs += [("auto", "row", "amsgrad_per_row_wd", False, None)]
  runs += [("explicit", "row", "amsgrad_per_row_wd", True, None)]
  # The accelerator step (GPU/TPU), forced onto these CPU devices, on sharded tables.
  runs += [("auto", "row", "plain", False, choice.ACCELERATOR)]
  runs += [("explicit", "row", "amsgrad_per_row_wd", False, choice.ACCELERATOR)]
  for mode, layout, opt_name, jit_init, forced in runs:
    axis_type = AxisType.Auto if mode == "auto" else AxisType.Explicit
    mesh = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(axis_type,))
    # Explicit axes need the mesh set; Auto axes run without, as in most code
    # (a set mesh would hide a state scalar left off the mesh).
    with (
      jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext(),
      choice.choose(forced=forced),
    ):
      run = train(
        optimizers[opt_name], data, mesh=mesh, table_spec=TABLE_SPECS[layout], jit_init=jit_init
      )
    reference = references[opt_name]
    run["max_abs_diff"] = {
      name: float(np.max(np.abs(a.astype(np.float64) - reference["arrays"][name])))
      for name, a in run.pop("arrays").items()
    }
    del run["first_table"]
    run["reference_losses"] = reference["losses"]
    name = f"{mode}/{layout}/{opt_name}" + ("/jit_init" if jit_init else "")
    results["runs"][name + (f"/{forced}" if forced else "")] = run
  uncombined = local_updates_without_combining(optimizers["plain"], data)
  results["uncombined_vs_combined_max_abs_diff"] = float(
    np.max(np.abs(uncombined - references["plain"]["first_table"]))
  )
  results["reference_memory"] = {
    "argument_bytes": references["plain"]["argument_bytes"],
    "temp_bytes": references["plain"]["temp_bytes"],
  }
  json.dump(results, sys.stdout)


if __name__ == "__main__":
  main()
