"""Ragged bags at a few static sizes: `pad_ids` keeps the step's bits, and recompiles are flagged.

The reference for "padding changes nothing" is the same jitted step on the unpadded
ids (bit for bit); the warning is checked on a jitted lookup traced for many id counts.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402
from tests._helpers import tiered  # noqa: E402

ROWS, DIM, BAGS = 40, 4, 5


def test_bucket_sizes_and_padding():
  assert [osa.bucket_size(n) for n in (0, 8, 9, 539, 771)] == [8, 8, 16, 1024, 1024]
  assert osa.bucket_size(539, [1024, 768]) == 768
  with pytest.raises(ValueError, match="do not fit the largest of the sizes"):
    osa.bucket_size(1025, [768, 1024])
  np.testing.assert_array_equal(osa.pad_ids(np.array([1, 2]), 4), [1, 2, -1, -1])
  np.testing.assert_array_equal(
    osa.pad_ids(np.array([[1], [2]]), 2, pad_id=ROWS), [[1, 40], [2, 40]]
  )
  with pytest.raises(ValueError, match="3 ids do not fit size=2"):
    osa.pad_ids(np.arange(3), 2)
  with pytest.raises(TypeError, match="ids must be integers"):
    osa.pad_ids(np.ones(3))


def _ragged_batch(rng, num_ids):
  ids = rng.integers(0, ROWS, size=num_ids).astype(np.int32)
  ids[:3] = ids[3]  # repeated ids: duplicates summed in the gradient
  cuts = np.sort(rng.integers(0, num_ids + 1, size=BAGS - 1))
  return ids, np.concatenate([[0], cuts]).astype(np.int32), rng.normal(size=BAGS)


OPTIMIZERS = {"sgd": lambda: osa.sparse_sgd(0.1), "adagrad": lambda: osa.sparse_adagrad(0.1)}
BAG_CASES = [(m, last, name) for m, last in (("sum", False), ("mean", True)) for name in OPTIMIZERS]


# Each bag form and each optimizer in the default tier (sum with SGD, mean with Adagrad).
@pytest.mark.parametrize(
  "mode, include_last_offset, optimizer",
  tiered(BAG_CASES, lambda case: case[2] != ("sgd" if case[0] == "sum" else "adagrad")),
  ids=[f"{m}-{name}" for m, _, name in BAG_CASES],
)
def test_padded_bags_step_bit_for_bit_as_unpadded(mode, include_last_offset, optimizer):
  make = OPTIMIZERS[optimizer]
  model = osa.SparseEmbedBag(
    ROWS, DIM, mode=mode, include_last_offset=include_last_offset, rngs=nnx.Rngs(0)
  )
  tx = make()

  @jax.jit
  def step(table, opt_state, ids, offsets, target):
    def loss(module):
      return jnp.sum((module(ids, offsets) @ jnp.ones(DIM) - target) ** 2)

    module = osa.SparseEmbedBag(
      ROWS, DIM, mode=mode, include_last_offset=include_last_offset, rngs=nnx.Rngs(0)
    )
    module.embedding[...] = table
    value, grads = osa.sparse_value_and_grad(loss)(module)
    (grad,) = jax.tree.leaves(grads, is_leaf=lambda x: isinstance(x, sparse.BCOO))
    updates, opt_state = tx.update(grad, opt_state, table)
    return osa.apply_updates(table, updates), opt_state, value

  rng = np.random.default_rng(0)
  table0 = model.embedding[...]
  plain = padded = (table0, tx.init(table0))
  for num_ids in (23, 17, 30):
    ids, offsets, target = _ragged_batch(rng, num_ids)
    if include_last_offset:
      offsets = np.append(offsets, num_ids).astype(np.int32)
    *plain, plain_loss = step(*plain, ids, offsets, target)
    *padded, padded_loss = step(*padded, osa.pad_ids(ids, [32]), offsets, target)
    assert np.asarray(plain_loss).tobytes() == np.asarray(padded_loss).tobytes()
    np.testing.assert_array_equal(np.asarray(plain[0]), np.asarray(padded[0]))
    for a, b in zip(jax.tree.leaves(plain[1]), jax.tree.leaves(padded[1]), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(padded[0]), np.asarray(table0))  # it trained


def test_a_lookup_traced_for_many_id_counts_warns_once_and_padded_ids_do_not():
  table = jnp.ones((ROWS, DIM))
  lookup = jax.jit(osa.embedding_lookup)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for n in range(1, 40):  # padded to powers of two: 8, 16, 32, 64
      lookup(table, osa.pad_ids(np.arange(n) % ROWS))
  with pytest.warns(osa.RaggedIdsWarning, match=r"pad_ids") as record:
    for n in range(1, 20):  # 17 shapes pass the threshold of 16; the warning comes once
      lookup(table, jnp.arange(n) % ROWS)
  assert len(record) == 1
  assert "(40, 4)" in str(record[0].message) and "17 different id shapes" in str(record[0].message)
