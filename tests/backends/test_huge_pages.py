"""advise_huge_pages moves large CPU tables to huge pages and changes nothing else."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from tests._helpers import cpu_only, train_step

pytestmark = cpu_only("huge-page advice (host memory)")

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
  not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
  reason="transparent huge pages are not available on this system",
)
NUM_ROWS, DIM = 1 << 16, 64  # 16 MiB tables


def _huge_kib_at(address: int) -> int:
  """AnonHugePages (KiB) of the mapping holding `address`, from /proc/self/smaps."""
  inside = False
  for line in Path("/proc/self/smaps").read_text().splitlines():
    head = line.split()[0]
    if "-" in head and ":" not in head:
      lo, hi = (int(x, 16) for x in head.split("-"))
      inside = lo <= address < hi
    elif inside and line.startswith("AnonHugePages:"):
      return int(line.split()[1])
  return 0


@needs_thp
def test_large_tables_are_collapsed_into_huge_pages():
  params = {"table": jnp.ones((NUM_ROWS, DIM)), "bias": jnp.ones((8,))}
  before = np.asarray(params["table"]).copy()
  advice = osa.advise_huge_pages(params)
  assert advice.arrays == 1  # the small bias is left alone
  assert advice.advised_bytes >= params["table"].nbytes - 2 * (2 << 20)
  if advice.collapsed_bytes == 0:
    pytest.skip("MADV_COLLAPSE is not supported here (Linux < 6.1)")
  assert _huge_kib_at(params["table"].unsafe_buffer_pointer() + (4 << 20)) >= 2048
  np.testing.assert_array_equal(np.asarray(params["table"]), before)


def test_small_and_non_array_leaves_are_skipped():
  advice = osa.advise_huge_pages({"w": jnp.ones((4, 4)), "n": 3, "none": None})
  assert advice == osa.HugePageAdvice(0, 0, 0)


@needs_thp
def test_training_on_huge_pages_is_unchanged_bit_for_bit():
  opt = osa.sparse_adam(1e-2)
  rng = np.random.default_rng(0)
  batches = [
    (rng.integers(0, NUM_ROWS, (256, 1)).astype(np.int32), rng.standard_normal((256, DIM)))
    for _ in range(3)
  ]

  step = jax.jit(train_step(opt), donate_argnums=(0, 1))
  results = []
  for advise in (False, True):
    params = {"table": jnp.full((NUM_ROWS, DIM), 0.5, jnp.float32)}
    state = opt.init(params)
    if advise:
      assert osa.advise_huge_pages((params, state)).arrays == 3
    for idx, val in batches:
      grad = sparse.BCOO((jnp.asarray(val, jnp.float32), jnp.asarray(idx)), shape=(NUM_ROWS, DIM))
      params, state = step(params, state, {"table": grad})
    results.append((np.asarray(params["table"]), np.asarray(state.mu["table"])))
  for a, b in zip(results[0], results[1], strict=True):
    np.testing.assert_array_equal(a, b)
