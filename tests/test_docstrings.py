"""Every `Example:` in the public docstrings runs and prints what it says."""

import doctest
import importlib

import pytest

MODULES = [
  "optax_sparse_adam._transform",
  "optax_sparse_adam._composition",
  "optax_sparse_adam._checks",
  "optax_sparse_adam._cpu_kernel",
  "optax_sparse_adam._huge_pages",
  "optax_sparse_adam._flax",
  "optax_sparse_adam._flax_bag",
  "optax_sparse_adam.torch_compat",
  "optax_sparse_adam._torch_parameter",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
  result = doctest.testmod(module, optionflags=flags)
  assert result.attempted > 0, f"{name} has no docstring examples"
  assert result.failed == 0
