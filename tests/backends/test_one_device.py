"""A table on one device of a multi-device process takes the CPU kernels (`_backends.one_device`).

Under jit, a table committed to one device of several has a type that does not
say where it lives: the kernels are chosen when the program is lowered, for one
device. Checked in a process with 4 forced CPU devices (`_one_device_script.py`).
"""

import pytest

from optax_sparse_adam._backends.cpu import kernels
from tests._helpers import BACKEND
from tests.core._forced_devices import run_checks

pytestmark = pytest.mark.skipif(
  BACKEND != "cpu" or not kernels.available(), reason="the CPU kernels run on the CPU only"
)


@pytest.fixture(scope="module")
def checks():
  return run_checks("../backends/_one_device_script.py")


@pytest.mark.parametrize("name", ["sparse_adam", "sparse_ftrl"])
def test_a_table_on_one_device_of_four_takes_the_kernels_in_place(checks, name):
  result = checks[name]
  assert result["kernels_on_one_device"]
  assert result["table_copies"] == []
  assert result["equal_to_xla_ops"]


@pytest.mark.parametrize("name", ["sparse_adam", "sparse_ftrl"])
def test_a_table_sharded_over_four_devices_takes_no_kernel(checks, name):
  result = checks[name]
  assert not result["kernels_when_sharded"]
  assert result["sharded_equal_to_xla_ops"]
