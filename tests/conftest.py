"""Strict test setup: warnings are errors (pyproject), JAX on CPU, reproducible hypothesis."""

import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Two test workers (addopts: -n 2) share one GPU where JAX_PLATFORMS selects it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# On a GPU, scatter-adds sum a row's duplicates with atomics in no fixed order, so two
# runs of one step can differ in their last bits (measured on an H100; same bits with
# this flag: docs/performance/gpu.md). Tests compare runs of one path exactly.
if "xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true"
  ).strip()

# One compilation cache for the session: a program that a test (or the other worker, or a
# subprocess with forced devices) has compiled is loaded, not compiled again, by the next
# that lowers the same program. The suite is bound by XLA compiles; a fresh directory per
# session keeps runs independent. Set JAX_COMPILATION_CACHE_DIR to choose another.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="osa-test-compiles-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
  "ci",
  max_examples=200,
  deadline=None,
  derandomize=True,
  suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _torch_sparse_invariant_checks_on():
  """Sparse invariant checks explicitly on wherever torch builds a sparse tensor.

  torch (2.11 and later) warns "Sparse invariant checks are implicitly disabled"
  for a sparse tensor built without an explicit choice, inside its own
  functions too, and warnings are errors here. Opting in explicitly removes
  that warning at its cause, whatever the torch version; tests that build an
  invalid tensor on purpose still pass `check_invariants=False`.
  """
  torch = sys.modules.get("torch")  # only where a test module imported it
  check = getattr(getattr(torch, "sparse", None), "check_sparse_tensor_invariants", None)
  if check is None:
    yield
    return
  with check(enable=True):
    yield


@pytest.fixture(autouse=True)
def _fresh_ragged_id_counts():
  """Each test starts with no traced id shapes counted (the recompile warning's counter)."""
  from optax_sparse_adam._core import ragged

  ragged.reset_traced_ids()
  yield


# The longest files, each one work unit of `--dist loadfile` (a subprocess of forced
# devices, an example run against torch, many compiled snippets): scheduled first, so that
# neither worker is left running one of them alone at the end of the session.
FIRST_FILES = (
  "tests/core/test_routed.py",
  "tests/flax/test_dlrm_example.py",
  "tests/docs/test_snippets.py",
  "tests/flax/test_patterns.py",
  "tests/core/test_sharding.py",
)


def pytest_collection_modifyitems(items):
  """Moves the items of `FIRST_FILES` to the front, in that order; the rest keep theirs."""
  rank = {path: i for i, path in enumerate(FIRST_FILES)}

  def first(item):
    return rank.get(item.nodeid.split("::", 1)[0], len(FIRST_FILES))

  items.sort(key=first)  # stable: the order within a file and among the others is kept
