"""`named_parameters`, `set_grads`, `parameters_tree`: torch_compat optimizers over a Flax model.

The reference is the same model trained by `osa.sparse_sgd` through `SparseOptimizer`
(bit for bit), and torch's own model for the copied weights.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
torch = pytest.importorskip("torch")
from flax import nnx  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402
from optax_sparse_adam import torch_compat as tc  # noqa: E402


class Tiny(nnx.Module):
  def __init__(self):
    self.bag = osa.SparseEmbedBag(10, 3, mode="sum", rngs=nnx.Rngs(0))
    self.out = nnx.Linear(3, 1, rngs=nnx.Rngs(1))

  def __call__(self, ids, offsets):
    return self.out(self.bag(ids, offsets))[:, 0]


BATCHES = [
  (jnp.array([1, 4, 4, 7, 2]), jnp.array([0, 2]), jnp.array([1.0, -1.0])),
  (jnp.array([0, 4, 9, 9, 1]), jnp.array([0, 3]), jnp.array([0.5, 2.0])),
]


def _loss(model, ids, offsets, target):
  return jnp.mean((model(ids, offsets) - target) ** 2)


def test_the_adapter_trains_a_flax_model_as_sparse_sgd_does():
  ported = Tiny()
  state = nnx.state(ported, nnx.Param)
  params = tc.named_parameters(state)
  assert list(params) == ["bag.embedding", "out.bias", "out.kernel"]
  opt = tc.SGD(params.items(), lr=0.1, weight_decay=0.0)

  reference = Tiny()
  optimizer = osa.SparseOptimizer(reference, osa.sparse_sgd(0.1), wrt=nnx.Param)
  for ids, offsets, target in BATCHES:
    _, grads = osa.sparse_value_and_grad(_loss)(ported, ids, offsets, target)
    tc.set_grads(params, grads)
    opt.step()
    nnx.update(ported, tc.parameters_tree(state, params))

    _, grads = osa.sparse_value_and_grad(_loss)(reference, ids, offsets, target)
    optimizer.update(reference, grads)
  for a, b in zip(
    jax.tree.leaves(nnx.state(ported, nnx.Param)),
    jax.tree.leaves(nnx.state(reference, nnx.Param)),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(ported.out.kernel[...]), np.asarray(Tiny().out.kernel[...]))


def test_torch_weights_copied_into_the_flax_model_give_torchs_outputs():
  torch_bag = torch.nn.EmbeddingBag(10, 3, mode="sum", sparse=True)
  torch_out = torch.nn.Linear(3, 1)
  model = Tiny()
  state = nnx.state(model, nnx.Param)
  params = tc.named_parameters(state)
  weights = {
    "bag.embedding": torch_bag.weight,
    "out.kernel": torch_out.weight.T,  # torch's Linear keeps (out, in), Flax's (in, out)
    "out.bias": torch_out.bias,
  }
  for name, weight in weights.items():
    params[name].data = jnp.asarray(weight.detach().numpy())
  nnx.update(model, tc.parameters_tree(state, params))
  ids, offsets, _ = BATCHES[0]
  theirs = torch_out(torch_bag(torch.tensor(np.asarray(ids)), torch.tensor(np.asarray(offsets))))
  np.testing.assert_allclose(
    np.asarray(model(ids, offsets)), theirs[:, 0].detach().numpy(), rtol=1e-6, atol=1e-7
  )


def test_names_that_do_not_match_are_refused():
  params = tc.named_parameters({"a": jnp.ones(2), "b": [jnp.ones(3)]})
  assert list(params) == ["a", "b.0"]
  with pytest.raises(ValueError, match=r"parameters without a gradient \['b.0'\]"):
    tc.set_grads(params, {"a": jnp.ones(2), "c": jnp.ones(3)})
  with pytest.raises(ValueError, match=r"no parameter named \['z'\]"):
    tc.parameters_tree({"z": jnp.ones(2)}, params)
