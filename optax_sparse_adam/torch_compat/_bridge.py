"""A pytree of arrays (a Flax NNX `State`, Linen params) as named `Parameter`s, and back.

torch's recipes hand `model.named_parameters()` to one optimizer. The same with a
JAX model: `named_parameters(state)` makes a `Parameter` of each leaf, named by its
path as torch names a module's parameters ("bottom.0.kernel"); `set_grads` gives
them a gradient tree of the same structure (BCOO and dense leaves alike, as
`osa.sparse_value_and_grad` returns); `parameters_tree(state, params)` is the tree
again, holding the parameters' current arrays (after a step, which donates the
old ones), for `nnx.update(model, ...)`. Nothing here imports Flax.
"""

from collections.abc import Mapping
from typing import Any

import jax
from jax.experimental import sparse

from optax_sparse_adam.torch_compat._parameter import Parameter


def _name(path: tuple) -> str:
  """torch's dotted name of a pytree path; a trailing `.value` (an NNX variable's) left out."""
  parts = []
  for key in path:
    if isinstance(key, jax.tree_util.DictKey):
      parts.append(str(key.key))
    elif isinstance(key, jax.tree_util.SequenceKey):
      parts.append(str(key.idx))
    elif isinstance(key, jax.tree_util.GetAttrKey):
      parts.append(key.name)
    else:
      parts.append(str(key).strip(".[]'\""))
  if len(parts) > 1 and parts[-1] in ("value", "raw_value"):
    parts.pop()
  return ".".join(parts)


def _named_leaves(tree: Any) -> list[tuple[str, Any]]:
  leaves = jax.tree_util.tree_flatten_with_path(
    tree, is_leaf=lambda x: x is None or isinstance(x, sparse.BCOO)
  )[0]
  return [(_name(path), leaf) for path, leaf in leaves]


def named_parameters(tree: Any) -> dict[str, Parameter]:
  """A `Parameter` of each array leaf of `tree`, by torch-style name (`model.named_parameters()`).

  Args:
    tree: a pytree of arrays: an NNX `State` (`nnx.split(model, nnx.Param)[1]`,
      or `nnx.state(model, nnx.Param)`), Linen params, a dict.

  Returns:
    `{name: Parameter}` in the tree's order; give `.items()` to an optimizer
    (`SGD(params.items(), lr=...)`) so that its errors and state dict carry the names.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_sparse_adam import torch_compat as tc
    >>> params = tc.named_parameters({"bottom": [{"kernel": jnp.ones((2, 3))}]})
    >>> list(params), params["bottom.0.kernel"].shape
    (['bottom.0.kernel'], (2, 3))
  """
  named = _named_leaves(tree)
  names = [name for name, _ in named]
  if len(set(names)) != len(names):
    raise ValueError(f"named_parameters: two leaves of the tree have one name: {names}")
  return {name: Parameter(leaf) for name, leaf in named}


def set_grads(params: Mapping[str, Parameter], grads: Any) -> None:
  """Sets each parameter's `.grad` from the gradient tree's leaf of the same name.

  Args:
    params: `named_parameters`' result.
    grads: a tree of the params' structure (BCOO, dense or None leaves), e.g. the
      gradients of `osa.sparse_value_and_grad(loss)(model)`.
  """
  named = dict(_named_leaves(grads))
  if set(named) != set(params):
    missing, extra = sorted(set(params) - set(named)), sorted(set(named) - set(params))
    raise ValueError(
      f"set_grads: the gradients' names differ from the parameters': parameters without a "
      f"gradient {missing}, gradients without a parameter {extra}"
    )
  for name, param in params.items():
    param.grad = named[name]


def parameters_tree(tree: Any, params: Mapping[str, Parameter]) -> Any:
  """`tree` with each leaf replaced by the current `.data` of its named parameter.

  Args:
    tree: the tree `params` were made from (or one of its structure).
    params: `named_parameters`' result, after any number of steps.

  Returns:
    The tree holding the parameters' arrays: `nnx.update(model, parameters_tree(state,
    params))` puts them in the model.
  """
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  names = [_name(path) for path, _ in leaves]
  unknown = [name for name in names if name not in params]
  if unknown:
    raise ValueError(f"parameters_tree: no parameter named {unknown}; have {sorted(params)}")
  return jax.tree_util.tree_unflatten(treedef, [params[name].data for name in names])
