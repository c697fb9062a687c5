"""sparse_adam against real torch.optim.SparseAdam on nn.Embedding(sparse=True) gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import optax_sparse_adam as osa
from tests._helpers import train_step

torch = pytest.importorskip("torch")


def torch_grad_to_bcoo(grad):
  """An uncoalesced torch sparse COO gradient as a BCOO, duplicates kept."""
  indices = grad._indices().numpy().T.astype(np.int32)
  values = grad._values().numpy()
  return sparse.BCOO((jnp.asarray(values), jnp.asarray(indices)), shape=tuple(grad.shape))


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
  "hp",
  [
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, maximize=False),
    dict(lr=0.3, betas=(0.5, 0.9), eps=0.5, maximize=True),  # a large eps shows where it goes
  ],
  ids=["defaults", "large-eps-maximize"],
)
def test_embedding_training_matches_torch(hp, use_jit):
  vocab, dim, batch, steps = 50, 8, 24, 25
  torch.manual_seed(0)
  emb = torch.nn.Embedding(vocab, dim, sparse=True)
  init = emb.weight.detach().numpy().copy()
  torch_opt = torch.optim.SparseAdam(emb.parameters(), **hp)

  params = {"embedding": jnp.asarray(init)}
  opt = osa.sparse_adam(hp["lr"], *hp["betas"], hp["eps"], maximize=hp["maximize"])
  state = opt.init(params)

  step = train_step(opt)
  if use_jit:
    step = jax.jit(step, donate_argnums=(0, 1))
  rng = np.random.default_rng(0)
  seen = np.zeros(vocab, bool)
  for _ in range(steps):
    # Zipf-like ids over the first half of the vocabulary: repeats, and rows never touched.
    ids = np.minimum(rng.zipf(1.3, size=batch) - 1, vocab // 2)
    seen[ids] = True
    torch_opt.zero_grad()
    target = torch.from_numpy(rng.normal(size=(batch, dim)).astype(np.float32))
    loss = ((emb(torch.from_numpy(ids)) - target) ** 2).sum()
    loss.backward()
    grads = {"embedding": torch_grad_to_bcoo(emb.weight.grad)}
    torch_opt.step()
    params, state = step(params, state, grads)

  ours = np.asarray(params["embedding"])
  theirs = emb.weight.detach().numpy()
  np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(ours[~seen], init[~seen])
  np.testing.assert_array_equal(theirs[~seen], init[~seen])
  torch_state = torch_opt.state[emb.weight]
  assert int(state.step["embedding"]) == int(torch_state["step"]) == steps
  np.testing.assert_allclose(
    state.mu["embedding"], torch_state["exp_avg"].numpy(), rtol=1e-5, atol=1e-7
  )
  np.testing.assert_allclose(
    state.nu["embedding"], torch_state["exp_avg_sq"].numpy(), rtol=1e-5, atol=1e-9
  )


def test_moments_are_bit_identical_to_torch_without_repeated_ids():
  """Where no id repeats within a step, m, v and the step count match torch bit for bit.

  (With repeated ids torch's coalesce sums duplicates in an order of its own, so the
  summed gradient can differ in its last bit; parameters also carry the float32 step
  size and torch's CPU sqrt, hence the tolerance in the test above.)
  """
  vocab, dim, batch, steps = 60, 8, 20, 12
  torch.manual_seed(1)
  emb = torch.nn.Embedding(vocab, dim, sparse=True)
  torch_opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-2)
  params = {"embedding": jnp.asarray(emb.weight.detach().numpy().copy())}
  opt = osa.sparse_adam(1e-2)
  state = opt.init(params)

  step = jax.jit(train_step(opt))

  rng = np.random.default_rng(1)
  for _ in range(steps):
    ids = rng.permutation(vocab)[:batch]
    torch_opt.zero_grad()
    target = torch.from_numpy(rng.normal(size=(batch, dim)).astype(np.float32))
    ((emb(torch.from_numpy(ids)) - target) ** 2).sum().backward()
    grads = {"embedding": torch_grad_to_bcoo(emb.weight.grad)}
    torch_opt.step()
    params, state = step(params, state, grads)
  torch_state = torch_opt.state[emb.weight]
  np.testing.assert_array_equal(state.mu["embedding"], torch_state["exp_avg"].numpy())
  np.testing.assert_array_equal(state.nu["embedding"], torch_state["exp_avg_sq"].numpy())
  np.testing.assert_allclose(params["embedding"], emb.weight.detach().numpy(), rtol=1e-6)
