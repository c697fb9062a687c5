"""Which routed runs only the slow tier checks (`-m slow`); shared by the checks and the test.

Each is a variant whose arithmetic another default run covers: a single option that
`all_options` also turns on, a second capacity factor, a second mesh mode, another
id pattern through the same path. Kept out of
the default command for the suite's time; this module imports nothing that starts JAX.
"""

SLOW_RUNS = frozenset(
  {
    *(
      f"explicit/{name}/cross_device_duplicates/cf2"
      for name in ("amsgrad", "l2_weight_decay", "adamw", "per_row_bias_correction", "maximize")
    ),
    "explicit/plain/one_owner/cf1",
    "explicit/plain/zipf/cf1",
    "explicit/stochastic_amsgrad/device_local_rows/cf2",
    "auto/stochastic/zipf/cf1",
    "auto/all_options/zipf/cf1",
    *(
      f"auto_default/{name}/cross_device_duplicates/cf2" for name in ("rowwise", "catch_up", "bf16")
    ),
    # Variants of runs the default tier keeps: another id pattern, mesh mode or option.
    *(f"explicit/plain/{kind}/cf2" for kind in ("uniform", "spread_to_all")),
    "auto/plain/one_owner/cf2",
    *(
      f"explicit/{name}/cross_device_duplicates/cf2"
      for name in ("apply_if_finite", "rowwise", "catch_up")
    ),
    "explicit/all_options/one_owner/cf2",
    "explicit/stochastic/device_local_rows/cf2",
    "auto_default/stochastic/zipf/cf1",
    "auto_default/plain/one_owner/cf2",
    "auto_default/all_options/zipf/cf1",
    *(
      f"{mode}/optax_apply_if_finite/cross_device_duplicates/cf2"
      for mode in ("auto", "auto_default")
    ),
    "auto_off/all_options/zipf/cf2",
    "two_axes/batch_over_y",
    "auto/replicated_batch_of_250",
    "auto_default/column_table",
    "auto_default/rowwise_column_table",
    # Evenly spread ids at a capacity factor of 1 (none overflow: the default tier's
    # auto_default/all_options run counts that).
    "explicit/plain/spread_to_all/cf1",
  }
)
# Cyclic tables: the Explicit run keeps the Zipf ids routed in the default tier; the same
# tables under the partitioner's own axes run in the slow tier.
SLOW_CYCLIC_RUNS = frozenset({"auto_default/all_options/zipf"})
# The Flax front ends of the routed step beside the NNX table (`flax_nnx`, default tier) and
# the torch adapter: the Linen table, the bags, NNX with the partitioner's own axes, NNX on a
# cyclic table. Each traces the same routed lookup, step and apply the default runs check.
SLOW_CHECKS = frozenset(
  {
    "front_ends/linen_table",
    "front_ends/nnx_bag",
    "front_ends/linen_bag",
    "flax_nnx_auto_default",
    "flax_nnx_cyclic",
    # catch_up_rows eagerly on a table split over Explicit axes (8 s of op-by-op
    # compiles); the cyclic table's eager catch_up_rows under Auto axes stays.
    "catch_up_rows_explicit",
  }
)
