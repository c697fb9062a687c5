"""A BCOO given as a parameter: torch's sentence, with its [group, position] pairs, word for
word, for plain lists, groups and named parameters (compared with real torch)."""

import jax.numpy as jnp
import pytest
from jax.experimental import sparse

from optax_sparse_adam.torch_compat import Parameter, SparseAdam

torch = pytest.importorskip("torch")


def _t():
  return torch.zeros(3, 2, requires_grad=True)


def _t_sparse():
  return torch.zeros(3, 2).to_sparse()


def _j():
  return Parameter(jnp.zeros((3, 2)))


def _j_sparse():
  return sparse.BCOO.fromdense(jnp.zeros((3, 2)))


def _layouts(dense, sparse_param):
  return {
    "two_in_a_list": [dense(), sparse_param(), sparse_param()],
    "groups": [
      {"params": [sparse_param(), dense(), sparse_param()]},
      {"params": [dense()], "lr": 0.1},
      {"params": [sparse_param()]},
    ],
    "named": [("a", dense()), ("b", sparse_param()), ("c", sparse_param())],
    "named_groups": [
      {"params": [("x", sparse_param())]},
      {"params": [("y", dense()), ("z", sparse_param())]},
    ],
  }


def _message(fn):
  with pytest.raises(ValueError) as caught:
    fn()
  return str(caught.value)


@pytest.mark.parametrize("given", ["bcoo", "torch_sparse"])
@pytest.mark.parametrize("layout", sorted(_layouts(_j, _j_sparse)))
def test_sparse_params_are_named_as_torch_names_them(layout, given):
  """A BCOO, or a sparse torch tensor handed over as it is, named in torch's words."""
  theirs = _message(lambda: torch.optim.SparseAdam(_layouts(_t, _t_sparse)[layout]))
  sparse_param = _j_sparse if given == "bcoo" else _t_sparse
  ours = _message(lambda: SparseAdam(_layouts(_j, sparse_param)[layout]))
  assert theirs.startswith("Sparse params at indices [[")
  assert ours == theirs


def test_sparse_param_group_added_later_is_named_with_its_group():
  opt = SparseAdam([_j()])
  message = _message(lambda: opt.add_param_group({"params": [_j(), _t_sparse()]}))
  assert message == "Sparse params at indices [[1, 1]]: SparseAdam requires dense parameter tensors"
  assert len(opt.param_groups) == 1  # nothing was added


def test_a_bcoo_wrapped_as_a_parameter_says_torchs_words_first():
  message = _message(lambda: Parameter(_j_sparse()))
  assert message.startswith("SparseAdam requires dense parameter tensors")
