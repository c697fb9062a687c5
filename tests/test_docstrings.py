"""Every `Example:` in the public docstrings runs and prints what it says."""

import doctest
import importlib

import pytest

MODULES = [
  "optax_sparse_adam._optax.transform",
  "optax_sparse_adam._optax.rule_transform",
  "optax_sparse_adam._optax.optimizers",
  "optax_sparse_adam._optax.state",
  "optax_sparse_adam._optax.apply",
  "optax_sparse_adam._optax.composition",
  "optax_sparse_adam._optax.param_ema",
  "optax_sparse_adam._optax.multi_steps",
  "optax_sparse_adam._optax.checks",
  "optax_sparse_adam._optax.deltas",
  "optax_sparse_adam._optax.reset",
  "optax_sparse_adam._backends.cpu.kernels",
  "optax_sparse_adam._backends.cpu.huge_pages",
  "optax_sparse_adam.flax._nnx",
  "optax_sparse_adam.flax._bag",
  "optax_sparse_adam.flax._grads",
  "optax_sparse_adam.flax._optimizer",
  "optax_sparse_adam.torch_compat._sparse_adam",
  "optax_sparse_adam.torch_compat._sgd",
  "optax_sparse_adam.torch_compat._adagrad",
  "optax_sparse_adam.torch_compat._parameter",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
  result = doctest.testmod(module, optionflags=flags)
  assert result.attempted > 0, f"{name} has no docstring examples"
  assert result.failed == 0
