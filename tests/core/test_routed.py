"""The routed step of row-sharded tables on 8 forced CPU devices: one device's numbers, O(B) bytes.

The runs happen in a subprocess (tests/core/_routed_checks.py), as in
tests/core/test_sharding.py; this process keeps its single device.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from optax_sparse_adam._backends.cpu import kernels
from optax_sparse_adam._core.sharded import overflow, placement, routing
from optax_sparse_adam._core.sharded.overflow import WARN_AFTER, WARN_SHARE
from tests.core._forced_devices import run_checks
from tests.core._routed_tiers import SLOW_CHECKS, SLOW_CYCLIC_RUNS, SLOW_RUNS

# Float32: a row's entries on several devices are summed per device first, then
# the devices' sums in device order, where one device adds them one by one.
F32_ATOL = 1e-6
# bfloat16 values and moments: that reassociation moves a result by a few ulps.
BF16_RELATIVE = 2.0**-5


@pytest.fixture(scope="module")
def default_tier_checks():
  return run_checks("_routed_checks.py", timeout=600)


@pytest.fixture(scope="module")
def every_check():
  return run_checks("_routed_checks.py", "--all", timeout=900)


@pytest.fixture
def checks(request):
  """The default tier's runs; a test marked slow (a run in `SLOW_RUNS`) reads every run."""
  slow = request.node.get_closest_marker("slow") is not None
  return request.getfixturevalue("every_check" if slow else "default_tier_checks")


def tiered(runs):
  """`runs` as parameters, those of the slow tier marked slow."""
  return [pytest.param(run, marks=pytest.mark.slow) if run in SLOW_RUNS else run for run in runs]


def tiered_checks(names, prefix=""):
  """`names` as parameters, those whose check only the slow tier runs (`SLOW_CHECKS`) marked."""
  return [
    pytest.param(name, marks=pytest.mark.slow) if prefix + name in SLOW_CHECKS else name
    for name in names
  ]


ROUTED_RUNS = [
  f"explicit/plain/{kind}/cf2"
  for kind in (
    "uniform",
    "zipf",
    "one_owner",
    "spread_to_all",
    "cross_device_duplicates",
    "empty_local_batches",
    "out_of_range",
  )
]
ROUTED_RUNS += [f"explicit/plain/{kind}/cf1" for kind in ("one_owner", "zipf", "spread_to_all")]
ROUTED_RUNS += ["auto/plain/uniform/cf2", "auto/plain/one_owner/cf2"]
ROUTED_RUNS += [
  f"explicit/{name}/cross_device_duplicates/cf2"
  for name in (
    "amsgrad",
    "l2_weight_decay",
    "adamw",
    "per_row_bias_correction",
    "maximize",
    "all_options",
    "bf16",
    "apply_if_finite",
    "rowwise",
    "catch_up",
  )
]
ROUTED_RUNS += ["explicit/all_options/one_owner/cf2", "auto/all_options/zipf/cf1"]
STOCHASTIC_RUNS = [
  "explicit/stochastic/device_local_rows/cf2",
  "explicit/stochastic_amsgrad/device_local_rows/cf2",
  "explicit/param_stochastic/device_local_rows/cf2",
  "explicit/stochastic/one_owner/cf2",
  "auto/stochastic/zipf/cf1",
  "auto_default/stochastic/zipf/cf1",
]
ROUTED_RUNS += STOCHASTIC_RUNS
ROUTED_RUNS += ["two_axes/batch_over_x"]
# Auto axes with default settings: routed from the shardings the partitioner chose.
ROUTED_RUNS += [f"auto_default/plain/{kind}/cf2" for kind in ("uniform", "one_owner", "zipf")]
ROUTED_RUNS += [
  f"auto_default/{name}/cross_device_duplicates/cf2"
  for name in ("all_options", "rowwise", "catch_up", "bf16")
]
ROUTED_RUNS += ["auto_default/all_options/zipf/cf1"]
# Auto axes with default settings, tables not split by rows: not routed, layouts kept.
KEPT_LAYOUTS = {
  "auto_default/replicated_table": "P()",
  "auto_default/column_table": "P(None, 'x')",
  "auto_default/rowwise_column_table": "P(None, 'x')",
}


OPTAX_APPLY_IF_FINITE_RUNS = [
  f"{mode}/optax_apply_if_finite/cross_device_duplicates/cf2"
  for mode in ("explicit", "auto", "auto_default")
]
UNROUTED_RUNS = ["two_axes/batch_over_y", "auto/replicated_batch_of_250"]
UNROUTED_RUNS += OPTAX_APPLY_IF_FINITE_RUNS
# Auto axes: routing turned off, and a mesh of two axes (the rows' axis could be either).
UNROUTED_RUNS += ["auto_off/all_options/zipf/cf2", "auto_default/two_axes"]


EVERY_RUN = [*ROUTED_RUNS, *UNROUTED_RUNS, "auto/replicated_batch_of_256", *KEPT_LAYOUTS]


@pytest.mark.parametrize("tier", ["default", pytest.param("all", marks=pytest.mark.slow)])
def test_every_run_is_reported(checks, tier):
  expected = EVERY_RUN if tier == "all" else [run for run in EVERY_RUN if run not in SLOW_RUNS]
  assert sorted(checks["runs"]) == sorted(expected)
  assert SLOW_RUNS < set(EVERY_RUN)


@pytest.mark.parametrize("run", tiered(EVERY_RUN))
def test_routed_training_matches_one_device(checks, run):
  result = checks["runs"][run]
  for name, (diff, relative) in result["max_abs_diff"].items():
    if "/bf16/" in run:
      assert relative <= BF16_RELATIVE, (name, diff, relative)
    else:
      assert diff <= F32_ATOL, (name, diff)
  # optax.apply_if_finite's init puts its counters on one device, and its first step
  # returns them on the mesh (under `Auto` axes): optax's second compilation, routed or not.
  # A table not split by rows: as many compilations as XLA's own partitioning needs
  # (the first call's state, placed outside the jit, can differ from the step's output).
  optax_counters = run in OPTAX_APPLY_IF_FINITE_RUNS[1:]
  assert result["compilations"] == (2 if optax_counters else result.get("compilations_unrouted", 1))


@pytest.mark.parametrize(
  "run", tiered(["explicit/plain/one_owner/cf2", "explicit/all_options/one_owner/cf2"])
)
def test_an_overflowing_step_sums_in_one_devices_order(checks, run):
  """All ids of all devices on one owner overflow every bucket: the overflow path
  sums each row's entries in global input order and matches one device bit for bit."""
  for name, (diff, _) in checks["runs"][run]["max_abs_diff"].items():
    assert diff == 0.0, name


@pytest.mark.parametrize(
  ("run", "overflowed"),
  [
    pytest.param(run, overflowed, marks=[pytest.mark.slow] if run in SLOW_RUNS else [])
    for run, overflowed in (
      ("explicit/plain/spread_to_all/cf1", 0),
      ("explicit/plain/one_owner/cf2", 3),
      ("auto/plain/one_owner/cf2", 3),
      ("auto_default/all_options/cross_device_duplicates/cf2", 0),
      ("auto_default/plain/one_owner/cf2", 3),
      ("auto_default/replicated_table", None),
      ("two_axes/batch_over_y", None),
    )
  ],
)
def test_routing_stats_count_the_steps_that_overflowed(checks, run, overflowed):
  """`osa.routing_stats` after 3 steps: every step routed, all ids on one owner overflowing
  each, ids spread evenly over the owners (or only 12 rows) none; a step not routed (a
  replicated table, a batch over another axis) is not counted."""
  stats = checks["runs"][run]["stats"]
  steps = 0 if overflowed is None else 3
  assert (stats["steps"], stats["overflowed_steps"]) == (steps, overflowed or 0)
  assert (stats["lookups"], stats["overflowed_lookups"]) == (0, 0)


@pytest.mark.parametrize("mode", ["explicit", "auto", "auto_default"])
def test_routing_stats_count_the_lookups_that_overflowed(checks, mode):
  """One lookup each: all ids on one owner overflow; uniform ids, 4 per owner on average,
  fit twice the share or not (one uniform step in 8 devices' batches of 32 overflows most)."""
  for kind in ("uniform", "one_owner"):
    stats = checks["lookups"][f"{mode}/{kind}"]["stats"]
    assert stats["lookups"] == 1 and stats["steps"] == 0, kind
  assert checks["lookups"][f"{mode}/one_owner"]["stats"]["overflowed_lookups"] == 1


def test_repeated_overflows_warn_once_until_reset(checks):
  """Lookups that all overflow warn at the `WARN_AFTER`-th, once, naming the remedy;
  after `routing_stats(reset=True)` the counting starts again."""
  result = checks["overflow_warning"]
  assert result["warned_after"] == WARN_AFTER, result
  assert result["total_warnings"] == 1 and result["after_reset"] == 0, result
  assert result["stats"]["overflowed_lookups"] == WARN_AFTER + 4, result
  assert "row_placement='cyclic'" in result["message"] and "capacity_factor" in result["message"]


@pytest.mark.parametrize("overflowed", [0, 1])
def test_overflow_warning_waits_for_a_steady_share(overflowed):
  """Steps counted by the callback: no warning below `WARN_AFTER` overflowed or below
  `WARN_SHARE` of the routed ones; one at the step that reaches both."""
  osa.routing_stats(reset=True)
  routed = int(WARN_AFTER / WARN_SHARE) * 2 if not overflowed else WARN_AFTER
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(routed):  # routed, not overflowed: dilutes the share
      overflow._record(overflow.STEP, jnp.int32(overflow.ROUTED))
    for _ in range(WARN_AFTER):
      overflow._record(overflow.STEP, jnp.int32(overflow.OVERFLOWED))
  osa.routing_stats(reset=True)
  warned = [w for w in caught if w.category is osa.RoutingOverflowWarning]
  assert len(warned) == overflowed, [str(w.message) for w in caught]
  if overflowed:
    assert f"{WARN_AFTER} of {routed + WARN_AFTER} routed optimizer steps" in str(warned[0].message)


def test_overflow_warning_made_an_error_does_not_fail_the_step(caplog):
  """Under `-W error` the advice is logged: raised in the step's callback, it would fail
  a step whose results are right."""
  osa.routing_stats(reset=True)

  @jax.jit
  def overflowing_steps(flag):
    for _ in range(WARN_AFTER):
      overflow.note(overflow.STEP, flag)
    return flag + 1

  with warnings.catch_warnings(), caplog.at_level("WARNING"):
    warnings.simplefilter("error", osa.RoutingOverflowWarning)
    assert int(overflowing_steps(jnp.int32(overflow.OVERFLOWED))) == overflow.OVERFLOWED + 1
    stats = osa.routing_stats(reset=True)
  assert stats.overflowed_steps == WARN_AFTER
  assert any("RoutingOverflowWarning" in record.getMessage() for record in caplog.records)


def test_routing_stats_on_one_device_count_nothing():
  osa.routing_stats(reset=True)
  grad = sparse.BCOO((jnp.ones((2, 3)), jnp.array([[0], [1]])), shape=(4, 3))
  opt = osa.sparse_adam(1e-2)
  params = {"t": jnp.zeros((4, 3))}
  osa.apply_updates(params, opt.update({"t": grad}, opt.init(params))[0])
  osa.sharded_lookup(params["t"], jnp.array([0, 1]))
  assert osa.routing_stats(reset=True) == osa.RoutingStats(0, 0, 0, 0)


@pytest.mark.parametrize("run", tiered(STOCHASTIC_RUNS))
def test_stochastic_rounding_routed_draws_one_devices_bits(checks, run):
  """bf16 moments rounded stochastically: each shard keys its rows' bits on their global
  rows (`StepInputs.row_offset`), so the routed step stores one device's bits, on the
  routed path (rows each in one device's batch), the overflow path (one owner) and both
  (Zipf ids, capacity factor 1, `Auto` axes)."""
  for name, (diff, _) in checks["runs"][run]["max_abs_diff"].items():
    assert diff == 0.0, name


@pytest.mark.parametrize("run", tiered(ROUTED_RUNS))
def test_state_keeps_the_tables_row_sharding(checks, run):
  specs = checks["runs"][run]["specs"]
  per_row = ("row_step", "row_last_step") + (("nu", "nu_max") if "/rowwise/" in run else ())
  for name, spec in specs.items():
    assert spec == ("P('x',)" if name in per_row else "P('x', None)"), name


@pytest.mark.parametrize("run", tiered(ROUTED_RUNS))
def test_routed_path_sends_one_all_to_all_of_the_buckets(checks, run):
  """Outside the overflow path: one all-to-all of `capacity` slots per owner, each slot
  a row's id and values (ids apart for bfloat16), and scalar flags; nothing of the
  global batch's size."""
  local, dim = checks["local"], checks["dim"]
  num_shards = 4 if run.startswith("two_axes") else 8
  factor = 1.0 if run.endswith("cf1") else 2.0
  local = local * 8 // num_shards if run.startswith("two_axes") else local
  slots = num_shards * routing.capacity(local, num_shards, factor)
  routed_path = [
    (op, size) for op, size, overflow in checks["runs"][run]["collectives"] if not overflow
  ]
  sent = sorted(size for op, size in routed_path if op == "all-to-all")
  if "/bf16/" in run or "/param_stochastic/" in run:  # ids apart from bfloat16 rows
    assert sent == [slots, slots * dim]
  else:  # each float32 row carries its id in one more word
    assert sent == [slots * (dim + 1)]
  assert all(size == 1 for op, size in routed_path if op != "all-to-all"), routed_path


@pytest.mark.parametrize("run", tiered(ROUTED_RUNS))
def test_a_bfloat16_tables_values_travel_as_their_bits(checks, run):
  """A bfloat16 table's gradient rows and new rows cross devices as uint16 bits
  (`routing.as_bits`): XLA:CPU would move them through float32 (a conversion each way
  around every collective, select and loop carry: the routed bfloat16 step measured
  1.12-1.27x the float32 table's, float16's 0.83-0.98x); float32 tables keep float32."""
  bf16 = "/bf16/" in run or "/param_stochastic/" in run
  assert (checks["runs"][run]["float32_collectives"] == 0) == bf16


@pytest.mark.parametrize("run", tiered(ROUTED_RUNS))
def test_the_donated_routed_step_updates_the_table_in_place(checks, run):
  """The compiled train step (`update` + `apply_updates`, donated) writes the table into
  its own buffer and copies no buffer of a table shard's size: a step's work follows
  the rows it touches, not the table's size (issue 20: a `lax.cond` around the apply put
  a copy of the shard in the step)."""
  num_shards = 4 if run.startswith("two_axes") else 8
  shard_elements = checks["num_rows"] // num_shards * checks["dim"]
  result = checks["runs"][run]
  assert result["table_aliased"]
  assert result["largest_copy"] < shard_elements, (result["largest_copy"], shard_elements)


@pytest.mark.parametrize("run", tiered(UNROUTED_RUNS))
def test_a_batch_split_otherwise_or_not_divisible_is_left_to_xla(checks, run):
  """A batch over another axis than the table's rows, or one whose size is not a
  multiple of the axis size: the step XLA partitions, with one device's numbers."""
  collectives = checks["runs"][run]["collectives"]
  assert "all-to-all" not in [op for op, _, _ in collectives]


@pytest.mark.parametrize(
  "run",
  tiered([*OPTAX_APPLY_IF_FINITE_RUNS, "explicit/apply_if_finite/cross_device_duplicates/cf2"]),
)
def test_apply_if_finite_skips_the_nonfinite_step_of_a_row_sharded_table(checks, run):
  """The second step's gradient holds a NaN: skipped, as on one device. optax's own
  `apply_if_finite` builds its rejecting branch from the gradient's entries, which a
  routed update cannot match: that step is left to XLA's partitioner, with a warning
  naming `osa.sparse_apply_if_finite` (which routes)."""
  result = checks["runs"][run]
  assert result["skipped_steps"] == 1
  warned = [w for w in result["warnings"] if "osa.sparse_apply_if_finite" in w]
  if run.split("/")[1] == "optax_apply_if_finite" and run.split("/")[0] != "auto_default":
    assert warned and "'table'" in warned[0], result["warnings"]
  else:
    assert not warned, result["warnings"]


@pytest.mark.parametrize("run", tiered(list(KEPT_LAYOUTS)))
def test_tables_not_split_by_rows_under_auto_axes_keep_their_layout_unrouted(checks, run):
  """Default settings under Auto axes: a replicated or column-split table is stepped as
  the partitioner laid it out, with no all-to-all and nothing of the table's size moved,
  except a rule with a per-row slot on split columns: gathered, with a warning."""
  result = checks["runs"][run]
  assert result["specs"]["table"] == result["specs"]["mu"] == KEPT_LAYOUTS[run]
  ops = [op for op, _, _ in result["collectives"]]
  assert "all-to-all" not in ops or run.endswith("column_table")
  table_size = 4096 * checks["dim"]
  moved = [size for _, size, _ in result["collectives"] if size >= table_size // 8]
  if run == "auto_default/rowwise_column_table":
    assert moved and any("gathers the table" in w for w in result["warnings"])
  else:
    assert not moved and result["warnings"] == []


@pytest.mark.parametrize("kind", ["uniform", pytest.param("one_owner", marks=pytest.mark.slow)])
def test_auto_axes_by_default_compile_what_a_declared_auto_axis_compiles(checks, kind):
  """The partitioner's choice lowers the same routed step as `auto_axis="x"`: the same
  collectives, and the CPU kernels on each device's shard (the fused step, the adds)."""
  default = checks["runs"][f"auto_default/plain/{kind}/cf2"]
  declared = checks["runs"][f"auto/plain/{kind}/cf2"]
  assert default["collectives"] == declared["collectives"]
  assert default["kernel_calls"] == declared["kernel_calls"]
  if not kernels.available():
    pytest.skip("the CPU kernels were not built here: the forced CPU devices ran the XLA ops")
  assert declared["kernel_calls"] > 0


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_a_step_itself_vmapped_or_differentiated_under_auto_axes_matches_one_device(
  checks, transform
):
  assert checks["transformed"][transform] <= F32_ATOL


def test_a_replicated_batch_under_auto_axis_is_split_and_routed(checks):
  collectives = checks["runs"]["auto/replicated_batch_of_256"]["collectives"]
  assert "all-to-all" in [op for op, _, _ in collectives]


def test_apply_of_rows_held_by_other_devices_adds_each_once(checks):
  result = checks["apply_foreign"]
  assert result["max_abs_diff"] == 0.0
  assert result["spec"] == "P('x', None)"
  ops = {op for op, _, _ in result["collectives"]}
  assert "all-gather" in ops  # the update's entries went to their owners


@pytest.mark.parametrize(
  ("local", "shards", "factor", "expected"),
  [(2048, 8, 2.0, 512), (2048, 2, 2.0, 2048), (10, 8, 1.0, 2), (7, 8, 2.0, 2), (1, 8, 2.0, 1)],
)
def test_capacity_is_a_multiple_of_the_even_share_at_most_the_local_entries(
  local, shards, factor, expected
):
  assert routing.capacity(local, shards, factor) == expected


@pytest.mark.parametrize(
  ("local", "shards", "expected"),
  [
    (2048, 8, 346),  # 256 + 6 * sqrt(256 * 7 / 8) = 345.8
    (2048, 4, 630),  # 512 + 6 * sqrt(512 * 3 / 4) = 629.6
    (2048, 2, 1160),  # 1024 + 6 * sqrt(1024 / 2) = 1159.8
    (256, 8, 64),  # 32 + 6 * 5.3 > 2 * 32: twice the share
    (32, 8, 8),
    (3, 2, 3),  # at most the local entries
  ],
)
def test_the_default_capacity_is_six_deviations_over_the_share_at_most_twice_it(
  local, shards, expected
):
  """Sized for uniform ids (a binomial count per owner); never above capacity factor 2,
  so no more bytes and, for uniform ids, no more overflowing steps than that."""
  capacity = routing.capacity(local, shards, None)
  assert capacity == expected
  assert capacity <= routing.capacity(local, shards, 2.0)


def test_a_capacity_factor_below_one_is_refused():
  with pytest.raises(ValueError, match="capacity_factor"), osa.sharded_routing(capacity_factor=0.5):
    pass


LOOKUPS = [
  f"{mode}/{kind}"
  for mode in ("explicit", "auto", "auto_default")
  for kind in ("uniform", "one_owner", "out_of_range_and_negative")
]


@pytest.mark.parametrize("run", LOOKUPS)
def test_sharded_lookup_is_table_of_ids(checks, run):
  result = checks["lookups"][run]
  assert result["max_abs_diff"] == 0.0
  assert result["spec"] == "P('x', None)"


@pytest.mark.parametrize("run", LOOKUPS)
def test_sharded_lookup_sends_ids_out_and_rows_back(checks, run):
  """Outside the overflow path: an all-to-all of the capacity's ids, one of their rows,
  and a scalar flag."""
  slots = 8 * routing.capacity(checks["local"], 8, None)  # the default capacity
  routed_path = [
    (op, size) for op, size, overflow in checks["lookups"][run]["collectives"] if not overflow
  ]
  assert sorted(routed_path) == sorted(
    [("all-to-all", slots), ("all-to-all", slots * checks["dim"]), ("all-reduce", 1)]
  )


def test_sharded_lookup_on_one_device_is_table_of_ids():
  table = np.arange(12.0, dtype=np.float32).reshape(6, 2)
  ids = np.array([5, 0, -1, 7, -9], np.int32)
  np.testing.assert_array_equal(
    osa.sharded_lookup(jnp.asarray(table), jnp.asarray(ids)), jnp.asarray(table)[ids]
  )


def test_sharded_lookup_refuses_ids_that_are_not_1d_integers():
  table = jnp.zeros((4, 2))
  with pytest.raises(ValueError, match="ids of shape"):
    osa.sharded_lookup(table, jnp.zeros((2, 2), jnp.int32))
  with pytest.raises(ValueError, match="dtype float32"):
    osa.sharded_lookup(table, jnp.zeros((2,), jnp.float32))


@pytest.mark.parametrize("run", tiered_checks(["flax_nnx", "flax_nnx_auto_default"]))
def test_a_flax_nnx_table_row_sharded_is_looked_up_and_stepped_routed_as_on_one_device(checks, run):
  """SparseEmbed's lookup (2 ids per example, some padding), sparse_value_and_grad and
  SparseOptimizer: every collective of the whole compiled train step outside the
  overflow paths is an all-to-all (lookup: ids out, rows back; step) or a small
  all-reduce (flags, the loss, the dense tower's gradient)."""
  result = checks[run]
  if result is None:
    pytest.skip("flax is not installed")
  assert result["routed"] == ["apply", "lookup", "step"]
  assert result["max_abs_diff"] <= F32_ATOL
  routed_path = [(op, size) for op, size, overflow in result["collectives"] if not overflow]
  assert [op for op, _ in routed_path].count("all-to-all") == 3
  assert all(size <= 2 * checks["dim"] for op, size in routed_path if op != "all-to-all"), (
    routed_path
  )


FRONT_ENDS = ["nnx_bag", "linen_table", "linen_bag", "torch_sparse_adam"]


@pytest.mark.parametrize("front_end", tiered_checks(FRONT_ENDS, prefix="front_ends/"))
def test_front_ends_on_a_row_sharded_table_route_and_match_one_device(checks, front_end):
  """NNX `SparseEmbedBag` (sum), Linen `LinenSparseEmbed` and `LinenSparseEmbedBag` (mean)
  with `SparseTrainState` (bags of 3 ids, some padding; `Auto` axes with `auto_axis`), and
  the torch adapter's `SparseAdam` on a row-sharded `Parameter` (`Explicit` axes): 3
  steps, routed, against one device."""
  result = checks["front_ends"].get(front_end)
  if result is None:
    pytest.skip("flax is not installed")
  assert result["max_abs_diff"] <= F32_ATOL
  assert result["rows_changed"] >= 12  # the steps moved the rows they touched
  expected = ["apply", "step"] if front_end == "torch_sparse_adam" else ["apply", "lookup", "step"]
  assert result["routed"] == expected
  if front_end == "torch_sparse_adam":
    assert result["spec"] == "P('x', None)"


@pytest.mark.parametrize("row_shape", [(), (3,), (2, 2)])
def test_ids_travel_bit_cast_in_float32_words_and_come_back_exact(row_shape):
  # Ids up to the first non-finite float32 pattern: denormal and normal patterns.
  rows = jnp.array([0, 7, 0x7F7FFFFF, 123456789], jnp.int32)
  values = jnp.arange(4 * int(np.prod(row_shape)), dtype=jnp.float32).reshape((4,) + row_shape)
  assert routing._packs(values, max_row=0x7F7FFFFF)
  packed = routing._pack(rows, values - 5)
  got_rows, got_values = routing._unpack(packed, values)
  np.testing.assert_array_equal(got_rows, rows)
  np.testing.assert_array_equal(got_values, values - 5)


def test_ids_that_would_be_nan_patterns_or_16_bit_words_travel_apart():
  """bfloat16 words would hold NaN patterns for some ids (2**31 - 1 is two NaNs),
  which XLA:CPU rewrites: such rows and ids go in two collectives."""
  assert not routing._packs(jnp.zeros((2, 3), jnp.bfloat16), max_row=10)
  assert not routing._packs(jnp.zeros((2, 3), jnp.float16), max_row=10)
  assert not routing._packs(jnp.zeros((2, 3), jnp.float32), max_row=0x7F800000)


def test_buckets_hold_each_owners_distinct_rows_and_flag_overflow():
  # 4 owners of 10 rows each; slots past a bucket's rows are padding (num_rows).
  coalesced = osa.coalesce_rows(
    jnp.array([12, 3, 3, 31, 35, 38, 39, 40, -1], jnp.int32), jnp.ones((9, 2)), 40
  )
  buckets = routing.bucket_by_owner(coalesced, num_rows=40, num_shards=4, capacity=3)
  np.testing.assert_array_equal(buckets.rows, [3, 40, 40, 12, 40, 40, 40, 40, 40, 31, 35, 38])
  np.testing.assert_array_equal(buckets.values[:, 0], [2, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1])
  # Owner 3 has 4 distinct rows (31, 35, 38, 39): 3 slots are too few.
  assert bool(buckets.overflow)
  roomy = routing.bucket_by_owner(coalesced, num_rows=40, num_shards=4, capacity=4)
  assert not bool(roomy.overflow)


def test_block_ids_and_global_ids_convert_both_ways_with_unique_padding():
  shard = jnp.int32(2)
  local = routing.to_local(jnp.array([20, 29, 19, 30, 40], jnp.int32), shard, 10)
  np.testing.assert_array_equal(local, [0, 9, 10, 10, 10])
  ids = routing.owned_ids(jnp.array([0, 9, 10, 12], jnp.int32), shard, 10)
  np.testing.assert_array_equal(ids, [21, 30, 0, 0])
  np.testing.assert_array_equal(
    routing.decode_rows(ids, shard, 40), [20, 29, 40 + 8 + 2, 40 + 8 + 3]
  )


def test_chunk_reads_fill_past_the_end():
  x = jnp.arange(5)
  np.testing.assert_array_equal(routing.chunk(x, jnp.int32(1), 3, -1), [3, 4, -1])
  np.testing.assert_array_equal(routing.chunk(x, jnp.int32(0), 3, -1), [0, 1, 2])


def test_the_step_finds_optax_apply_if_finite_s_accepting_branch():
  """The routed step recognises `optax.apply_if_finite`'s cond by its branch's code; an
  optax that renamed it would fail here, not silently (JAX's cond would then refuse the
  routed update's shape at trace time)."""
  from optax_sparse_adam._optax import leaf

  code = leaf._optax_apply_if_finite_branch()
  assert code is not None and code.co_name == "do_update"
  assert not leaf._inside_optax_apply_if_finite()


CYCLIC_RUNS = [
  "explicit/all_options/zipf",
  "auto_default/all_options/zipf",
  "explicit/plain/one_owner",
]


def cyclic_tiered(runs):
  """`runs` as parameters, the cyclic runs of the slow tier (`SLOW_CYCLIC_RUNS`) marked."""
  return [
    pytest.param(run, marks=pytest.mark.slow) if run in SLOW_CYCLIC_RUNS else run for run in runs
  ]


@pytest.mark.parametrize("tier", ["default", pytest.param("all", marks=pytest.mark.slow)])
def test_every_cyclic_run_is_reported(checks, tier):
  expected = [run for run in CYCLIC_RUNS if tier == "all" or run not in SLOW_CYCLIC_RUNS]
  assert sorted(checks["cyclic"]["runs"]) == sorted(expected)
  assert SLOW_CYCLIC_RUNS < set(CYCLIC_RUNS)


@pytest.mark.parametrize("run", cyclic_tiered(CYCLIC_RUNS))
def test_cyclic_tables_train_as_one_device_in_logical_order(checks, run):
  """`row_placement="cyclic"`: the table (converted to cyclic order in NumPy) and its
  state, read back in logical order, match one device's training on logical ids; the
  default capacity; the state keeps the table's sharding; one all-to-all outside the
  overflow path."""
  result = checks["cyclic"]["runs"][run]
  for name, (diff, relative) in result["max_abs_diff"].items():
    assert diff <= F32_ATOL, (name, diff, relative)
  assert result["stats"]["steps"] == 3
  per_row = ("row_step", "row_last_step") + (("nu", "nu_max") if "/rowwise/" in run else ())
  for name, spec in result["specs"].items():
    assert spec == ("P('x',)" if name in per_row else "P('x', None)"), name
  routed_path = [(op, n) for op, n, overflow in result["collectives"] if not overflow]
  assert [op for op, _ in routed_path].count("all-to-all") == 1


@pytest.mark.parametrize("mode", ["explicit", pytest.param("auto_default", marks=pytest.mark.slow)])
def test_cyclic_placement_keeps_frequency_sorted_zipf_ids_routed(checks, mode):
  """The Zipf ids' hot rows are the low ids: in blocks they all live on device 0 and
  overflow even twice the share; cyclically they spread over every device and fit the
  default capacity (at most twice the share)."""
  assert checks["cyclic"]["runs"][f"{mode}/all_options/zipf"]["stats"]["overflowed_steps"] == 0
  assert checks["runs"][f"{mode}/plain/zipf/cf2"]["stats"]["overflowed_steps"] > 0


@pytest.mark.parametrize("mode", ["explicit", "auto_default"])
def test_cyclic_lookup_and_converters(checks, mode):
  """`sharded_lookup` of a cyclic table reads logical rows (Zipf, negative, out of range:
  as `table[ids]`); `to_cyclic_rows`/`from_cyclic_rows` equal the NumPy permutation on a
  row-sharded array and keep its sharding."""
  result = checks["cyclic"][f"lookup/{mode}"]
  assert result["max_abs_diff"] == 0.0
  assert result["stats"] == {"steps": 0, "overflowed_steps": 0, "lookups": 1,
                             "overflowed_lookups": 0}  # fmt: skip
  assert result["to_cyclic_diff"] == result["from_cyclic_diff"] == 0.0
  assert result["specs"] == ["P('x', None)", "P('x', None)"]


@pytest.mark.parametrize(
  ("name", "message"),
  [
    ("stochastic_rounding", "moment_rounding='stochastic'"),
    ("optax_apply_if_finite", "cannot be routed"),
    ("replicated_batch", "cannot be routed"),
  ],
)
def test_a_cyclic_table_that_cannot_be_routed_is_refused(checks, name, message):
  """Unrouted, a step would read logical ids as the cyclic table's physical rows: refused
  when traced, before any state changes."""
  error = checks["cyclic"]["errors"][name]
  assert error is not None and message in error and "row_placement" in error


def test_catch_up_rows_of_a_cyclic_table_catches_up_the_logical_rows(checks):
  """`catch_up_rows` gathers a cyclic table's rows directly (not routed): it maps the
  logical ids to their physical rows, and equals one device."""
  assert checks["cyclic"]["catch_up_rows_diff"] <= F32_ATOL


@pytest.mark.slow  # "catch_up_rows_explicit" in SLOW_CHECKS: the slow tier computes it
def test_catch_up_rows_of_a_table_split_over_explicit_axes_matches_one_device(checks):
  """Eagerly under `jax.set_mesh` with `Explicit` axes, where a gather from a row-split
  table has no one output sharding: partitioned by XLA, as on one device."""
  assert checks["catch_up_rows_explicit_diff"] <= F32_ATOL


def test_a_cyclic_table_saved_in_logical_order_reshards_from_8_to_4_devices(checks):
  """`from_cyclic_rows` on 8 devices, `to_cyclic_rows(x, 4)` on 4: the routed lookup of
  every row reads the table exactly."""
  assert checks["cyclic"]["resharded_diff"] == 0.0
  assert checks["cyclic"]["resharded_spec"] == "P('x', None)"


@pytest.mark.slow  # SLOW_CHECKS
def test_a_flax_nnx_cyclic_table_trains_as_one_device(checks):
  """`SparseEmbed` (2 ids per example, padding), `sparse_value_and_grad`, `SparseOptimizer`
  with the table converted to cyclic order: routed lookup, step and apply, one device's
  numbers in logical order."""
  result = checks["flax_nnx_cyclic"]
  if result is None:
    pytest.skip("flax is not installed")
  assert result["routed"] == ["apply", "lookup", "step"]
  assert result["max_abs_diff"] <= F32_ATOL


def test_cyclic_converters_on_one_device():
  x = jnp.arange(12).reshape(6, 2)
  np.testing.assert_array_equal(osa.to_cyclic_rows(x, 3), np.asarray(x)[[0, 3, 1, 4, 2, 5]])
  np.testing.assert_array_equal(osa.from_cyclic_rows(osa.to_cyclic_rows(x, 3), 3), x)
  with pytest.raises(ValueError, match="num_shards=4"):
    osa.to_cyclic_rows(x, 4)


def test_cyclic_ids_map_both_ways():
  rows = jnp.array([0, 1, 5, 6, 11, 12, -1], jnp.int32)  # 12 rows, 3 shards of 4
  physical = placement.physical_rows(rows, 12, 3)
  np.testing.assert_array_equal(physical, [0, 4, 9, 2, 11, 12, -1])
  np.testing.assert_array_equal(placement.logical_rows(physical, 12, 3), rows)


def test_an_unknown_row_placement_is_refused():
  with pytest.raises(ValueError, match="row_placement='diagonal'"):
    with osa.sharded_routing(row_placement="diagonal"):
      pass


@pytest.mark.parametrize("what", ["step", "lookup"])
def test_once_tables_are_cyclic_an_unsaid_placement_is_refused(checks, what):
  """A cyclic table is a plain array: traced outside the cyclic block it would be read in
  blocks. Once the process has placed tables cyclically, a row-split step or lookup
  traced where no placement is said is refused, before any state changes."""
  message = checks["cyclic"]["unsaid"][what]
  assert message is not None, f"the {what} was not refused"
  assert "outside sharded_routing(row_placement=...)" in message
  assert "row_placement='block'" in message


def test_a_block_table_said_block_runs_after_cyclic_tables(checks):
  diffs = checks["cyclic"]["unsaid"]["block_max_abs_diff"]
  assert set(diffs) == {"table", "mu", "nu"}
  assert all(value == 0.0 for values in diffs.values() for value in values), diffs
