"""Which routed runs only the slow tier checks (`-m slow`); shared by the checks and the test.

Each is a variant whose arithmetic another default run covers: a single option that
`all_options` also turns on, a second capacity factor, a second mesh mode. Kept out of
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
  }
)
