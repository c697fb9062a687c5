"""Sharded tables on 8 forced CPU devices: same numbers as one device, no table-sized traffic.

The measurements run in a subprocess (tests/core/_sharded_checks.py) because the
device count is fixed when JAX starts; this process keeps its single device.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import optax_sparse_adam as osa
from optax_sparse_adam._core.sharded import sharding
from tests.core._forced_devices import run_checks

ROOT = Path(__file__).resolve().parents[2]
NUM_DEVICES = 8
# Float32 round-off: the sharded step sums a row's entries in another order.
ATOL = 1e-6
TABLE_SPECS = {"row": "P('x', None)", "col": "P(None, 'x')", "replicated": "P(None, None)"}


@pytest.fixture(scope="module")
def checks():
  return run_checks("_sharded_checks.py", timeout=300)


RUNS = [
  "auto/row/plain",
  "auto/col/plain",
  "auto/replicated/plain",
  "explicit/row/plain",
  "explicit/col/plain",
  "explicit/replicated/plain",
  "auto/row/amsgrad_per_row_wd",
  "explicit/row/amsgrad_per_row_wd/jit_init",
  "auto/row/plain/accelerator",
  "explicit/row/amsgrad_per_row_wd/accelerator",
]


def test_subprocess_has_eight_devices_and_this_process_one(checks):
  assert checks["num_devices"] == NUM_DEVICES
  assert sorted(checks["runs"]) == sorted(RUNS)
  assert jax.device_count() == 1


@pytest.mark.parametrize("run", RUNS)
def test_sharded_training_matches_one_device(checks, run):
  result = checks["runs"][run]
  for name, diff in result["max_abs_diff"].items():
    assert diff <= ATOL, (name, diff)
  np.testing.assert_allclose(result["losses"], result["reference_losses"], rtol=1e-5)


@pytest.mark.parametrize("run", RUNS)
def test_state_is_sharded_like_the_table_and_stays_so(checks, run):
  result = checks["runs"][run]
  # Inputs of the second step sharded otherwise than the first's would compile again.
  assert result["compilations"] == 1
  table_spec = TABLE_SPECS[run.split("/")[1]]
  assert result["specs"]["table"] == table_spec
  for name in ("mu", "nu", "nu_max"):
    if name in result["specs"]:
      assert result["init_specs"][name] == table_spec, name
      assert result["specs"][name] == table_spec, name
  if "row_step" in result["specs"]:
    # One step count per row, split like the table's rows.
    assert result["init_specs"]["row_step"] == "P('x',)"
    assert result["specs"]["row_step"] == "P('x',)"


@pytest.mark.parametrize("run", RUNS)
def test_each_device_holds_its_share_of_table_and_state(checks, run):
  result = checks["runs"][run]
  layout = run.split("/")[1]
  rows, dim = result["shard_shapes"]["table"]
  full_rows, full_dim = 32768, 16
  expected = {
    "row": [full_rows // NUM_DEVICES, full_dim],
    "col": [full_rows, full_dim // NUM_DEVICES],
    "replicated": [full_rows, full_dim],
  }[layout]
  for name in ("table", "mu", "nu", "nu_max"):
    if name in result["shard_shapes"]:
      assert result["shard_shapes"][name] == expected, name
  # What the compiled step holds per device: its inputs (table, state, batch)
  # plus its scratch; the outputs alias the donated inputs.
  per_device = result["argument_bytes"] + result["temp_bytes"]
  if layout == "replicated":
    assert per_device >= result["total_bytes"]
  else:
    assert per_device <= 1.1 * result["total_bytes"] / NUM_DEVICES


@pytest.mark.parametrize("run", RUNS)
def test_no_collective_moves_a_table_sized_array(checks, run):
  """Only gradient-sized arrays cross devices: ids, gathered rows, their sums.

  Even for the replicated table no dense gradient is all-reduced.
  """
  result = checks["runs"][run]
  table_elements = checks["table_bytes"] // 4
  assert result["collectives"], "a sharded step must communicate"
  largest = max(size for _, size in result["collectives"])
  assert largest < table_elements // NUM_DEVICES, result["collectives"]


def test_test_data_needs_entries_of_all_shards_combined(checks):
  """Updating from each shard's entries alone and averaging gives other numbers,
  so the equality with one device above shows the entries are combined."""
  assert checks["uncombined_vs_combined_max_abs_diff"] > 1000 * ATOL


@pytest.mark.parametrize(
  ("spec", "num_dims", "expected"),
  [
    (P("x", None), 1, "x"),
    (P(None, "x"), 1, None),
    (P(("x", "y"), None), 1, ("x", "y")),
    (P("x"), 2, "x"),
    (P("x", "y", None), 2, None),
    (P(), 1, None),
  ],
)
def test_per_row_state_follows_the_leading_dims(spec, num_dims, expected):
  assert sharding._flattened_axis(spec, num_dims) == expected


def test_single_device_state_is_unchanged_by_sharding_support():
  params = {"table": jax.numpy.ones((6, 3))}
  state = osa.sparse_adam(per_row_bias_correction=True).init(params)
  assert state.row_step["table"].shape == (6,)
  assert state.row_step["table"].sharding == params["table"].sharding
  assert sharding.explicit_axes() == ()


# Two processes under jax.distributed (20 s of two interpreters compiling): the slow tier;
# the forced-device runs above check the same sharded step in one process.
@pytest.mark.slow
def test_two_processes_with_jax_distributed_match_one_device():
  """jax.distributed over 2 local processes (gloo CPU collectives), 4 CPU devices each."""
  done = subprocess.run(
    [sys.executable, str(ROOT / "examples" / "two_process_sharded.py"), "--json"],
    capture_output=True,
    text=True,
    env=dict(os.environ, PYTHONPATH=str(ROOT)),
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-4000:]
  reports = json.loads(done.stdout.strip().splitlines()[-1])
  assert sorted(r["process"] for r in reports) == [0, 1]
  for report in reports:
    assert report["global_devices"] == NUM_DEVICES
    assert report["local_devices"] == NUM_DEVICES // 2
    assert report["local_rows"] == 4096 // 2
    assert report["moments_spec"] == "P('x', None)"
    for name, diff in report["max_abs_diff"].items():
      assert diff <= ATOL, (name, diff)
    # The same training routed (Explicit axes): rows' gradients sent to their owners.
    for name, diff in report["routed_max_abs_diff"].items():
      assert diff <= ATOL, (name, diff)
