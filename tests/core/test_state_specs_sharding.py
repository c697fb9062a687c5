"""`optax.tree.map_params` specs as `jax.jit` out_shardings, on 4 forced CPU devices.

The checks run in a subprocess (tests/core/_state_specs_checks.py) because the device
count is fixed when JAX starts; this process keeps its single device.
"""

import pytest

from tests.core._forced_devices import run_checks

RUNS = ["sparse_adam", "sparse_adamw_amsgrad", "per_row_bias_correction", "chain_inject_plateau"]
TABLE_SPECS = {"rows": "P('x', None)", "cols": "P(None, 'x')"}
# The state leaves that follow a parameter, by where their path ends.
FOLLOWING = ("mu", "nu", "nu_max")


@pytest.fixture(scope="module")
def checks():
  return run_checks("_state_specs_checks.py", timeout=300)


def test_subprocess_has_four_devices(checks):
  assert checks["num_devices"] == 4
  assert sorted(checks["runs"]) == sorted(RUNS)


@pytest.mark.parametrize("run", RUNS)
def test_every_leaf_gets_a_spec_of_its_rank_and_keeps_it(checks, run):
  result = checks["runs"][run]
  for leaf in result["leaves"]:
    # At most one entry per dim (jit would refuse more, but this names the leaf).
    assert leaf["mapped_rank"] <= len(leaf["shape"]), leaf
    assert leaf["spec"] == leaf["mapped_spec"], leaf
  assert [leaf["spec"] for leaf in result["leaves"]] == result["init_specs"]
  assert result["compilations"] == 1


@pytest.mark.parametrize("run", RUNS)
def test_moments_are_split_like_their_table_and_counters_replicated(checks, run):
  result = checks["runs"][run]
  seen = set()
  for leaf in result["leaves"]:
    path = leaf["path"]
    field = path.split("[")[-2].rsplit(".", 1)[-1] if "['" in path else path.rsplit(".", 1)[-1]
    table = path.rsplit("['", 1)[-1].rstrip("']") if "['" in path else None
    if field in FOLLOWING and table in TABLE_SPECS:
      assert leaf["spec"] == TABLE_SPECS[table], leaf
      split = leaf["shape"][0 if table == "rows" else 1] // 4
      assert leaf["shard_shape"][0 if table == "rows" else 1] == split, leaf
      seen.add(field)
    if field in ("count", "param_steps"):
      assert leaf["spec"] == "P()", leaf
      seen.add(field)
    if field == "row_step" and table == "rows":
      assert leaf["spec"] == "P('x',)" and leaf["shard_shape"] == [16], leaf
      seen.add(field)
  assert {"mu", "nu", "count", "param_steps"} <= seen


@pytest.mark.parametrize("run", RUNS)
def test_sharded_steps_match_one_device(checks, run):
  assert checks["runs"][run]["max_abs_diff"] <= 1e-6
