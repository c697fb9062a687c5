"""The torch adapter's `reset_rows` against real torch whose state rows are reset by hand.

torch has no such method; its reference is torch's own optimizer with the rows of
`state[p][...]` and of the parameter written in place between steps, which is
what an evicting vocabulary does to a torch table. The parameters match within
the few float32 ulps of torch's fused update (as in the parity tests), SparseAdam's
moments bit for bit.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

from optax_sparse_adam import torch_compat as tc

torch = pytest.importorskip("torch")

ROWS, DIM = 16, 3
RNG = np.random.default_rng(3)
TABLE0 = RNG.standard_normal((ROWS, DIM)).astype(np.float32)
BATCHES = [
  (RNG.integers(0, ROWS, 6), RNG.standard_normal((6, DIM)).astype(np.float32)) for _ in range(8)
]
RESET_AT = 4
RESET, VALUES = np.array([2, 5, 11]), RNG.standard_normal((3, DIM)).astype(np.float32)
CASES = [
  ("SparseAdam", {"lr": 0.05}, {"exp_avg": 0.0, "exp_avg_sq": 0.0}),
  ("Adagrad", {"lr": 0.1, "initial_accumulator_value": 0.3}, {"sum": 0.3}),
]


@pytest.mark.parametrize("name,options,fresh", CASES)
def test_reset_rows_matches_torch_reset_by_hand(name, options, fresh):
  torch_param = torch.nn.Parameter(torch.tensor(TABLE0.copy()))
  torch_opt = getattr(torch.optim, name)([torch_param], **options)
  ours = tc.Parameter(jnp.asarray(TABLE0.copy()))
  our_opt = getattr(tc, name)([ours], **options)
  for i, (ids, vals) in enumerate(BATCHES):
    if i == RESET_AT:
      with torch.no_grad():
        for key, value in fresh.items():
          torch_opt.state[torch_param][key][torch.tensor(RESET)] = value
        torch_param[torch.tensor(RESET)] = torch.tensor(VALUES)
      our_opt.reset_rows(ours, jnp.asarray(RESET), values=VALUES)
      for key in fresh:
        np.testing.assert_array_equal(
          np.asarray(our_opt.state[ours][key])[RESET], np.full((3, DIM), fresh[key], np.float32)
        )
    torch_param.grad = torch.sparse_coo_tensor(
      torch.tensor(ids[None]), torch.tensor(vals), (ROWS, DIM)
    )
    ours.grad = sparse.BCOO((jnp.asarray(vals), jnp.asarray(ids[:, None])), shape=(ROWS, DIM))
    torch_opt.step()
    our_opt.step()
  theirs, mine = torch_param.detach().numpy(), np.asarray(ours.data)
  # torch fuses the parameter's update into one FMA: a few float32 ulps apart
  # (test_torch_sparse_adam_parity); the state matches bit for bit where no FMA enters it.
  np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
  for key in fresh:
    state_mine, state_theirs = our_opt.state[ours][key], torch_opt.state[torch_param][key]
    if name == "SparseAdam":
      np.testing.assert_array_equal(np.asarray(state_mine), state_theirs.numpy())
    else:
      np.testing.assert_allclose(np.asarray(state_mine), state_theirs.numpy(), rtol=1e-6)
  assert our_opt.state[ours]["step"] == len(BATCHES)  # the parameter's count is kept


@pytest.mark.parametrize("name", ["SGD", "Adagrad", "SparseAdam"])
def test_reset_rows_refuses_bad_input_and_changes_nothing(name):
  ours = tc.Parameter(jnp.asarray(TABLE0.copy()))
  other = tc.Parameter(jnp.asarray(TABLE0.copy()))
  opt = getattr(tc, name)([ours], lr=0.1)
  ids, vals = BATCHES[0]
  ours.grad = sparse.BCOO((jnp.asarray(vals), jnp.asarray(ids[:, None])), shape=(ROWS, DIM))
  opt.step()
  before = np.asarray(ours.data).copy()
  with pytest.raises(ValueError, match="has 16 rows, but ids holds 16"):
    opt.reset_rows(ours, [3, 16], values=np.zeros((2, DIM), np.float32))
  with pytest.raises(ValueError, match=r"values has shape \(1, 2\)"):
    opt.reset_rows(ours, [3], values=np.zeros((1, 2), np.float32))
  with pytest.raises(ValueError, match="not in this optimizer's param groups"):
    opt.reset_rows(other, [3])
  np.testing.assert_array_equal(np.asarray(ours.data), before)
  state = {key: np.asarray(v) for key, v in opt.state.get(ours, {}).items() if key != "step"}
  opt.reset_rows(ours, [])  # no rows: nothing changes
  for key, value in state.items():
    np.testing.assert_array_equal(np.asarray(opt.state[ours][key]), value)
  opt.reset_rows(ours, [3], values=np.ones((1, DIM), np.float32))
  np.testing.assert_array_equal(np.asarray(ours.data)[3], np.ones(DIM, np.float32))
