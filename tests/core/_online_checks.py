"""Online training on row-sharded tables, on 4 forced CPU devices, printed as JSON.

Run by tests/core/test_online_sharded.py in a subprocess (the device count is fixed
when JAX starts). Each run trains a table with `track_changed_rows=True`, publishes
a delta every two steps into a serving copy on one device, resets rows, trains
on, and publishes again; on one device, row-split by XLA's partitioner, and
routed under Explicit and Auto mesh axes. The test compares the runs.

  PYTHONPATH=. python tests/core/_online_checks.py   # prints one JSON object
"""

from tests.core._forced_devices import force_cpu_devices

force_cpu_devices(4)

import contextlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import sparse  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402
from optax_sparse_adam._core.sharded import sharding  # noqa: E402
from optax_sparse_adam._optax import deltas  # noqa: E402

NUM_DEVICES, NUM_ROWS, DIM, BATCH, STEPS = 4, 256, 4, 16, 6
OPTIMIZERS = {
  "adam": lambda: osa.sparse_adam(0.05, track_changed_rows=True),
  "sgd_catch_up": lambda: osa.sparse_sgd(
    0.1, momentum=0.9, catch_up_idle_rows=True, track_changed_rows=True
  ),
}
# Adam's CPU kernel and a rule's catch-up in the routed step; kept few: each compiles.
RUNS = {"adam": ("one", "plain", "explicit", "auto"), "sgd_catch_up": ("one", "explicit")}
ALL_GATHER = re.compile(r"=\s*(\S+)\s+all-gather")


def run(opt_name, mode):
  rng = np.random.default_rng(0)
  table0 = rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32)
  # Distinct ids in a batch: no row's entries are summed across devices, so the
  # sharded runs must equal one device's bit for bit.
  batches = [
    (
      rng.choice(NUM_ROWS, BATCH, replace=False).astype(np.int32),
      rng.normal(size=(BATCH, DIM)).astype(np.float32),
    )
    for _ in range(STEPS)
  ]
  opt = OPTIMIZERS[opt_name]()
  if mode == "one":
    mesh, context = None, contextlib.nullcontext()
    device = jax.devices()[0]
    put_table = put_batch = lambda x, spec=None: jax.device_put(x, device)  # noqa: E731
  else:
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(axis_type,))
    context = contextlib.ExitStack()
    if mode == "explicit":
      context.enter_context(jax.set_mesh(mesh))
    if mode in ("explicit", "auto"):
      context.enter_context(osa.sharded_routing(auto_axis="x" if mode == "auto" else None))
    put_table = lambda x: jax.device_put(x, NamedSharding(mesh, P("x", None)))  # noqa: E731
    put_batch = lambda x: jax.device_put(  # noqa: E731
      x, NamedSharding(mesh, P("x", *([None] * (x.ndim - 1))))
    )

  def step(params, state, ids, rows):
    grad = sparse.BCOO((rows, ids[:, None]), shape=(NUM_ROWS, DIM))
    updates, state = opt.update({"table": grad}, state, params)
    return osa.apply_updates(params, updates), state

  out = {"delta_ids": [], "serving_equal": []}
  with context:
    params = {"table": put_table(jnp.asarray(table0))}
    state = opt.init(params)
    published = []
    jitted = jax.jit(step, donate_argnums=(0, 1))
    reset = jax.jit(lambda p, s, ids: osa.reset_rows(opt, p, s, {"table": ids}))
    since = 0
    for i, (ids, rows) in enumerate(batches):
      params, state = jitted(params, state, put_batch(ids), put_batch(rows))
      if i == 3:
        params, state = reset(params, state, jnp.asarray(batches[0][0][:3]))
      if i % 2 == 1:
        delta = osa.rows_delta(params, state, since)
        out["delta_ids"].append(np.asarray(delta.ids["table"]).tolist())
        out["delta_spec"] = str(getattr(delta.rows["table"].sharding, "spec", None))
        # Sent to serving as host arrays, with the trained table to compare with there.
        published.append((jax.device_get(delta), np.asarray(params["table"])))
        since = delta.steps
    # What the delta's gather compiles to: no all-gather of the table.
    ids = delta.ids["table"]
    gather = jax.jit(lambda t, i: sharding.call_with_auto_axes(deltas._gather_rows, (t, i), P()))
    hlo = gather.lower(params["table"], ids).compile().as_text()
    out["gathered_shapes"] = ALL_GATHER.findall(hlo)
    out["table_spec"] = str(getattr(params["table"].sharding, "spec", None))
    out["last_step_spec"] = str(getattr(state.row_last_step["table"].sharding, "spec", None))
    out["table"] = np.asarray(params["table"]).tolist()
    out["last_step"] = np.asarray(state.row_last_step["table"]).tolist()
  # The serving copy: one device, outside the training mesh.
  serving = {"table": jnp.asarray(table0)}
  for delta, trained in published:
    serving = osa.apply_rows_delta(serving, delta)
    out["serving_equal"].append(
      bool(np.array_equal(np.asarray(serving["table"]).view(np.uint32), trained.view(np.uint32)))
    )
  return out


def main():
  # Batches of 16 over 4 owners overflow the routed capacity now and then: counted, not
  # checked here (test_routed.py does).
  warnings.simplefilter("ignore", osa.RoutingOverflowWarning)
  results = {}
  for opt_name, modes in RUNS.items():
    for mode in modes:
      results[f"{opt_name}/{mode}"] = run(opt_name, mode)
  print(json.dumps(results))


if __name__ == "__main__":
  main()
