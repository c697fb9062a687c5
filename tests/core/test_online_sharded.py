"""Online training on row-sharded tables equals one device's, bit for bit.

The runs happen in a subprocess on 4 forced CPU devices (tests/core/_online_checks.py):
a table trained with `track_changed_rows=True`, deltas published every two steps to
a serving copy on one device, rows reset in between; on one device, row-split by
XLA's partitioner, and routed under Explicit and Auto mesh axes.
"""

import pytest

from tests.core._forced_devices import run_checks

RUNS = [("adam", mode) for mode in ("plain", "explicit", "auto")] + [("sgd_catch_up", "explicit")]


@pytest.fixture(scope="module")
def runs():
  return run_checks("_online_checks.py", timeout=600)


@pytest.mark.parametrize("opt_name,mode", RUNS)
def test_sharded_online_run_equals_one_device(runs, opt_name, mode):
  one, run = runs[f"{opt_name}/one"], runs[f"{opt_name}/{mode}"]
  # Each published serving copy equals the trained table at that step, bit for bit.
  assert run["serving_equal"] == [True, True, True]
  assert one["serving_equal"] == [True, True, True]
  # The same rows published, the same table and last steps as on one device.
  assert run["delta_ids"] == one["delta_ids"]
  assert run["table"] == one["table"]
  assert run["last_step"] == one["last_step"]
  # The last steps stay split like the table, and a delta gathers no table.
  assert run["table_spec"] == "P('x', None)"
  assert run["last_step_spec"] == "P('x',)"
  assert not any(shape.split("[")[1].startswith("256,") for shape in run["gathered_shapes"])
