"""The routed step of row-sharded tables on 8 forced CPU devices, against one device, as JSON.

Run by tests/core/test_routed.py in a subprocess (the device count is fixed when
JAX starts). Each run trains a row-sharded table a few jitted, donated steps
(`update` + `apply_updates`) and the same on one device, and reports the largest
differences, whether the step was routed (an all-to-all in the compiled step),
and the collectives outside the overflow path.

  PYTHONPATH=. python tests/core/_routed_checks.py         # the default tier, as JSON
  PYTHONPATH=. python tests/core/_routed_checks.py --all   # and the slow tier's runs
"""

from tests.core._forced_devices import force_cpu_devices

force_cpu_devices(8)

import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import sparse  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402
from optax_sparse_adam._core.sharded import lookup, overflow, routed  # noqa: E402
from tests.core._routed_tiers import SLOW_CHECKS, SLOW_CYCLIC_RUNS, SLOW_RUNS  # noqa: E402

NUM_DEVICES = 8
NUM_ROWS, DIM, BATCH, STEPS = 4096, 8, 256, 3
LOCAL = BATCH // NUM_DEVICES
ROWS_PER_SHARD = NUM_ROWS // NUM_DEVICES
COLLECTIVE = re.compile(
  r"=\s*(?P<type>.*?)\s+(?P<op>all-gather|all-reduce|all-to-all|reduce-scatter|"
  r"collective-permute)(?:-start)?\("
)
ARRAY_TYPE = re.compile(r"[a-z]+\d*\[([\d,]*)\]")
COPY = re.compile(r"=\s*(?P<type>.*?)\s+copy(?:-start)?\(")
# The donated table (the step's first argument) is written in place into the first output.
TABLE_ALIASED = re.compile(r"input_output_alias=\{.*\{0\}: \(0, \{\}")


def ids_of(kind, rng):
  """One global batch of ids of a given distribution (device d holds [d*LOCAL, (d+1)*LOCAL))."""
  if kind == "uniform":
    return rng.integers(0, NUM_ROWS, BATCH)
  if kind == "zipf":
    popularity = 1.0 / np.arange(1, NUM_ROWS + 1) ** 1.1
    return rng.choice(NUM_ROWS, BATCH, p=popularity / popularity.sum())
  if kind == "one_owner":  # worst skew: every id of every device belongs to shard 3
    return rng.integers(3 * ROWS_PER_SHARD, 4 * ROWS_PER_SHARD, BATCH)
  if kind == "spread_to_all":  # each device sends its entries to every owner evenly
    return (np.arange(BATCH) % NUM_DEVICES) * ROWS_PER_SHARD + rng.integers(0, 4, BATCH)
  if kind == "cross_device_duplicates":  # 12 rows, each on many devices
    return rng.choice(NUM_ROWS, 12, replace=False)[rng.integers(0, 12, BATCH)]
  if kind == "empty_local_batches":  # devices 0-3 hold only out-of-range (padding) ids
    ids = rng.integers(0, NUM_ROWS, BATCH)
    ids[: 4 * LOCAL] = NUM_ROWS + rng.integers(0, 5, 4 * LOCAL)
    return ids
  if kind == "out_of_range":
    return rng.integers(-40, NUM_ROWS + 40, BATCH)
  if kind == "device_local_rows":  # duplicates within a device's batch, none across devices
    local_rows = rng.permutation(NUM_ROWS)[: NUM_DEVICES * 8].reshape(NUM_DEVICES, 8)
    return np.concatenate([rng.choice(rows, LOCAL) for rows in local_rows])
  raise ValueError(kind)


OPTIMIZERS = {
  "plain": lambda: osa.sparse_adam(1e-2),
  "amsgrad": lambda: osa.sparse_adam(1e-2, amsgrad=True),
  "l2_weight_decay": lambda: osa.sparse_adam(1e-2, weight_decay=0.1),
  "adamw": lambda: osa.sparse_adamw(1e-2, weight_decay=0.1),
  "per_row_bias_correction": lambda: osa.sparse_adam(1e-2, per_row_bias_correction=True),
  "maximize": lambda: osa.sparse_adam(1e-2, maximize=True),
  "all_options": lambda: osa.sparse_adamw(
    1e-2, weight_decay=0.1, amsgrad=True, per_row_bias_correction=True, maximize=True
  ),
  "bf16": lambda: osa.sparse_adam(1e-2),
  # A lax.cond whose rejecting branch must build the routed update's type (the
  # second step's gradient holds a NaN: skipped).
  "apply_if_finite": lambda: osa.sparse_apply_if_finite(osa.sparse_adam(1e-2), 3),
  # optax's own: its rejecting branch is zeros like the gradient, so the step is left
  # to XLA's partitioner (with a warning), still one device's numbers.
  "optax_apply_if_finite": lambda: optax.apply_if_finite(osa.sparse_adam(1e-2), 3),
  # Per-row state routed with the rows: a row-wise second moment, catch-up's last steps.
  "rowwise": lambda: osa.sparse_adam(1e-2, rowwise_second_moment=True),
  "catch_up": lambda: osa.sparse_adamw(1e-2, weight_decay=0.1, catch_up_idle_rows=True),
  # bf16 moments rounded stochastically: keyed on global rows, so one device's bits
  # (the fused CPU kernel on each shard; amsgrad: the XLA ops).
  "stochastic": lambda: osa.sparse_adam(
    1e-2, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16, moment_rounding="stochastic"
  ),
  "stochastic_amsgrad": lambda: osa.sparse_adam(
    1e-2, amsgrad=True, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16, moment_rounding="stochastic"
  ),
  # A bf16 table rounded stochastically (param_rounding): its rows' bits keyed on global
  # rows too (the fused kernel's delta, rounded by XLA ops, on each shard).
  "param_stochastic": lambda: osa.sparse_adam(
    1e-2, mu_dtype=jnp.float32, nu_dtype=jnp.float32, param_rounding="stochastic"
  ),
}
# Options checked bit for bit on ids whose rows each live in one device's batch
# (a row summed across devices may round its moments the other way).
EXACT_OPTIONS = ("stochastic", "stochastic_amsgrad", "param_stochastic")


def collectives(hlo_text):
  """(op, element count of its results, whether in the overflow path) per collective."""
  found = []
  for line in hlo_text.splitlines():
    match = COLLECTIVE.search(line)
    if match is None:
      continue
    found.append((match["op"], sum(element_counts(match["type"])), routed.OVERFLOW_SCOPE in line))
  return found


def element_counts(type_text):
  """The element count of each array in an HLO type (a tuple's arrays, one by one)."""
  return [
    int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    for dims in ARRAY_TYPE.findall(type_text)
  ]


def largest_copy(hlo_text):
  """The element count of the largest array a `copy` makes in the compiled program (0: none)."""
  return max((n for m in COPY.finditer(hlo_text) for n in element_counts(m["type"])), default=0)


def cyclic_order(x, shards=NUM_DEVICES):
  """NumPy: logical row r at (r % shards) * (V / shards) + r // shards (an independent check)."""
  x = np.asarray(x)
  return x.reshape((-1, shards) + x.shape[1:]).swapaxes(0, 1).reshape(x.shape)


def logical_order(x, shards=NUM_DEVICES):
  x = np.asarray(x)
  return x.reshape((shards, -1) + x.shape[1:]).swapaxes(0, 1).reshape(x.shape)


def train(
  opt_name, kind, *, mesh=None, batch_axis="x", batch=BATCH, seed=0, table_spec=None, cyclic=False
):
  rng = np.random.default_rng(seed)
  dtype = jnp.bfloat16 if opt_name in ("bf16", "param_stochastic") else jnp.float32
  table0 = rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32)
  batches = [
    (ids_of(kind, rng).astype(np.int32)[:batch], rng.normal(size=(batch, DIM)).astype(np.float32))
    for _ in range(STEPS)
  ]
  if "apply_if_finite" in opt_name:
    batches[1][1][0, 0] = np.nan
  opt = OPTIMIZERS[opt_name]()
  if mesh is None:
    device = jax.devices()[0]
    put_table = put_ids = put_rows = lambda x: jax.device_put(x, device)  # noqa: E731
  else:
    table_sharding = NamedSharding(mesh, P("x", None) if table_spec is None else table_spec)
    put_table = lambda x: jax.device_put(x, table_sharding)  # noqa: E731
    put_ids = lambda x: jax.device_put(x, NamedSharding(mesh, P(batch_axis)))  # noqa: E731
    put_rows = lambda x: jax.device_put(x, NamedSharding(mesh, P(batch_axis, None)))  # noqa: E731

  def step(table, state, ids, grad_rows):
    grad = sparse.BCOO((grad_rows, ids[:, None]), shape=table.shape)
    updates, state = opt.update({"table": grad}, state, {"table": table})
    return osa.apply_updates({"table": table}, updates)["table"], state

  table = put_table(jnp.asarray(cyclic_order(table0) if cyclic else table0, dtype))
  state = opt.init({"table": table})
  jitted = jax.jit(step, donate_argnums=(0, 1))
  osa.routing_stats(reset=True)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for ids, rows in batches:
      table, state = jitted(table, state, put_ids(ids), put_rows(jnp.asarray(rows, dtype)))
  stats = osa.routing_stats(reset=True)
  ids, rows = batches[0]
  hlo = jitted.lower(table, state, put_ids(ids), put_rows(jnp.asarray(rows, dtype)))
  skipped = int(state.total_notfinite) if hasattr(state, "total_notfinite") else None
  state = getattr(state, "inner_state", state)
  arrays = {"table": table, "mu": state.mu["table"], "nu": state.nu["table"]}
  if state.nu_max is not None:
    arrays["nu_max"] = state.nu_max["table"]
  if state.row_step is not None:
    arrays["row_step"] = state.row_step["table"]
  if getattr(state, "row_last_step", None) is not None:
    arrays["row_last_step"] = state.row_last_step["table"]
  to_logical = logical_order if cyclic else np.asarray
  return {
    "arrays": {k: to_logical(v.astype(jnp.float32)) for k, v in arrays.items()},
    "specs": {k: str(getattr(v.sharding, "spec", None)) for k, v in arrays.items()},
    "collectives": collectives(hlo_text := hlo.compile().as_text()),
    # Collectives moving float32 arrays (a bfloat16 table's values move as their bits).
    "float32_collectives": sum(
      "f32[" in m["type"] for line in hlo_text.splitlines() if (m := COLLECTIVE.search(line))
    ),
    "kernel_calls": hlo_text.count('custom_call_target="optax_sparse_adam_'),
    # The donated step writes the table in place: no copy of a shard of it.
    "largest_copy": largest_copy(hlo_text),
    "table_aliased": TABLE_ALIASED.search(hlo_text) is not None,
    "compilations": jitted._cache_size(),
    "skipped_steps": skipped,
    "warnings": [str(w.message) for w in caught],
    "stats": stats._asdict(),
  }


def compare(run, reference):
  """Per array: the largest difference, absolute and relative to the largest value."""
  diffs = {}
  for name, a in run.pop("arrays").items():
    ref = reference["arrays"][name].astype(np.float64)
    diff = float(np.max(np.abs(a.astype(np.float64) - ref)))
    diffs[name] = (diff, diff / max(float(np.max(np.abs(ref))), 1e-30))
  return diffs


def apply_foreign_update(mesh):
  """`apply_updates` of a BCOO split over the axis whose rows belong to other devices."""
  rng = np.random.default_rng(1)
  table = rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32)
  rows = rng.integers(-3, NUM_ROWS + 3, BATCH).astype(np.int32)
  values = rng.normal(size=(BATCH, DIM)).astype(np.float32)
  expected = table.copy()
  for row, value in zip(rows, values, strict=True):
    if 0 <= row < NUM_ROWS:
      expected[row] += value
  with jax.set_mesh(mesh):
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    update = sparse.BCOO(
      (put(values, P("x", None)), put(rows[:, None], P("x", None))), shape=table.shape
    )
    out = jax.jit(osa.apply_updates)({"t": put(table, P("x", None))}, {"t": update})["t"]
    hlo = jax.jit(osa.apply_updates).lower({"t": put(table, P("x", None))}, {"t": update})
    return {
      "max_abs_diff": float(np.max(np.abs(np.asarray(out) - expected))),
      "spec": str(out.sharding.spec),
      "collectives": collectives(hlo.compile().as_text()),
    }


def lookups():
  """`osa.sharded_lookup` against `table[ids]` on one device, for skewed and bad ids."""
  rng = np.random.default_rng(2)
  table = rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32)
  kinds = {
    "uniform": rng.integers(0, NUM_ROWS, BATCH),
    "one_owner": ids_of("one_owner", rng),
    "out_of_range_and_negative": rng.integers(-NUM_ROWS - 40, NUM_ROWS + 40, BATCH),
  }
  results = {}
  for mode in ("explicit", "auto", "auto_default"):
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(axis_type,))
    for kind, ids in kinds.items():
      ids = ids.astype(np.int32)
      expected = np.asarray(jnp.asarray(table)[jnp.asarray(ids)])
      with (
        jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext(),
        osa.sharded_routing(auto_axis="x" if mode == "auto" else None),
      ):
        args = (
          jax.device_put(table, NamedSharding(mesh, P("x", None))),
          jax.device_put(ids, NamedSharding(mesh, P("x"))),
        )
        lookup = jax.jit(osa.sharded_lookup)
        osa.routing_stats(reset=True)
        rows = lookup(*args)
        stats = osa.routing_stats(reset=True)
        hlo = lookup.lower(*args).compile().as_text()
      results[f"{mode}/{kind}"] = {
        "max_abs_diff": float(np.max(np.abs(np.asarray(rows) - expected))),
        "spec": str(rows.sharding.spec),
        "collectives": collectives(hlo),
        "stats": stats._asdict(),
      }
  return results


def overflow_warning():
  """A lookup whose ids all live on one owner, run past `WARN_AFTER`: one
  `RoutingOverflowWarning` (not one per call), none again before a reset."""
  rng = np.random.default_rng(2)
  table = rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32)
  mesh = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh), osa.sharded_routing():
    args = (
      jax.device_put(table, NamedSharding(mesh, P("x", None))),
      jax.device_put(ids_of("one_owner", rng).astype(np.int32), NamedSharding(mesh, P("x"))),
    )
    lookup = jax.jit(osa.sharded_lookup)
    osa.routing_stats(reset=True)
    counts = []
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      for _ in range(overflow.WARN_AFTER + 4):
        lookup(*args)
        osa.routing_stats()  # waits for the callback
        counts.append(sum(w.category is osa.RoutingOverflowWarning for w in caught))
      stats = osa.routing_stats(reset=True)
      lookup(*args)
      osa.routing_stats(reset=True)
  messages = [str(w.message) for w in caught if w.category is osa.RoutingOverflowWarning]
  return {
    "warned_after": counts.index(1) + 1 if 1 in counts else None,
    "total_warnings": counts[-1],
    "after_reset": sum(w.category is osa.RoutingOverflowWarning for w in caught) - counts[-1],
    "stats": stats._asdict(),
    "message": messages[0] if messages else "",
  }


CYCLIC_CASES = [
  ("all_options", "zipf", "explicit"),
  ("all_options", "zipf", "auto_default"),
  ("plain", "one_owner", "explicit"),
]


def cyclic_runs(references, every_run):
  """`sharded_routing(row_placement="cyclic")` with the default capacity: tables stored
  in cyclic order (converted in NumPy), compared in logical order with one device; the
  lookup; the converters on sharded arrays; what is refused."""
  results = {"runs": {}, "errors": {}}
  for opt_name, kind, mode in CYCLIC_CASES:
    if f"{mode}/{opt_name}/{kind}" in SLOW_CYCLIC_RUNS and not every_run:
      continue
    if (opt_name, kind) not in references:
      references[opt_name, kind] = train(opt_name, kind)
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(axis_type,))
    with (
      jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext(),
      osa.sharded_routing(auto_axis="x" if mode == "auto" else None, row_placement="cyclic"),
    ):
      run = train(opt_name, kind, mesh=mesh, cyclic=True)
    run["max_abs_diff"] = compare(run, references[opt_name, kind])
    results["runs"][f"{mode}/{opt_name}/{kind}"] = run
  rng = np.random.default_rng(4)
  table = rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32)
  ids = np.concatenate([ids_of("zipf", rng), [-1, -NUM_ROWS, NUM_ROWS + 3, 7]]).astype(np.int32)
  ids = ids[-BATCH:]
  expected = np.asarray(jnp.asarray(table)[jnp.asarray(ids)])  # one device: clamped, wrapped
  for mode in ("explicit", "auto_default"):
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(axis_type,))
    with (
      jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext(),
      osa.sharded_routing(row_placement="cyclic"),
    ):
      sharded = jax.device_put(cyclic_order(table), NamedSharding(mesh, P("x", None)))
      put_ids = jax.device_put(ids, NamedSharding(mesh, P("x")))
      osa.routing_stats(reset=True)
      rows = jax.jit(osa.sharded_lookup)(sharded, put_ids)
      stats = osa.routing_stats(reset=True)
      converted = osa.to_cyclic_rows(jax.device_put(table, NamedSharding(mesh, P("x", None))), 8)
      back = osa.from_cyclic_rows(converted, 8)
    results[f"lookup/{mode}"] = {
      "max_abs_diff": float(np.max(np.abs(np.asarray(rows) - expected))),
      "stats": stats._asdict(),
      "to_cyclic_diff": float(np.max(np.abs(np.asarray(converted) - cyclic_order(table)))),
      "from_cyclic_diff": float(np.max(np.abs(np.asarray(back) - table))),
      "specs": [str(converted.sharding.spec), str(back.sharding.spec)],
    }
  # A checkpoint N -> M: saved in logical order from 8 devices, placed cyclically on 4.
  eight = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(AxisType.Auto,))
  four = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
  on_eight = jax.device_put(cyclic_order(table), NamedSharding(eight, P("x", None)))
  saved = np.asarray(osa.from_cyclic_rows(on_eight, NUM_DEVICES))
  restored = osa.to_cyclic_rows(jax.device_put(saved, NamedSharding(four, P("x", None))), 4)
  with osa.sharded_routing(row_placement="cyclic"):
    every_row = jax.device_put(np.arange(NUM_ROWS, dtype=np.int32), NamedSharding(four, P("x")))
    read = jax.jit(osa.sharded_lookup)(restored, every_row)
  results["resharded_diff"] = float(np.max(np.abs(np.asarray(read) - table)))
  results["resharded_spec"] = str(restored.sharding.spec)
  explicit = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(AxisType.Explicit,))
  reference = one_device_caught_up_table()
  auto = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(AxisType.Auto,))
  with osa.sharded_routing(row_placement="cyclic"):  # catch_up_rows: eager, Auto axes
    caught_up = caught_up_table(auto)
  results["catch_up_rows_diff"] = float(np.max(np.abs(caught_up - reference)))
  for name, opt_name, batch_axis in (
    ("stochastic_rounding", "stochastic", "x"),
    ("optax_apply_if_finite", "optax_apply_if_finite", "x"),
    ("replicated_batch", "plain", None),
  ):
    try:
      with jax.set_mesh(explicit), osa.sharded_routing(row_placement="cyclic"):
        train(opt_name, "uniform", mesh=explicit, batch_axis=batch_axis, cyclic=True)
      results["errors"][name] = None
    except ValueError as err:
      results["errors"][name] = str(err)
  return results


@functools.cache
def one_device_caught_up_table():
  """`caught_up_table()` on one device, computed once: the reference of both meshes."""
  return caught_up_table()


def caught_up_table(mesh=None, cyclic=True):
  """Two catch-up steps on disjoint rows, then `catch_up_rows` of rows idle since: the
  table in logical order (on `mesh`: stored cyclically, or in blocks)."""
  rng = np.random.default_rng(5)
  table0 = rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32)
  opt = OPTIMIZERS["catch_up"]()
  if mesh is None:
    put = jnp.asarray
    table = put(table0)
  else:
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("x", *[None] * (x.ndim - 1))))  # noqa: E731
    table = put(cyclic_order(table0) if cyclic else table0)
  state = opt.init({"table": table})

  @jax.jit
  def step(table, state, ids, rows):
    grad = sparse.BCOO((rows, ids[:, None]), shape=table.shape)
    updates, state = opt.update({"table": grad}, state, {"table": table})
    return osa.apply_updates({"table": table}, updates)["table"], state

  for first in (0, 1):  # rows 0, 2, 4, ... then 1, 3, 5, ...
    ids = (first + 2 * rng.permutation(NUM_ROWS // 2)[:BATCH]).astype(np.int32)
    table, state = step(table, state, put(ids), put(rng.normal(size=(BATCH, DIM)).astype("f4")))
  ids = np.arange(0, NUM_ROWS, 3, dtype=np.int32)[:BATCH]
  ids = jnp.asarray(ids) if mesh is None else jax.device_put(ids, NamedSharding(mesh, P()))
  params, _ = osa.catch_up_rows(opt, {"table": table}, state, {"table": ids})
  if mesh is not None and cyclic:
    return logical_order(params["table"])
  return np.asarray(params["table"])


def flax_nnx(auto_axis="x", placement="block"):
  """A Flax NNX model's table, row-sharded, trained with `SparseOptimizer` (Auto axes and
  `auto_axis`), against one device; None without flax."""
  try:
    import optax
    from flax import nnx
  except ImportError:
    return None

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.users = osa.SparseEmbed(NUM_ROWS, DIM, rngs=rngs)
      self.tower = nnx.Linear(DIM, 1, rngs=rngs)

    def __call__(self, users):
      return self.tower(self.users(users))[..., 0].sum(-1)

  def loss_fn(model, users, targets):
    return jnp.mean((model(users) - targets) ** 2)

  rng = np.random.default_rng(3)
  # Two ids per example, some of them padding (out of range: zero rows, no gradient).
  batches = [
    (
      np.stack([ids_of("cross_device_duplicates", rng), ids_of("out_of_range", rng)], -1),
      rng.normal(size=BATCH),
    )
    for _ in range(STEPS)
  ]

  def run(mesh):
    model = Model(nnx.Rngs(0))
    put = jnp.asarray
    if mesh is not None:
      table = model.users.embedding
      value = table.get_value()
      value = cyclic_order(value) if placement == "cyclic" else value
      table.set_value(jax.device_put(value, NamedSharding(mesh, P("x", None))))
      put = lambda x: jax.device_put(x, NamedSharding(mesh, P("x", *[None] * (x.ndim - 1))))  # noqa: E731
    tx = optax.multi_transform(
      {"sparse": osa.sparse_adam(1e-2), "dense": optax.adam(1e-2)}, osa.table_labels(model)
    )
    optimizer = osa.SparseOptimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, users, targets):
      loss, grads = osa.sparse_value_and_grad(loss_fn)(model, users, targets)
      optimizer.update(model, grads)
      return loss

    for users, targets in batches:
      args = (put(users.astype(np.int32)), put(targets.astype(np.float32)))
      step(model, optimizer, *args)
    hlo = step.lower(model, optimizer, *args).compile().as_text()
    value = model.users.embedding.get_value()
    value = logical_order(value) if mesh is not None and placement == "cyclic" else value
    return np.asarray(value), hlo

  reference, _ = run(None)
  mesh = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(AxisType.Auto,))
  with (
    osa.sharded_routing(auto_axis=auto_axis, row_placement=placement),
    tracing_routed() as traced,
  ):
    table, hlo = run(mesh)
  return {
    "max_abs_diff": float(np.max(np.abs(table - reference))),
    "routed": sorted(set(traced)),
    "collectives": collectives(hlo),
  }


@contextlib.contextmanager
def tracing_routed():
  """Within the block, the list of the routed functions traced (step, apply, lookup)."""
  traced = []
  masked_step, scatter_add = routed.flagged_step, routed.scatter_add
  routed_lookup = lookup._routed_lookup
  routed.flagged_step = lambda *a, **k: traced.append("step") or masked_step(*a, **k)
  routed.scatter_add = lambda *a, **k: traced.append("apply") or scatter_add(*a, **k)
  lookup._routed_lookup = lambda *a, **k: traced.append("lookup") or routed_lookup(*a, **k)
  try:
    yield traced
  finally:
    routed.flagged_step, routed.scatter_add = masked_step, scatter_add
    lookup._routed_lookup = routed_lookup


def front_ends(every_run=True):
  """Linen tables, the NNX and Linen bags, and the torch adapter's SparseAdam on a row-sharded
  table, against one device: the largest difference of the trained table and what was
  routed. The Flax ones under `Auto` axes with `auto_axis`, the adapter under `Explicit`."""
  results = {}
  rng = np.random.default_rng(4)
  # Three ids per example (bags of 3; the plain tables look all three up), some padding.
  batches = [
    (
      np.stack(
        [ids_of(kind, rng) for kind in ("cross_device_duplicates", "uniform", "out_of_range")],
        -1,
      ).astype(np.int32),
      rng.normal(size=BATCH).astype(np.float32),
    )
    for _ in range(STEPS)
  ]
  auto = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(AxisType.Auto,))

  def put_batch(x):
    return jax.device_put(x, NamedSharding(auto, P("x", *[None] * (x.ndim - 1))))

  try:
    import flax.linen as nn
    from flax import nnx
  except ImportError:
    nn = nnx = None
  if nnx is not None:

    class NNXBag(nnx.Module):
      def __init__(self, rngs):
        self.bag = osa.SparseEmbedBag(NUM_ROWS, DIM, mode="sum", rngs=rngs)

      def __call__(self, ids):
        return self.bag(ids).sum(-1)

    def nnx_run(sharded):
      model = NNXBag(nnx.Rngs(0))
      initial = np.asarray(model.bag.embedding.get_value())
      put = put_batch if sharded else jnp.asarray
      if sharded:
        table = model.bag.embedding
        table.set_value(jax.device_put(table.get_value(), NamedSharding(auto, P("x", None))))
      optimizer = osa.SparseOptimizer(model, osa.sparse_adam(1e-2), wrt=nnx.Param)

      @nnx.jit
      def step(model, optimizer, ids, targets):
        def loss_fn(model):
          return jnp.mean((model(ids) - targets) ** 2)

        _, grads = osa.sparse_value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)

      for ids, targets in batches:
        step(model, optimizer, put(ids), put(targets))
      return initial, np.asarray(model.bag.embedding.get_value())

    class LinenModel(nn.Module):
      bag: bool

      @nn.compact
      def __call__(self, ids):
        if self.bag:
          pooled = osa.LinenSparseEmbedBag(NUM_ROWS, DIM, mode="mean", name="table")(ids)
        else:
          pooled = osa.LinenSparseEmbed(NUM_ROWS, DIM, name="table")(ids).sum(1)
        return nn.Dense(1)(pooled)[..., 0]

    def linen_run(sharded, bag):
      model = LinenModel(bag)
      params = model.init(jax.random.key(0), jnp.zeros((2, 3), jnp.int32))["params"]
      initial = np.asarray(params["table"]["embedding"].unbox())
      put = put_batch if sharded else jnp.asarray
      if sharded:
        box = params["table"]["embedding"]
        table = jax.device_put(box.unbox(), NamedSharding(auto, P("x", None)))
        params["table"]["embedding"] = box.replace_boxed(table)
      tx = optax.multi_transform(
        {"sparse": osa.sparse_adam(1e-2), "dense": optax.adam(1e-2)}, osa.table_labels
      )
      state = osa.SparseTrainState.create(apply_fn=model.apply, params=params, tx=tx)

      @jax.jit
      def step(state, ids, targets):
        def loss_fn(params):
          return jnp.mean((state.apply_fn({"params": params}, ids) - targets) ** 2)

        _, grads = osa.sparse_value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads)

      for ids, targets in batches:
        state = step(state, put(ids), put(targets))
      return initial, np.asarray(state.params["table"]["embedding"].unbox())

    runs = {
      "nnx_bag": nnx_run,
      "linen_table": lambda sharded: linen_run(sharded, bag=False),
      "linen_bag": lambda sharded: linen_run(sharded, bag=True),
    }
    for name, run in runs.items():
      if f"front_ends/{name}" in SLOW_CHECKS and not every_run:
        continue
      initial, reference = run(False)
      with osa.sharded_routing(auto_axis="x"), tracing_routed() as traced:
        _, table = run(True)
      results[name] = {
        "max_abs_diff": float(np.max(np.abs(table - reference))),
        "rows_changed": int(np.sum(np.any(reference != initial, axis=1))),
        "routed": sorted(set(traced)),
      }

  from optax_sparse_adam.torch_compat import Parameter, SparseAdam

  explicit = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(AxisType.Explicit,))
  table0 = rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32)
  grads = [
    (ids_of("cross_device_duplicates", rng).astype(np.int32), rng.normal(size=(BATCH, DIM)))
    for _ in range(STEPS)
  ]

  def torch_run(mesh):
    def put(x, spec):
      if mesh is None:
        return jnp.asarray(x)
      return jax.device_put(x, NamedSharding(mesh, spec))

    param = Parameter(put(table0, P("x", None)))
    opt = SparseAdam([param], lr=1e-2)
    for ids, values in grads:
      param.grad = sparse.BCOO(
        (put(values.astype(np.float32), P("x", None)), put(ids[:, None], P("x", None))),
        shape=table0.shape,
      )
      opt.step()
    return param.data

  reference = np.asarray(torch_run(None))
  with jax.set_mesh(explicit), tracing_routed() as traced:
    data = torch_run(explicit)
  results["torch_sparse_adam"] = {
    "max_abs_diff": float(np.max(np.abs(np.asarray(data) - reference))),
    "rows_changed": int(np.sum(np.any(reference != table0, axis=1))),
    "routed": sorted(set(traced)),
    "spec": str(data.sharding.spec),
  }
  return results


def transformed_steps(mesh):
  """A step that is itself vmapped (two tables) or differentiated, under Auto axes with
  default settings (the whole step, left to XLA), against one device."""
  rng = np.random.default_rng(4)
  opt = osa.sparse_adam(1e-2)
  tables = rng.normal(size=(2, NUM_ROWS, DIM)).astype(np.float32)
  ids = rng.integers(0, NUM_ROWS, (2, BATCH)).astype(np.int32)
  grads = rng.normal(size=(2, BATCH, DIM)).astype(np.float32)

  def step(table, ids, grad_rows):
    state = opt.init({"t": table})
    grad = sparse.BCOO((grad_rows, ids[:, None]), shape=table.shape)
    updates, _ = opt.update({"t": grad}, state, {"t": table})
    return osa.apply_updates({"t": table}, updates)["t"]

  def loss(table, ids, grad_rows):  # the table after one step, differentiated
    return jnp.sum(step(table, ids, grad_rows) ** 2)

  def put(x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))

  vmapped = jax.jit(jax.vmap(step))
  expected = vmapped(*map(jnp.asarray, (tables, ids, grads)))
  got = vmapped(put(tables, None, "x"), put(ids, None, "x"), put(grads, None, "x"))
  gradient = jax.jit(jax.grad(loss))
  expected_grad = gradient(*map(jnp.asarray, (tables[0], ids[0], grads[0])))
  got_grad = gradient(put(tables[0], "x"), put(ids[0], "x"), put(grads[0], "x"))
  return {
    "vmap": float(jnp.max(jnp.abs(np.asarray(got) - np.asarray(expected)))),
    "grad": float(jnp.max(jnp.abs(np.asarray(got_grad) - np.asarray(expected_grad)))),
  }


def main():
  assert jax.device_count() == NUM_DEVICES, jax.devices()
  results = {"runs": {}, "local": LOCAL, "dim": DIM, "num_rows": NUM_ROWS}
  kinds = (
    "uniform", "zipf", "one_owner", "spread_to_all", "cross_device_duplicates",
    "empty_local_batches", "out_of_range",
  )  # fmt: skip
  # (optimizer, ids, mesh mode, capacity factor): the skewed batches also with a
  # capacity factor of 1, where more steps overflow.
  cases = [("plain", kind, "explicit", 2.0) for kind in kinds]
  cases += [("plain", kind, "explicit", 1.0) for kind in ("one_owner", "zipf", "spread_to_all")]
  cases += [("plain", kind, "auto", 2.0) for kind in ("uniform", "one_owner")]
  options = [name for name in OPTIMIZERS if name not in ("plain", *EXACT_OPTIONS)]
  cases += [
    ("optax_apply_if_finite", "cross_device_duplicates", mode, 2.0)
    for mode in ("auto", "auto_default")
  ]
  cases += [(name, "cross_device_duplicates", "explicit", 2.0) for name in options]
  cases += [(name, "device_local_rows", "explicit", 2.0) for name in EXACT_OPTIONS]
  cases += [("stochastic", "one_owner", "explicit", 2.0), ("stochastic", "zipf", "auto", 1.0)]
  cases += [("all_options", "one_owner", "explicit", 2.0), ("all_options", "zipf", "auto", 1.0)]
  # Auto axes, default settings: the partitioner's shardings choose the routed step.
  cases += [("plain", kind, "auto_default", 2.0) for kind in ("uniform", "one_owner", "zipf")]
  cases += [
    (name, "cross_device_duplicates", "auto_default", 2.0)
    for name in ("all_options", "rowwise", "catch_up", "bf16")
  ]
  cases += [
    ("all_options", "zipf", "auto_default", 1.0),
    ("stochastic", "zipf", "auto_default", 1.0),
  ]
  cases += [("all_options", "zipf", "auto_off", 2.0)]  # sharded_routing(False): left to XLA
  every_run = "--all" in sys.argv[1:]
  references = {}
  for opt_name, kind, mode, capacity_factor in cases:
    name = f"{mode}/{opt_name}/{kind}/cf{capacity_factor:g}"
    if name in SLOW_RUNS and not every_run:
      continue
    if (opt_name, kind) not in references:
      references[opt_name, kind] = train(opt_name, kind)
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(axis_type,))
    auto_axis = "x" if mode == "auto" else None  # "auto_default", "auto_off": none
    with (
      jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext(),
      osa.sharded_routing(mode != "auto_off", capacity_factor=capacity_factor, auto_axis=auto_axis),
    ):
      run = train(opt_name, kind, mesh=mesh)
    run["max_abs_diff"] = compare(run, references[opt_name, kind])
    results["runs"][name] = run
  # A mesh of two axes: rows over "x" (4 devices), the batch over "x" (routed,
  # each "y" pair computing the same) or over "y" (not routed: XLA partitions it).
  two_axes = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
  for batch_axis in ("x", "y"):
    if f"two_axes/batch_over_{batch_axis}" in SLOW_RUNS and not every_run:
      continue
    with jax.set_mesh(two_axes):
      run = train("all_options", "cross_device_duplicates", mesh=two_axes, batch_axis=batch_axis)
    run["max_abs_diff"] = compare(run, references["all_options", "cross_device_duplicates"])
    results["runs"][f"two_axes/batch_over_{batch_axis}"] = run
  # Auto axes with auto_axis="x": a batch of 250 ids (not a multiple of 8) is left
  # to XLA; 256 replicated ids are split over "x" by the routed step itself.
  auto = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(AxisType.Auto,))
  for batch in (250, 256):
    if f"auto/replicated_batch_of_{batch}" in SLOW_RUNS and not every_run:
      continue
    reference = train("plain", "cross_device_duplicates", batch=batch)
    with osa.sharded_routing(auto_axis="x"):
      run = train("plain", "cross_device_duplicates", mesh=auto, batch_axis=None, batch=batch)
    run["max_abs_diff"] = compare(run, reference)
    results["runs"][f"auto/replicated_batch_of_{batch}"] = run
  # Auto axes on a mesh of two axes, default settings: the axis of the rows could be
  # either, so the step is left to XLA.
  auto_two_axes = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
  run = train("all_options", "cross_device_duplicates", mesh=auto_two_axes)
  run["max_abs_diff"] = compare(run, references["all_options", "cross_device_duplicates"])
  results["runs"]["auto_default/two_axes"] = run
  # Auto axes, default settings, tables not split by rows: the partitioner's
  # shardings are kept (a replicated table is not routed, nor split).
  for opt_name, table_spec, name in (
    ("all_options", P(), "replicated_table"),
    ("all_options", P(None, "x"), "column_table"),
    ("rowwise", P(None, "x"), "rowwise_column_table"),
  ):
    if f"auto_default/{name}" in SLOW_RUNS and not every_run:
      continue
    reference = train(opt_name, "cross_device_duplicates")
    run = train(opt_name, "cross_device_duplicates", mesh=auto, table_spec=table_spec)
    run["max_abs_diff"] = compare(run, reference)
    with osa.sharded_routing(False):  # XLA's own partitioning, for the compilation count
      unrouted = train(opt_name, "cross_device_duplicates", mesh=auto, table_spec=table_spec)
    run["compilations_unrouted"] = unrouted["compilations"]
    results["runs"][f"auto_default/{name}"] = run
  results["transformed"] = transformed_steps(auto)
  explicit = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(AxisType.Explicit,))
  results["lookups"] = lookups()
  results["overflow_warning"] = overflow_warning()
  results["flax_nnx"] = flax_nnx()
  if every_run or "flax_nnx_auto_default" not in SLOW_CHECKS:
    results["flax_nnx_auto_default"] = flax_nnx(auto_axis=None)
  results["front_ends"] = front_ends(every_run)
  results["apply_foreign"] = apply_foreign_update(explicit)
  if every_run or "catch_up_rows_explicit" not in SLOW_CHECKS:
    with jax.set_mesh(explicit), osa.sharded_routing(row_placement="block"):
      caught_up = caught_up_table(explicit, cyclic=False)  # catch_up_rows eagerly, Explicit axes
    caught_up_diff = np.max(np.abs(caught_up - one_device_caught_up_table()))
    results["catch_up_rows_explicit_diff"] = float(caught_up_diff)
  # Cyclic placement last: once a process has placed tables cyclically, a row-split
  # table traced where no placement is said is refused (checked at the end).
  started = time.perf_counter()
  results["cyclic"] = cyclic_runs(references, every_run)
  if every_run or "flax_nnx_cyclic" not in SLOW_CHECKS:
    results["flax_nnx_cyclic"] = flax_nnx(placement="cyclic")
  results["cyclic"]["unsaid"] = unsaid_placement(references, explicit)
  results["cyclic"]["seconds"] = time.perf_counter() - started  # the suite's time budget
  json.dump(results, sys.stdout)


def unsaid_placement(references, explicit):
  """After cyclic tables: a step and a lookup of a row-split table traced outside any
  `row_placement` are refused (a cyclic table would be read in blocks), the lookup's
  function traced before included; said "block", the step runs and equals one device."""
  out = {}
  try:
    with jax.set_mesh(explicit):
      train("plain", "uniform", mesh=explicit)
    out["step"] = None
  except ValueError as err:
    out["step"] = str(err)
  table = jax.device_put(np.zeros((NUM_ROWS, DIM), np.float32), NamedSharding(explicit, P("x")))
  ids = jax.device_put(np.arange(BATCH, dtype=np.int32), NamedSharding(explicit, P("x")))
  try:
    with jax.set_mesh(explicit):
      jax.jit(osa.sharded_lookup)(table, ids)
    out["lookup"] = None
  except ValueError as err:
    out["lookup"] = str(err)
  with jax.set_mesh(explicit), osa.sharded_routing(row_placement="block"):
    run = train("plain", "uniform", mesh=explicit)
  out["block_max_abs_diff"] = compare(run, references["plain", "uniform"])
  return out


if __name__ == "__main__":
  main()
