import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse
from reference import NumpySparseAdam

import optax_sparse_adam as osa


def test_one_step_matches_reference():
  params = {"table": jnp.zeros((5, 2))}
  opt = osa.sparse_adam(learning_rate=0.1)
  state = opt.init(params)
  idx = np.array([[3], [3], [1]])
  val = np.ones((3, 2), np.float32)
  updates, state = opt.update(
    {"table": sparse.BCOO((jnp.asarray(val), jnp.asarray(idx)), shape=(5, 2))}, state
  )
  new = osa.apply_updates(params, updates)
  ref = NumpySparseAdam(np.zeros((5, 2)), lr=0.1)
  ref.step(idx, val)
  np.testing.assert_allclose(new["table"], ref.param, rtol=1e-6)
